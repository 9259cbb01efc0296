// The decode kernel's main loop over one pass's KV range: K and V gathered from pages into a ring
// of shared-memory stages (cp.async), and per stage each warp's step over its own 16 keys:
// S = Q K^T, the logits' transform, the mask band, the online softmax and O += P V (mma.sync).
#pragma once

#include <cuda_runtime.h>

#include <cmath>

#include "kernels/attention/common/mask.cuh"
#include "kernels/attention/common/mask_tile.cuh"
#include "kernels/attention/common/register_tile.cuh"
#include "kernels/attention/decode_params.h"
#include "kernels/attention/portable/decode_config_sm80.cuh"
#include "kernels/attention/portable/row_softmax_sm80.cuh"
#include "kernels/common/device_check.cuh"
#include "kernels/common/mma_sm80.cuh"

namespace tessera::kernels::sm80 {

// Rows r0 .. r0 + kRows of a pass into the Q tile, zeros from `rows` on: row rr is query token
// q_start + rr / group of query head kv_head * group + rr % group (a KV head's GQA group). The
// copies join the caller's next commit group.
template <typename T, typename Cfg, int kHeadDim>
__device__ __forceinline__ void load_q_rows(const DecodeParams& p, const SwizzledTile<T, Cfg::kRows, kHeadDim>& q_tile,
                                            int q_start, int kv_head, int group, int r0, int rows) {
#pragma unroll
  for (int c = threadIdx.x; c < Cfg::kRows * Cfg::kChunksPerRow; c += Cfg::kThreads) {
    const int row = c / Cfg::kChunksPerRow, col = (c % Cfg::kChunksPerRow) * 8;
    const int rr = r0 + row;
    const bool valid = rr < rows;
    const T* src = static_cast<const T*>(p.q) +
                   (valid ? int64_t(q_start + rr / group) * p.q_stride_row +
                                int64_t(kv_head * group + rr % group) * p.q_stride_head
                          : 0) +
                   col;
    cp_async_16(q_tile.at(row, col), src, valid);
  }
}

// The page gather of one pass's keys [begin, end) of one KV head: a thread copies one 16-byte chunk
// column of Cfg::kRowsPerThread rows of each stage, and looks up their page ids (into registers) a
// stage ahead of the copies, so the ids' latency stays off the copy issue. Branch-free: rows past
// `end` read the last valid row's address and copy zeros (cp.async with 0 source bytes), so the
// per-row address math stays a handful of integer ops: the copy loop is most of the kernel's
// instructions (measured: integer ops were 600 of 950 instructions per tile before it was made
// branch-free with 32-bit strides). (The prefill's PagedKV publishes offsets through shared memory
// instead: its compute per tile is long enough to hide that; decode's is not.)
template <typename T, typename Cfg, int kHeadDim>
struct DecodePageGather {
  using KVTile = SwizzledTile<T, Cfg::kBlockN, kHeadDim>;
  using PageIds = int[Cfg::kRowsPerThread];
  const int32_t* pages;  // the request's page ids
  const T* k_head;       // this thread's chunk column of the KV head, page 0 slot 0
  const T* v_head;
  int begin, end;
  int copy_row;

