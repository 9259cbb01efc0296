// The softmax of the portable prefill kernel for one KV tile: the mask on S, then the online
// softmax (row_softmax_sm80.cuh's row operations) in the order PrefillConfig chose per head dim:
// new row maxima (the 4 lanes of a row share them; a pair exchanges its two key halves' through
// shared memory), the O rescale, the exponentials and the row sums, and the request of the next K
// tile between the maxima and the exponentials or after them (kExponentialsAfterKeyRequest).
#pragma once

#include <cuda_runtime.h>

#include <cmath>

#include "kernels/attention/common/mask_tile.cuh"
#include "kernels/attention/common/register_tile.cuh"
#include "kernels/attention/portable/prefill_config_sm80.cuh"
#include "kernels/attention/portable/prefill_warp_sm80.cuh"
#include "kernels/attention/portable/row_softmax_sm80.cuh"

namespace tessera::kernels::sm80 {

// Keys outside the band (or past kv_len) at -inf in S (keys [n0, n0 + kBlockN) of the CTA's rows
// from m0 on), for a tile that crosses the band's edge (the kernel tests that).
template <typename Config>
__device__ __forceinline__ void prefill_mask(AccTile<Config::kSKeys> (&s)[Config::kMTiles], const MaskBand& band,
                                             const PrefillWarp<Config>& w, int n0, int m0) {
#pragma unroll
  for (int mt = 0; mt < Config::kMTiles; ++mt)
    mask_outside_band(s[mt], band, m0 + w.tile_row(mt), n0 + w.half * Config::kSKeys, w.lane);
}

template <typename Config>
using PrefillRowSoftmax = RowSoftmax<Config::kMTiles, Config::kTreeRowReductions, Config::kTreeRowReductions>;

// The registers of one tile's softmax, declared by the kernel (next to S) and passed in: as
// locals of this function the compiler placed them elsewhere among the kernel's registers, and
// ptxas, whose allocation depends on that order, emitted different machine code.
template <typename Config>
struct PrefillSoftmaxScratch {
  float (&pair_max)[Config::kMTiles][2];  // a pair's row maxima of this tile
  float (&rescale)[Config::kMTiles][2];   // the O and sum factors
  bool& max_moved;
  float (&m_scaled)[Config::kMTiles][2];  // exponent offsets (kExponentialsAfterKeyRequest)
};

// S -> P for one KV tile and O rescaled; request_next_keys(tile) is the mainloop's K(tile + 1)
// request. exchange: a pair's floats in shared memory.
template <typename Config, typename RequestNextKeys>
__device__ __forceinline__ void prefill_softmax_tile(PrefillRowSoftmax<Config>& softmax,
                                                     AccTile<Config::kSKeys> (&s)[Config::kMTiles],
                                                     AccTile<Config::kODims> (&o)[Config::kMTiles],
                                                     const PrefillWarp<Config>& w, float* exchange,
                                                     float log2_scale, RequestNextKeys& request_next_keys, int tile,
                                                     const PrefillSoftmaxScratch<Config>& scratch) {
  constexpr int kMTiles = Config::kMTiles, kBlockM = Config::kBlockM;
  auto& pair_max = scratch.pair_max;
  auto& rescale = scratch.rescale;
  bool& max_moved = scratch.max_moved;
  auto& m_scaled = scratch.m_scaled;
  if constexpr (Config::kWarpPairs) {
    // The partner read the previous tile's values before the pair's last barrier.
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        pair_max[mt][r] = softmax.tile_max(s[mt], mt, r);
        if (w.t == 0) exchange[w.half * kBlockM + w.tile_row(mt) + w.g + 8 * r] = pair_max[mt][r];
      }
    }
    w.pair_sync();
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int r = 0; r < 2; ++r)
        pair_max[mt][r] = fmaxf(pair_max[mt][r], exchange[(1 - w.half) * kBlockM + w.tile_row(mt) + w.g + 8 * r]);
  }
  auto new_max = [&](int mt, int r) { return Config::kWarpPairs ? pair_max[mt][r] : softmax.tile_max(s[mt], mt, r); };
  // A row whose maximum did not move has rescale exactly 1 (ex2 of 0): O is rescaled only when
  // some row of the warp moved, which after the first tiles is rare (or on every tile:
  // kRescaleEveryTile). Results are bitwise those of rescaling always.
  auto rescale_o = [&] {
    if (Config::kRescaleEveryTile || __any_sync(0xffffffffu, max_moved)) {
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) mul_row(o[mt], rescale[mt]);
    }
  };
  if constexpr (Config::kExponentialsAfterKeyRequest) {
    // Maxima, O rescale and K(tile + 1)'s request first: the exponentials and O += P V then
    // share one basic block (no branch or barrier between them) that the compiler interleaves.
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int r = 0; r < 2; ++r)
        m_scaled[mt][r] = softmax.update_max(mt, r, new_max(mt, r), log2_scale, rescale[mt][r], max_moved);
    rescale_o();
    request_next_keys(tile);
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int r = 0; r < 2; ++r) softmax.exponentiate(s[mt], mt, r, log2_scale, m_scaled[mt][r], rescale[mt][r]);
  } else {
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int r = 0; r < 2; ++r)
        softmax.exponentiate(s[mt], mt, r, log2_scale,
                             softmax.update_max(mt, r, new_max(mt, r), log2_scale, rescale[mt][r], max_moved),
                             rescale[mt][r]);
    rescale_o();
    request_next_keys(tile);
  }
}

}  // namespace tessera::kernels::sm80
