#include "core/cuda_check.h"

#include "tessera/error.h"

namespace tessera::detail {

void throw_cuda_error(cudaError_t status, const char* call, const char* file, int line) {
  throw Error(std::string("tessera: CUDA error '") + cudaGetErrorString(status) + "' (" +
              cudaGetErrorName(status) + ") from " + call + " at " + file + ":" +
              std::to_string(line));
}

}  // namespace tessera::detail