  // The ids of this thread's rows of tile `tile`.
  __device__ __forceinline__ void fetch(const DecodeParams& p, int tile, PageIds& ids) const {
    const int n0 = begin + tile * Cfg::kBlockN;
#pragma unroll
    for (int i = 0; i < Cfg::kRowsPerThread; ++i) {
      const int token = min(n0 + copy_row + i * Cfg::kRowStep, end - 1);
      ids[i] = __ldg(pages + page_index(p, token));
      TESSERA_DEVICE_CHECK(ids[i] >= 0 && ids[i] < p.num_pages, "a kv_indices page id (device copy) outside the cache");
    }
  }
  // The copies of tile `tile` into its stage's K and V tiles.
  __device__ __forceinline__ void issue(const DecodeParams& p, int tile, const PageIds& ids, const KVTile& kt,
                                        const KVTile& vt, int copy_col, uint64_t policy) const {
    const int n0 = begin + tile * Cfg::kBlockN;
#pragma unroll
    for (int i = 0; i < Cfg::kRowsPerThread; ++i) {
      const int row = copy_row + i * Cfg::kRowStep;
      const bool valid = n0 + row < end;
      const int token = min(n0 + row, end - 1);
      const int slot = token - page_index(p, token) * p.page_size;
      const T* k_src = k_head + int64_t(ids[i]) * p.k_stride_page + int64_t(slot) * p.k_stride_token;
      const T* v_src = v_head + int64_t(ids[i]) * p.v_stride_page + int64_t(slot) * p.v_stride_token;
      cp_async_16(kt.at(row, copy_col), k_src, valid, policy);
      cp_async_16(vt.at(row, copy_col), v_src, valid, policy);
    }
  }
};

// One warp's step over its 16 keys [n0 + 16 warp, + 16) of a stage: S = Q K^T, the logits'
// transform, the mask (only on stages that cross the band's edge: `needs_mask`), the online
// softmax of the lane's two rows (query rows lane_rows[0], lane_rows[1] of `band`), O rescaled
// when a row's maximum moved (skipped once the maxima settle, after the first stages:
// warp-uniform test), then O += P V with P straight from the S accumulators (one k16 A tile).
template <typename T, typename Cfg, int kHeadDim, typename Logits, typename Softmax, typename QFrags>
__device__ __forceinline__ void decode_warp_step(const Logits& logits, const MaskBand& band, bool needs_mask,
                                                 const int (&lane_rows)[2], int n0,
                                                 const LdmatrixLane<T, Cfg::kRows, kHeadDim>& q_lane, const QFrags& q_frag,
                                                 const LdmatrixLane<T, Cfg::kBlockN, kHeadDim>& k_lane,
                                                 const LdmatrixLane<T, Cfg::kBlockN, kHeadDim>& v_lane, int warp,
                                                 int lane, Softmax& softmax, AccTile<kHeadDim>& o) {
  constexpr int kKSteps = kHeadDim / 16;
  AccTile<16> s;
  fill(s, 0.f);
#pragma unroll
  for (int ks = 0; ks < kKSteps; ++ks) {
    uint32_t b[4];
    ldmatrix_x4(b, k_lane.at(warp * 16, ks));
    if constexpr (Cfg::kQInRegisters) {
      mma_16816<T>(s.v[0], q_frag[ks], b[0], b[1]);
      mma_16816<T>(s.v[1], q_frag[ks], b[2], b[3]);
    } else {
      uint32_t a[4];
      ldmatrix_x4(a, q_lane.at(0, ks));
      mma_16816<T>(s.v[0], a, b[0], b[1]);
      mma_16816<T>(s.v[1], a, b[2], b[3]);
    }
  }
  if constexpr (!Logits::kIdentity) for_each(s, [&](float& x, int, int, int) { x = logits(x); });
  if (needs_mask) mask_outside_band(s, band, lane_rows, n0 + warp * 16, lane);

  float rescale[2];
  bool moved = false;
#pragma unroll
  for (int r = 0; r < 2; ++r) softmax.update(s, 0, r, logits.log2_scale, rescale[r], moved);
  if (__any_sync(0xffffffffu, moved)) mul_row(o, rescale);

  uint32_t a[4];
  a_fragment<T>(s, 0, a);
#pragma unroll
  for (int dp = 0; dp < kHeadDim / 16; ++dp) {
    uint32_t b[4];
    ldmatrix_x4_trans(b, v_lane.at(warp * 16, dp));
    mma_16816<T>(o.v[2 * dp], a, b[0], b[1]);
    mma_16816<T>(o.v[2 * dp + 1], a, b[2], b[3]);
  }
}

}  // namespace tessera::kernels::sm80
