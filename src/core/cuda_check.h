// Turning CUDA runtime failures into tessera::Error with the failing call spelled out.
#pragma once

#include <cuda_runtime_api.h>

#include <string>

namespace tessera::detail {

[[noreturn]] void throw_cuda_error(cudaError_t status, const char* call, const char* file,
                                   int line);

}  // namespace tessera::detail

#define TESSERA_CUDA_CHECK(call)                                                  \
  do {                                                                            \
    cudaError_t tessera_status_ = (call);                                         \
    if (tessera_status_ != cudaSuccess)                                           \
      ::tessera::detail::throw_cuda_error(tessera_status_, #call, __FILE__, __LINE__); \
  } while (0)

// After a launch: reports a bad launch configuration at once (asynchronous faults surface at the
// next synchronizing call, as everywhere in CUDA).
#define TESSERA_CHECK_LAUNCH() TESSERA_CUDA_CHECK(cudaGetLastError())
