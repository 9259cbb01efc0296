// Benchmark timing: CUDA events around each launch after a warm-up, the median over a fixed window, and
// enough rotating input sets that the working set is several times the L2, so no run is served
// from a cache the previous run warmed.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
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

// The benchmarks' one timing protocol, the same as bench/peers.py's time_cuda, so that tessera's
// figures and the peers' are taken over equal windows: a warm-up of at least `min_warmup` calls and
// kWarmupSeconds, then per-call CUDA-event times over at least `min_iters` calls and
// kWindowSeconds of calls (at most kMaxIters), enqueued in batches of kBatch behind a spin kernel
// (the events then time GPU work, not the host's launch rate); the median. Median milliseconds of
// run(i) for i = 0, 1, 2, ... (the caller rotates inputs by i).
// Why a window in seconds and not a count of calls: under full tensor load the H200 keeps its
// 1.98 GHz clock for a few tens of milliseconds and then settles at its power limit (690-700 W,
// 1.5-1.9 GHz). 3 + 20 launches of a 1.6 ms prefill were timed at the high clock while the peers'
// 0.3 s windows ran at the power limit: the same kernel read 693 TFLOP/s here and 623 through the
// Python package in the peers' process, run 2026-12-05 (notes/prefill_hopper.md, "Timing windows").
constexpr double kWarmupSeconds = 0.05;
constexpr double kWindowSeconds = 0.25;
constexpr int kMaxIters = 1000;
constexpr int kBatch = 20;
inline double median_ms(const std::function<void(int)>& run, int min_warmup = 3, int min_iters = 20) {
  using Clock = std::chrono::steady_clock;
  const auto seconds_since = [](Clock::time_point t0) {
    return std::chrono::duration<double>(Clock::now() - t0).count();
  };
  int next = 0;
  const Clock::time_point warm_start = Clock::now();
  while (next < min_warmup || seconds_since(warm_start) < kWarmupSeconds) {
    run(next++);
    cuda_ok(cudaDeviceSynchronize(), "warm-up");
  }
  // One call's GPU and host times, from three back-to-back calls.
  cudaEvent_t a, b;
  cuda_ok(cudaEventCreate(&a), "cudaEventCreate");
  cuda_ok(cudaEventCreate(&b), "cudaEventCreate");
  cuda_ok(cudaEventRecord(a), "record");
  const Clock::time_point host_start = Clock::now();
  for (int i = 0; i < 3; ++i) run(next++);
  const double host_s = seconds_since(host_start) / 3;
  cuda_ok(cudaEventRecord(b), "record");
  cuda_ok(cudaEventSynchronize(b), "sync");
  float three_ms = 0.f;
  cuda_ok(cudaEventElapsedTime(&three_ms, a, b), "elapsed");
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  const double per_call_s = std::max({three_ms / 3e3, host_s, 1e-6});
  const int iters = static_cast<int>(std::clamp(kWindowSeconds / per_call_s, double(min_iters), double(kMaxIters)));
  std::vector<cudaEvent_t> start(iters), end(iters);
  for (int i = 0; i < iters; ++i) {
    cuda_ok(cudaEventCreate(&start[i]), "cudaEventCreate");
    cuda_ok(cudaEventCreate(&end[i]), "cudaEventCreate");
  }
  for (int b0 = 0; b0 < iters; b0 += kBatch) {
    // Room for the host to enqueue the batch (argument checks included) before the GPU reaches it.
    gpu_spin(std::min(50e3, 1.5e6 * kBatch * host_s + 100.0));
    for (int i = b0; i < std::min(iters, b0 + kBatch); ++i) {
      cuda_ok(cudaEventRecord(start[i]), "record");
      run(next++);
      cuda_ok(cudaEventRecord(end[i]), "record");
    }
  }
  cuda_ok(cudaEventSynchronize(end[iters - 1]), "sync");
  cuda_ok(cudaGetLastError(), "launch");
  std::vector<float> ms(iters);
  for (int i = 0; i < iters; ++i) {
    cuda_ok(cudaEventElapsedTime(&ms[i], start[i], end[i]), "elapsed");
    cudaEventDestroy(start[i]);
    cudaEventDestroy(end[i]);
  }
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
