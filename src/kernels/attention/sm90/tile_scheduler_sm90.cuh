// Which (request, query head, query tile[, KV split]) a CTA of the Hopper prefill kernel computes,
// and in what order. The work is a list of tiles in a linear order (TileOrder); with a KV split
// (kv_splits > 1) each tile is kv_splits list positions in a row, one per run of its KV tiles. A
// scheduler hands list positions to CTAs:
//   - SingleTileScheduler: one tile per CTA, grid = the list; the hardware starts CTAs roughly in
//     list order as SMs free up (dynamic, longest-first when the list is sorted so).
//   - StaticPersistentScheduler: one CTA per SM walks positions blockIdx.x, + gridDim.x, ...:
//     a CTA's next tile loads (Q, the first K / V) while its previous one finishes, but the
//     assignment is fixed, so balance relies on the order.
//   - StepListScheduler: CTA b walks the plan's static schedule for its slot (plan/
//     prefill_schedule.h: longest first, balanced by the host), over a list whose shape (batch,
//     query tiles, KV splits) it reads from the plan's PrefillStep in the workspace, not from its
//     launch parameters: the launch of a CUDA graph, replayed for steps it was not captured with.
// A scheduler walks cursors first(p), next(p, c), ... while c < tiles(p); list_position(p, c) is
// the cursor's list position. It also says what shape the list has (m_tiles, batch_size,
// kv_splits) and whether the epilogue writes split partials. Both roles of a CTA (producer,
// consumers) walk the same sequence and decode the same WorkTile.
#pragma once

#include <cuda_runtime.h>

#include "kernels/attention/common/mask.cuh"
#include "kernels/attention/sm90/kv_source_sm90.cuh"
#include "kernels/attention/sm90/prefill_sm90_params.h"

namespace tessera::kernels::sm90 {

// What one tile of the list covers: tile rows [m0, m0 + kBlockM) of (request, head), against
// the KV tiles [first_kv_tile, end_kv_tile) that meet the mask band of any of its rows (with a KV
// split: split's run of them, possibly none). Tile row r is query token r >> row_shift of the
// request and query head head + r % 2^row_shift (packed GQA, PrefillParams::gqa_pack; without
// it row_shift is 0: row r is token r of `head`).
struct WorkTile {
  int request, head, kv_head;  // head: the tile's first query head
  int split;  // which of kv_splits runs (0 without a split)
  int m0;
  int row_shift;
  int q_start, qo_len;
  int kv_start, kv_len;  // kv_start: the request's first K / V row, or first kv_indices entry (paged)
  MaskBand band;
  int first_kv_tile, end_kv_tile;

