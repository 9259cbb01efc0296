// Runs a per-device setup step once per device instead of on every launch: raising a kernel's
// dynamic shared memory limit (cudaFuncSetAttribute) is a driver call of about a microsecond,
// paid per layer and per step otherwise. One instance per kernel instantiation (a function-local
// static in the launching template). Devices 0..63; others run the step every time. A process
// that calls cudaDeviceReset and then launches again on that device is not supported.
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdint>

#include "core/cuda_check.h"

namespace tessera::detail {

class OncePerDevice {
 public:
  template <typename Setup>
  void operator()(Setup&& setup) {
    int device = 0;
    TESSERA_CUDA_CHECK(cudaGetDevice(&device));
    const uint64_t bit = device < 64 ? uint64_t{1} << device : 0;
    if (bit != 0 && (done_.load(std::memory_order_acquire) & bit) != 0) return;
    setup();  // idempotent: two threads racing here both run it, harmlessly
    done_.fetch_or(bit, std::memory_order_release);
  }

 private:
  std::atomic<uint64_t> done_{0};
};

}  // namespace tessera::detail
