// The attention state of one query row over a set of keys, and its merge: defined once for the
// merge kernels, the decode kernel's split-KV merge and its warp combine.
//
// A state is (o, lse): o = sum_k e^{s_k} v_k / sum_k e^{s_k}, lse = log sum_k e^{s_k}. Two states
// merge as lse = log(e^lse_a + e^lse_b), o = o_a e^(lse_a - lse) + o_b e^(lse_b - lse), and a state
// at -inf (no visible key) contributes nothing (DESIGN.md). Merges work in max/sum form: for states
// i with maxima m_i and sums l_i (a stored state has m = lse, l = 1), against any M >= every m_i,
//   l = sum_i l_i e^(m_i - M),  o l = sum_i o_i l_i e^(m_i - M),  lse = M + log l.
// Two ways to get there: online (a running maximum, rescaled as states arrive: MergeAccumulator)
// and closed form (the maximum first, then independent multiply-adds: MergeStats), each measured
// where it is used (notes/merge_states.md, notes/decode.md v6 / v8).
//
// Units. States read from memory hold natural-log LSEs and are weighed with the IEEE exp2f (no
// flush to zero of small weights); a kernel's own running states are in the log2 units of its
// softmax (log2_math.cuh) and are weighed with ex2.approx like the exponentials that built them.
#pragma once

#include <cuda_runtime.h>

#include <cmath>

#include "kernels/attention/common/log2_math.cuh"

namespace tessera::kernels {

// Maxima that are natural-log LSEs (the states of the merge kernels and of split-KV partials).
struct NaturalLogUnits {
  // e^(m - max): the weight of a state with maximum m against the merge's maximum `max`.
  __device__ __forceinline__ static float weight(float m, float max) { return exp2f((m - max) * kLog2e); }
  // The natural-log LSE max + ln(sum) of a state in max/sum form.
  __device__ __forceinline__ static float lse(float max, float sum) { return max + log2f(sum) * kLn2; }
};

// Maxima in log2 units (a kernel's running softmax state: the max logit times log2_scale).
struct Log2Units {
  // 2^(m - max).
  __device__ __forceinline__ static float weight(float m, float max) { return exp2_approx(m - max); }
  // The natural-log LSE (max + log2 sum) ln 2.
  __device__ __forceinline__ static float lse(float max, float sum) { return (max + log2f(sum)) * kLn2; }
};

// Online merge of stored states (o, natural-log LSE s) into a running (max, sum of weights,
// weighted o), kElems values of o per state (0: the LSEs only, for a closed-form merge's
// statistics). A NaN LSE poisons the row; a NaN in an o of a contributing state poisons that
// element only.
template <int kElems>
struct MergeAccumulator {
  float max_s = -INFINITY;
  float sum = 0.f;
  float acc[kElems > 0 ? kElems : 1] = {};
  bool nan = false;

  // Adds the state (o, s).
  template <int N>
  __device__ __forceinline__ void add(float s, const float (&o)[N]) {
    static_assert(N == kElems, "one o of kElems values per state");
    add_state(s, o);
  }
  // Adds the LSE s of a state (kElems == 0).
  __device__ __forceinline__ void add(float s) {
    static_assert(kElems == 0, "an LSE-only accumulator");
    add_state(s, nullptr);
  }

  // This state's sum of weights against a larger maximum (the lanes of a warp-wide merge); an
  // empty state gives 0 (its max is -inf, against which no weight is defined).
  __device__ __forceinline__ float sum_against(float max) const {
    return sum > 0.f ? sum * NaturalLogUnits::weight(max_s, max) : 0.f;
  }

  // Writes the merged o into `out` and returns the merged LSE.
  __device__ __forceinline__ float finish(float (&out)[kElems]) const {
    const bool empty = max_s == -INFINITY;
    const float inv = empty ? 0.f : 1.f / sum;
#pragma unroll
    for (int e = 0; e < kElems; ++e) out[e] = nan ? NAN : (empty ? 0.f : acc[e] * inv);
    if (nan) return NAN;
    return empty ? -INFINITY : NaturalLogUnits::lse(max_s, sum);
  }

 private:
  __device__ __forceinline__ void add_state(float s, const float* o) {
    if (isnan(s)) nan = true;
    if (!(s > -INFINITY)) return;  // no visible key: its o is never read
    if (s > max_s) {
      const float rescale = NaturalLogUnits::weight(max_s, s);  // 0 for the first state
      sum = fmaf(sum, rescale, 1.f);
#pragma unroll
      for (int e = 0; e < kElems; ++e) acc[e] = fmaf(acc[e], rescale, o[e]);
      max_s = s;
    } else {
      const float w = NaturalLogUnits::weight(s, max_s);
      sum += w;
#pragma unroll
      for (int e = 0; e < kElems; ++e) acc[e] = fmaf(w, o[e], acc[e]);
    }
  }
};

// A closed-form merge of stored states (o_i, LSE s_i), per row: with M = max_i s_i,
//   sum = sum_i merge_weight(s_i, M),  o = (sum_i merge_weight(s_i, M) o_i) * merge_inv_sum(sum),
//   lse = merged_lse(M, sum, nan), where nan says whether some s_i is NaN (which poisons the row).
// The weight e^(s - M) of a state, 0 for a state at -inf: it contributes nothing, not 0 times its
// o (which may be NaN or garbage).
__device__ __forceinline__ float merge_weight(float s, float max) {
  return s > -INFINITY ? NaturalLogUnits::weight(s, max) : 0.f;
}
// 1 / sum, 0 when nothing contributes.
__device__ __forceinline__ float merge_inv_sum(float sum) { return sum > 0.f ? 1.f / sum : 0.f; }
// M + ln(sum); -inf when nothing contributes, NaN when a NaN LSE poisons the row.
__device__ __forceinline__ float merged_lse(float max, float sum, bool nan) {
  return nan ? NAN : (sum > 0.f ? NaturalLogUnits::lse(max, sum) : -INFINITY);
}

// The statistics of one row's closed-form merge, computed once and shared by the threads that
// fold its o's.
struct MergeStats {
  float max_lse, inv_sum, lse;
  bool nan;

  // From the maximum LSE and the sum of the weights against it.
  __device__ __forceinline__ static MergeStats of(float max_lse, float sum, bool nan) {
    MergeStats st;
    st.max_lse = max_lse;
    st.inv_sum = merge_inv_sum(sum);
    st.lse = merged_lse(max_lse, sum, nan);
    st.nan = nan;
    return st;
  }
  __device__ __forceinline__ float weight(float s) const { return merge_weight(s, max_lse); }
  // The merged o from the states' weighted sum.
  __device__ __forceinline__ float normalise(float weighted) const { return nan ? NAN : weighted * inv_sum; }
};

// A kernel's own running state in log2 units (max, sum), whose NaN travels in the sum: a sum of 0
// means no visible key (O = 0, LSE = -inf), and a NaN sum must reach O and LSE rather than read
// as empty. 1 / sum for O:
__device__ __forceinline__ float state_inv_sum(float sum) { return sum == 0.f ? 0.f : 1.f / sum; }
// and the natural-log LSE.
__device__ __forceinline__ float state_lse(float max, float sum) {
  return sum == 0.f ? -INFINITY : Log2Units::lse(max, sum);
}

}  // namespace tessera::kernels
