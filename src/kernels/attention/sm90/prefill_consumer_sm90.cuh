// A consumer warpgroup of the Hopper prefill kernel: 64 query rows of a work tile against its KV
// tiles, last to first (the tiles crossing the causal diagonal or kv_len come first, the window's
// left edge last), then the epilogue.
//
// Per KV tile j: S = Q K_j^T (wgmma, both operands in shared memory), the logit transform and the
// mask, the online softmax (register_tile.cuh / online_softmax.cuh), then O += P V_j with P taken
// from the S accumulators as wgmma's register A operand and V read transposed. The loop overlaps
// the softmax of tile j with the P V product of tile j - 1 (FA3's intra-warpgroup pipelining):
//   issue S_j = Q K_j^T;  issue O += P_{j-1} V_{j-1};  wait for S_j;  softmax(S_j) -> P_j, factors;
//   wait for P V;  O *= factors
// which needs S_j, P_{j-1} and O in registers at once.
#pragma once

#include <cuda_runtime.h>

#include "kernels/attention/common/logits.cuh"
#include "kernels/attention/common/mask_tile.cuh"
#include "kernels/attention/common/online_softmax.cuh"
#include "kernels/attention/common/register_tile.cuh"
#include "kernels/attention/sm90/phase_timeline_sm90.cuh"
#include "kernels/attention/sm90/prefill_config_sm90.cuh"
#include "kernels/attention/sm90/tile_scheduler_sm90.cuh"

namespace tessera::kernels::sm90 {

// Ablation switch (notes/prefill_hopper.md, "What FA3 does at the work-tile boundary"): 0 issues a
// work tile's first S and last P V outside the ping-pong's turns, as FA3 does (only the loop's
// products take turns; every consumer still takes as many turns as the others, so the round robin
// holds). As #if: the default kernels are the same machine code as without it.
#ifndef TESSERA_SM90_BOUNDARY_TURNS
#define TESSERA_SM90_BOUNDARY_TURNS 1
#endif
// Timing experiment only (0): the consumers skip the proxy fence after a gathered K / V stage
// lands (PrefillConsumer::after_generic_fill); without it the PTX memory model does not order the
// copies before the wgmma reads.
#ifndef TESSERA_SM90_GATHER_FENCE
#define TESSERA_SM90_GATHER_FENCE 1
#endif

// Scheduler: the list's walk and shape (tile_scheduler_sm90.cuh); here it says whether the
// epilogue writes split partials.
template <typename T, typename Config, typename Logits, typename KV, typename Scheduler>
struct PrefillConsumer {
  static constexpr int kHeadDim = Config::kHeadDim, kBlockN = Config::kBlockN;
  using Smem = PrefillSm90SmemFor<T, Config, KV>;
  using STile = AccTile<kBlockN>;           // this warp's 16 rows of S (and P, in fp32)
  using OTile = AccTile<kHeadDim>;          // this warp's 16 rows of O
  using PFragments = AFragments<T, kBlockN>;  // P in T, as the A operand of P V

  const PrefillSm90Params& p;
  const Smem& smem;
  const Logits logits;
  const int consumer;  // which 64 rows of the tile: [64 consumer, 64 consumer + 64)
  const int warp;      // warp within the warpgroup: rows [16 warp, 16 warp + 16) of those
  const int lane;
  RingPosition<Config::kStages> ring;
  RingPosition<Config::kQStages> q_ring;
  int q_slot = 0;  // the Q buffer of the work tile being computed
  uint32_t zeroed_phases = 0;  // bit s: parity of v_zeroed[s]'s next phase
  // Empty but in experiment builds (phase_timeline_sm90.cuh); the 192-key tile has no registers
  // for the loop's wait sums.
  PhaseTimeline<kBlockN <= 128> timeline;

  __device__ PrefillConsumer(const PrefillSm90Params& params, const Smem& s, int consumer_index)
      : p(params), smem(s), logits(params.base.scale, params.base.soft_cap), consumer(consumer_index),
        warp((threadIdx.x / 32) % 4), lane(threadIdx.x % 32), timeline(params) {}

