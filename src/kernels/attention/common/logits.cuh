// Logit transforms of the attention kernels (the "variant" functors), applied to the raw q.k of
// every key. The softmax then works in log2 units: p = 2^(x * log2_scale - max * log2_scale), one
// FFMA and one EX2 per element (FA2's trick of folding the softmax scale into the exponent).
// kIdentity lets a kernel compile the transform out with `if constexpr`.
#pragma once

#include <cuda_runtime.h>

#include "kernels/attention/common/log2_math.cuh"

namespace tessera::kernels {

struct PlainLogits {
  static constexpr bool kIdentity = true;
  float log2_scale;  // scale * log2(e)
  __host__ __device__ PlainLogits(float scale, float /*soft_cap*/)
      : log2_scale(scale * kLog2e) {}
  __device__ float operator()(float qk) const { return qk; }
};

struct SoftCappedLogits {
  static constexpr bool kIdentity = false;
  float pre, cap, log2_scale;  // x = cap * tanh(qk * scale / cap), already scaled
  __host__ __device__ SoftCappedLogits(float scale, float soft_cap)
      : pre(scale / soft_cap), cap(soft_cap), log2_scale(kLog2e) {}
  __device__ float operator()(float qk) const { return cap * tanhf(qk * pre); }
};

}  // namespace tessera::kernels
