// Helpers shared by the GPU tests: device buffers, random inputs, poisoned outputs, host-side
// bf16/fp16 conversion and the tolerance rule of docs/CONVENTIONS.md. GPU tests call TESSERA_REQUIRE_GPU()
// first: without a GPU they skip with the reason instead of failing.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "dispatch/prefill_dispatch.h"
#include "tessera/tessera.h"

namespace tessera::testing {

// Skips the current test (with the reason) when no CUDA GPU is usable.
#define TESSERA_REQUIRE_GPU()                                                         \
  do {                                                                                \
    const ::tessera::DeviceInfo tessera_info_ = ::tessera::device_info();             \
    if (!tessera_info_.present) GTEST_SKIP() << "no GPU: " << tessera_info_.reason;   \
  } while (0)

#define CUDA_OK(call) ASSERT_EQ((call), cudaSuccess) << #call

// Owning device allocation, freed on scope exit.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(std::size_t bytes) : bytes_(bytes) {
    if (bytes_ > 0 && cudaMalloc(&ptr_, bytes_) != cudaSuccess) {
      throw std::runtime_error("cudaMalloc of " + std::to_string(bytes_) + " bytes failed");
    }
  }
  ~DeviceBuffer() { if (ptr_) cudaFree(ptr_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& o) noexcept : ptr_(o.ptr_), bytes_(o.bytes_) { o.ptr_ = nullptr; }

  void* get() const { return ptr_; }
  std::size_t bytes() const { return bytes_; }
  template <typename T>
  void upload(const std::vector<T>& host) {
    if (host.size() * sizeof(T) > bytes_) throw std::runtime_error("upload larger than buffer");
    if (!host.empty()) check(cudaMemcpy(ptr_, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice), "upload");
  }
  template <typename T>
  std::vector<T> download(std::size_t count) const {
    std::vector<T> host(count);
    if (count * sizeof(T) > bytes_) throw std::runtime_error("download larger than buffer");
    if (count) check(cudaMemcpy(host.data(), ptr_, count * sizeof(T), cudaMemcpyDeviceToHost), "download");
    return host;
  }
  // Every byte set to 0xFF: NaN in bf16/fp16/fp32, -1 in int32. Outputs are poisoned before a run
  // and checked afterwards for any element still holding the poison pattern.
  void poison() {
    if (bytes_) check(cudaMemset(ptr_, 0xFF, bytes_), "poison");
    check(cudaDeviceSynchronize(), "poison");
  }

 private:
  // A failed copy or fill would make every later check meaningless: stop the test there.
  static void check(cudaError_t status, const char* what) {
    if (status != cudaSuccess) {
      throw std::runtime_error(std::string("DeviceBuffer ") + what + ": " + cudaGetErrorString(status));
    }
  }
  void* ptr_ = nullptr;
  std::size_t bytes_ = 0;
};

// ---- Host-side 16-bit floats --------------------------------------------------------------------
inline uint16_t to_bits(float x, DType dtype) {
  if (dtype == DType::kBF16) {
    __nv_bfloat16 h = __float2bfloat16_rn(x);
    uint16_t b;
    std::memcpy(&b, &h, 2);
    return b;
  }
  __half h = __float2half_rn(x);
  uint16_t b;
  std::memcpy(&b, &h, 2);
  return b;
}
inline float from_bits(uint16_t b, DType dtype) {
  if (dtype == DType::kBF16) {
    __nv_bfloat16 h;
    std::memcpy(&h, &b, 2);
    return __bfloat162float(h);
  }
  __half h;
  std::memcpy(&h, &b, 2);
  return __half2float(h);
}
constexpr uint16_t kPoison16 = 0xFFFF;
inline bool is_poison(float x) {
  uint32_t b;
  std::memcpy(&b, &x, 4);
  return b == 0xFFFFFFFFu;
}

// Random values in [-1, 1) rounded to `dtype`; `bits` receives the 16-bit encodings and the return
// value the exact float of each (what the kernel sees).
inline std::vector<float> random_16bit(std::size_t n, DType dtype, std::mt19937& rng,
                                       std::vector<uint16_t>& bits, float lo = -1.f,
                                       float hi = 1.f) {
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> values(n);
  bits.resize(n);
  for (std::size_t i = 0; i < n; ++i) {
    bits[i] = to_bits(dist(rng), dtype);
    values[i] = from_bits(bits[i], dtype);
  }
  return values;
}

