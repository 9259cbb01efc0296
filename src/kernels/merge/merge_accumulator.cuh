// Online merge of attention states (o, natural-log LSE s) into a running (max LSE, sum of weights,
// weighted o), one Vec8 of o per accumulator. Used by the n-ary merge kernel (the decode kernel's
// split-KV merge takes the closed form instead: max and weights first, then independent
// multiply-adds). States at -inf contribute nothing (their o is never used); a NaN LSE
// poisons the row, a NaN in an o of a contributing state poisons that element only.
#pragma once

#include <cuda_runtime.h>

#include <cmath>

namespace tessera::kernels {

struct MergeAccumulator {
  static constexpr int kElems = 8;
  static constexpr float kLog2e = 1.4426950408889634f;
  static constexpr float kLn2 = 0.6931471805599453f;

  float max_s = -INFINITY;
  float sum = 0.f;
  float acc[kElems] = {};
  bool nan = false;

  __device__ void add(float s, const float (&o)[kElems]) {
    if (isnan(s)) nan = true;
    if (!(s > -INFINITY)) return;
    if (s > max_s) {
      const float rescale = exp2f((max_s - s) * kLog2e);  // 0 for the first state
      sum = fmaf(sum, rescale, 1.f);
#pragma unroll
      for (int e = 0; e < kElems; ++e) acc[e] = fmaf(acc[e], rescale, o[e]);
      max_s = s;
    } else {
      const float w = exp2f((s - max_s) * kLog2e);
      sum += w;
#pragma unroll
      for (int e = 0; e < kElems; ++e) acc[e] = fmaf(w, o[e], acc[e]);
    }
  }

  // Folds another accumulator of the same row into this one (both relative to their own max).
  __device__ void combine(const MergeAccumulator& other) {
    nan = nan || other.nan;
    if (!(other.max_s > -INFINITY)) return;
    if (other.max_s > max_s) {
      const float rescale = exp2f((max_s - other.max_s) * kLog2e);  // 0 when this one is empty
      sum = fmaf(sum, rescale, other.sum);
#pragma unroll
      for (int e = 0; e < kElems; ++e) acc[e] = fmaf(acc[e], rescale, other.acc[e]);
      max_s = other.max_s;
    } else {
      const float w = exp2f((other.max_s - max_s) * kLog2e);
      sum = fmaf(w, other.sum, sum);
#pragma unroll
      for (int e = 0; e < kElems; ++e) acc[e] = fmaf(w, other.acc[e], acc[e]);
    }
  }

  // Writes the merged o into `out` and returns the merged LSE.
  __device__ float finish(float (&out)[kElems]) const {
    const bool empty = max_s == -INFINITY;
    const float inv = empty ? 0.f : 1.f / sum;
#pragma unroll
    for (int e = 0; e < kElems; ++e) out[e] = nan ? NAN : (empty ? 0.f : acc[e] * inv);
    if (nan) return NAN;
    return empty ? -INFINITY : max_s + log2f(sum) * kLn2;
  }
};

}  // namespace tessera::kernels