  // Ping-pong (Config::kPingPong): consumer c issues its products only on its turn (named barrier
  // kTurnBarrier + c: its own 128 threads wait, the 128 of the consumer before it arrive) and
  // hands the turn on to consumer c + 1 (mod kConsumers) after issuing: round robin.
  static constexpr int kTurnBarrier = 1;
  __device__ void take_turn() const {
    if constexpr (Config::kPingPong) named_barrier_sync(kTurnBarrier + consumer, 256);
  }
  __device__ void pass_turn() const {
    if constexpr (Config::kPingPong) named_barrier_arrive(kTurnBarrier + (consumer + 1) % Config::kConsumers, 256);
  }
  // A work tile's first S and last P V (TESSERA_SM90_BOUNDARY_TURNS).
  __device__ void take_boundary_turn() const {
#if TESSERA_SM90_BOUNDARY_TURNS
    take_turn();
#endif
  }
  __device__ void pass_boundary_turn() const {
#if TESSERA_SM90_BOUNDARY_TURNS
    pass_turn();
#endif
  }
  // Consumer 0 takes the first turn: the last consumer starts by handing it over; at the end
  // consumer 0 takes the turn the last one passed, so no barrier is left with arrivals pending
  // (every consumer takes the same number of turns: they walk the same tiles).
  __device__ void start_turns() const {
    if (consumer == Config::kConsumers - 1) pass_turn();
  }
  __device__ void finish_turns() const {
    if (consumer == 0) take_turn();
  }

  // A stage filled through the generic proxy (cp.async: GatheredKVSm90), seen through this
  // thread's barrier wait, is ordered before the wgmma (async proxy) reads of it.
  // (Not with TESSERA_SM90_GATHER_FENCE=0, a timing experiment.)
  __device__ static void after_generic_fill() {
#if TESSERA_SM90_GATHER_FENCE
    if constexpr (KV::kConsumersFence) fence_async_shared();
#endif
  }

  // One arrival per warp on a barrier counting kConsumers x 4 warps.
  __device__ void release(Mbarrier& b) const { b.arrive_if(lane == 0); }

  // S = Q K^T for the K tile in `stage` (between wgmma_fence and the wait; commits).
  __device__ void issue_scores(STile& s, int stage) const {
    const auto q = smem.q(q_slot);
    const auto k = smem.k(stage);
#pragma unroll
    for (int kk = 0; kk < kHeadDim / 16; ++kk)
      wgmma_ss<T, kBlockN, gmma::Major::K>(q.k_major(64 * consumer, kk), k.k_major(0, kk), s, kk > 0);
    wgmma_commit();
  }
  // O += P V for the V tile in `stage` (commits).
  __device__ void issue_values(const PFragments& pf, OTile& o, int stage) const {
    const auto v = smem.v(stage);
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) wgmma_rs<T, kHeadDim, gmma::Major::MN>(pf.a[kk], v.mn_major(kk), o);
    wgmma_commit();
  }
  // K of `stage` has landed.
  __device__ void wait_keys(const RingPosition<Config::kStages>& at) const {
    smem.barriers().k_full[at.stage].wait(at.phase);
    after_generic_fill();
  }
  // V of `stage` has landed (and, for a partial tile, been zeroed past kv_len).
  __device__ void wait_values(const RingPosition<Config::kStages>& at, bool partial) {
    auto& bar = smem.barriers();
    bar.v_full[at.stage].wait(at.phase);
    after_generic_fill();
    if (!KV::kZeroesPastEnd && partial) {
      bar.v_zeroed[at.stage].wait((zeroed_phases >> at.stage) & 1);
      zeroed_phases ^= 1u << at.stage;
    }
  }

