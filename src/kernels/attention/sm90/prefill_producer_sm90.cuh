// The producer of the Hopper prefill kernel: for each work tile, Q once (by TMA, warp 0), then K
// and V of its KV tiles from the last to the first (the order the consumers take them) into the
// rings: by TMA from warp 0, or gathered by all four warps of the producer warpgroup for pages
// TMA cannot box (the KV source, kv_source_sm90.cuh, says how a tile is copied and by whom).
//
// The rows of a request's last, partial KV tile past kv_len hold other data (the next request's
// rows, the rest of a page, or an older tile when the paged source skips a box). Their logits are
// masked, but P = 0 times a NaN or Inf there would still reach O through the tensor cores; the
// conventions promise that keys past kv_len never do. So for the TMA sources the producer zeroes
// those rows of the V tile once it has landed (after issuing the next tile's copies, so nothing
// waits on it), and the consumers take a partial tile's V only after its `v_zeroed` barrier (the
// gathered source's copies write zeros there: KV::kZeroesPastEnd). K needs nothing: masked
// logits are overwritten.
//
// With O staged in a V stage (Config::kOSharesV) a work tile's first V goes into the stage the
// previous work tile's O stores read from, so it waits for them (o_read) after the tile's Q and
// first K have gone out.
#pragma once

#include <cuda_runtime.h>

#include "kernels/attention/sm90/kv_source_sm90.cuh"
#include "kernels/attention/sm90/prefill_config_sm90.cuh"
#include "kernels/attention/sm90/tile_scheduler_sm90.cuh"
#include "kernels/attention/sm90/tile_handover_sm90.cuh"
#include "kernels/common/cp_async.cuh"
#include "kernels/common/device_check.cuh"

