// The epilogue of the portable prefill kernel: O / l and the natural-log LSE of each of the warp's
// rows (attention_state.cuh's rule: a row that saw no key gives O = 0 and LSE = -inf), written
// straight from the accumulators; a pair first adds its two key halves' row sums.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "kernels/attention/common/attention_state.cuh"
#include "kernels/attention/common/register_tile.cuh"
#include "kernels/attention/portable/prefill_config_sm80.cuh"
#include "kernels/attention/portable/prefill_warp_sm80.cuh"
#include "kernels/attention/portable/row_softmax_sm80.cuh"
#include "kernels/attention/prefill_params.h"
#include "kernels/common/mma_sm80.cuh"

namespace tessera::kernels::sm80 {

// Rows [m0, min(m0 + kBlockM, qo_len)) of the request whose rows start at q_start, for query head
// `head`. exchange: a pair's floats in shared memory (PrefillConfig::kExchangeBytes).
// kFixedGrid: the list of a fixed-grid launch, whose step splits into list_splits runs.
template <typename T, typename Config, bool kFixedGrid, typename Softmax>
__device__ __forceinline__ void prefill_epilogue(const PrefillParams& p, const AccTile<Config::kODims> (&o)[Config::kMTiles],
                                                 Softmax& softmax, const PrefillWarp<Config>& w, float* exchange,
                                                 float log2_scale, int q_start, int qo_len, int head, int m0,
                                                 int split, int list_splits) {
  constexpr int kMTiles = Config::kMTiles, kBlockM = Config::kBlockM;
  auto& row_sum = softmax.row_sum;
  T* o_head = static_cast<T*>(p.o) + int64_t(q_start) * p.o_stride_row + head * p.o_stride_head;
  if constexpr (Config::kWarpPairs) {  // row sums over the row's 4 lanes and both key halves
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float l = row_sum[mt][r];
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        row_sum[mt][r] = l + __shfl_xor_sync(0xffffffffu, l, 2);
        if (w.t == 0) exchange[w.half * kBlockM + w.tile_row(mt) + w.g + 8 * r] = row_sum[mt][r];
      }
    }
    w.pair_sync();
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int r = 0; r < 2; ++r) row_sum[mt][r] += exchange[(1 - w.half) * kBlockM + w.tile_row(mt) + w.g + 8 * r];
  }
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float l = row_sum[mt][r];
      if constexpr (!Config::kWarpPairs) {
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
      }
      // Nothing visible gives l == 0; a NaN logit gives l = NaN (and row_max may stay -inf,
      // since fmaxf skips NaN), which must reach O and LSE rather than read as empty.
      const float inv_sum = state_inv_sum(l);
      const int row = m0 + w.tile_row(mt) + w.g + 8 * r;
      if (row >= qo_len) continue;
      // A split's partial state (fp32), merged by the caller (a fixed-grid launch: when its step
      // splits; list_splits is unused otherwise).
      if (kFixedGrid ? list_splits > 1 : p.partial_o != nullptr) {
        const int64_t state = (int64_t(split) * p.q_rows + q_start + row) * p.num_qo_heads + head;
        float* po = p.partial_o + state * Config::kHeadDim + w.half * Config::kODims;
#pragma unroll
        for (int d = 0; d < Config::kODTiles; ++d) {
          *reinterpret_cast<float2*>(po + d * 8 + 2 * w.t) =
              make_float2(o[mt].v[d][2 * r] * inv_sum, o[mt].v[d][2 * r + 1] * inv_sum);
        }
        if (w.t == 0 && w.half == 0) {
          p.partial_lse[state] = l == 0.f ? -INFINITY : Log2Units::lse(softmax.row_max[mt][r] * log2_scale, l);
        }
        continue;
      }
      T* o_row = o_head + int64_t(row) * p.o_stride_row + w.half * Config::kODims;
#pragma unroll
      for (int d = 0; d < Config::kODTiles; ++d) {
        *reinterpret_cast<uint32_t*>(o_row + d * 8 + 2 * w.t) =
            pack2<T>(o[mt].v[d][2 * r] * inv_sum, o[mt].v[d][2 * r + 1] * inv_sum);
      }
      if (p.lse != nullptr && w.t == 0 && w.half == 0) {
        // state_lse's rule, written out (through the helper the compiler orders the start of log2
        // differently, and the kernel's machine code changed).
        p.lse[int64_t(q_start + row) * p.lse_stride_row + head * p.lse_stride_head] =
            l == 0.f ? -INFINITY : Log2Units::lse(softmax.row_max[mt][r] * log2_scale, l);
      }
    }
  }
}

}  // namespace tessera::kernels::sm80
