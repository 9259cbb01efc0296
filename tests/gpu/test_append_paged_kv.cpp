// append_paged_kv on the GPU against a host model of the same write: every new row lands in its
// page slot bit for bit, and every other slot of the cache keeps its old contents.
#include <algorithm>
#include <numeric>

#include "gpu/gpu_test_util.h"

namespace tessera::testing {
namespace {

struct AppendCase {
  KVLayout layout;
  DType dtype;
  int page_size;
  int num_kv_heads;
  int head_dim;
  std::vector<int> old_len;   // tokens already cached per request
  std::vector<int> new_len;   // tokens appended per request
  int64_t pad = 0;            // extra elements per page (strided pages) and per new row
};

std::string name_of(const AppendCase& c) {
  return std::string(kv_layout_name(c.layout)) + " " + dtype_name(c.dtype) + " page_size " +
         std::to_string(c.page_size) + " heads " + std::to_string(c.num_kv_heads) + " hd " +
         std::to_string(c.head_dim) + " pad " + std::to_string(c.pad);
}

void run_case(const AppendCase& c, uint32_t seed) {
  std::mt19937 rng(seed);
  const int batch = static_cast<int>(c.old_len.size());
  const int H = c.num_kv_heads, D = c.head_dim, P = c.page_size;

  // Page table after the append; pages handed out in a shuffled order.
  std::vector<int32_t> kv_indptr{0}, last_page_len, append_indptr{0};
  int total_pages = 0;
  for (int i = 0; i < batch; ++i) {
    const int len = c.old_len[i] + c.new_len[i];
    const int pages = (len + P - 1) / P;
    total_pages += pages;
    kv_indptr.push_back(total_pages);
    last_page_len.push_back(pages == 0 ? 0 : len - (pages - 1) * P);
    append_indptr.push_back(append_indptr.back() + c.new_len[i]);
  }
  const int num_pages = total_pages + 3;  // spare pages that must stay untouched
  std::vector<int32_t> kv_indices(num_pages);
  std::iota(kv_indices.begin(), kv_indices.end(), 0);
  std::shuffle(kv_indices.begin(), kv_indices.end(), rng);
  kv_indices.resize(total_pages);
  const int nnz = append_indptr.back();

  // Strided geometry: `pad` extra elements after each page and after each new row.
  const bool nhd = c.layout == KVLayout::kNHD;
  const int64_t s_inner = D;                    // stride of dim 2
  const int64_t s_mid = int64_t(nhd ? H : P) * D;  // stride of dim 1
  const int64_t s_page = int64_t(P) * H * D + c.pad;
  const std::size_t page_elems = std::size_t(num_pages) * s_page;
  const int64_t row_stride = int64_t(H) * D + c.pad;
  const std::size_t new_elems = std::size_t(std::max(nnz, 1)) * row_stride;

  std::vector<uint16_t> k_pages_bits, v_pages_bits, k_new_bits, v_new_bits;
  random_16bit(page_elems, c.dtype, rng, k_pages_bits);
  random_16bit(page_elems, c.dtype, rng, v_pages_bits);
  random_16bit(new_elems, c.dtype, rng, k_new_bits);
  random_16bit(new_elems, c.dtype, rng, v_new_bits);

  // Expected cache: the old pages with the new rows written at positions old_len .. old_len+new-1.
  std::vector<uint16_t> k_expect = k_pages_bits, v_expect = v_pages_bits;
  for (int i = 0; i < batch; ++i) {
    for (int t = 0; t < c.new_len[i]; ++t) {
      const int pos = c.old_len[i] + t;
      const int page = kv_indices[kv_indptr[i] + pos / P];
      const int slot = pos % P;
      const int row = append_indptr[i] + t;
      for (int h = 0; h < H; ++h) {
        const int64_t dst = page * s_page + (nhd ? slot * s_mid + h * s_inner
                                                 : h * s_mid + slot * s_inner);
        const int64_t src = int64_t(row) * row_stride + int64_t(h) * D;
        std::copy_n(&k_new_bits[src], D, &k_expect[dst]);
        std::copy_n(&v_new_bits[src], D, &v_expect[dst]);
      }
    }
  }

  DeviceBuffer k_pages(page_elems * 2), v_pages(page_elems * 2), k_new(new_elems * 2),
      v_new(new_elems * 2), d_indptr(kv_indptr.size() * 4), d_indices(std::max<std::size_t>(kv_indices.size(), 1) * 4),
      d_last(std::max<std::size_t>(last_page_len.size(), 1) * 4), d_append(append_indptr.size() * 4);
  k_pages.upload(k_pages_bits);
  v_pages.upload(v_pages_bits);
  k_new.upload(k_new_bits);
  v_new.upload(v_new_bits);
  d_indptr.upload(kv_indptr);
  d_indices.upload(kv_indices);
  d_last.upload(last_page_len);
  d_append.upload(append_indptr);

  PagedKVCache cache;
  cache.layout = c.layout;
  const int64_t d1 = nhd ? P : H, d2 = nhd ? H : P;
  cache.k_pages = TensorView::strided(k_pages.get(), c.dtype, {num_pages, d1, d2, D},
                                      {s_page, s_mid, s_inner, 1});
  cache.v_pages = TensorView::strided(v_pages.get(), c.dtype, {num_pages, d1, d2, D},
                                      {s_page, s_mid, s_inner, 1});
  PageTable table;
  table.indptr = TensorView::contiguous(d_indptr.get(), DType::kInt32, {batch + 1});
  table.indices = TensorView::contiguous(d_indices.get(), DType::kInt32, {int64_t(kv_indices.size())});
  table.last_page_len = TensorView::contiguous(d_last.get(), DType::kInt32, {batch});
  table.host_indptr = kv_indptr.data();
  table.host_indices = kv_indices.data();
  table.host_last_page_len = last_page_len.data();
  const TensorView append = TensorView::contiguous(d_append.get(), DType::kInt32, {batch + 1});
  const TensorView kn = TensorView::strided(k_new.get(), c.dtype, {nnz, H, D}, {row_stride, D, 1});
  const TensorView vn = TensorView::strided(v_new.get(), c.dtype, {nnz, H, D}, {row_stride, D, 1});

  append_paged_kv(cache, table, append, kn, vn, nullptr, append_indptr.data());
  CUDA_OK(cudaDeviceSynchronize());
  const auto k_got = k_pages.download<uint16_t>(page_elems);
  const auto v_got = v_pages.download<uint16_t>(page_elems);
  std::size_t k_bad = 0, v_bad = 0;
  for (std::size_t i = 0; i < page_elems; ++i) {
    k_bad += k_got[i] != k_expect[i];
    v_bad += v_got[i] != v_expect[i];
  }
  EXPECT_EQ(k_bad, 0u) << name_of(c) << ": K elements differ from the expected cache";
  EXPECT_EQ(v_bad, 0u) << name_of(c) << ": V elements differ from the expected cache";
}

TEST(GpuAppendPagedKV, LayoutsPageSizesAndAwkwardLengths) {
  TESSERA_REQUIRE_GPU();
  const std::vector<int> old_len{0, 53, 1, 0, 96, 16384, 7};
  const std::vector<int> new_len{1, 1, 96, 0, 577, 1, 54};
  uint32_t seed = 1;
  for (KVLayout layout : {KVLayout::kNHD, KVLayout::kHND}) {
    for (int page_size : {1, 16, 64, 256}) {
      run_case({layout, DType::kBF16, page_size, 4, 128, old_len, new_len, 0}, seed++);
    }
  }
}

TEST(GpuAppendPagedKV, DtypesHeadDimsAndStridedPages) {
  TESSERA_REQUIRE_GPU();
  const std::vector<int> old_len{5, 0, 31};
  const std::vector<int> new_len{97, 7, 1};
  uint32_t seed = 100;
  for (DType dtype : {DType::kBF16, DType::kFP16}) {
    for (int head_dim : {64, 128, 256}) {
      for (KVLayout layout : {KVLayout::kNHD, KVLayout::kHND}) {
        run_case({layout, dtype, 16, 8, head_dim, old_len, new_len, /*pad=*/24}, seed++);
      }
    }
  }
  run_case({KVLayout::kNHD, DType::kFP16, 16, 1, 8, old_len, new_len, 8}, seed++);
}

TEST(GpuAppendPagedKV, EmptyAppendWritesNothing) {
  TESSERA_REQUIRE_GPU();
  run_case({KVLayout::kNHD, DType::kBF16, 16, 2, 64, {10, 3}, {0, 0}, 0}, 7);
}

}  // namespace
}  // namespace tessera::testing
