#include "kernels/common/tensor_map_encode.h"

#include <cudaTypedefs.h>  // PFN_cuTensorMapEncodeTiled
#include <cuda_runtime_api.h>

#include <mutex>

#include "tessera/error.h"

namespace tessera::kernels::sm90 {
namespace {

PFN_cuTensorMapEncodeTiled_v12000 encode_function() {
  static PFN_cuTensorMapEncodeTiled_v12000 encode = nullptr;
  static std::once_flag once;
  std::call_once(once, [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found) ==
            cudaSuccess &&
        found == cudaDriverEntryPointSuccess) {
      encode = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
    }
    cudaGetLastError();
  });
  if (encode == nullptr) throw Error("tessera: the CUDA driver does not provide cuTensorMapEncodeTiled (Hopper kernels)");
  return encode;
}

}  // namespace

CUtensorMap encode_tensor_map_16bit(const char* what, const std::string& detail, DType dtype, int rank,
                                    const void* data, const uint64_t* dims, const uint64_t* strides_bytes,
                                    const uint32_t* box) {
  CUtensorMap map;
  cuuint64_t d[5], s[4];
  cuuint32_t b[5], element_strides[5];
  for (int i = 0; i < rank; ++i) {
    d[i] = dims[i];
    b[i] = box[i];
    element_strides[i] = 1;
    if (i + 1 < rank) s[i] = strides_bytes[i];
  }
  const CUresult r = encode_function()(
      &map, dtype == DType::kBF16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
      cuuint32_t(rank), const_cast<void*>(data), d, s, b, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
      CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    throw Error(std::string("tessera: the copy engine cannot describe ") + what + " (cuTensorMapEncodeTiled error " +
                std::to_string(int(r)) + ": " + detail + ")");
  }
  return map;
}

}  // namespace tessera::kernels::sm90
