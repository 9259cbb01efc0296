// The producer warp of the Hopper prefill kernel: for each work tile, Q once, then K and V of its
// KV tiles from the last to the first (the order the consumers take them), by TMA into the rings.
//
// K / V boxes are cut from the whole ragged tensor, so the rows of a request's last, partial KV
// tile past kv_len are the next request's rows (or zeros past the tensor's end). Their logits are
// masked, but P = 0 times a NaN or Inf there would still reach O through the tensor cores; the
// conventions promise that keys past kv_len never do. So the producer zeroes those rows of the V
// tile once it has landed (after issuing the next tile's copies, so nothing waits on it), and the
// consumers take a partial tile's V only after its `v_zeroed` barrier. K needs nothing: masked
// logits are overwritten.
#pragma once

#include <cuda_runtime.h>

#include "kernels/attention/sm90/prefill_config_sm90.cuh"
#include "kernels/attention/sm90/tile_scheduler_sm90.cuh"

namespace tessera::kernels::sm90 {

template <typename T, typename Config, typename Scheduler>
__device__ __forceinline__ void prefill_producer_warp(const PrefillSm90Params& p,
                                                      const PrefillSm90Smem<T, Config>& smem) {
  using Smem = PrefillSm90Smem<T, Config>;
  constexpr int kBlockM = Config::kBlockM, kBlockN = Config::kBlockN;
  const int lane = threadIdx.x % 32;
  auto& bar = smem.barriers();
  RingPosition<Config::kStages> ring;
  RingPosition<Config::kQStages> q_ring;

  if (lane == 0) {
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
  auto zero_pending = [&] {
    if (pending.stage < 0) return;
    bar.v_full[pending.stage].wait(pending.phase);
    smem.v(pending.stage).zero_rows(pending.valid_rows, lane, 32);
    fence_async_shared();
    __syncwarp();
    if (lane == 0) bar.v_zeroed[pending.stage].arrive();
    pending.stage = -1;
  };

  for (int position = Scheduler::first(p); position < p.tiles; position = Scheduler::next(p, position)) {
    const WorkTile w = make_work_tile<kBlockM, kBlockN>(p, position);
    if (!w.has_rows() || w.kv_tiles() == 0) continue;
    const int q_slot = q_ring.stage;
    bar.q_empty[q_slot].wait(q_ring.phase ^ 1);
    if (lane == 0) {
      bar.q_full[q_slot].arrive_expect_tx(Smem::QTile::kBytes);
      smem.q(q_slot).load(&p.q_map, &bar.q_full[q_slot], w.head, w.q_start + w.m0);
    }
    q_ring.advance();
    for (int tile = w.end_kv_tile - 1; tile >= w.first_kv_tile; --tile) {
      const int n0 = tile * kBlockN;
      const int s = ring.stage;
      bar.k_empty[s].wait(ring.phase ^ 1);
      if (lane == 0) {
        bar.k_full[s].arrive_expect_tx(Smem::KVTile::kBytes);
        smem.k(s).load(&p.k_map, &bar.k_full[s], w.kv_head, w.kv_start + n0);
      }
      bar.v_empty[s].wait(ring.phase ^ 1);
      if (lane == 0) {
        bar.v_full[s].arrive_expect_tx(Smem::KVTile::kBytes);
        smem.v(s).load(&p.v_map, &bar.v_full[s], w.kv_head, w.kv_start + n0);
      }
      __syncwarp();
      zero_pending();
      if (n0 + kBlockN > w.kv_len) pending = PendingZero{s, ring.phase, w.kv_len - n0};
      ring.advance();
    }
    zero_pending();
  }
}

}  // namespace tessera::kernels::sm90
