// Shared-memory barriers and tensor copies of sm_90, as raw PTX (each wrapper is one instruction;
// spelled out rather than taken from CUTLASS's barrier classes so that a kernel's pipeline reads as
// the waits and arrivals it does):
//   - mbarrier: a 64-bit barrier in shared memory that completes a phase once `count` arrivals and
//     the expected transaction bytes (written by the copy engine) have arrived; a waiter names the
//     phase it waits for by its parity.
//   - TMA (cp.async.bulk.tensor): one thread copies a box of a tensor described by a CUtensorMap
//     (host-encoded, passed as a __grid_constant__ kernel parameter) into shared memory, and the
//     copy engine signals its bytes on an mbarrier. Coordinates are in elements, innermost first;
//     parts of the box outside the tensor are zero-filled.
//   - the proxy fence: shared memory written by ordinary stores and read next by the copy engine or
//     the tensor cores (the async proxy) needs fence.proxy.async in the writing thread first.
// Device code for sm_90 and newer only.
#pragma once

#include <cuda.h>  // CUtensorMap
#include <cuda_runtime.h>

#include <cstdint>

namespace tessera::kernels::sm90 {

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

struct Mbarrier {
  uint64_t word;

  // One thread initialises; fence_init() then makes the initialisation visible to the copy engine
  // and (after a CTA barrier) to the other threads.
  __device__ void init(uint32_t arrivals) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(&word)), "r"(arrivals));
  }
  __device__ static void fence_init() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }

  __device__ void arrive() {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_u32(&word)) : "memory");
  }
  // An arrival by the threads where `pred` holds, predicated inside the instruction rather than
  // branched around: a C++ `if (lane == 0)` between wgmma issues is a divergent path to ptxas,
  // which then serialises every wgmma of the kernel (C7520).
  __device__ void arrive_if(bool pred) {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %1, 0;\n"
        "@p mbarrier.arrive.shared::cta.b64 _, [%0];\n"
        "}\n" ::"r"(smem_u32(&word)),
        "r"(int(pred))
        : "memory");
  }
  // `count` arrivals at once (one thread standing for others that have already synchronised with
  // it), predicated like arrive_if.
  __device__ void arrive_if(bool pred, uint32_t count) {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %1, 0;\n"
        "@p mbarrier.arrive.shared::cta.b64 _, [%0], %2;\n"
        "}\n" ::"r"(smem_u32(&word)),
        "r"(int(pred)), "r"(count)
        : "memory");
  }
  // One arrival once every cp.async this thread issued before has landed, not counted ahead
  // (.noinc: the barrier's arrival count includes it).
  __device__ void arrive_after_copies() {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(smem_u32(&word)) : "memory");
  }
  // One arrival that also announces `bytes` of copies that will complete on this barrier.
  __device__ void arrive_expect_tx(uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(&word)), "r"(bytes)
                 : "memory");
  }
  // Whether the phase of parity `phase` has completed, without waiting.
  __device__ bool ready(uint32_t phase) {
    uint32_t done;
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "mbarrier.test_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n"
        "}\n"
        : "=r"(done)
        : "r"(smem_u32(&word)), "r"(phase)
        : "memory");
    return done != 0;
  }
  // Blocks until the phase of parity `phase` has completed. A barrier starts in phase 0, and the
  // phase "before" it (parity 1) counts as complete: a producer's first wait on an empty slot
  // passes at once.
  __device__ void wait(uint32_t phase) {
    const uint32_t addr = smem_u32(&word);
    asm volatile(
        "{\n"
        ".reg .pred done;\n"
        "WAIT_%=:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra WAIT_%=;\n"
        "}\n" ::"r"(addr),
        "r"(phase)
        : "memory");
  }
};

// The slot and phase of a ring of kStages buffers, advanced in the same order by the producer and
// every consumer.
template <int kStages>
struct RingPosition {
  int stage = 0;
  uint32_t phase = 0;
  __device__ void advance() {
    if (++stage == kStages) {
      stage = 0;
      phase ^= 1;
    }
  }
};

__device__ __forceinline__ void prefetch_tensor_map(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

// A 2-D box at (c0, c1) of `map` into shared memory at `dst`, completing on `bar`.
__device__ __forceinline__ void tma_load_2d(const CUtensorMap* map, Mbarrier* bar, void* dst, int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4}], [%2];\n" ::"r"(smem_u32(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(&bar->word)), "r"(c0), "r"(c1)
      : "memory");
}

