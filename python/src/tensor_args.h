// Python objects -> tessera::TensorView, without copies and with strides kept.
//
// A tensor argument is anything that speaks DLPack (PyTorch, JAX, CuPy, NumPy, ...), imported
// through nanobind's ndarray. torch.Tensor takes a faster path that reads data_ptr(), shape,
// stride(), dtype and device straight from the tensor: torch's __dlpack__ costs about 2 us a
// tensor, more than a whole decode run() may spend in Python. Both give the same view.
//
// Failures are tessera::Error in the library's own format, naming the entry point and argument:
//   tessera::batch_prefill: argument 'q': dtype float64 is not supported (bf16, fp16, fp32, int32)
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <array>
#include <cstdint>

#include "tessera/kv_cache.h"
#include "tessera/stream.h"
#include "tessera/tensor.h"

namespace tessera::python {

// Converts the arguments of one call. Imported DLPack tensors are held here until the call
// returns (the views point into them).
class ArgConverter {
 public:
  explicit ArgConverter(const char* entry_point) : entry_(entry_point) {}

  // A tensor argument (None is an error).
  TensorView tensor(nanobind::handle obj, const char* arg);
  // None gives an empty view (an optional output such as lse).
  TensorView optional(nanobind::handle obj, const char* arg);
  // A host int32 index array (CPU memory, 1-D, contiguous) of exactly `length` entries, or null
  // when obj is None. The C++ entry points read that many entries through the pointer, so the
  // length is checked here.
  const int32_t* host_indices(nanobind::handle obj, const char* arg, int64_t length);
  // Like host_indices, for an array whose length the caller checks itself (returns the length).
  const int32_t* host_indices_any(nanobind::handle obj, const char* arg, int64_t* length);

  // A paged cache: separate k_pages / v_pages, or v_pages None and k_pages the combined
  // [num_pages, 2, ...] tensor (FlashInfer's and vLLM's layout), split into two strided views.
  PagedKVCache paged_cache(nanobind::handle k_pages, nanobind::handle v_pages, KVLayout layout);

  [[noreturn]] void fail(const char* arg, const std::string& rule) const;
  const char* entry_point() const { return entry_; }

  // The CUDA device of the first CUDA tensor converted (-1 while there is none).
  int cuda_device() const { return cuda_device_; }

 private:
  bool from_torch(nanobind::handle obj, const char* arg, TensorView& view);
  void from_dlpack(nanobind::handle obj, const char* arg, TensorView& view);
  void note_device(const TensorView& view, int device_id, const char* arg);

  static constexpr int kMaxHeld = 16;
  const char* entry_;
  std::array<nanobind::ndarray<nanobind::ro>, kMaxHeld> held_;
  int num_held_ = 0;
  int cuda_device_ = -1;
};

// Makes `device` current for the duration of a call (and restores the previous one), so that a
// tensor on cuda:1 is served on cuda:1 whatever the thread's current device is. No-op for -1, and
// when the runtime reports no device (the validation that follows says what is wrong).
class DeviceGuard {
 public:
  explicit DeviceGuard(int device);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;
};

inline cudaStream_t as_stream(uintptr_t handle) { return reinterpret_cast<cudaStream_t>(handle); }

// "bf16" / "bfloat16" / torch.bfloat16 / DType.BF16 ... -> DType; likewise for layouts and paths.
DType parse_dtype(nanobind::handle obj, const char* entry_point, const char* arg);
KVLayout parse_layout(nanobind::handle obj, const char* entry_point, const char* arg);

}  // namespace tessera::python
