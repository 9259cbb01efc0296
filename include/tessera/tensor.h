// A non-owning view of a strided tensor in host or device memory. tessera never allocates or frees
// the memory behind a view; strides are in elements, like PyTorch's.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>

#include "tessera/dtype.h"

namespace tessera {

enum class Device : int { kCPU = 0, kCUDA = 1 };

struct TensorView {
  static constexpr int kMaxRank = 6;

  void* data = nullptr;
  DType dtype = DType::kFP32;
  Device device = Device::kCUDA;
  int rank = 0;
  int64_t shape[kMaxRank] = {};
  int64_t stride[kMaxRank] = {};

  // A row-major contiguous view of `shape`.
  static TensorView contiguous(void* data, DType dtype, std::initializer_list<int64_t> shape,
                               Device device = Device::kCUDA);
  // A view with explicit element strides (same length as shape).
  static TensorView strided(void* data, DType dtype, std::initializer_list<int64_t> shape,
                            std::initializer_list<int64_t> stride, Device device = Device::kCUDA);

  bool empty_view() const { return data == nullptr && rank == 0; }
  // size(-1) is the last dimension.
  int64_t size(int dim) const { return shape[dim < 0 ? dim + rank : dim]; }
  int64_t stride_of(int dim) const { return stride[dim < 0 ? dim + rank : dim]; }
  int64_t numel() const;
  bool is_contiguous() const;
  // "[2, 16, 8, 128] bf16 strides [16384, 1024, 128, 1] cuda"
  std::string describe() const;
};

}  // namespace tessera
