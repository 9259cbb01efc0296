// Tile shapes of the Hopper prefill family by head dim, and the shared-memory layout they imply.
// One CTA = one producer warpgroup (TMA) + kConsumers consumer warpgroups of 64 query rows each;
// K and V stream through a ring of kStages tiles of kBlockN keys. Shapes as measured on the H200
// (notes/prefill_hopper.md): 
//   hd64:  192 x 128, 3 consumers, 4 stages
//   hd128: 128 x 128, 2 consumers, 2 stages; for long rows 128 x 192 (O staged in Q's buffer)
//   hd256: 128 x 80,  2 consumers, 2 stages (Q 64 KB + 4 x 40 KB: the 227 KB opt-in limit)
#pragma once

#include <cstdint>
#include <type_traits>

#include "kernels/attention/sm90/prefill_sm90_launch.h"
#include "kernels/attention/sm90/tile_handover_sm90.cuh"
#include "kernels/common/tma_sm90.cuh"
#include "kernels/common/wgmma_sm90.cuh"

namespace tessera::kernels::sm90 {

// Ablation switches (notes/prefill_hopper.md): builds of the benchmark with other values time the
// alternatives against the defaults in one run. Not for production builds.
// TESSERA_SM90_PINGPONG sets the ping-pong of every head dim; the per-head-dim switches win.
#ifdef TESSERA_SM90_PINGPONG
#define TESSERA_SM90_PINGPONG_DEFAULT(hd_default) TESSERA_SM90_PINGPONG
#else
#define TESSERA_SM90_PINGPONG_DEFAULT(hd_default) hd_default
#endif
#ifndef TESSERA_SM90_PINGPONG_HD64
#define TESSERA_SM90_PINGPONG_HD64 TESSERA_SM90_PINGPONG_DEFAULT(1)
#endif
#ifndef TESSERA_SM90_PINGPONG_HD128
#define TESSERA_SM90_PINGPONG_HD128 TESSERA_SM90_PINGPONG_DEFAULT(1)
#endif
#ifndef TESSERA_SM90_PINGPONG_HD256
#define TESSERA_SM90_PINGPONG_HD256 TESSERA_SM90_PINGPONG_DEFAULT(0)
#endif
#ifndef TESSERA_SM90_HD64_CONSUMERS
#define TESSERA_SM90_HD64_CONSUMERS 3
#endif
#ifndef TESSERA_SM90_Q_STAGES
#define TESSERA_SM90_Q_STAGES 1
#endif
#ifndef TESSERA_SM90_HD128_STAGES
#define TESSERA_SM90_HD128_STAGES 2
#endif
#ifndef TESSERA_SM90_O_VIA_SMEM
#define TESSERA_SM90_O_VIA_SMEM 1
#endif
// Where O shares a buffer (the 192-key hd128 tile): 1 (the default) stages it in a V stage, 0 in
// Q's buffer.
#ifndef TESSERA_SM90_O_IN_V
#define TESSERA_SM90_O_IN_V 1
#endif
// setmaxnreg's producer budget with two consumer warpgroups: 24 (32 with consumers at 240 needs
// more registers than the CTA holds from its launch: kLaunchRegisters below). The gathered-page
// producers spill at 24.
#ifndef TESSERA_SM90_PRODUCER_REGISTERS_2C
#define TESSERA_SM90_PRODUCER_REGISTERS_2C 24
#endif
// TESSERA_SM90_LAZY_RESCALE sets the conditional O rescale of every head dim (default: hd256 only).
#ifndef TESSERA_SM90_LAZY_RESCALE
#define TESSERA_SM90_LAZY_RESCALE_DEFAULT(hd) ((hd) == 256)
#else
#define TESSERA_SM90_LAZY_RESCALE_DEFAULT(hd) TESSERA_SM90_LAZY_RESCALE
#endif

// kBlockNT: keys per K / V tile, 0 for the head dim's default. hd128 also has a 192-key shape
// (prefill_sm90_wide_inst.cu.in; 160 too, for ablations) for long rows: a tile's fixed work (O's
// rescale, the row reductions, barriers, descriptors: ~229 instructions a warp either way) spread
// over 1.5x the keys (notes/prefill_hopper.md: FA3's non-causal hd128 tile; 4.04 -> ~3.4
// instructions a key).
template <int kHeadDimT, int kBlockNT = 0>
struct PrefillSm90Config {
  static constexpr int kHeadDim = kHeadDimT;
  // Consumer warpgroups. hd64: three (192-row tiles, FA3's shape): 484 vs 396 TFLOP/s with two at
  // 8K (same run, 295074c); the short S = Q K^T leaves the softmax exposed with two.
  static constexpr int kConsumers = kHeadDim == 64 ? TESSERA_SM90_HD64_CONSUMERS : 2;
  static constexpr int kBlockM = 64 * kConsumers;      // query rows per tile
  static constexpr int kBlockN = kBlockNT != 0 ? kBlockNT : prefill_sm90_default_block_n(kHeadDim);  // keys per K / V tile
  // The paged sources take tiles of at most 128 keys (the gather copies two rows per producer lane
  // pair; the TMA page boxes were sized and tested for them): wider tiles are for ragged K / V.
  static constexpr bool kPagedSources = kBlockN <= 128;
  // (TESSERA_SM90_HD128_STAGES: the 128-key tiles'; three stages leave no room for O tiles, so O is
  // then staged in a V stage. The wide tiles fit two.)
  static constexpr int kStages = kHeadDim == 64 ? 4 : kHeadDim == 128 ? (kBlockN > 128 ? 2 : TESSERA_SM90_HD128_STAGES) : 2;
  // The consumer warpgroups take turns issuing their products (FA3's ping-pong, round robin):
  // while one runs its softmax the others have the tensor cores. Same run (notes/prefill_hopper.md
  // v4): hd128 674 vs 577 TFLOP/s at 8K, 547 vs 490 at 1K; hd64 (three consumers) 544 vs 519;
  // hd256 773 vs 775 at 8K: off, as in FA3. (An earlier 0.71x "loss" was ptxas serialising every
  // wgmma, C7520, not the ping-pong.)
  static constexpr bool kPingPong =
      (kHeadDim == 64 ? TESSERA_SM90_PINGPONG_HD64 : kHeadDim == 128 ? TESSERA_SM90_PINGPONG_HD128 : TESSERA_SM90_PINGPONG_HD256) != 0;
  // Q buffers. Two (the next work tile's Q loading during the whole current tile, not only its
  // last P V) measure even with one at hd128 (v4, same run: 8K 668 vs 667, 1K causal 329 vs 332
  // TFLOP/s; v2's 0.89x was likely the C7520 serialisation; v7, with the boundary cheaper: 1K
  // causal 438.5 vs 440.3, 8K 693.7 vs 697.2), so one: less shared memory.
  static constexpr int kQStages = kHeadDim == 256 || kBlockN > 128 ? 1 : TESSERA_SM90_Q_STAGES;  // hd256, wide tiles: no room for two
  // O of a consumer's 64 full rows leaves through a shared-memory tile and TMA stores that run on
  // while the consumer starts its next work tile (rows past qo_len, and an o the copy engine
  // cannot describe, from registers). hd256 has no room for it (Q 64 KB + 4 x 40 KB of K / V at
  // the 227 KB limit): registers.
  static constexpr bool kStoreOViaSmem = kHeadDim != 256 && TESSERA_SM90_O_VIA_SMEM != 0;
  // Where the O tiles would not fit beside Q and the K / V ring (the 192-key hd128 tile: Q 32 KB +
  // 2 x 2 x 48 KB), O is staged in a buffer it shares:
  // - kOSharesV (the default, FA3's way): the consumers stage O in the V stage that the next work
  //   tile's first V tile will fill; the producer loads that tile's Q and first K at once and
  //   waits for the O stores to have read the stage (o_read) only before its first V. Same run on
  //   the H200: +1 to +3% over kOSharesQ from 2K (notes/prefill_hopper.md v11);
  // - kOSharesQ (TESSERA_SM90_O_IN_V=0): each consumer writes its O into its own 64 rows of the Q
  //   tile, which only its own S = Q K^T read; the producer loads the next tile's Q once those
  //   stores have read them (q_empty: PrefillConsumer::epilogue), so the next Q load waits for
  //   both O stores at every work tile boundary.
  static constexpr bool kOSharesBuffer = kStoreOViaSmem &&
      2 /* bytes an element */ * (kBlockM * kHeadDim * kQStages + 2 * kStages * kBlockN * kHeadDim +
                               kConsumers * 64 * kHeadDim) + 2048 > 227 * 1024;
  static constexpr bool kOSharesV = kOSharesBuffer && TESSERA_SM90_O_IN_V != 0;
  static constexpr bool kOSharesQ = kOSharesBuffer && !kOSharesV;
  // O is rescaled only when a row maximum of the warp rose by more than 2^8 (OnlineSoftmax::
  // update<true>, FA4's conditional rescale), so most KV tiles of a long row skip O's FMULs.
  // Same run, two interleaved rounds (H100, notes/prefill_hopper.md v9): hd256 +3-4% (8K 717 vs
  // 687, 16K causal 675 vs 653 TFLOP/s: O is 128 FMULs a thread there and no ping-pong hides the
  // softmax); hd128 -0.5 to -1.5% (the ping-pong already hides it; the vote and branch cost);
  // hd64 +1.4%, within the rounds' spread. On for hd256 only.
  static constexpr bool kLazyRescale = TESSERA_SM90_LAZY_RESCALE_DEFAULT(kHeadDim) != 0;
  static constexpr int kThreads = 128 * (1 + kConsumers);
  // setmaxnreg budgets: 65536 registers per SM for 128 + 128 kConsumers threads.
  static constexpr int kProducerRegisters = kConsumers == 2 ? TESSERA_SM90_PRODUCER_REGISTERS_2C : 32;
  static constexpr int kConsumerRegisters = kConsumers == 2 ? 240 : 160;
  static_assert(kBlockN % 8 == 0 && kBlockN / 8 <= 32, "a paged tile is at most 32 boxes: one per producer lane");
  // What the CTA holds from its launch: kThreads x the registers ptxas gives each thread under
  // the launch bound (65536 / kThreads rounded down to the allocation unit of 8, at most 255). The
  // consumers' setmaxnreg.inc can only take what the producer's decrease freed: a budget beyond
  // this waits forever (producer 32 with two consumers at 240 needs 65536 of the 64512 held, and
  // hung on the H100: notes/prefill_hopper.md, the A/B of 2026-12-07).
  static constexpr int kLaunchRegisters = (65536 / kThreads < 255 ? 65536 / kThreads : 255) / 8 * 8;
  static_assert(kProducerRegisters * 128 + kConsumerRegisters * 128 * kConsumers <= kLaunchRegisters * kThreads,
                "setmaxnreg budgets beyond the registers the CTA holds from its launch");
  static_assert(!kOSharesQ || kQStages == 1, "O in Q's buffer: one Q buffer, released after the O stores");
  static_assert(!kOSharesV || kBlockN >= 64 * kConsumers, "O staged in a V stage: the stage holds the O tiles");
};

// The dynamic shared memory of one CTA: the Q tile, the K and V rings, the consumers' O tiles
// (kStoreOViaSmem) and the barriers. K / V tiles of paged sources interleave their column blocks
// per 8 rows (Sw128GroupedTile: one copy per page run; kv_source_sm90.cuh); the sizes agree.
// kHandover: the barriers are followed by the work tiles' hand-over (tile_handover_sm90.cuh).
template <typename T, typename Config, bool kGroupedKV = false, bool kHandover = false>
struct PrefillSm90Smem {
  using QTile = Sw128Tile<T, Config::kBlockM, Config::kHeadDim>;
  using KVTile = std::conditional_t<kGroupedKV, Sw128GroupedTile<T, Config::kBlockN, Config::kHeadDim>,
                                    Sw128Tile<T, Config::kBlockN, Config::kHeadDim>>;
  static constexpr int kStages = Config::kStages;
  static constexpr int kQStages = Config::kQStages;
  static constexpr int kQOffset = 0;
  static constexpr int kKOffset = kQOffset + kQStages * QTile::kBytes;
  static constexpr int kVOffset = kKOffset + kStages * KVTile::kBytes;
  using OTile = Sw128Tile<T, 64, Config::kHeadDim>;  // one consumer's 64 rows of O
  static constexpr int kOOffset = kVOffset + kStages * KVTile::kBytes;
  static constexpr int kOBytes = Config::kStoreOViaSmem && !Config::kOSharesBuffer ? Config::kConsumers * OTile::kBytes : 0;
  static constexpr int kBarrierOffset = kOOffset + kOBytes;
  struct Barriers {
    Mbarrier q_full[kQStages], q_empty[kQStages];
    Mbarrier k_full[kStages], k_empty[kStages];
    Mbarrier v_full[kStages], v_empty[kStages];
    Mbarrier v_zeroed[kStages];  // a partial V tile's rows past kv_len were zeroed (see the producer)
    Mbarrier o_read;             // Config::kOSharesV: the work tile's O stores have read their V stage
  };
  struct BarriersAndHandover : Barriers {
    TileHandover handover;  // the producer's decoded work tiles
  };
  using AllBarriers = std::conditional_t<kHandover, BarriersAndHandover, Barriers>;
  static constexpr int kAlignment = 1024;  // of the swizzled tiles
  // Requested from the launch: the layout plus the slack that aligns the dynamic base.
  static constexpr int kBytes = kBarrierOffset + int(sizeof(AllBarriers)) + kAlignment;
  static_assert(kBytes <= 227 * 1024, "shared memory of one sm_90 block");
  static_assert(!Config::kOSharesV || KVTile::kBytes >= Config::kConsumers * OTile::kBytes, "O tiles in a V stage");

