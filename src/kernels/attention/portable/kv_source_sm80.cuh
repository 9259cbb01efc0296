// Where the prefill kernel's K/V rows come from: one request's rows of one KV head, copied tile by
// tile into swizzled shared memory with cp.async. The kernel is written once against this
// interface:
//   Source src(p, request, kv_head, smem);  src.kv_len
//   src.fetch_rows(p, n0, buf)      start loading what locating rows [n0, n0 + kBlockN) needs
//   src.publish_rows(p, n0, buf)    locate them for the CTA (visible after a __syncthreads)
//   src.load(p, tile, n0, buf, kKeys / kValues)  copy those rows of K or V (rows >= kv_len: zeros)
// RaggedKV reads [total_kv, heads, head_dim] rows at a fixed stride and needs none of the first two.
// PagedKV reads a paged cache through the page table (the BSR view of src/format): the page ids of
// a tile's rows are copied into shared memory with cp.async two tiles ahead (fetch_rows), turned
// into the rows' element offsets in K and V one tile ahead (publish_rows, after S = QK^T), so
// copying a row costs one shared load more than a ragged row. When K and V pages have the same
// strides (the usual case) only the K offsets are published and V uses them (+3-4% at hd128).
// Measured against the ragged kernel:
// page arithmetic per 16-byte chunk 0.84-0.87; ids loaded into registers one tile ahead 0.96 at
// hd128 but 0.86-0.88 at hd64 / hd256, whose shorter S = QK^T did not hide the load; offsets in
// shared memory 0.88-0.90; all of a thread's offsets read before its first copy 0.94-0.96.
// The parameters are passed to every call rather than kept by address: taking the address of a
// kernel parameter copies the whole struct to local memory.
#pragma once

#include <cuda_runtime.h>

#include "kernels/attention/prefill_params.h"
#include "kernels/common/device_check.cuh"
#include "kernels/common/mma_sm80.cuh"

namespace tessera::kernels::sm80 {

enum class KVPart { kKeys, kValues };

// Copies rows [row0, row0 + kRows) of a tile; row r lives at row_ptr(r) (any address for rows past
// valid_rows, which are zero-filled).
template <typename T, int kRows, int kHeadDim, int kThreads, typename RowPtr>
__device__ void copy_tile_rows(const SwizzledTile<T, kRows, kHeadDim>& tile, int valid_rows,
                               RowPtr row_ptr) {
  constexpr int kChunks = kRows * kHeadDim / 8;
  static_assert(kChunks % kThreads == 0, "tile chunks must divide evenly among the threads");
#pragma unroll
  for (int i = 0; i < kChunks / kThreads; ++i) {
    const int c = threadIdx.x + i * kThreads;
    const int row = c / (kHeadDim / 8);
    const int col = (c % (kHeadDim / 8)) * 8;
    const bool valid = row < valid_rows;
    cp_async_16(tile.at(row, col), row_ptr(valid ? row : 0) + col, valid);
  }
}

// Copies of a whole tile in passes: thread c copies chunk c % kChunksPerRow of rows
// c / kChunksPerRow + i * kRowsPerPass (i < kPasses), so its rows lie a fixed step apart (and its
// swizzled destinations compile-time offsets apart when a pass is a multiple of the 8-row swizzle
// period).
template <int kRows, int kHeadDim, int kThreads>
struct TileCopyPasses {
  static constexpr int kChunksPerRow = kHeadDim / 8;
  static constexpr int kRowsPerPass = kThreads / kChunksPerRow;
  static constexpr int kPasses = kRows / kRowsPerPass;
  static_assert(kThreads % kChunksPerRow == 0 && kRows % kRowsPerPass == 0,
                "each pass of the threads covers whole rows");
  __device__ static int row() { return threadIdx.x / kChunksPerRow; }  // in the first pass
  __device__ static int col() { return (threadIdx.x % kChunksPerRow) * 8; }
};

// copy_tile_rows for a tile whose rows are all valid and lie `stride` elements apart.
template <typename T, int kRows, int kHeadDim, int kThreads>
__device__ void copy_full_tile_rows(const SwizzledTile<T, kRows, kHeadDim>& tile, const T* base,
                                    int64_t stride) {
  using Passes = TileCopyPasses<kRows, kHeadDim, kThreads>;
  const int row = Passes::row(), col = Passes::col();
  const T* src = base + row * stride + col;
  const int64_t step = Passes::kRowsPerPass * stride;
#pragma unroll
  for (int i = 0; i < Passes::kPasses; ++i)
    cp_async_16(tile.at(row + i * Passes::kRowsPerPass, col), src + i * step, true);
}

// kFullTileCopy: tiles wholly inside the request are copied by copy_full_tile_rows.
template <typename T, int kBlockN, int kHeadDim, int kThreads, bool kFullTileCopy>
struct RaggedKV {
  static constexpr int kSmemBytes = 0;  // shared memory it needs
  // Head pointers held in registers: rebuilding them from the constant bank per tile (as PagedKV
  // does) measured more spills here at hd128 (188 vs 136 bytes), register allocation being what
  // it is at the 255 limit.
  const T* k_head;
  const T* v_head;
  int kv_len;

