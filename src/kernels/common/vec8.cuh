// Eight consecutive elements of one row, moved with 16-byte accesses and computed on in fp32.
// The unit of work of the memory-bound kernels (append, merge): one thread owns one Vec8.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace tessera::kernels {

__device__ inline float2 to_float2(__nv_bfloat162 x) { return __bfloat1622float2(x); }
__device__ inline float2 to_float2(__half2 x) { return __half22float2(x); }
__device__ inline void from_float2(float a, float b, __nv_bfloat162& out) {
  out = __floats2bfloat162_rn(a, b);
}
__device__ inline void from_float2(float a, float b, __half2& out) { out = __floats2half2_rn(a, b); }

template <typename T>
struct PairOf;
template <>
struct PairOf<__nv_bfloat16> { using type = __nv_bfloat162; };
template <>
struct PairOf<__half> { using type = __half2; };

// bf16 / fp16: one 16-byte access.
template <typename T>
struct Vec8 {
  static_assert(sizeof(T) == 2, "Vec8<T> for 16-bit types; fp32 has its own specialisation");
  using Pair = typename PairOf<T>::type;
  uint4 raw;

  // Data read exactly once: evict-first, so it does not push reused data out of the caches.
  __device__ static Vec8 load_stream(const T* p) {
    return {__ldcs(reinterpret_cast<const uint4*>(p))};
  }
  __device__ void store(T* p) const { *reinterpret_cast<uint4*>(p) = raw; }
  __device__ void to_float(float (&f)[8]) const {
    const Pair* h = reinterpret_cast<const Pair*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 x = to_float2(h[i]);
      f[2 * i] = x.x;
      f[2 * i + 1] = x.y;
    }
  }
  __device__ static Vec8 from_float(const float (&f)[8]) {
    Vec8 v;
    Pair* h = reinterpret_cast<Pair*>(&v.raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) from_float2(f[2 * i], f[2 * i + 1], h[i]);
    return v;
  }
};

// fp32: two 16-byte accesses.
template <>
struct Vec8<float> {
  float4 lo, hi;

  __device__ static Vec8 load_stream(const float* p) {
    const float4* q = reinterpret_cast<const float4*>(p);
    return {__ldcs(q), __ldcs(q + 1)};
  }
  __device__ void store(float* p) const {
    float4* q = reinterpret_cast<float4*>(p);
    q[0] = lo;
    q[1] = hi;
  }
  __device__ void to_float(float (&f)[8]) const {
    f[0] = lo.x; f[1] = lo.y; f[2] = lo.z; f[3] = lo.w;
    f[4] = hi.x; f[5] = hi.y; f[6] = hi.z; f[7] = hi.w;
  }
  __device__ static Vec8 from_float(const float (&f)[8]) {
    return {make_float4(f[0], f[1], f[2], f[3]), make_float4(f[4], f[5], f[6], f[7])};
  }
};

}  // namespace tessera::kernels
