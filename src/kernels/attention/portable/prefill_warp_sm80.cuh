// A warp's place in the portable prefill CTA.
//
// Warp w (or pair w % kRowGroups) owns the CTA rows {mt * 16 * kRowGroups + (w % kRowGroups) * 16 +
// [0, 16)} of its kMTiles m16 tiles; a lane holds rows g and g + 8 of each (the accumulator layout,
// register_tile.cuh). In a pair (PrefillConfig::kWarpPairs), warp half `half` computes S for keys
// [half, half + 1) * kSKeys of each K/V tile and O for head dims [half, half + 1) * kODims, so the
// pair shares each row's maximum and sum, and P, through shared memory.
//
// The kernel computes these indices itself and the parts read them from this aggregate (by
// reference): computed inside the parts (or passed as plain values), the compiler simplified their
// arithmetic differently and the kernel's machine code changed.
#pragma once

#include <cuda_runtime.h>

#include "kernels/attention/portable/prefill_config_sm80.cuh"
#include "kernels/common/mma_sm80.cuh"

namespace tessera::kernels::sm80 {

template <typename Config>
struct PrefillWarp {
  int warp, lane;
  int g, t;       // lane / 4, lane % 4
  int row_group;  // which rows: the warp's, or its pair's
  int half;       // which half of a pair; a constant 0 without pairs

  // The CTA row of m16 tile mt's first row.
  __device__ __forceinline__ int tile_row(int mt) const { return mt * 16 * Config::kRowGroups + row_group * 16; }
  // The pair's barrier (ids 1..kRowGroups; 0 is __syncthreads').
  __device__ __forceinline__ void pair_sync() const { named_barrier_sync(1 + row_group, Config::kKeyHalves * 32); }
};

// Warp pairs: the pair's P tile (a swizzled kBlockM x kBlockN tile at p_base); this lane's P stores
// (row g + 8r of each m16 tile, keys 2t, 2t + 1 of each of its 8-key tiles j: chunk
// (half * kSNTiles + j) ^ g) and its ldmatrix addresses into the partner's key half (k-steps
// 2 (1 - half) + kk, the A-operand pattern). Nothing without pairs.
template <typename Config, typename T>
__device__ __forceinline__ void pair_p_addresses(T* p_base, const PrefillWarp<Config>& w, T* (&p_store)[Config::kSNTiles],
                                                 const T* (&p_load)[Config::kSNTiles / 2]) {
  constexpr int kBlockN = Config::kBlockN, kSNTiles = Config::kSNTiles;
  if constexpr (Config::kWarpPairs) {
#pragma unroll
    for (int j = 0; j < kSNTiles; ++j) p_store[j] = p_base + w.g * kBlockN + ((w.half * kSNTiles + j) ^ w.g) * 8 + 2 * w.t;
    const int lane_row = LdmatrixX4::a_row(w.lane);
#pragma unroll
    for (int kk = 0; kk < kSNTiles / 2; ++kk) {
      const int step = (1 - w.half) * (kSNTiles / 2) + kk;
      p_load[kk] = p_base + lane_row * kBlockN + ((2 * step + LdmatrixX4::a_chunk(w.lane)) ^ (lane_row % 8)) * 8;
    }
  }
}

}  // namespace tessera::kernels::sm80
