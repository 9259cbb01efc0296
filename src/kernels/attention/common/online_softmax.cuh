// The online softmax of one lane's two rows of an accumulator tile (register_tile.cuh), in log2
// units: for every tile of logits S (already transformed and masked to -inf),
//   m' = max(m, rowmax S),  P = 2^(S log2_scale - m' log2_scale),  l' = l 2^((m - m') log2_scale) + rowsum P
// and O is rescaled by the same factor before P V is added. A row that has seen no visible key
// keeps m = -inf and uses an exponent offset of 0, so its P and l stay 0 (and its output is 0
// with LSE -inf). A NaN logit is skipped by the max (fmaxf) but reaches P, l and so O and LSE.
#pragma once

#include <cuda_runtime.h>

#include <cmath>

#include "kernels/attention/common/log2_math.cuh"
#include "kernels/attention/common/register_tile.cuh"

// Ablation switch (notes/prefill_hopper.md, "The epilogue's first part"), off until timed: 1 takes
// finish()'s log2(l) from log2_approx (one MUFU.LG2; l >= 2^-8 here, so its ~2^-22 absolute error
// is far inside the LSE's tolerance) instead of log2f's polynomial, a chain of ~20 dependent FFMAs
// in every work tile's epilogue (~940 cycles for O / l and LSE at 128-key tiles, H100 timeline).
#ifndef TESSERA_FAST_LSE
#define TESSERA_FAST_LSE 0
#endif

namespace tessera::kernels {

struct OnlineSoftmax {
  float log2_scale;                     // the logits' scale times log2(e)
  float max[2] = {-INFINITY, -INFINITY};  // per row, in logit units (whole rows)
  float sum[2] = {0.f, 0.f};            // per row, this lane's partial sum of P

  __device__ explicit OnlineSoftmax(float log2_scale_) : log2_scale(log2_scale_) {}

  // Turns S into P in place and returns in `rescale` the factor for O (and applies it to the
  // sums), exactly 1 for a row whose maximum did not move: max * log2_scale - offset contracts
  // into an FMA whose result is max * log2_scale's rounding error, not 0, and 2^that scaled O and
  // l by 1 + 2^-24 or so for every KV tile a row sees nothing in (a tile only other rows of its
  // tile reach), so a row's bits depended on its tile's other rows. 0 the first time.
  // kLazy: FA4's conditional rescale. A row whose new maximum is at most kLazyRescaleLog2 (log2
  // units) above its current one keeps the current one, so its P is taken against it (at most
  // 2^kLazyRescaleLog2: in range for fp16 / bf16 and their fp32 sums) and its O and l need no
  // rescale (factor 1: l and O carry the same stale-maximum factor, which finish()'s 1 / l and LSE
  // account for exactly). Returns whether any row of the warp moved its maximum, i.e. whether O
  // must be multiplied by `rescale` (warp-uniform, so the caller's multiply is a branch instead of
  // 64 FMULs every tile; rows that kept theirs are multiplied by 1, which changes no bit, so a
  // row's result never depends on the other rows of its warp). Without kLazy: true.
  static constexpr float kLazyRescaleLog2 = 8.f;
  template <bool kLazy = false, int kCols>
  __device__ __forceinline__ bool update(AccTile<kCols>& s, float (&rescale)[2]) {
    float m[2] = {max[0], max[1]};
    row_max(s, m);
    float offset[2];
    bool moved_any = false;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const bool keep = m[r] == max[r] || (kLazy && (m[r] - max[r]) * log2_scale <= kLazyRescaleLog2);
      const float old_max = max[r];
      if (!keep) max[r] = m[r];
      offset[r] = max[r] == -INFINITY ? 0.f : max[r] * log2_scale;
      rescale[r] = keep ? 1.f : exp2_approx(old_max * log2_scale - offset[r]);
      sum[r] *= rescale[r];
      moved_any = moved_any || !keep;
    }
    exp2_row(s, log2_scale, offset);
    row_sum_partial(s, sum);
    if constexpr (kLazy) return __any_sync(0xffffffffu, moved_any);
    return true;
  }

  // The first tile of a row: nothing to rescale.
  template <int kCols>
  __device__ __forceinline__ void first(AccTile<kCols>& s) {
    float rescale[2];
    update(s, rescale);
  }

  // 1 / l for O (0 for a row with nothing visible) and the natural-log LSE of each row.
  __device__ __forceinline__ void finish(float (&inv_sum)[2], float (&lse)[2]) const {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float l = quad_sum(sum[r]);
      // Nothing visible gives l == 0; a NaN logit gives l = NaN (and max may stay -inf, since
      // fmaxf skips NaN), which must reach O and LSE rather than read as empty.
      const bool empty = l == 0.f;
      inv_sum[r] = empty ? 0.f : 1.f / l;
      const float log2_l = TESSERA_FAST_LSE ? log2_approx(l) : log2f(l);
      lse[r] = empty ? -INFINITY : (max[r] * log2_scale + log2_l) * kLn2;
    }
  }
};

}  // namespace tessera::kernels
