// Launch interface of the paged-KV append kernel (host-visible; no CUDA types but the stream).
#pragma once

#include <cstdint>

#include "tessera/dtype.h"
#include "tessera/stream.h"

namespace tessera::kernels {

struct AppendPagedKVParams {
  // New rows: [nnz, num_kv_heads, head_dim], head_dim contiguous.
  const void* k_new = nullptr;
  const void* v_new = nullptr;
  int64_t k_new_stride_token = 0, k_new_stride_head = 0;
  int64_t v_new_stride_token = 0, v_new_stride_head = 0;
  // Pages, addressed by (page, slot in page, head); the layout is folded into these strides.
  void* k_pages = nullptr;
  void* v_pages = nullptr;
  int64_t k_stride_page = 0, k_stride_slot = 0, k_stride_head = 0;
  int64_t v_stride_page = 0, v_stride_slot = 0, v_stride_head = 0;
  int page_size = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  // Page table after the append, and the new rows of each request (device, int32).
  const int32_t* append_indptr = nullptr;     // [batch + 1]
  const int32_t* kv_indptr = nullptr;         // [batch + 1]
  const int32_t* kv_indices = nullptr;
  const int32_t* kv_last_page_len = nullptr;  // [batch]
  int batch_size = 0;
  int64_t nnz = 0;  // new rows in all
  // Last, so that the fields the release kernel reads keep their offsets: pages of k_pages /
  // v_pages, read only by the device checks (device_check.cuh).
  int64_t num_pages = 0;
};

// dtype: bf16 or fp16 (the page dtype). Validated by the caller.
void launch_append_paged_kv(DType dtype, const AppendPagedKVParams& params, cudaStream_t stream);

}  // namespace tessera::kernels
