// The online softmax of the portable kernels (prefill and decode), one row at a time: for each of a
// lane's rows (kMTiles m16 tiles of the accumulator layout, two rows each), the tile's row max,
// the factor that rescales what came before, then the exponentials and their sum. In log2 units:
//   m' = max(m, rowmax S),  P = 2^(S log2_scale - m' log2_scale),  l' = l 2^((m - m') log2_scale) + rowsum P
// A row that has seen no visible key keeps m = -inf and uses an exponent offset of 0, so its P and
// l stay 0. A NaN logit is skipped by the max (fmaxf) but reaches P, l and so O and LSE.
//
// Row by row, with the per-tile sum added to the rescaled running sum in one FFMA, because that is
// the order the portable kernels were measured in (prefill_portable.md v10-v13; the hd128 prefill
// runs at the 255-register limit, where the order moves spills). common/online_softmax.cuh is the
// same math in the Hopper family's order (a whole tile per step).
// (The running maxima and sums are members in the reverse of the order the kernels once declared
// them as separate arrays, and the per-tile rescale factors stay the caller's arrays: the compiler
// then numbers their registers as before, and ptxas, whose output depends on that numbering,
// emits the same machine code.)
#pragma once

#include <cuda_runtime.h>

#include <cmath>

#include "kernels/attention/common/attention_state.cuh"
#include "kernels/attention/common/log2_math.cuh"
#include "kernels/attention/common/register_tile.cuh"

namespace tessera::kernels::sm80 {

// kTreeMax, kTreeSum: the row max, the row sum reduced as trees over the 8-column blocks rather
// than as chains (shorter dependency chains; prefill_portable.md v10). log2_scale: the logits'
// scale times log2(e) (logits.cuh).
template <int kMTiles, bool kTreeMax, bool kTreeSum>
struct RowSoftmax {
  float row_sum[kMTiles][2];  // this lane's partial sums; reduced over the row's 4 lanes at the end
  float row_max[kMTiles][2];  // raw logit units (whole rows)

  __device__ __forceinline__ RowSoftmax() {
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
      row_max[mt][0] = row_max[mt][1] = -INFINITY;
      row_sum[mt][0] = row_sum[mt][1] = 0.f;
    }
  }

  // The maximum of row r of tile s (m16 tile mt) and of the rows so far, over the row's quad.
  template <int kCols>
  __device__ __forceinline__ float tile_max(const AccTile<kCols>& s, int mt, int r) const {
    if constexpr (kTreeMax) return kernels::row_max_tree(s, r, row_max[mt][r]);
    else return kernels::row_max(s, r, row_max[mt][r]);
  }

  // Row (mt, r)'s new maximum m: sets the factor that rescales the row's O and sum (exactly 1 for
  // a maximum that did not move) and `moved` if it moved; returns the exponent offset.
  __device__ __forceinline__ float update_max(int mt, int r, float m, float log2_scale, float& rescale,
                                              bool& moved) {
    // A row with nothing visible yet keeps max -inf; its exponent offset is 0.
    const float m_scaled = m == -INFINITY ? 0.f : m * log2_scale;
    // Exactly 1 when the maximum stayed: exp2 of (old - new) * c computed by an fma carries the
    // rounding residual of the product (+-64 logit units at |logit| ~ 1e9), and the caller skips
    // O's rescale when no row moved, so a factor != 1 here would rescale l without O.
    const bool moved_here = m > row_max[mt][r];
    rescale = moved_here ? exp2_approx(row_max[mt][r] * log2_scale - m_scaled) : 1.f;
    moved |= moved_here;
    row_max[mt][r] = m;
    return m_scaled;
  }

  // P = 2^(S log2_scale - offset) in place on row r of tile s, and the row's running sum.
  template <int kCols>
  __device__ __forceinline__ void exponentiate(AccTile<kCols>& s, int mt, int r, float log2_scale, float offset,
                                               float rescale) {
    float sum;
    if constexpr (kTreeSum) {
      exp2_row(s, r, log2_scale, offset);
      sum = row_sum_tree(s, r);
    } else {
      sum = exp2_row_sum(s, r, log2_scale, offset);
    }
    row_sum[mt][r] = row_sum[mt][r] * rescale + sum;
  }

  // The three steps for row (mt, r).
  template <int kCols>
  __device__ __forceinline__ void update(AccTile<kCols>& s, int mt, int r, float log2_scale, float& rescale,
                                         bool& moved) {
    exponentiate(s, mt, r, log2_scale, update_max(mt, r, tile_max(s, mt, r), log2_scale, rescale, moved), rescale);
  }

  // The natural-log LSE of row (mt, r) once its sum `l` is complete (state_lse's rule: l == 0
  // means nothing visible).
  __device__ __forceinline__ float lse(int mt, int r, float l, float log2_scale) const {
    return state_lse(row_max[mt][r] * log2_scale, l);
  }
};

}  // namespace tessera::kernels::sm80