  __device__ int rows() const { return qo_len << row_shift; }  // tile rows the request has
  __device__ int token(int row) const { return row >> row_shift; }
  __device__ int head_of(int row) const { return head + (row & ((1 << row_shift) - 1)); }
  __device__ bool has_rows() const { return m0 < rows(); }
  __device__ int kv_tiles() const { return end_kv_tile - first_kv_tile; }
};

// The 128 x 128 kernels (hd128's short-row shape) divide a list position by the list's shape
// with the launcher's FastDivisors (a multiply-high, an add and a shift each, in place of ~20-40
// instructions a division by a runtime value). The decode of the next work tile then takes ~650
// instead of ~1.2 K cycles of each consumer's tile boundary; same run (H100,
// notes/prefill_hopper.md, "The decode of a work tile"): 1K +1.5 / +9.6%, 1K causal +3.2 / +7.8%
// (two rounds), 2K +0.9%, even from 4K. The others keep the divisions: the 192-key hd128 and
// 80-key hd256 consumers have no registers for the multiplies' operands (spills inside the KV
// loop), and hd64 (192 x 128) measured -0.8%. TESSERA_SM90_FAST_DECODE=0 (an ablation switch)
// turns it off.
#ifndef TESSERA_SM90_FAST_DECODE
#define TESSERA_SM90_FAST_DECODE 1
#endif
template <int kBlockM, int kBlockN>
constexpr bool kFastDecode = TESSERA_SM90_FAST_DECODE != 0 && kBlockM == 128 && kBlockN == 128;

// The list's shape as the launch parameters give it: an eager launch, sized to its step.
struct ListShapeFromParams {
  __device__ static int tiles(const PrefillSm90Params& p) { return p.tiles; }
  __device__ static int list_position(const PrefillSm90Params& /*p*/, int cursor) { return cursor; }
  __device__ static int m_tiles(const PrefillSm90Params& p) { return p.m_tiles; }
  __device__ static int batch_size(const PrefillSm90Params& p) { return p.base.batch_size; }
  __device__ static int kv_splits(const PrefillSm90Params& p) { return p.base.kv_splits; }
  __device__ static bool writes_partials(const PrefillSm90Params& p) { return p.base.partial_o != nullptr; }
  // (kFastDecode: by the launcher's FastDivisors.)
  __device__ static int divide_by_m_tiles(const PrefillSm90Params& p, int n) { return p.m_tiles_divisor.div(n); }
  __device__ static int divide_by_pairs(const PrefillSm90Params& p, int n) { return p.pairs_divisor.div(n); }
  __device__ static int divide_by_splits(const PrefillSm90Params& p, int n) { return p.splits_divisor.div(n); }
};

// position -> (request, head, m_tile), head counting the list's heads (KV heads when packed).
// kHeadsInner: every (request, head)'s query tiles
// consecutive (they share the head's K / V in L2); kHeavyFirst: the position's m_tile counts from
// the last query tile (for causal masks, the tile with the most keys first).
template <typename Scheduler, bool kFast>
__device__ __forceinline__ void decode_position(const PrefillSm90Params& p, int position, int& request,
                                                int& head, int& m_tile) {
  const int tiles = Scheduler::m_tiles(p);
  const int heads = p.base.num_qo_heads >> p.base.gqa_pack;
  if (p.order == TileOrder::kQueryTilesInner || p.order == TileOrder::kMirroredPairs) {
    if constexpr (kFast) {
      const int rest = Scheduler::divide_by_m_tiles(p, position);
      m_tile = position - rest * tiles;
      request = p.heads_divisor.div(rest);
      head = rest - request * heads;
    } else {
      int rest = position / tiles;
      m_tile = position - rest * tiles;
      head = rest % heads;
      request = rest / heads;
    }
    // The last tile, the first, the second last, the second, ...
    if (p.order == TileOrder::kMirroredPairs) m_tile = m_tile % 2 == 0 ? tiles - 1 - m_tile / 2 : m_tile / 2;
  } else {  // kQueryTilesOuter
    const int pairs = Scheduler::batch_size(p) * heads;
    if constexpr (kFast) {
      m_tile = Scheduler::divide_by_pairs(p, position);
      const int rest = position - m_tile * pairs;
      request = p.heads_divisor.div(rest);
      head = rest - request * heads;
    } else {
      m_tile = position / pairs;
      const int rest = position - m_tile * pairs;
      head = rest % heads;
      request = rest / heads;
    }
  }
  if (p.heavy_first && p.order != TileOrder::kMirroredPairs) m_tile = tiles - 1 - m_tile;
}

// Where the tile at a cursor lies in the list: the divisions of its list position (and the GQA
// group's, for its KV head), the part of a tile's decode that costs.
struct TilePosition {
  int request, list_head, kv_head, m_tile, split;
};
template <int kBlockM, int kBlockN, typename Scheduler>
__device__ __forceinline__ TilePosition locate_tile(const PrefillSm90Params& p, int cursor) {
  constexpr bool kFast = kFastDecode<kBlockM, kBlockN>;
  const int position = Scheduler::list_position(p, cursor);
  TilePosition t;
  int tile = position;
  if (Scheduler::kv_splits(p) > 1)
    tile = kFast ? Scheduler::divide_by_splits(p, position) : position / Scheduler::kv_splits(p);
  t.split = position - tile * Scheduler::kv_splits(p);
  decode_position<Scheduler, kFast>(p, tile, t.request, t.list_head, t.m_tile);
  const int head = t.list_head << p.base.gqa_pack;
  t.kv_head = kFast ? p.group_divisor.div(head) : head / (p.base.num_qo_heads / p.base.num_kv_heads);
  return t;
}

// The request of the tile at `cursor` (kBlockM, kBlockN: the kernel's tile, for kFastDecode).
template <typename Scheduler, int kBlockM, int kBlockN>
__device__ __forceinline__ int request_at(const PrefillSm90Params& p, int cursor) {
  return locate_tile<kBlockM, kBlockN, Scheduler>(p, cursor).request;
}

// The tile at position `t`; `entries` are its request's (load_request_entries).
template <int kBlockM, int kBlockN, typename KV, typename Scheduler>
__device__ __forceinline__ WorkTile make_work_tile(const PrefillSm90Params& p, const TilePosition& t,
                                                   const RequestEntries& entries) {
  constexpr bool kFast = kFastDecode<kBlockM, kBlockN>;
  WorkTile w;
  w.request = t.request;
  w.split = t.split;
  w.row_shift = p.base.gqa_pack;
  w.head = t.list_head << w.row_shift;
  w.kv_head = t.kv_head;
  w.m0 = t.m_tile * kBlockM;
  w.q_start = warp_uniform(entries.q_begin);
  w.qo_len = warp_uniform(entries.q_end) - w.q_start;
  KV::extent(entries, p.base.page_size, w.kv_start, w.kv_len);
  w.band = MaskBand{w.qo_len, w.kv_len, w.kv_len - w.qo_len, p.base.causal, p.base.window_left};
  const int last_row = min(w.m0 + kBlockM, w.rows()) - 1;
  const int n_begin = w.band.key_begin(w.token(w.m0));
  const int n_end = w.band.key_end(w.token(last_row));
  w.first_kv_tile = n_begin / kBlockN;
  w.end_kv_tile = n_end > n_begin ? (n_end + kBlockN - 1) / kBlockN : w.first_kv_tile;
  if (Scheduler::kv_splits(p) > 1) {  // the portable family's runs (prefill_sm80.cuh): equal, the last shorter
    const int runs = w.end_kv_tile - w.first_kv_tile + Scheduler::kv_splits(p) - 1;
    const int per_split = kFast ? Scheduler::divide_by_splits(p, runs) : runs / Scheduler::kv_splits(p);
    w.first_kv_tile = min(w.end_kv_tile, w.first_kv_tile + w.split * per_split);
    w.end_kv_tile = min(w.end_kv_tile, w.first_kv_tile + per_split);
  }
  return w;
}

// The tile at `cursor`; `entries` are its request's (load_request_entries).
template <int kBlockM, int kBlockN, typename KV, typename Scheduler>
__device__ __forceinline__ WorkTile make_work_tile(const PrefillSm90Params& p, int cursor, const RequestEntries& entries) {
  return make_work_tile<kBlockM, kBlockN, KV, Scheduler>(p, locate_tile<kBlockM, kBlockN, Scheduler>(p, cursor), entries);
}

template <int kBlockM, int kBlockN, typename KV, typename Scheduler>
__device__ __forceinline__ WorkTile make_work_tile(const PrefillSm90Params& p, int cursor) {
  return make_work_tile<kBlockM, kBlockN, KV, Scheduler>(
      p, cursor, load_request_entries<KV::kPaged>(p, request_at<Scheduler, kBlockM, kBlockN>(p, cursor)));
}

struct SingleTileScheduler : ListShapeFromParams {
  __device__ static int first(const PrefillSm90Params& /*p*/) { return blockIdx.x; }
  __device__ static int next(const PrefillSm90Params& /*p*/, int /*position*/) { return 1 << 30; }
};

// CTA b takes positions in runs of p.run_length: [b r, b r + r), then gridDim.x r further on. With
// kMirroredPairs and runs of 2, a CTA's two tiles of a run are a query tile and its mirror, whose
// causal costs add up to the same for every pair.
struct StaticPersistentScheduler : ListShapeFromParams {
  __device__ static int first(const PrefillSm90Params& p) { return blockIdx.x * p.run_length; }
  __device__ static int next(const PrefillSm90Params& p, int position) {
    return (position + 1) % p.run_length != 0 ? position + 1 : position + 1 + (gridDim.x - 1) * p.run_length;
  }
};

// CTA b walks slot b of the plan's static schedule (the grid is the schedule's slots), over the
// list the plan's PrefillStep describes (order: query tiles inner, as listed; the plan sorted each
// slot's tiles heaviest first). What the plan wrote is read through the read-only path: its copy
// finished before the launch.
template <int kBlockM>
struct StepListScheduler {
  __device__ static int first(const PrefillSm90Params& p) { return __ldg(&p.base.slot_begin[blockIdx.x]); }
  __device__ static int next(const PrefillSm90Params& /*p*/, int cursor) { return cursor + 1; }
  __device__ static int tiles(const PrefillSm90Params& p) { return __ldg(&p.base.slot_begin[blockIdx.x + 1]); }
  __device__ static int list_position(const PrefillSm90Params& p, int cursor) { return __ldg(&p.base.slot_tiles[cursor]); }
  __device__ static int batch_size(const PrefillSm90Params& p) { return __ldg(&p.base.step->batch_size); }
  __device__ static int m_tiles(const PrefillSm90Params& p) {
    return ((__ldg(&p.base.step->max_qo_len) << p.base.gqa_pack) + kBlockM - 1) / kBlockM;
  }
  __device__ static int kv_splits(const PrefillSm90Params& p) { return __ldg(&p.base.step->kv_splits); }
  __device__ static bool writes_partials(const PrefillSm90Params& p) { return kv_splits(p) > 1; }
  // (The step's shape is read from the workspace, so these divide by values the launch does not
  // know.)
  __device__ static int divide_by_m_tiles(const PrefillSm90Params& p, int n) { return n / m_tiles(p); }
  __device__ static int divide_by_pairs(const PrefillSm90Params& p, int n) {
    return n / (batch_size(p) * (p.base.num_qo_heads >> p.base.gqa_pack));
  }
  __device__ static int divide_by_splits(const PrefillSm90Params& p, int n) { return n / kv_splits(p); }
};

}  // namespace tessera::kernels::sm90
