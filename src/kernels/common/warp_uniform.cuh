// A value every lane of the warp holds, as lane 0's: the compiler then knows it is uniform. Every
// branch of a Hopper consumer's tile loop must be uniform in its eyes, or ptxas serialises all
// its wgmma ("C7520: wgmma.mma_async instructions are serialized due to ... divergent path"):
// loop bounds and tile fields read from memory count as divergent unless they pass through a
// shuffle (notes/prefill_hopper.md).
#pragma once

namespace tessera::kernels {

__device__ __forceinline__ int warp_uniform(int x) { return __shfl_sync(0xffffffffu, x, 0); }

}  // namespace tessera::kernels