// A 3-D box at (c0, c1, c2) of `map` into the L2 only (no shared memory, no barrier): a later load
// of the same box then reads L2, not memory.
__device__ __forceinline__ void tma_prefetch_l2_3d(const CUtensorMap* map, int c0, int c1, int c2) {
  asm volatile("cp.async.bulk.prefetch.tensor.3d.L2.global.tile [%0, {%1, %2, %3}];\n" ::"l"(
                   reinterpret_cast<uint64_t>(map)),
               "r"(c0), "r"(c1), "r"(c2)
               : "memory");
}

// A 3-D box at (c0, c1, c2) of `map` into shared memory at `dst`, completing on `bar`.
__device__ __forceinline__ void tma_load_3d(const CUtensorMap* map, Mbarrier* bar, void* dst, int c0, int c1,
                                            int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5}], [%2];\n" ::"r"(smem_u32(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(&bar->word)), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}

__device__ __forceinline__ void tma_load_4d(const CUtensorMap* map, Mbarrier* bar, void* dst, int c0, int c1,
                                            int c2, int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5, %6}], [%2];\n" ::"r"(smem_u32(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(&bar->word)), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}

__device__ __forceinline__ void tma_load_5d(const CUtensorMap* map, Mbarrier* bar, void* dst, int c0, int c1,
                                            int c2, int c3, int c4) {
  asm volatile(
      "cp.async.bulk.tensor.5d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5, %6, %7}], [%2];\n" ::"r"(smem_u32(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(&bar->word)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4)
      : "memory");
}

// Stores: a 2-D box of shared memory at `src` (the layout the map's swizzle names) into `map` at
// (c0, c1); elements past the tensor's dims are not written. Issued by the threads where `pred`
// holds, predicated inside the instruction (see Mbarrier::arrive_if: no divergent branch between
// wgmma issues). Each issuing thread tracks its stores in bulk groups: commit closes a group,
// wait_read<N> returns once at most N of its groups still read shared memory (the buffer may be
// rewritten), wait_all<0> once they are all written.
// The PTX of one instruction issued only where operand %0 (an int) is nonzero: predicated inside
// the asm, not branched around.
#define TESSERA_PTX_IF_OPERAND0(instruction) "{\n.reg .pred p;\nsetp.ne.b32 p, %0, 0;\n@p " instruction "\n}\n"
__device__ __forceinline__ void tma_store_2d_if(bool pred, const CUtensorMap* map, const void* src, int c0, int c1) {
  asm volatile(TESSERA_PTX_IF_OPERAND0("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%1, {%3, %4}], [%2];")
               ::"r"(int(pred)), "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(src)), "r"(c0), "r"(c1)
               : "memory");
}
__device__ __forceinline__ void tma_store_3d_if(bool pred, const CUtensorMap* map, const void* src, int c0, int c1,
                                                int c2) {
  asm volatile(
      TESSERA_PTX_IF_OPERAND0("cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%1, {%3, %4, %5}], [%2];")
      ::"r"(int(pred)), "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(src)), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}
__device__ __forceinline__ void bulk_commit_if(bool pred) {
  asm volatile(TESSERA_PTX_IF_OPERAND0("cp.async.bulk.commit_group;")::"r"(int(pred)) : "memory");
}
template <int kPending>
__device__ __forceinline__ void bulk_wait_read_if(bool pred) {
  asm volatile(TESSERA_PTX_IF_OPERAND0("cp.async.bulk.wait_group.read %1;")::"r"(int(pred)), "n"(kPending) : "memory");
}
template <int kPending>
__device__ __forceinline__ void bulk_wait_all_if(bool pred) {
  asm volatile(TESSERA_PTX_IF_OPERAND0("cp.async.bulk.wait_group %1;")::"r"(int(pred)), "n"(kPending) : "memory");
}

// A 4-byte store by shared-window address. Through a generic pointer that the compiler cannot
// place in shared memory (one computed from a stored base, as the CTA's layout structs hold it)
// the store is a generic ST with a 64-bit address: two registers per address and the generic
// path's translation.
__device__ __forceinline__ void st_shared_u32(uint32_t address, uint32_t value) {
  asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(address), "r"(value));
}

// Ordinary shared-memory writes of this thread become visible to later async-proxy reads
// (tensor cores, copy engine) once the reader has synchronised with this thread.
__device__ __forceinline__ void fence_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// Named barriers (1..15; 0 is __syncthreads') over `threads` threads in whole warps.
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

}  // namespace tessera::kernels::sm90
