#include "tessera/dtype.h"

namespace tessera {

std::size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kBF16:
    case DType::kFP16: return 2;
    case DType::kFP32:
    case DType::kInt32: return 4;
    case DType::kFP8E4M3: return 1;
  }
  return 0;
}

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kBF16: return "bf16";
    case DType::kFP16: return "fp16";
    case DType::kFP32: return "fp32";
    case DType::kInt32: return "int32";
    case DType::kFP8E4M3: return "fp8_e4m3";
  }
  return "unknown";
}

}  // namespace tessera