  // Logits of keys [n0, n0 + kBlockN), -inf outside the band; only tiles crossing the band's edge
  // pay for the per-element test.
  __device__ void logits_and_mask(STile& s, const WorkTile& w, int n0) const {
    if constexpr (!Logits::kIdentity) for_each(s, [&](float& x, int, int, int) { x = logits(x); });
    const int warp_row0 = w.m0 + 64 * consumer + 16 * warp;
    const int first_row = w.m0 + 64 * consumer;
    const int last_row = min(first_row + 63, w.rows() - 1);
    if (w.band.tile_crosses_edge(n0, kBlockN, w.token(first_row), w.token(last_row)))
      mask_outside_band(s, w.band, warp_row0, n0, lane, w.row_shift);
  }

  // Q of the tile has been read by this warp's last S: the producer may load the next one into its
  // buffer. With O staged in Q's buffer (Config::kOSharesQ) that waits for the epilogue instead.
  __device__ void release_q_after_scores() const {
    if constexpr (!Config::kOSharesQ) release(smem.barriers().q_empty[q_slot]);
  }

  // O staged in a V stage (Config::kOSharesV): consumer c writes its O into the stage that follows
  // the work tile's last (`o_stage`: the V of the tile kStages - 1 before the last was there) once
  // every other consumer has read that V (they arrive on named barrier kOStageBarrier + c; c
  // syncs), and its leader arrives on o_read once the stores have read the stage (the producer's
  // next first V waits for it). Each consumer arrives and syncs once per work tile with KV tiles,
  // whichever way its O leaves; an arrival comes after its P V of a V tile of this work tile, so
  // after the producer saw the last work tile's o_read: no consumer arrives twice before a sync.
  __device__ void o_stage_read() const {
    if constexpr (Config::kOSharesV) {
      for (int c = 0; c < Config::kConsumers; ++c)
        if (c != consumer) named_barrier_arrive(kOStageBarrier + c, 128 * Config::kConsumers);
    }
  }
  __device__ void wait_o_stage_read() const {
    if constexpr (Config::kOSharesV) named_barrier_sync(kOStageBarrier + consumer, 128 * Config::kConsumers);
  }
  __device__ void o_stage_released() const {
    if constexpr (Config::kOSharesV) smem.barriers().o_read.arrive_if(threadIdx.x % 128 == 0);
  }
  // The buffer O shares, where O left without it (registers, partials) after a tile with KV tiles.
  __device__ void release_o_buffer(bool has_kv) const {
    if (!has_kv) return;
    if constexpr (Config::kOSharesQ) release(smem.barriers().q_empty[q_slot]);
    o_stage_released();
  }

