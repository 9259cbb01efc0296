// The 16-byte cp.async copy (global -> shared, sm_80+), one definition for every family: the
// portable kernels' K / V loads (mma_sm80.cuh wraps it for a generic pointer) and the Hopper
// prefill's gathered pages (kv_source_sm90.cuh).
#pragma once

#include <cstdint>

namespace tessera::kernels {

// 16 bytes from `gmem` to the shared-memory address `smem_addr`; `valid == false` writes zeros and
// reads nothing (no source bytes).
__device__ __forceinline__ void cp_async_16(uint32_t smem_addr, const void* gmem, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr), "l"(gmem), "r"(src_bytes));
}

// Every cp.async this thread issued has landed in shared memory (visible to this thread).
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

}  // namespace tessera::kernels
