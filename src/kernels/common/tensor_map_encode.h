// Host-side encoding of TMA tensor maps (CUtensorMap) for 16-bit tensors with 128-byte swizzled
// boxes, through the driver's cuTensorMapEncodeTiled reached by cudart's driver entry point (so the
// library does not link libcuda). Used by every Hopper family (attention, MoE).
#pragma once

#include <cuda.h>

#include <cstdint>
#include <string>

#include "tessera/dtype.h"

namespace tessera::kernels::sm90 {

// A rank-`rank` map over `data` (16-bit elements): dims and box innermost first, strides (in
// BYTES) of dims 1..rank-1. Throws tessera::Error naming `what` and `detail` when the driver lacks
// the function or rejects the map.
CUtensorMap encode_tensor_map_16bit(const char* what, const std::string& detail, DType dtype, int rank,
                                    const void* data, const uint64_t* dims, const uint64_t* strides_bytes,
                                    const uint32_t* box);

}  // namespace tessera::kernels::sm90
