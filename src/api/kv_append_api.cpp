// tessera::append_paged_kv: validation, then one kernel launch.
#include <algorithm>
#include <string>
#include <vector>

#include "core/arg_check.h"
#include "kernels/kv_append/append_paged_kv.h"
#include "tessera/kv_cache.h"

namespace tessera {

const char* kv_layout_name(KVLayout layout) { return layout == KVLayout::kNHD ? "NHD" : "HND"; }

namespace {

// The host copies of the index arrays are required: with them every index the kernel will follow
// is checked here, so a bad page table is an error, never an out-of-bounds write.
void check_page_table_host(const detail::ArgCheck& check, const PageTable& table,
                           const PagedKVCache& cache, const int32_t* host_append_indptr,
                           int64_t nnz) {
  TESSERA_REQUIRE(check, table.host_indptr != nullptr, "host_indptr",
                  "is required (a host copy of kv_indptr, checked before launching)");
  TESSERA_REQUIRE(check, table.host_indices != nullptr, "host_indices", "is required (a host copy of kv_indices)");
  TESSERA_REQUIRE(check, table.host_last_page_len != nullptr, "host_last_page_len",
                  "is required (a host copy of kv_last_page_len)");
  TESSERA_REQUIRE(check, host_append_indptr != nullptr, "host_append_indptr",
                  "is required (a host copy of append_indptr)");
  const int64_t batch = table.batch_size();
  const int64_t page_size = cache.page_size();
  check.indptr_host(table.host_indptr, batch + 1, "kv_indptr", table.indices.size(0),
                    /*exact_end=*/false);
  check.indptr_host(host_append_indptr, batch + 1, "append_indptr", nnz, /*exact_end=*/true);
  // Only the pages this append writes into are followed by the kernel, so only they are checked
  // (O(new rows / page_size + batch) per call, not O(pages held)): inside the cache, and none
  // written twice.
  std::vector<int32_t> written;
  written.reserve(static_cast<size_t>(nnz / page_size + 2 * batch));
  for (int64_t i = 0; i < batch; ++i) {
    const int64_t pages = table.host_indptr[i + 1] - table.host_indptr[i];
    const int32_t last = table.host_last_page_len[i];
    // Messages are built only on failure: these loops run per call over every written page
    // (building them eagerly cost 800 us per call at 4096 pages).
    if (!(pages == 0 || (last >= 1 && last <= page_size))) {
      check.fail("kv_last_page_len", "value " + std::to_string(last) + " at index " +
                                         std::to_string(i) + " is outside 1.." +
                                         std::to_string(page_size));
    }
    const int64_t kv_len = pages == 0 ? 0 : (pages - 1) * page_size + last;
    const int64_t n_new = host_append_indptr[i + 1] - host_append_indptr[i];
    if (n_new > kv_len) {
      check.fail("append_indptr", "request " + std::to_string(i) + " appends " +
                                      std::to_string(n_new) + " rows but its pages hold only " +
                                      std::to_string(kv_len) +
                                      " tokens (the page table must already include the new rows)");
    }
    if (n_new == 0) continue;
    for (int64_t p = (kv_len - n_new) / page_size; p <= (kv_len - 1) / page_size; ++p) {
      const int64_t at = table.host_indptr[i] + p;
      const int32_t page = table.host_indices[at];
      if (page < 0 || page >= cache.num_pages()) {
        check.fail("kv_indices", "page id " + std::to_string(page) + " at index " +
                                     std::to_string(at) + " is outside the cache's " +
                                     std::to_string(cache.num_pages()) + " pages");
      }
      written.push_back(page);
    }
  }
  std::sort(written.begin(), written.end());
  const auto dup = std::adjacent_find(written.begin(), written.end());
  TESSERA_REQUIRE(check, dup == written.end(), "kv_indices",
                  dup == written.end() ? std::string()
                                       : "page id " + std::to_string(*dup) +
                                             " receives new rows twice (two requests, or one "
                                             "request twice, append into the same page)");
}

}  // namespace

void append_paged_kv(const PagedKVCache& cache, const PageTable& table,
                     const TensorView& append_indptr, const TensorView& k_new,
                     const TensorView& v_new, cudaStream_t stream,
                     const int32_t* host_append_indptr) {
  const detail::ArgCheck check("append_paged_kv");
  check.kv_layout(cache.layout, "cache.layout");
  check.tensor(cache.k_pages, "k_pages", 4);
  check.tensor(cache.v_pages, "v_pages", 4);
  check.dtype(cache.k_pages, "k_pages", {DType::kBF16, DType::kFP16});
  check.dtype(cache.v_pages, "v_pages", {cache.k_pages.dtype});
  check.same_shape(cache.k_pages, "k_pages", cache.v_pages, "v_pages");
  check.vectorizable_rows(cache.k_pages, "k_pages");
  check.vectorizable_rows(cache.v_pages, "v_pages");
  TESSERA_REQUIRE(check, cache.page_size() >= 1, "k_pages", "page_size must be at least 1");
  TESSERA_REQUIRE(check, cache.num_kv_heads() >= 1, "k_pages", "num_kv_heads must be at least 1");
  TESSERA_REQUIRE(check, cache.head_dim() >= 8, "k_pages",
                  "head_dim must be at least 8, got " + std::to_string(cache.head_dim()));
  check.output_layout(cache.k_pages, "k_pages");
  check.output_layout(cache.v_pages, "v_pages");
  check.disjoint(cache.v_pages, "v_pages", cache.k_pages, "k_pages");

  check.tensor(k_new, "k_new", 3);
  check.tensor(v_new, "v_new", 3);
  check.dtype(k_new, "k_new", {cache.k_pages.dtype});
  check.dtype(v_new, "v_new", {cache.k_pages.dtype});
  check.dim(k_new, "k_new", 1, cache.num_kv_heads(), "num_kv_heads of the cache");
  check.dim(k_new, "k_new", 2, cache.head_dim(), "head_dim of the cache");
  check.same_shape(k_new, "k_new", v_new, "v_new");
  check.vectorizable_rows(k_new, "k_new");
  check.vectorizable_rows(v_new, "v_new");
  // The index arrays' own view rules before the overlap checks, which would otherwise charge a
  // broken one (reaching past 2^63 bytes, it spans everything) to the pages.
  check.index_array(table.indptr, "kv_indptr");
  check.index_array(table.indices, "kv_indices");
  check.index_array(table.last_page_len, "kv_last_page_len");
  check.index_array(append_indptr, "append_indptr");
  // The pages (the outputs) overlap no input: not the new rows, not the index arrays read.
  for (const TensorView* page : {&cache.k_pages, &cache.v_pages}) {
    const char* name = page == &cache.k_pages ? "k_pages" : "v_pages";
    check.disjoint(*page, name, k_new, "k_new");
    check.disjoint(*page, name, v_new, "v_new");
    check.disjoint(*page, name, table.indptr, "kv_indptr");
    check.disjoint(*page, name, table.indices, "kv_indices");
    check.disjoint(*page, name, table.last_page_len, "kv_last_page_len");
    check.disjoint(*page, name, append_indptr, "append_indptr");
  }

  TESSERA_REQUIRE(check, table.indptr.size(0) >= 1, "kv_indptr", "must have batch_size + 1 >= 1 entries");
  const int64_t batch = table.batch_size();
  check.dim(table.last_page_len, "kv_last_page_len", 0, batch, "batch_size (kv_indptr size - 1)");
  check.dim(append_indptr, "append_indptr", 0, batch + 1, "batch_size + 1");

  const int64_t nnz = k_new.size(0);
  const int64_t vectors = nnz * cache.num_kv_heads() * (cache.head_dim() / 8);
  // The kernel's grid-stride loop runs in int32: keep the last stride step below 2^31 too.
  TESSERA_REQUIRE(check, vectors < (int64_t(1) << 31) - (int64_t(1) << 24), "k_new",
                  "too many rows for one call (" + std::to_string(nnz) + "); split the batch");
  TESSERA_REQUIRE(check, cache.num_pages() * cache.page_size() < (int64_t(1) << 31), "k_pages",
                  "the cache holds " + std::to_string(cache.num_pages() * cache.page_size()) +
                      " token slots (num_pages x page_size); at most 2^31 - 1 are supported");
  check_page_table_host(check, table, cache, host_append_indptr, nnz);
  if (nnz == 0 || batch == 0) return;

  const bool nhd = cache.layout == KVLayout::kNHD;
  kernels::AppendPagedKVParams p;
  p.k_new = k_new.data;
  p.v_new = v_new.data;
  p.k_new_stride_token = k_new.stride[0];
  p.k_new_stride_head = k_new.stride[1];
  p.v_new_stride_token = v_new.stride[0];
  p.v_new_stride_head = v_new.stride[1];
  p.k_pages = cache.k_pages.data;
  p.v_pages = cache.v_pages.data;
  p.k_stride_page = cache.k_pages.stride[0];
  p.v_stride_page = cache.v_pages.stride[0];
  p.k_stride_slot = cache.k_pages.stride[nhd ? 1 : 2];
  p.k_stride_head = cache.k_pages.stride[nhd ? 2 : 1];
  p.v_stride_slot = cache.v_pages.stride[nhd ? 1 : 2];
  p.v_stride_head = cache.v_pages.stride[nhd ? 2 : 1];
  p.page_size = static_cast<int>(cache.page_size());
  p.num_kv_heads = static_cast<int>(cache.num_kv_heads());
  p.head_dim = static_cast<int>(cache.head_dim());
  p.append_indptr = static_cast<const int32_t*>(append_indptr.data);
  p.kv_indptr = static_cast<const int32_t*>(table.indptr.data);
  p.kv_indices = static_cast<const int32_t*>(table.indices.data);
  p.num_pages = cache.num_pages();
  p.kv_last_page_len = static_cast<const int32_t*>(table.last_page_len.data);
  p.batch_size = static_cast<int>(batch);
  p.nnz = nnz;
  kernels::launch_append_paged_kv(cache.k_pages.dtype, p, stream);
}

}  // namespace tessera