  // O / l and LSE for this warp's rows of the request (rows past the request's are not written).
  // has_kv: the tile had KV tiles (kOSharesQ: its Q was loaded and is released here; kOSharesV: its
  // O may be staged in V stage o_stage).
  __device__ void epilogue(OTile& o, const OnlineSoftmax& softmax, const WorkTile& w, bool has_kv, int o_stage) const {
    float inv_sum[2], lse[2];
    softmax.finish(inv_sum, lse);
    mul_row(o, inv_sum);
    const int g = lane / 4, t = lane % 4;
    const int first_row = w.m0 + 64 * consumer;
    if (has_kv) wait_o_stage_read();
    timeline.stamp(kOutNormalised);
    if (Scheduler::writes_partials(p)) {
      store_partial_state(o, lse, w, first_row);
      release_o_buffer(has_kv);
      return;
    }
    bool via_smem = false;
    // (A shared buffer only after a tile with KV tiles: without, no Q was loaded, and the producer
    // may be filling the V stage.)
    if constexpr (Config::kStoreOViaSmem)
      via_smem = p.o_via_tma && first_row + 64 <= w.rows() && (!Config::kOSharesBuffer || has_kv);
    if (via_smem) store_o_via_smem(o, w, first_row, o_stage);
    else release_o_buffer(has_kv);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = first_row + 16 * warp + g + 8 * r;
      if (row >= w.rows()) continue;
      const int64_t q_row = int64_t(w.q_start) + w.token(row);
      const int head = w.head_of(row);
      if (!via_smem) {
        T* dst = static_cast<T*>(p.base.o) + q_row * p.base.o_stride_row + int64_t(head) * p.base.o_stride_head;
#pragma unroll
        for (int j = 0; j < OTile::kBlocks; ++j)
          *reinterpret_cast<uint32_t*>(dst + 8 * j + 2 * t) = pack_half2<T>(o.v[j][2 * r], o.v[j][2 * r + 1]);
      }
      if (p.base.lse != nullptr && t == 0)
        p.base.lse[q_row * p.base.lse_stride_row + int64_t(head) * p.base.lse_stride_head] = lse[r];
    }
  }

  // A KV split's state of this warp's rows, fp32 (O normalised, natural-log LSE; no visible key:
  // O = 0, LSE = -inf), at partial_o / partial_lse [split, q row, head] (prefill_params.h), for the
  // caller's merge. Each thread's two neighbouring columns go out as one 8-byte store.
  __device__ void store_partial_state(const OTile& o, const float (&lse)[2], const WorkTile& w, int first_row) const {
    const int g = lane / 4, t = lane % 4;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = first_row + 16 * warp + g + 8 * r;
      if (row >= w.rows()) continue;
      const int64_t state = (int64_t(w.split) * p.base.q_rows + w.q_start + w.token(row)) * p.base.num_qo_heads + w.head_of(row);
      float* dst = p.base.partial_o + state * kHeadDim;
#pragma unroll
      for (int j = 0; j < OTile::kBlocks; ++j)
        *reinterpret_cast<float2*>(dst + 8 * j + 2 * t) = make_float2(o.v[j][2 * r], o.v[j][2 * r + 1]);
      if (t == 0) p.base.partial_lse[state] = lse[r];
    }
  }

  // This consumer's 64 rows, all inside the request: into its O tile in shared memory (the
  // 128-byte swizzle of the map: 16-byte chunk (col / 8) ^ (row % 8), so a warp's 4-byte writes
  // hit 32 banks), then one thread stores the tile's 64-column blocks with TMA, which run on while
  // the consumer starts its next work tile. The previous tile's stores must have left the buffer.
  // O in a shared buffer: the leader waits for its stores to have read it, then releases Q for the
  // four warps (kOSharesQ: the barrier before the stores saw all four past their S) or arrives on
  // o_read (kOSharesV).
  static constexpr int kStoreBarrier = kTurnBarrier + Config::kConsumers;  // + consumer
  static constexpr int kOStageBarrier = kStoreBarrier + Config::kConsumers;  // + consumer (kOSharesV)
  __device__ void store_o_via_smem(const OTile& o, const WorkTile& w, int first_row, int o_stage) const {
    const bool leader = threadIdx.x % 128 == 0;
    bulk_wait_read_if<0>(leader);
    named_barrier_sync(kStoreBarrier + consumer, 128);
    const int g = lane / 4, t = lane % 4;
    uint32_t block[kHeadDim / 64];  // each 64-column block's shared-window address
#pragma unroll
    for (int b = 0; b < kHeadDim / 64; ++b) block[b] = smem_u32(smem.o_block(consumer, q_slot, o_stage, b));
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = 16 * warp + g + 8 * r;  // row % 8 == g
#pragma unroll
      for (int j = 0; j < OTile::kBlocks; ++j) {
        st_shared_u32(block[j / 8] + row * 128 + (((j % 8) ^ g) * 16) + 4 * t,
                      pack_half2<T>(o.v[j][2 * r], o.v[j][2 * r + 1]));
      }
    }
    fence_async_shared();
    named_barrier_sync(kStoreBarrier + consumer, 128);
    timeline.stamp(kOutStaged);
