// The two memory ceilings every memory-bound record is compared with, measured in the same run:
//   copy: a plain device-to-device copy kernel, 16 bytes per thread, counting read + write;
//   read: a read-only streaming kernel, 16-byte loads, grid-stride, the decode ceiling.
// Also a fill kernel that puts random-looking finite bf16/fp32 values into benchmark buffers.
#include <algorithm>
#include <cuda_runtime.h>

#include <cstdint>

#include "ceilings.h"
#include "timing.h"

namespace tessera::bench {
namespace {

__global__ void copy_kernel(const uint4* __restrict__ src, uint4* __restrict__ dst, size_t n) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    dst[i] = __ldcs(src + i);
  }
}

__global__ void read_kernel(const uint4* __restrict__ src, size_t n, unsigned* sink) {
  unsigned acc = 0;
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x;
  // Four independent loads in flight per thread.
  for (; i + 3 * stride < n; i += 4 * stride) {
    const uint4 a = __ldcs(src + i), b = __ldcs(src + i + stride), c = __ldcs(src + i + 2 * stride),
                d = __ldcs(src + i + 3 * stride);
    acc ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w ^ c.x ^ c.y ^ c.z ^ c.w ^ d.x ^ d.y ^ d.z ^ d.w;
  }
  for (; i < n; i += stride) {
    const uint4 a = __ldcs(src + i);
    acc ^= a.x ^ a.y ^ a.z ^ a.w;
  }
  if (acc == 0x9e3779b9u) *sink = acc;  // practically never: keeps the loads alive
}

// Finite values in [-1, 1): bf16 pairs or fp32 from a hash of the index.
__global__ void fill_kernel(uint32_t* p, size_t words, uint32_t seed, bool fp32) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < words; i += size_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 2654435761u ^ seed;
    h ^= h >> 15; h *= 2246822519u; h ^= h >> 13; h *= 3266489917u; h ^= h >> 16;
    if (fp32) {
      p[i] = 0x3f800000u | (h >> 9);  // [1, 2)
      reinterpret_cast<float*>(p)[i] -= 1.5f;
    } else {
      // Two bf16 in [-1, 1): sign bit random, exponent 118..126.
      const uint32_t lo = (h & 0x8000u) | ((118u + (h >> 16) % 9u) << 7) | (h & 0x7Fu);
      const uint32_t hi = ((h >> 8) & 0x8000u) | ((118u + (h >> 24) % 9u) << 7) | ((h >> 4) & 0x7Fu);
      p[i] = lo | (hi << 16);
    }
  }
}

__global__ void spin_kernel(long long ns) {
  long long start;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  long long now = start;
  while (now - start < ns) asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
}

__global__ void empty_kernel() {}

int sm_count() {
  int device = 0, sms = 0;
  cuda_ok(cudaGetDevice(&device), "device");
  cuda_ok(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "sms");
  return sms;
}

int blocks_for(size_t n, int threads) {
  const int sms = sm_count();
  const size_t wanted = (n + threads - 1) / threads;
  return int(wanted < size_t(sms) * 8 ? wanted : size_t(sms) * 8);
}

}  // namespace

void gpu_spin(double us) {
  spin_kernel<<<1, 1>>>(static_cast<long long>(us * 1e3));
  cuda_ok(cudaGetLastError(), "spin");
}

void fill_random(void* p, size_t bytes, uint32_t seed, bool fp32) {
  const size_t words = bytes / 4;
  if (words == 0) return;
  fill_kernel<<<blocks_for(words, 256), 256>>>(static_cast<uint32_t*>(p), words, seed, fp32);
  cuda_ok(cudaGetLastError(), "fill");
}

Ceilings measure_ceilings(size_t bytes) {
  bytes = std::max<size_t>(bytes / 16 * 16, 16);
  Buffer a(bytes), b(bytes), sink(16);
  fill_random(a.get(), bytes, 1, false);
  const size_t n = bytes / 16;
  const int threads = 256;
  const double copy_ms = median_ms([&](int) {
    copy_kernel<<<blocks_for(n, threads), threads>>>(static_cast<const uint4*>(a.get()), static_cast<uint4*>(b.get()), n);
  }, 3, 20);
  const double read_ms = median_ms([&](int) {
    read_kernel<<<blocks_for(n, threads), threads>>>(static_cast<const uint4*>(a.get()), n, static_cast<unsigned*>(sink.get()));
  }, 3, 20);
  // An empty kernel of two CTAs per SM (a one-wave decode grid), timed as every benchmark times
  // its launches: the per-launch floor of the method itself.
  const int sms = sm_count();
  const double launch_ms = median_ms([&](int) { empty_kernel<<<2 * sms, 128>>>(); }, 3, 50);
  Ceilings c;
  c.launch_us = launch_ms * 1e3;
  c.copy_tbs = 2.0 * bytes / (copy_ms * 1e-3) / 1e12;
  c.read_tbs = double(bytes) / (read_ms * 1e-3) / 1e12;
  return c;
}

}  // namespace tessera::bench