namespace tessera::kernels::sm90 {

// Ablation switches of the work-tile boundary (notes/prefill_hopper.md, "What FA3 does at the
// work-tile boundary"), off by default (as #if: the default kernels are the same machine code as
// without them):
// TESSERA_SM90_K_BEFORE_Q=1 issues a work tile's first K before waiting for Q's buffer (the
// consumers free the K stage a KV tile before they free Q), so only Q's copy is left at the
// boundary; TESSERA_SM90_PREFETCH_NEXT_Q=1 prefetches the next work tile's Q boxes into the L2 once
// this tile's copies are issued, so that Q's copy reads L2.
#ifndef TESSERA_SM90_K_BEFORE_Q
#define TESSERA_SM90_K_BEFORE_Q 0
#endif
#ifndef TESSERA_SM90_PREFETCH_NEXT_Q
#define TESSERA_SM90_PREFETCH_NEXT_Q 0
#endif
// TESSERA_SM90_K_AHEAD_OF_V=1 runs the K copies one KV tile ahead of the V copies (FlashInfer's
// sm90 gather order): a work tile's first K, then Q, then per KV tile K of the next tile before V
// of this one, so a K copy never queues behind the wait for the previous tile's V stage (released
// after its P V, a KV tile later than its K stage). For the gathered source the producer's issue
// time is not negligible, so the order decides how early each copy starts.
#ifndef TESSERA_SM90_K_AHEAD_OF_V
#define TESSERA_SM90_K_AHEAD_OF_V 0
#endif

template <typename T, typename Config, typename Scheduler, typename KV>
__device__ __forceinline__ void prefill_producer_warp(const PrefillSm90Params& p,
                                                      const PrefillSm90SmemFor<T, Config, KV>& smem) {
  using Smem = PrefillSm90SmemFor<T, Config, KV>;
  constexpr int kBlockM = Config::kBlockM, kBlockN = Config::kBlockN;
  const int lane = threadIdx.x % 32;
  // Of the KV::kProducerWarps loading warps (Q: warp 0 only); the lane with one warp, so the TMA
  // sources' code is as it was before the gathered source came.
  const int thread = KV::kProducerWarps == 1 ? lane : int(threadIdx.x);
  auto& bar = smem.barriers();
  RingPosition<Config::kStages> ring;
#if TESSERA_SM90_K_AHEAD_OF_V
  RingPosition<Config::kStages> v_ring;  // (ring: the K copies', a KV tile ahead)
#endif
  RingPosition<Config::kQStages> q_ring;
  // Config::kOSharesV: whether a work tile with KV tiles went before (its O is staged in the stage
  // this one's first V fills), and the parity of o_read's phase that says its stores read it.
  bool o_staged = false;
  uint32_t o_read_phase = 0;

  if (thread == 0) {
    prefetch_tensor_map(&p.q_map);
    prefetch_tensor_map(&p.k_map);
    prefetch_tensor_map(&p.v_map);
  }

  // A partial V tile waiting to have its rows past kv_len zeroed.
  struct PendingZero {
    int stage = -1;
    uint32_t phase = 0;
    int valid_rows = 0;
  } pending;
  // KV::kWriterFence (the gathered source with the writer-side fence): the full barriers this
  // thread issued copies for and has not arrived on yet (bit s: k_full[s], kStages + s: v_full[s]).
  // It arrives once its copies have landed and it has fenced them for the async proxy, and only
  // before a wait that would block: the consumers may be waiting for those copies, and a copy not
  // waited for keeps the next one's issue from waiting on it.
  uint32_t unarrived = 0;
  auto arrive_for_copies = [&] {
    if constexpr (KV::kWriterFence) {
      if (unarrived == 0) return;
      cp_async_wait_all();
      fence_async_shared();
#pragma unroll
      for (int s = 0; s < Config::kStages; ++s) {
        if (unarrived >> s & 1) bar.k_full[s].arrive();
        if (unarrived >> (Config::kStages + s) & 1) bar.v_full[s].arrive();
      }
      unarrived = 0;
    }
  };
  auto copies_issued = [&](KVOperand operand, int stage) {
    if constexpr (KV::kWriterFence) unarrived |= 1u << (operand == KVOperand::kKeys ? stage : Config::kStages + stage);
  };
  // Every wait of the producer on the consumers (a free slot, Q's buffer, O's stores).
  auto acquire = [&](Mbarrier& b, uint32_t parity) {
    if constexpr (KV::kWriterFence) {
      if (unarrived != 0 && !b.ready(parity)) arrive_for_copies();
    }
    b.wait(parity);
  };

  auto zero_pending = [&] {
    if (pending.stage < 0) return;
    bar.v_full[pending.stage].wait(pending.phase);
    smem.v(pending.stage).zero_rows(pending.valid_rows, lane, 32);
    fence_async_shared();
    __syncwarp();
    if (lane == 0) bar.v_zeroed[pending.stage].arrive();
    pending.stage = -1;
  };

  RingPosition<TileHandover::kSlots> handed;  // (kTileHandover: the next slot)
  for (int position = Scheduler::first(p); position < Scheduler::tiles(p); position = Scheduler::next(p, position)) {
    const WorkTile w = make_work_tile<kBlockM, kBlockN, KV, Scheduler>(p, position);
    if constexpr (kTileHandover<Config, KV>) {
      if (thread == 0) bar.handover.publish(w, handed);
    }
    // The device's qo_indptr / kv_indptr against the tensors (the host checked its copies); the
    // consumers read the same entries.
    TESSERA_DEVICE_CHECK_QUIET(w.qo_len <= 0 || (w.q_start >= 0 && int64_t(w.q_start) + w.qo_len <= p.base.q_rows),
                         "qo_indptr (device copy) reaches past q's rows");
    TESSERA_DEVICE_CHECK_QUIET(p.base.paged || w.kv_len <= 0 || (w.kv_start >= 0 && int64_t(w.kv_start) + w.kv_len <= p.base.kv_rows),
                         "kv_indptr (device copy) reaches past k / v's rows");
    if (!w.has_rows() || w.kv_tiles() == 0) continue;
    // What the first KV tile's copies read (paged: page ids), looked up before the waits.
    auto where = KV::locate(p, w.kv_start, w.kv_len, (w.end_kv_tile - 1) * kBlockN, thread);
    const int q_slot = q_ring.stage;
#if TESSERA_SM90_K_AHEAD_OF_V
    const int last = w.end_kv_tile - 1;
    auto load_keys = [&](const decltype(where)& at) {
      acquire(bar.k_empty[ring.stage], ring.phase ^ 1);
      KV::template load<KVOperand::kKeys>(p, smem.k(ring.stage), bar.k_full[ring.stage], w.kv_head, at, thread);
      copies_issued(KVOperand::kKeys, ring.stage);
      ring.advance();
    };
    load_keys(where);
    if (KV::kProducerWarps == 1 || thread < 32) {
      acquire(bar.q_empty[q_slot], q_ring.phase ^ 1);
      if (lane == 0) {
        bar.q_full[q_slot].arrive_expect_tx(Smem::QTile::kBytes);
        smem.q(q_slot).load(&p.q_map, &bar.q_full[q_slot], w.head, w.q_start + w.token(w.m0));
      }
    }
    q_ring.advance();
    for (int tile = last; tile >= w.first_kv_tile; --tile) {
      const int n0 = tile * kBlockN;
      const auto where_v = where;
      if (tile > w.first_kv_tile) {
        where = KV::locate(p, w.kv_start, w.kv_len, n0 - kBlockN, thread);
        load_keys(where);
      }
      const int s = v_ring.stage;
      acquire(bar.v_empty[s], v_ring.phase ^ 1);
      if (Config::kOSharesV && o_staged && tile == last) {
        acquire(bar.o_read, o_read_phase);
        o_read_phase ^= 1;
      }
      KV::template load<KVOperand::kValues>(p, smem.v(s), bar.v_full[s], w.kv_head, where_v, thread);
      copies_issued(KVOperand::kValues, s);
      __syncwarp();
      zero_pending();
      if (!KV::kZeroesPastEnd && n0 + kBlockN > w.kv_len) pending = PendingZero{s, v_ring.phase, w.kv_len - n0};
      v_ring.advance();
    }
#else
#if !TESSERA_SM90_K_BEFORE_Q
    if (KV::kProducerWarps == 1 || thread < 32) {
      acquire(bar.q_empty[q_slot], q_ring.phase ^ 1);
      if (lane == 0) {
        bar.q_full[q_slot].arrive_expect_tx(Smem::QTile::kBytes);
        smem.q(q_slot).load(&p.q_map, &bar.q_full[q_slot], w.head, w.q_start + w.token(w.m0));
      }
    }
#else
    const uint32_t q_free_parity = q_ring.phase ^ 1;
#endif
    q_ring.advance();
    for (int tile = w.end_kv_tile - 1; tile >= w.first_kv_tile; --tile) {
      const int n0 = tile * kBlockN;
      const int s = ring.stage;
      acquire(bar.k_empty[s], ring.phase ^ 1);
      KV::template load<KVOperand::kKeys>(p, smem.k(s), bar.k_full[s], w.kv_head, where, thread);
      copies_issued(KVOperand::kKeys, s);
#if TESSERA_SM90_K_BEFORE_Q
      // The tile's Q once its first K is out (the K stage frees a KV tile before Q's buffer does).
      if (tile == w.end_kv_tile - 1 && (KV::kProducerWarps == 1 || thread < 32)) {
        acquire(bar.q_empty[q_slot], q_free_parity);
        if (lane == 0) {
          bar.q_full[q_slot].arrive_expect_tx(Smem::QTile::kBytes);
          smem.q(q_slot).load(&p.q_map, &bar.q_full[q_slot], w.head, w.q_start + w.token(w.m0));
        }
      }
#endif
      acquire(bar.v_empty[s], ring.phase ^ 1);
      if (Config::kOSharesV && o_staged && tile == w.end_kv_tile - 1) {
        acquire(bar.o_read, o_read_phase);
        o_read_phase ^= 1;
      }
      KV::template load<KVOperand::kValues>(p, smem.v(s), bar.v_full[s], w.kv_head, where, thread);
      copies_issued(KVOperand::kValues, s);
      // The next tile's lookups go out now; the waits below and at the loop's top hide them.
      if (tile > w.first_kv_tile) where = KV::locate(p, w.kv_start, w.kv_len, n0 - kBlockN, thread);
      __syncwarp();
      zero_pending();
      if (!KV::kZeroesPastEnd && n0 + kBlockN > w.kv_len) pending = PendingZero{s, ring.phase, w.kv_len - n0};
      ring.advance();
    }
#endif
    zero_pending();
    o_staged = true;
#if TESSERA_SM90_PREFETCH_NEXT_Q
    // The next work tile's Q, into the L2 while this tile computes (its request's index entries
    // are read here once more, while the producer waits on the ring anyway; every producer lane
    // decodes it: make_work_tile shuffles within the warp).
    const int next = Scheduler::next(p, position);
    if (next < Scheduler::tiles(p)) {
      const WorkTile n = make_work_tile<kBlockM, kBlockN, KV, Scheduler>(p, next);
      if (thread == 0 && n.has_rows() && n.kv_tiles() > 0)
        Smem::QTile::prefetch_l2(&p.q_map, n.head, n.q_start + n.token(n.m0));
    }
#endif
  }
  if constexpr (kTileHandover<Config, KV>) {
    if (thread == 0) {
      WorkTile end{};
      end.request = -1;
      bar.handover.publish(end, handed);
    }
  }
  arrive_for_copies();
}

}  // namespace tessera::kernels::sm90