#pragma unroll
    for (int b = 0; b < kHeadDim / 64; ++b)
      tma_store_3d_if(leader, &p.o_map, smem.o_block(consumer, q_slot, o_stage, b), 64 * b, w.head,
                      w.q_start + w.token(first_row));
    bulk_commit_if(leader);
    if constexpr (Config::kOSharesBuffer) {
      bulk_wait_read_if<0>(leader);
      if constexpr (Config::kOSharesQ) smem.barriers().q_empty[q_slot].arrive_if(leader, 4);
      else o_stage_released();
    }
  }

  // Before the CTA exits: its O stores have left shared memory and been written.
  __device__ void finish_stores() const {
    if constexpr (Config::kStoreOViaSmem) bulk_wait_all_if<0>(threadIdx.x % 128 == 0);
  }

  __device__ void compute(const WorkTile& w) {
    auto& bar = smem.barriers();
    timeline.begin_tile();
    OTile o;
    fill(o, 0.f);
    OnlineSoftmax softmax(logits.log2_scale);
    const int tiles = w.kv_tiles();
    if (tiles > 0) {
      q_slot = q_ring.stage;
      bar.q_full[q_slot].wait(q_ring.phase);
      timeline.stamp(kQReady);
      q_ring.advance();
      STile s;
      PFragments pf;
      int tile = w.end_kv_tile - 1;
      // The first tile: S, softmax, P.
      wait_keys(ring);
      fence_registers(s);
      take_boundary_turn();
      wgmma_fence();
      issue_scores(s, ring.stage);
      pass_boundary_turn();
      wgmma_wait<0>();
      timeline.stamp(kFirstScores);
      fence_registers(s);
      release(bar.k_empty[ring.stage]);
      if (tiles == 1) release_q_after_scores();
      logits_and_mask(s, w, tile * kBlockN);
      softmax.first(s);
      convert(s, pf);
      RingPosition<Config::kStages> prev = ring;
      bool prev_partial = (tile + 1) * kBlockN > w.kv_len;
      ring.advance();
      // The rest: S of this tile overlapped with P V of the previous one.
      for (int i = 1; i < tiles; ++i) {
        --tile;
        timeline.wait_begin();
        wait_keys(ring);
        fence_registers(s);
        fence_registers(o);
        fence_registers(pf);
        take_turn();
        timeline.wait_end(kWaitInputs);
        wgmma_fence();
        issue_scores(s, ring.stage);
        wait_values(prev, prev_partial);
        issue_values(pf, o, prev.stage);
        pass_turn();
        timeline.wait_begin();
        wgmma_wait<1>();
        timeline.wait_end(kWaitScores);
        fence_registers(s);
        release(bar.k_empty[ring.stage]);
        if (i == tiles - 1) release_q_after_scores();
        logits_and_mask(s, w, tile * kBlockN);
        float rescale[2];
        const bool rescale_o = softmax.template update<Config::kLazyRescale>(s, rescale);
        timeline.wait_begin();
        wgmma_wait<0>();
        timeline.wait_end(kWaitValues);
        fence_registers(o);
        fence_registers(pf);
        release(bar.v_empty[prev.stage]);
        if (i == tiles - Config::kStages + 1) o_stage_read();
        if (rescale_o) mul_row(o, rescale);
        convert(s, pf);
        prev = ring;
        prev_partial = false;
        ring.advance();
      }
      timeline.stamp(kLoopEnd);
      wait_values(prev, prev_partial);
      fence_registers(o);
      fence_registers(pf);
      take_boundary_turn();
      wgmma_fence();
      issue_values(pf, o, prev.stage);
      pass_boundary_turn();
      wgmma_wait<0>();
      timeline.stamp(kLastValues);
      fence_registers(o);
      release(bar.v_empty[prev.stage]);
      if (tiles < Config::kStages) o_stage_read();
    }
    epilogue(o, softmax, w, tiles > 0, ring.stage);  // (ring: the stage after the tile's last)
    timeline.end_tile(w);
  }
};

}  // namespace tessera::kernels::sm90