  __device__ RaggedKV(const PrefillParams& p, int request, int kv_head, unsigned char* /*smem*/) {
    const int kv_start = p.kv_indptr[request];
    kv_len = p.kv_indptr[request + 1] - kv_start;
    k_head = static_cast<const T*>(p.k) + int64_t(kv_start) * p.k_stride_row + kv_head * p.k_stride_head;
    v_head = static_cast<const T*>(p.v) + int64_t(kv_start) * p.v_stride_row + kv_head * p.v_stride_head;
  }
  __device__ void fetch_rows(const PrefillParams& /*p*/, int /*n0*/, int /*buf*/) const {}
  __device__ void publish_rows(const PrefillParams& /*p*/, int /*n0*/, int /*buf*/) const {}
  __device__ void load(const PrefillParams& p, const SwizzledTile<T, kBlockN, kHeadDim>& tile,
                       int n0, int /*buf*/, KVPart part) const {
    const bool keys = part == KVPart::kKeys;
    const int64_t stride = keys ? p.k_stride_row : p.v_stride_row;
    const T* base = (keys ? k_head : v_head) + int64_t(n0) * stride;
    if (kFullTileCopy && n0 + kBlockN <= kv_len) {  // one address per thread, fixed steps
      copy_full_tile_rows<T, kBlockN, kHeadDim, kThreads>(tile, base, stride);
    } else {
      copy_tile_rows<T, kBlockN, kHeadDim, kThreads>(tile, kv_len - n0,
                                                     [&](int r) { return base + r * stride; });
    }
  }
};

template <typename T, int kBlockN, int kHeadDim, int kThreads>
struct PagedKV {
  static_assert(kBlockN <= kThreads, "one thread per row of a tile");
  // Page ids of two tiles' rows, then element offsets of two tiles' rows in K and in V.
  static constexpr int kSmemBytes = 2 * kBlockN * 4 + 2 * 2 * kBlockN * 8;
  // Few registers on purpose (the hd128 kernel is at its 255-register limit).
  int kv_head;
  int page_begin;        // this request's first entry of kv_indices
  int kv_len;
  int* ids;              // shared: [buf][kBlockN]
  int64_t* row_offsets;  // shared: [buf][K, V][kBlockN]

  __device__ PagedKV(const PrefillParams& p, int request, int kv_head_, unsigned char* smem) {
    kv_head = kv_head_;
    page_begin = p.kv_indptr[request];
    const int num_pages = p.kv_indptr[request + 1] - page_begin;
    kv_len = num_pages == 0 ? 0 : (num_pages - 1) * p.page_size + p.kv_last_page_len[request];
    ids = reinterpret_cast<int*>(smem);
    row_offsets = reinterpret_cast<int64_t*>(smem + 2 * kBlockN * 4);
  }
  // K and V pages with the same strides (the usual case): a row's V offset is its K offset.
  __device__ static bool same_layout(const PrefillParams& p) {
    return p.k_stride_page == p.v_stride_page && p.k_stride_token == p.v_stride_token &&
           p.k_stride_head == p.v_stride_head;
  }
  __device__ static int page_of(const PrefillParams& p, int token) {  // token / page_size
    const unsigned t = static_cast<unsigned>(token);
    return static_cast<int>((__umulhi(t, p.page_magic) + t) >> p.page_shift);
  }
  // Thread r < kBlockN owns row r. Rows past kv_len take the last row's page: their copies are
  // zero-filled anyway. The id copy joins the caller's next commit group.
  __device__ void fetch_rows(const PrefillParams& p, int n0, int buf) const {
    if (threadIdx.x < kBlockN) {
      const int token = min(n0 + int(threadIdx.x), kv_len - 1);
      asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(smem_addr(ids + buf * kBlockN + threadIdx.x)),
                   "l"(p.kv_indices + page_begin + page_of(p, token)));
    }
  }
  __device__ void publish_rows(const PrefillParams& p, int n0, int buf) const {
    if (threadIdx.x < kBlockN) {
      const int token = min(n0 + int(threadIdx.x), kv_len - 1);
      const int slot = token - page_of(p, token) * p.page_size;
      const int64_t page = ids[buf * kBlockN + threadIdx.x];
      TESSERA_DEVICE_CHECK(page >= 0 && page < p.num_pages, "a kv_indices page id (device copy) outside the page tensors");
      int64_t* offsets = row_offsets + buf * 2 * kBlockN;
      offsets[threadIdx.x] = page * p.k_stride_page + int64_t(slot) * p.k_stride_token +
                             int64_t(kv_head) * p.k_stride_head;
      if (!same_layout(p)) {
        offsets[kBlockN + threadIdx.x] = page * p.v_stride_page + int64_t(slot) * p.v_stride_token +
                                         int64_t(kv_head) * p.v_stride_head;
      }
    }
  }
  // Copies in TileCopyPasses' order. Every row's offset is a valid address (rows past kv_len
  // repeat the last row's), so the offsets are all read before the first copy is issued: read one
  // by one, each copy waited on its shared load (ncu at hd64: short-scoreboard stalls 15% of the
  // paged kernel's samples against 7% of the ragged kernel's).
  __device__ void load(const PrefillParams& p, const SwizzledTile<T, kBlockN, kHeadDim>& tile,
                       int n0, int buf, KVPart part) const {
    using Passes = TileCopyPasses<kBlockN, kHeadDim, kThreads>;
    constexpr int kPasses = Passes::kPasses, kRowsPerPass = Passes::kRowsPerPass;
    const bool keys = part == KVPart::kKeys;
    const T* base = static_cast<const T*>(keys ? p.k : p.v);
    const int64_t* offsets = row_offsets + buf * 2 * kBlockN + (keys || same_layout(p) ? 0 : kBlockN);
    const int row = Passes::row(), col = Passes::col();
    int64_t row_offset[kPasses];
#pragma unroll
    for (int i = 0; i < kPasses; ++i) row_offset[i] = offsets[row + i * kRowsPerPass];
    const int valid_rows = kv_len - n0;
#pragma unroll
    for (int i = 0; i < kPasses; ++i) {
      const int r = row + i * kRowsPerPass;
      cp_async_16(tile.at(r, col), base + row_offset[i] + col, r < valid_rows);
    }
  }
};

}  // namespace tessera::kernels::sm80
