// The work tiles the producer decodes, handed to the consumers through shared memory
// (kTileHandover below).
//
// Without it, both roles of a CTA walk the scheduler's sequence and each decodes every WorkTile
// (make_work_tile: the list position's divisions and the request's index entries). The
// consumers' decode sits at each work tile's boundary, where their tensor cores idle: ~650 cycles
// at the 128 x 128 tiles (multiply-high divisions) and ~1.2 K at the 192-key and hd256 tiles
// (divisions by runtime values; their consumers have no registers for the multipliers), per the
// phase timeline (notes/prefill_hopper.md). The producer decodes the same tile a few KV tiles
// earlier, while it waits on the ring anyway. With the hand-over it writes each decoded tile into
// one of kSlots shared-memory slots (its first thread, before the tile's copies); the consumers
// wait for the slot and copy it (five 16-byte loads and a shuffle a field); the sequence ends with
// a tile whose request is -1.
// (FA3 hands its dynamic scheduler's tile index over the same way.)
#pragma once

#include <cuda_runtime.h>

#include "kernels/attention/sm90/tile_scheduler_sm90.cuh"
#include "kernels/common/tma_sm90.cuh"
#include "kernels/common/warp_uniform.cuh"

namespace tessera::kernels::sm90 {

// Where: the 128 x 128 kernels over ragged K / V (hd128's short rows, where a boundary is the
// largest share of a work tile); their producer then takes 40 registers and the consumers 232
// (prefill_sm90.cuh, RegisterSplit; at 24 the producer spills in its copy loop holding the whole
// tile). Measured (notes/prefill_hopper.md, "The work tiles handed over"): ragged 1K / 2K +0.5 to
// +2.8% (H100 and H200), from 4K even (the 192-key kernels, which keep their own decode: their
// consumers spill at 232, and a second producer warp publishing at 24 made the copying warp
// spill); the paged 128 x 128 kernels lost 0.8-2.5% with it (page 16) or were even (pages 1 / 7),
// so they keep the walk. 0: every kernel decodes its own tiles (an ablation switch).
#ifndef TESSERA_SM90_TILE_HANDOVER
#define TESSERA_SM90_TILE_HANDOVER 1
#endif
template <typename Config, typename KV>
constexpr bool kTileHandover =
    TESSERA_SM90_TILE_HANDOVER != 0 && Config::kBlockM == 128 && Config::kBlockN == 128 && !KV::kPaged;

struct TileHandover {
  // Two: the producer decodes tile t + 1 once tile t's copies are out, long after the consumers
  // took tile t - 1 from the other slot.
  static constexpr int kSlots = 2;
  struct alignas(16) Slot {
    WorkTile tile;
  };
  static constexpr int kWords = int(sizeof(Slot) / 16);
  Slot slot[kSlots];
  Mbarrier full[kSlots];   // one arrival: the producer wrote the slot
  Mbarrier empty[kSlots];  // one arrival per consumer warp: it copied the slot

  __device__ void init(int consumer_warps) {
    for (int s = 0; s < kSlots; ++s) {
      full[s].init(1);
      empty[s].init(consumer_warps);
    }
  }

  // Producer, one thread: `w` (request -1: the end of the sequence) into the next slot.
  __device__ void publish(const WorkTile& w, RingPosition<kSlots>& at) {
    empty[at.stage].wait(at.phase ^ 1);
    slot[at.stage].tile = w;
    full[at.stage].arrive();  // (release: the slot's stores before the arrival)
    at.advance();
  }

  // Consumer warp: the next tile, every field as lane 0's (warp-uniform to ptxas, which keeps the
  // wgmma loop asynchronous only over uniform branches).
  __device__ WorkTile take(RingPosition<kSlots>& at) {
    full[at.stage].wait(at.phase);
    int4 words[kWords];
    const int4* src = reinterpret_cast<const int4*>(&slot[at.stage]);
#pragma unroll
    for (int i = 0; i < kWords; ++i) words[i] = src[i];
    __syncwarp();
    empty[at.stage].arrive_if(threadIdx.x % 32 == 0);
    at.advance();
#pragma unroll
    for (int i = 0; i < kWords; ++i) {
      words[i].x = warp_uniform(words[i].x);
      words[i].y = warp_uniform(words[i].y);
      words[i].z = warp_uniform(words[i].z);
      words[i].w = warp_uniform(words[i].w);
    }
    Slot copy;
    static_assert(sizeof(copy) == sizeof(words), "a slot is whole 16-byte words");
    memcpy(&copy, words, sizeof(copy));
    return copy.tile;
  }
};

}  // namespace tessera::kernels::sm90
