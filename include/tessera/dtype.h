// Element types tessera understands. Q/K/V/O are bf16 or fp16; accumulation and LSE are fp32;
// every index array is int32. fp8 e4m3 is reserved for KV caches and MoE weights (not yet used).
#pragma once

#include <cstddef>

namespace tessera {

enum class DType : int {
  kBF16 = 0,
  kFP16 = 1,
  kFP32 = 2,
  kInt32 = 3,
  kFP8E4M3 = 4,  // reserved
};

// Bytes per element.
std::size_t dtype_size(DType dtype);

// "bf16", "fp16", "fp32", "int32", "fp8_e4m3".
const char* dtype_name(DType dtype);

}  // namespace tessera