  unsigned char* base;
  __device__ explicit PrefillSm90Smem(unsigned char* raw)
      : base(reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(raw) + kAlignment - 1) &
                                              ~uintptr_t(kAlignment - 1))) {}
  __device__ QTile q(int slot) const { return QTile{base + kQOffset + slot * QTile::kBytes}; }
  __device__ KVTile k(int stage) const { return KVTile{base + kKOffset + stage * KVTile::kBytes}; }
  __device__ KVTile v(int stage) const { return KVTile{base + kVOffset + stage * KVTile::kBytes}; }
  // Column block b of consumer c's 64 rows of O as staged for the TMA store: in the O tiles, or in
  // its own rows of the Q tile in q_slot (Config::kOSharesQ: rows 64 c of each column block), or
  // in V stage v_stage (Config::kOSharesV). 1024-byte aligned 8 KB blocks: the same swizzle and box.
  __device__ unsigned char* o_block(int consumer, int q_slot, int v_stage, int b) const {
    if constexpr (Config::kOSharesQ) return q(q_slot).block(b) + consumer * 64 * 128;
    unsigned char* tiles = Config::kOSharesV ? base + kVOffset + v_stage * KVTile::kBytes : base + kOOffset;
    return tiles + consumer * OTile::kBytes + b * OTile::kBlockBytes;
  }
  __device__ AllBarriers& barriers() const { return *reinterpret_cast<AllBarriers*>(base + kBarrierOffset); }
};

// A kernel's shared memory over KV source KV (its tile layout, and whether the work tiles are
// handed over).
template <typename T, typename Config, typename KV>
using PrefillSm90SmemFor = PrefillSm90Smem<T, Config, KV::kGroupedTiles, kTileHandover<Config, KV>>;

}  // namespace tessera::kernels::sm90
