// Division by a runtime constant on the device without a divide: for 1 <= d < 2^31,
//   shift = ceil(log2 d),  magic = floor(2^32 (2^shift - d) / d) + 1,
//   n / d = (umulhi(n, magic) + n) >> shift   for 0 <= n < 2^31
// (Granlund-Montgomery). The kernels divide token positions by the page size with it.
#pragma once

#include <cstdint>

namespace tessera::detail {

struct FastDivisor {
  uint32_t magic = 0;
  int shift = 0;
};

inline FastDivisor fast_divisor(uint32_t d) {
  int shift = 0;
  while ((uint64_t(1) << shift) < d) ++shift;
  const uint64_t magic = ((uint64_t(1) << 32) * ((uint64_t(1) << shift) - d)) / d + 1;
  return {static_cast<uint32_t>(magic), shift};
}

// The device formula, on the host (for tests).
inline uint32_t fast_divide(uint32_t n, const FastDivisor& f) {
  const uint32_t hi = static_cast<uint32_t>((uint64_t(n) * f.magic) >> 32);
  return (hi + n) >> f.shift;
}

}  // namespace tessera::detail
