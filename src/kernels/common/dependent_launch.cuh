// Programmatic dependent launch (sm_90+). A kernel launched with the programmatic-stream-
// serialization attribute may start while the kernel before it in the stream is still running;
// it must call wait_for_preceding_grid() before touching any memory that kernel reads or writes
// (the wait returns once the preceding grid has completed and its writes are visible). A kernel
// calls allow_dependent_launch() to let the next such kernel start launching its CTAs early.
// What this hides is the launch itself: the gap between one kernel's last CTA and the next
// kernel's first, a few microseconds that count against short, bandwidth-bound kernels (decode).
// Both compile to nothing for architectures before sm_90 (a launcher must then not ask for an
// early launch: check the loaded code's cudaFuncAttributes::ptxVersion), and do nothing when the
// kernel was launched without the attribute.
#pragma once

#include <cuda_runtime.h>

namespace tessera::kernels {

__device__ __forceinline__ void wait_for_preceding_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void allow_dependent_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

}  // namespace tessera::kernels