inline std::vector<float> random_floats(std::size_t n, std::mt19937& rng, float lo, float hi) {
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(rng);
  return v;
}

// Rounds x to the precision of dtype (identity for fp32).
inline float round_to(float x, DType dtype) {
  if (dtype == DType::kFP32) return x;
  return from_bits(to_bits(x, dtype), dtype);
}

// ---- The tolerance rule ---------------------------------------------------------------------------
// The kernel's max error against the fp64 reference must be at most 2x the max error of the naive
// computation in the kernel's precision, plus a small absolute floor. NaN must match NaN exactly.
struct ErrorReport {
  double max_err = 0;
  std::size_t worst = 0;
  std::size_t nan_mismatch = 0;
  std::size_t unwritten = 0;
};

inline ErrorReport compare(const std::vector<float>& got, const std::vector<double>& ref) {
  ErrorReport r;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    if (is_poison(got[i])) { ++r.unwritten; continue; }
    const bool gn = std::isnan(got[i]), rn = std::isnan(ref[i]);
    if (gn || rn) { r.nan_mismatch += gn != rn; continue; }
    if (std::isinf(ref[i]) || std::isinf(got[i])) {
      if (got[i] != ref[i]) { r.max_err = INFINITY; r.worst = i; }
      continue;
    }
    const double e = std::fabs(double(got[i]) - ref[i]);
    if (e > r.max_err) { r.max_err = e; r.worst = i; }
  }
  return r;
}

inline void expect_within_rule(const std::vector<float>& got, const std::vector<double>& ref,
                               double naive_max_err, double abs_floor, const std::string& what) {
  ASSERT_EQ(got.size(), ref.size()) << what;
  const ErrorReport r = compare(got, ref);
  EXPECT_EQ(r.unwritten, 0u) << what << ": elements never written (still poisoned)";
  EXPECT_EQ(r.nan_mismatch, 0u) << what << ": NaN where the reference has none, or the reverse";
  const double tol = 2.0 * naive_max_err + abs_floor;
  EXPECT_LE(r.max_err, tol) << what << ": max error " << r.max_err << " at " << r.worst
                            << " (got " << got[r.worst] << ", ref " << ref[r.worst]
                            << "), allowed 2 x " << naive_max_err << " + " << abs_floor;
}

// Every element written, finite and of magnitude at most `bound`.
inline void expect_bounded(const std::vector<float>& got, double bound, const std::string& what) {
  std::size_t unwritten = 0, bad = 0, worst = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (is_poison(got[i])) { ++unwritten; continue; }
    if (!std::isfinite(got[i]) || std::fabs(got[i]) > bound) {
      if (bad++ == 0) worst = i;
    }
  }
  EXPECT_EQ(unwritten, 0u) << what << ": elements never written (still poisoned)";
  EXPECT_EQ(bad, 0u) << what << ": " << bad << " elements not finite or beyond " << bound << ", first at " << worst
                     << " (" << (got.empty() ? 0.f : got[worst]) << ")";
}

class Stream {  // a non-blocking stream, destroyed on scope exit
 public:
  Stream() {
    if (cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking) != cudaSuccess) {
      throw std::runtime_error("cudaStreamCreateWithFlags failed");
    }
  }
  ~Stream() { cudaStreamDestroy(s_); }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  operator cudaStream_t() const { return s_; }

 private:
  cudaStream_t s_ = nullptr;
};

// Imposes a shared-memory-per-block limit (what a smaller GPU has) for the scope, lifting it
// however the scope ends: the kernels' tile choices then follow that GPU's.
class SharedMemoryLimit {
 public:
  explicit SharedMemoryLimit(int bytes) { dispatch::limit_shared_memory_per_block(bytes); }
  ~SharedMemoryLimit() { dispatch::limit_shared_memory_per_block(0); }
  SharedMemoryLimit(const SharedMemoryLimit&) = delete;
  SharedMemoryLimit& operator=(const SharedMemoryLimit&) = delete;
};

// Runs `call`, expects a tessera::Error whose message contains every fragment.
inline void expect_error(const std::function<void()>& call, const std::vector<std::string>& fragments) {
  try {
    call();
    ADD_FAILURE() << "expected tessera::Error containing '" << fragments[0] << "'";
  } catch (const Error& e) {
    for (const auto& f : fragments) EXPECT_THAT(e.what(), ::testing::HasSubstr(f));
  }
}

}  // namespace tessera::testing
