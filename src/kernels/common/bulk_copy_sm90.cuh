// Bulk copies global -> shared on sm_90 (cp.async.bulk, completion on an mbarrier): one
// instruction moves a whole contiguous block, where 16-byte cp.async needs one per 16 bytes per
// thread. Used by the decode kernel's split-KV merge to stage the chunks' partial rows. Device
// code compiled for older architectures does not see it (callers guard with __CUDA_ARCH__).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/common/mma_sm80.cuh"  // smem_addr

namespace tessera::kernels::sm80 {

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// Copies `count` blocks of `block_floats` floats, `src_stride` floats apart in global memory, to
// consecutive blocks of shared memory with the bulk copy engine (cp.async.bulk, sm_90), completing
// on an mbarrier. Block sizes and addresses are multiples of 16 bytes. The barrier is initialised
// by the constructor and invalidated by release(); every thread of the CTA calls stage() and wait().
struct BulkStaging {
  uint32_t barrier;
  uint32_t phase = 0;
  __device__ explicit BulkStaging(uint64_t* bar) : barrier(smem_addr(bar)) {
    if (threadIdx.x == 0) {
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(barrier));
      asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
  }
  __device__ void stage(const float* src, int64_t src_stride, float* dst, int block_floats, int count) {
    // Earlier generic accesses to the staging area happen before the copy engine's writes.
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    __syncthreads();
    if (threadIdx.x < 32) {
      const uint32_t bytes = uint32_t(block_floats) * 4;
      if (threadIdx.x == 0) {
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(barrier),
                     "r"(bytes * uint32_t(count))
                     : "memory");
      }
      __syncwarp();
      for (int b = threadIdx.x; b < count; b += 32) {
        asm volatile(
            "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                smem_addr(dst + int64_t(b) * block_floats)),
            "l"(src + b * src_stride), "r"(bytes), "r"(barrier)
            : "memory");
      }
    }
  }
  __device__ void wait() {
    uint32_t done = 0;
    while (!done) {
      asm volatile(
          "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
          : "=r"(done)
          : "r"(barrier), "r"(phase)
          : "memory");
    }
    phase ^= 1;
  }
  __device__ void release() {
    __syncthreads();
    if (threadIdx.x == 0) asm volatile("mbarrier.inval.shared::cta.b64 [%0];\n" ::"r"(barrier) : "memory");
  }
};
#endif

}  // namespace tessera::kernels::sm80
