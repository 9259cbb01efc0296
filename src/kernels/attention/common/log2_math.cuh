// The log2-domain arithmetic of the softmax, defined once for every attention and merge kernel:
// exponentials are taken as 2^(x log2 e) (one FFMA and one EX2 per element, FA2's trick of
// folding the softmax scale into the exponent), and LSEs are reported in natural log (log2 values
// times ln 2).
#pragma once

#include <cuda_runtime.h>

namespace tessera::kernels {

inline constexpr float kLog2e = 1.4426950408889634f;  // log2(e)
inline constexpr float kLn2 = 0.6931471805599453f;    // ln(2)

// 2^x with the hardware approximation (2 ulp; subnormal results flush to 0, which only ever
// affects probabilities below 2^-126).
__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// log2(x) with the hardware approximation (lg2.approx, MUFU.LG2: absolute error ~2^-22 for
// normal x; NaN and +inf pass through).
__device__ __forceinline__ float log2_approx(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

}  // namespace tessera::kernels
