// Division by a divisor fixed for a launch, as a multiply-high, an add and a shift: the host sets
// it up once (FastDivisor(d)), kernels divide with it. A division by a runtime value is ~20-40
// instructions on the GPU; the Hopper prefill divides a list position by the list's shape several
// times at every work tile (tile_scheduler_sm90.cuh), ~1.2 K cycles of each consumer's tile
// boundary before (notes/prefill_hopper.md).
//
// The multiplier and shift are core/fast_divisor.h's (Granlund & Montgomery's round-up multiplier,
// which the page-size divisions of every family use); this form carries the divisor too and
// divides on either side. tests/cpu/test_fast_divisor.cpp checks it for every divisor a list shape
// can have.
#pragma once

#include <cstdint>

#include "core/fast_divisor.h"

#ifdef __CUDACC__
#define TESSERA_HOST_DEVICE __host__ __device__
#else
#define TESSERA_HOST_DEVICE
#endif

namespace tessera::kernels {

struct FastDivisor {
  uint32_t divisor = 1;
  uint32_t multiplier = 1;
  uint32_t shift = 0;

  FastDivisor() = default;
  // d >= 1 (a 0 is taken as 1: a list of no tiles never divides). Set up on the host, by the launcher.
  explicit FastDivisor(int32_t d) : divisor(d > 1 ? uint32_t(d) : 1u) {
    const detail::FastDivisor f = detail::fast_divisor(divisor);
    multiplier = f.magic;
    shift = uint32_t(f.shift);
  }

  // n / divisor and n % divisor, for 0 <= n < 2^31.
  TESSERA_HOST_DEVICE int32_t div(int32_t n) const {
#ifdef __CUDA_ARCH__
    const uint32_t high = __umulhi(uint32_t(n), multiplier);
#else
    const uint32_t high = uint32_t((uint64_t(uint32_t(n)) * multiplier) >> 32);
#endif
    return int32_t((high + uint32_t(n)) >> shift);
  }
  TESSERA_HOST_DEVICE int32_t mod(int32_t n, int32_t quotient) const { return n - quotient * int32_t(divisor); }
};

}  // namespace tessera::kernels
