// Two fp32 values rounded into one b32 of two 16-bit floats (bf16 or fp16): the register form of
// a product's 16-bit operand (mma.sync and wgmma A fragments) and of 16-bit output pairs.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace tessera::kernels {

// The low half holds `lo`. T is __nv_bfloat16 or __half.
template <typename T>
__device__ __forceinline__ uint32_t pack_half2(float lo, float hi) {
  uint32_t r;
  if constexpr (std::is_same<T, __nv_bfloat16>::value) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    r = *reinterpret_cast<uint32_t*>(&v);
  } else {
    __half2 v = __floats2half2_rn(lo, hi);
    r = *reinterpret_cast<uint32_t*>(&v);
  }
  return r;
}

// One fp32 value rounded to T (__nv_bfloat16 or __half), round to nearest even.
template <typename T>
__device__ __forceinline__ T round_half(float x) {
  if constexpr (std::is_same<T, __nv_bfloat16>::value) return __float2bfloat16_rn(x);
  else return __float2half_rn(x);
}

}  // namespace tessera::kernels
