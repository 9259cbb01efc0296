// The decode kernel's epilogue of a pass: every warp holds the state (max, sum, unnormalised O) of
// the pass's rows over its own keys of each stage; the warps' states meet in shared memory and are
// combined in closed form (attention_state.cuh, log2 units) into O / LSE, or into the fp32 partial
// state of a split request's chunk.
#pragma once

#include <cuda_runtime.h>

#include <cmath>

#include "kernels/attention/common/attention_state.cuh"
#include "kernels/attention/common/register_tile.cuh"
#include "kernels/attention/decode_params.h"
#include "kernels/attention/portable/row_softmax_sm80.cuh"
#include "kernels/common/vec8.cuh"

namespace tessera::kernels::sm80 {

// The warps' states of a pass in shared memory: per warp and row its max (log2 units) and sum,
// and its unnormalised O (rows padded against bank conflicts).
template <typename Cfg>
struct WarpStates {
  float* max;  // [warp][row]
  float* sum;  // [warp][row]
  float* o;    // [warp][row][kScratchStride]

  __device__ __forceinline__ int row(int warp, int r) const { return warp * Cfg::kRows + r; }

  // This warp's state of the pass's real rows (r0 + its 16 rows < rows): a GQA group of 4 fills 4
  // of the tile's 16 rows, and the padding rows would be three quarters of this traffic.
  template <typename Softmax, int kHeadDim>
  __device__ __forceinline__ void store(const Softmax& softmax, const AccTile<kHeadDim>& o_acc, float log2_scale,
                                        int warp, int lane, int r0, int rows) const {
    const int g = lane / 4, t = lane % 4;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float l = quad_sum(softmax.row_sum[0][r]);
      if (r0 + g + 8 * r >= rows) continue;
      const int at = row(warp, g + 8 * r);
      if (t == 0) {
        const float m = softmax.row_max[0][r];
        max[at] = m == -INFINITY ? -INFINITY : m * log2_scale;
        sum[at] = l;
      }
#pragma unroll
      for (int d = 0; d < AccTile<kHeadDim>::kBlocks; ++d) {
        *reinterpret_cast<float2*>(o + at * Cfg::kScratchStride + d * 8 + 2 * t) =
            make_float2(o_acc.v[d][2 * r], o_acc.v[d][2 * r + 1]);
      }
    }
  }

  // Combines the warps' states of the pass's rows and writes them: O / LSE, or the partial state
  // of chunk slot `partial_slot` (>= 0). A warp contributes when its sum is not 0 (a NaN sum
  // contributes and poisons the row); no contributor means no visible key: O = 0, LSE = -inf.
  template <typename T>
  __device__ __forceinline__ void combine_and_write(const DecodeParams& p, const plan::RequestInfo& req,
                                                    int kv_head, int partial_slot, int group, int r0,
                                                    int rows) const {
    constexpr int kChunksPerRow = Cfg::kChunksPerRow, kHeadDim = kChunksPerRow * 8;
    for (int u = threadIdx.x; u < Cfg::kRows * kChunksPerRow; u += Cfg::kThreads) {
      const int r = u / kChunksPerRow, col = (u % kChunksPerRow) * 8;
      const int rr = r0 + r;
      if (rr >= rows) continue;
      float m = -INFINITY;
#pragma unroll
      for (int wi = 0; wi < Cfg::kWarps; ++wi) {
        if (sum[row(wi, r)] != 0.f) m = fmaxf(m, max[row(wi, r)]);
      }
      float l = 0.f, acc[8] = {};
#pragma unroll
      for (int wi = 0; wi < Cfg::kWarps; ++wi) {
        const float sw = sum[row(wi, r)];
        if (sw == 0.f) continue;
        const float weight = Log2Units::weight(max[row(wi, r)], m);
        l = fmaf(weight, sw, l);
        const float* o_w = o + row(wi, r) * Cfg::kScratchStride + col;
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[e] = fmaf(weight, o_w[e], acc[e]);
      }
      const float inv = state_inv_sum(l);
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[e] *= inv;
      const float lse = state_lse(m, l);
      if (partial_slot < 0) {
        const int64_t q_row = req.q_start + rr / group;
        const int head = kv_head * group + rr % group;
        Vec8<T>::from_float(acc).store(static_cast<T*>(p.o) + q_row * p.o_stride_row + head * p.o_stride_head + col);
        if (p.lse != nullptr && col == 0) p.lse[q_row * p.lse_stride_row + head * p.lse_stride_head] = lse;
      } else {
        const int64_t prow = p.slot_rows[partial_slot] + rr;
        Vec8<float>::from_float(acc).store(p.partial_o + prow * kHeadDim + col);
        if (col == 0) p.partial_lse[prow] = lse;
      }
    }
  }
};

}  // namespace tessera::kernels::sm80
