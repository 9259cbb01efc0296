#pragma once

#include <cstddef>
#include <cstdint>

namespace tessera::bench {

struct Ceilings {
  double copy_tbs = 0;  // device-to-device copy, read + write
  double read_tbs = 0;  // read-only streaming
  double launch_us = 0; // an empty one-wave kernel: the per-launch floor of the timing method
};

// bytes: the streamed buffer (default 4 GiB, ~70x the L2); a smaller one (still several times the L2)
// gives the ceiling of a stream of that length, fixed costs of a launch included.
constexpr size_t kCeilingBytes = size_t(4) << 30;
Ceilings measure_ceilings(size_t bytes = kCeilingBytes);

// Fills a device buffer with finite values in [-1, 1): bf16 pairs, or fp32 when `fp32`.
void fill_random(void* p, size_t bytes, uint32_t seed, bool fp32);

}  // namespace tessera::bench
