// Writes a ragged batch of new K/V rows into a paged cache. Memory-bound: every 16 bytes read are
// written once. One thread moves one 16-byte vector of K and the matching one of V; the index math
// (which request, which page, which slot) is recomputed per thread from L1-resident page tables,
// which costs far less than the memory traffic it sits beside.
#include <cuda_runtime.h>

#include "core/cuda_check.h"
#include "kernels/common/device_check.cuh"
#include "kernels/common/vec8.cuh"
#include "kernels/kv_append/append_paged_kv.h"

namespace tessera::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kElemsPerVec = 8;  // 16 bytes of bf16/fp16

// Largest i in [0, batch) with indptr[i] <= token (indptr non-decreasing, indptr[0] = 0).
__device__ int request_of(const int32_t* indptr, int batch, int token) {
  int lo = 0, hi = batch;  // answer in [lo, hi)
  while (hi - lo > 1) {
    const int mid = (lo + hi) >> 1;
    if (__ldg(indptr + mid) <= token) lo = mid; else hi = mid;
  }
  return lo;
}

template <typename T>
__global__ void __launch_bounds__(kThreads) append_paged_kv_kernel(AppendPagedKVParams p) {
  const int vecs_per_row = p.head_dim / kElemsPerVec;
  const int vecs_per_token = p.num_kv_heads * vecs_per_row;
  const int total = static_cast<int>(p.nnz) * vecs_per_token;  // < 2^31, checked on the host
  for (int idx = blockIdx.x * kThreads + threadIdx.x; idx < total; idx += gridDim.x * kThreads) {
    const int token = idx / vecs_per_token;
    const int within = idx - token * vecs_per_token;
    const int head = within / vecs_per_row;
    const int col = (within - head * vecs_per_row) * kElemsPerVec;

    const int req = request_of(p.append_indptr, p.batch_size, token);
    const int first_new = __ldg(p.append_indptr + req);
    const int num_new = __ldg(p.append_indptr + req + 1) - first_new;
    const int page_begin = __ldg(p.kv_indptr + req);
    const int num_pages = __ldg(p.kv_indptr + req + 1) - page_begin;
    const int kv_len = (num_pages - 1) * p.page_size + __ldg(p.kv_last_page_len + req);
    const int pos = kv_len - num_new + (token - first_new);
    const int page = __ldg(p.kv_indices + page_begin + pos / p.page_size);
    TESSERA_DEVICE_CHECK(page >= 0 && page < p.num_pages && pos >= 0,
                         "a kv_indices page id (device copy) outside the cache, or a row before the request's first");
    const int slot = pos % p.page_size;

    const T* k_src = static_cast<const T*>(p.k_new) + token * p.k_new_stride_token +
                     head * p.k_new_stride_head + col;
    const T* v_src = static_cast<const T*>(p.v_new) + token * p.v_new_stride_token +
                     head * p.v_new_stride_head + col;
    T* k_dst = static_cast<T*>(p.k_pages) + page * p.k_stride_page + slot * p.k_stride_slot +
               head * p.k_stride_head + col;
    T* v_dst = static_cast<T*>(p.v_pages) + page * p.v_stride_page + slot * p.v_stride_slot +
               head * p.v_stride_head + col;
    const Vec8<T> k = Vec8<T>::load_stream(k_src);
    const Vec8<T> v = Vec8<T>::load_stream(v_src);
    k.store(k_dst);
    v.store(v_dst);
  }
}

template <typename T>
void launch(const AppendPagedKVParams& p, cudaStream_t stream) {
  const int64_t total = p.nnz * p.num_kv_heads * (p.head_dim / kElemsPerVec);
  if (total == 0) return;
  int device = 0, sms = 0;
  TESSERA_CUDA_CHECK(cudaGetDevice(&device));
  TESSERA_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  // Enough blocks to fill every SM 8 deep (2048 threads), fewer when the work is small.
  const int64_t wanted = (total + kThreads - 1) / kThreads;
  const int blocks = static_cast<int>(wanted < int64_t(sms) * 8 ? wanted : int64_t(sms) * 8);
  append_paged_kv_kernel<T><<<blocks, kThreads, 0, stream>>>(p);
  TESSERA_CHECK_LAUNCH();
}

}  // namespace

void launch_append_paged_kv(DType dtype, const AppendPagedKVParams& params, cudaStream_t stream) {
  if (dtype == DType::kBF16) {
    launch<__nv_bfloat16>(params, stream);
  } else {
    launch<__half>(params, stream);
  }
}

}  // namespace tessera::kernels
