// Benchmark timing: CUDA events around each launch after a warm-up, the median of many runs, and
// enough rotating input sets that the working set is several times the L2, so no run is served
// from a cache the previous run warmed.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <vector>

namespace tessera::bench {

// Keeps the GPU busy for about `us` microseconds (bench/ceilings.cu). Queued before the timed
// launches so that the host has enqueued them all before the first runs: the events then time GPU
// work only, not the host's launch rate (which dominates kernels of a few microseconds).
void gpu_spin(double us);

inline void cuda_ok(cudaError_t s, const char* what) {
  if (s != cudaSuccess) {
    std::fprintf(stderr, "CUDA error in %s: %s\n", what, cudaGetErrorString(s));
    std::exit(1);
  }
}

// How many copies of a working set of `bytes` make it at least 3x the L2 (at least 1, at most 64).
inline int rotations_for(double bytes) {
  int device = 0, l2 = 0;
  cuda_ok(cudaGetDevice(&device), "cudaGetDevice");
  cuda_ok(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, device), "L2 size");
  const double wanted = 3.0 * l2 / std::max(bytes, 1.0);
  return std::clamp(static_cast<int>(wanted) + 1, 1, 64);
}

// Median milliseconds of run(i) for i = 0, 1, 2, ... (the caller rotates inputs by i).
inline double median_ms(const std::function<void(int)>& run, int warmup = 5, int iters = 50) {
  for (int i = 0; i < warmup; ++i) run(i);
  cuda_ok(cudaDeviceSynchronize(), "warm-up");
  std::vector<cudaEvent_t> ev(iters + 1);
  for (auto& e : ev) cuda_ok(cudaEventCreate(&e), "cudaEventCreate");
  // Back-to-back launches, one event between each: per-launch times without host gaps.
  gpu_spin(iters * 100.0 + 2000.0);  // room for host-side argument checks per launch
  cuda_ok(cudaEventRecord(ev[0]), "record");
  for (int i = 0; i < iters; ++i) {
    run(warmup + i);
    cuda_ok(cudaEventRecord(ev[i + 1]), "record");
  }
  cuda_ok(cudaEventSynchronize(ev[iters]), "sync");
  cuda_ok(cudaGetLastError(), "launch");
  std::vector<float> ms(iters);
  for (int i = 0; i < iters; ++i) cuda_ok(cudaEventElapsedTime(&ms[i], ev[i], ev[i + 1]), "elapsed");
  for (auto& e : ev) cudaEventDestroy(e);
  std::nth_element(ms.begin(), ms.begin() + iters / 2, ms.end());
  return ms[iters / 2];
}

// Milliseconds per call of `calls` back-to-back calls between two events, none between the
// calls: a stream of steps as an engine issues them; the median over `reps` such streams. Unlike
// median_ms, consecutive kernels may overlap their launch with the previous kernel's tail
// (programmatic dependent launch). bench/peers.py times its stream peers the same way.
inline double stream_ms(const std::function<void(int)>& run, int warmup = 5, int calls = 20, int reps = 9) {
  for (int i = 0; i < warmup; ++i) run(i);
  cuda_ok(cudaDeviceSynchronize(), "warm-up");
  cudaEvent_t begin, end;
  cuda_ok(cudaEventCreate(&begin), "cudaEventCreate");
  cuda_ok(cudaEventCreate(&end), "cudaEventCreate");
  std::vector<float> ms(reps);
  int next = warmup;
  for (int r = 0; r < reps; ++r) {
    gpu_spin(calls * 100.0 + 2000.0);
    cuda_ok(cudaEventRecord(begin), "record");
    for (int i = 0; i < calls; ++i) run(next++);
    cuda_ok(cudaEventRecord(end), "record");
    cuda_ok(cudaEventSynchronize(end), "sync");
    cuda_ok(cudaEventElapsedTime(&ms[r], begin, end), "elapsed");
  }
  cuda_ok(cudaGetLastError(), "launch");
  cudaEventDestroy(begin);
  cudaEventDestroy(end);
  std::nth_element(ms.begin(), ms.begin() + reps / 2, ms.end());
  return ms[reps / 2] / calls;
}

// Owning device buffer filled with random bits of a bounded float range (never zeros).
class Buffer {
 public:
  explicit Buffer(size_t bytes) : bytes_(bytes) { cuda_ok(cudaMalloc(&p_, bytes ? bytes : 16), "cudaMalloc"); }
  ~Buffer() { cudaFree(p_); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  void* get() const { return p_; }
  size_t bytes() const { return bytes_; }

 private:
  void* p_ = nullptr;
  size_t bytes_;
};

}  // namespace tessera::bench
