// The paged KV cache and writing new K/V rows into it.
//
// K and V live in separate page tensors of page_size tokens each:
//   NHD: [num_pages, page_size, num_kv_heads, head_dim]
//   HND: [num_pages, num_kv_heads, page_size, head_dim]
// Page tensors may be strided, but head_dim must be the contiguous dimension.
// A page table is CSR over requests: request i owns pages indices[indptr[i] .. indptr[i+1]), and
// its kv_len = page_size * (pages - 1) + last_page_len[i] (0 when it has no pages).
#pragma once

#include <cstdint>

#include "tessera/stream.h"
#include "tessera/tensor.h"

namespace tessera {

enum class KVLayout : int { kNHD = 0, kHND = 1 };

const char* kv_layout_name(KVLayout layout);

struct PagedKVCache {
  TensorView k_pages;  // 4-D, bf16 or fp16
  TensorView v_pages;  // same shape and dtype as k_pages (strides may differ)
  KVLayout layout = KVLayout::kNHD;

  int64_t num_pages() const { return k_pages.size(0); }
  int64_t page_size() const { return k_pages.size(layout == KVLayout::kNHD ? 1 : 2); }
  int64_t num_kv_heads() const { return k_pages.size(layout == KVLayout::kNHD ? 2 : 1); }
  int64_t head_dim() const { return k_pages.size(3); }
};

// Device-resident page table (int32 tensors) read by kernels, with host copies of the same values
// (an engine builds the table on the host anyway). Entry points that write through the table
// require the host copies and check every index the kernel will follow (monotone indptr, page ids
// inside the cache, last_page_len in 1..page_size) before launching anything.
struct PageTable {
  TensorView indptr;         // [batch + 1]
  TensorView indices;        // [indptr[batch]]
  TensorView last_page_len;  // [batch]
  const int32_t* host_indptr = nullptr;
  const int32_t* host_indices = nullptr;
  const int32_t* host_last_page_len = nullptr;

  int64_t batch_size() const { return indptr.size(0) - 1; }
};

// Writes a ragged batch of new K/V rows into the cache. `append_indptr` ([batch + 1], int32,
// device) gives request i the rows [append_indptr[i], append_indptr[i+1]) of k_new / v_new
// ([nnz, num_kv_heads, head_dim], same dtype as the pages, head_dim contiguous).
// The page table already describes the cache *after* the append (the engine allocates pages first,
// as in FlashInfer): request i's new rows go to positions kv_len_i - n_i .. kv_len_i - 1, so its
// current length before the call is kv_len_i - n_i. The host copies (table.host_* and
// host_append_indptr) are required: n_i <= kv_len_i, rows inside k_new, page ids inside the cache,
// and no page receiving rows from two places are checked on them. Outputs (the pages) must not
// overlap each other or the inputs. Limits (the kernel indexes in int32): the cache holds fewer
// than 2^31 token slots (num_pages x page_size < 2^31), and one call writes fewer than
// 2^31 - 2^24 vectors of 8 elements (nnz x num_kv_heads x head_dim / 8); each is refused with an
// error naming k_pages / k_new.
// Asynchronous on `stream`; never synchronizes.
void append_paged_kv(const PagedKVCache& cache, const PageTable& table,
                     const TensorView& append_indptr, const TensorView& k_new,
                     const TensorView& v_new, cudaStream_t stream,
                     const int32_t* host_append_indptr);

}  // namespace tessera
