// The phase timeline of the Hopper prefill's consumer warpgroups: an instrument of experiment
// builds (cmake -DTESSERA_SM90_TIMELINE=ON). In every other build its members are empty and the
// kernels are those of a plain build (scripts/compare_sass.sh: the same machine code).
//
// Each consumer warpgroup's first thread stores the SM's cycle count at the phases of a work tile
// into the tile's record as it reaches them, and sums the cycles its KV loop spends in each kind
// of wait, written with the rest after the epilogue: one record of kTimelineWords 32-bit words,
// at most p.timeline_tiles records a consumer, at
// p.timeline + ((blockIdx.x * consumers + consumer) * timeline_tiles + ordinal) * kTimelineWords
// (set_prefill_sm90_timeline; bench/prefill_timeline.py reads them). The stamps are SM-local
// cycles: compare phases within a record, or records of one SM.
#pragma once

#include <cstdint>

#include "kernels/attention/sm90/prefill_sm90_params.h"
#include "kernels/attention/sm90/tile_scheduler_sm90.cuh"

namespace tessera::kernels::sm90 {

// A record's words. Phases are cycles after kTileStart (the start of the tile's compute: before
// its Q is waited for); waits are sums over the tile's KV loop.
enum TimelineWord : int {
  kTileStart = 0,      // clock() at the start (low 32 bits)
  kQReady,             // Q has landed
  kFirstScores,        // the first S = Q K^T has completed (the first KV tile: masked ones first)
  kLoopEnd,            // the KV loop is done (every S issued, the last softmax done)
  kLastValues,         // the last P V has completed
  kEpilogueEnd,        // O and LSE are written (or on their way through shared memory)
  kWaitInputs,         // loop: K landed and the consumer's turn (before an iteration's products)
  kWaitScores,         // loop: the wait for S_j (wgmma wait 1)
  kWaitValues,         // loop: the wait for P V_{j-1} (wgmma wait 0)
  kTileId,             // q_start + m0: the tile's first query row of the list (with kHead)
  kHead,               // the tile's first query head | split << 16
  kSmAndKvTiles,       // %smid << 16 | the tile's KV tiles
  kOutNormalised,      // epilogue: O / l and LSE in registers (and, O in a V stage, the stage read)
  kOutStaged,          // epilogue: O in shared memory, fenced, the warpgroup past its barrier
  kDecode,             // cycles from the decode of the tile (make_work_tile) to kTileStart
  kTimelineWords
};
static_assert(kTimelineWords == kPrefillSm90TimelineWords, "the record's size as the host sees it");

// A store by the threads whose `enabled` holds, predicated rather than branched around: a branch
// that only the warpgroup's first thread takes, between a tile's wgmma, made ptxas serialise them
// (C7520) in the 192-key kernel.
__device__ __forceinline__ void store_if(bool enabled, unsigned* address, unsigned value) {
  asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %2, 0;\n @p st.global.u32 [%0], %1;\n}" ::"l"(address),
               "r"(value), "r"(int(enabled))
               : "memory");
}

// The SM's cycle counter, low 32 bits (a tile's phases fit many times over).
__device__ __forceinline__ unsigned cycle_count() {
  unsigned c;
  asm volatile("mov.u32 %0, %%clock;" : "=r"(c));
  return c;
}

// Two registers through a tile where it is on (the 192-key hd128 kernel has none to spare: with
// the record's address and end kept, it spilled 72-112 bytes): the tile's start and the record's
// ordinal; the address comes from the kernel's parameters and the thread's place at each store.
// The wait sums, four more, are kept only with kWaitSums (the 128-key kernels; the 192-key kernel
// records its phases only, and ~0 for the sums).
template <bool kWaitSums>
class PhaseTimeline {
 public:
  __device__ explicit PhaseTimeline(const PrefillSm90Params& p) : p_(p) {
#if TESSERA_SM90_TIMELINE
    ordinal_ = p.timeline != nullptr && threadIdx.x % 128 == 0 ? 0 : -1;
#endif
  }

  // The tile is about to be decoded (the kernel's loop, before make_work_tile; the 128-key
  // kernels only, as the wait sums).
  __device__ void begin_decode() {
#if TESSERA_SM90_TIMELINE
    if constexpr (kWaitSums) decode_start_ = cycle_count();
#endif
  }
  __device__ void begin_tile() {
#if TESSERA_SM90_TIMELINE
    start_ = cycle_count();
    if constexpr (kWaitSums) wait_inputs_ = wait_scores_ = wait_values_ = 0;
#endif
  }
  // The phase `word` is reached now (stored at once).
  __device__ void stamp(TimelineWord word) const {
#if TESSERA_SM90_TIMELINE
    store_if(writes(), record() + word, cycle_count() - start_);
#else
    (void)word;
#endif
  }
  // A wait of the KV loop starts now; wait_end adds its cycles to `word` (kWaitInputs,
  // kWaitScores or kWaitValues).
  __device__ void wait_begin() {
#if TESSERA_SM90_TIMELINE
    if constexpr (kWaitSums) wait_start_ = cycle_count();
#endif
  }
  __device__ void wait_end(TimelineWord word) {
#if TESSERA_SM90_TIMELINE
    if constexpr (kWaitSums) {
      const unsigned cycles = cycle_count() - wait_start_;
      if (word == kWaitInputs) wait_inputs_ += cycles;
      else if (word == kWaitScores) wait_scores_ += cycles;
      else wait_values_ += cycles;
    }
#endif
    (void)word;
  }
  // Completes the tile's record and moves to the next (while the consumer's records last).
  __device__ void end_tile(const WorkTile& w) {
#if TESSERA_SM90_TIMELINE
    stamp(kEpilogueEnd);
    unsigned smid;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
    const bool on = writes();
    unsigned* r = record();
    const unsigned none = ~0u;  // (no wait sums recorded)
    store_if(on, r + kTileStart, start_);
    store_if(on, r + kWaitInputs, kWaitSums ? wait_inputs_ : none);
    store_if(on, r + kWaitScores, kWaitSums ? wait_scores_ : none);
    store_if(on, r + kWaitValues, kWaitSums ? wait_values_ : none);
    store_if(on, r + kTileId, unsigned(w.q_start + w.m0));
    store_if(on, r + kHead, unsigned(w.head) | unsigned(w.split) << 16);
    store_if(on, r + kSmAndKvTiles, smid << 16 | unsigned(w.kv_tiles()));
    store_if(on, r + kDecode, kWaitSums ? start_ - decode_start_ : none);
    ordinal_ += on ? 1 : 0;
#else
    (void)w;
#endif
  }

 private:
  const PrefillSm90Params& p_;
#if TESSERA_SM90_TIMELINE
  // This consumer's first thread, with records left.
  __device__ bool writes() const { return ordinal_ >= 0 && ordinal_ < p_.timeline_tiles; }
  // Slot (CTA x consumers + consumer; consumer warpgroups are 1.., the producer's 0), ordinal.
  __device__ unsigned* record() const {
    const int slot = blockIdx.x * (blockDim.x / 128 - 1) + threadIdx.x / 128 - 1;
    return p_.timeline + (int64_t(slot) * p_.timeline_tiles + ordinal_) * kTimelineWords;
  }
  int ordinal_ = -1;
  unsigned start_ = 0, wait_start_ = 0, decode_start_ = 0;
  unsigned wait_inputs_ = 0, wait_scores_ = 0, wait_values_ = 0;
#endif
};

}  // namespace tessera::kernels::sm90
