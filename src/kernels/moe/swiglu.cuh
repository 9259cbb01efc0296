// SwiGLU, the activation the first grouped GEMM fuses into its epilogue: silu(gate) * up, in fp32
// on the accumulators (one definition for both GEMM families and the reference's rule).
#pragma once

namespace tessera::kernels::moe {

__device__ __forceinline__ float silu(float x) { return x / (1.f + __expf(-x)); }
__device__ __forceinline__ float swiglu(float gate, float up) { return silu(gate) * up; }

}  // namespace tessera::kernels::moe
