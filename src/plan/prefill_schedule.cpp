#include "plan/prefill_schedule.h"

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "plan/prefill_split.h"

namespace tessera::plan {
namespace {

// The keys of request r (host page table), clamped: past 2^30 they only steer the costs.
int request_keys(const PrefillScheduleProblem& pr, int64_t r) {
  const int64_t pages = int64_t(pr.kv_indptr[r + 1]) - pr.kv_indptr[r];
  const int64_t keys = pages <= 0 ? 0 : (pages - 1) * pr.page_size + pr.last_page_len[r];
  return static_cast<int>(std::clamp<int64_t>(keys, 0, int64_t(1) << 30));
}

// (request, m_tile, split) with its cost; every query head of it costs the same.
struct Group {
  int64_t cost;  // KV tiles + kTileStartCost
  int32_t request, m_tile, split;
};

}  // namespace

int64_t prefill_schedule_tiles(const PrefillScheduleProblem& pr) {
  int64_t tiles = 0;
  for (int64_t r = 0; r < pr.batch; ++r) {
    const int64_t qo = pr.qo_indptr[r + 1] - pr.qo_indptr[r];
    tiles += (qo + pr.block_m - 1) / pr.block_m;
  }
  return tiles * pr.num_qo_heads * pr.kv_splits;
}

PrefillScheduleResult schedule_prefill(const PrefillScheduleProblem& pr, int32_t* slot_begin, int32_t* positions,
                                       std::vector<int64_t>& scratch) {
  PrefillScheduleResult res;
  int max_qo = 0;
  for (int64_t r = 0; r < pr.batch; ++r) max_qo = std::max(max_qo, pr.qo_indptr[r + 1] - pr.qo_indptr[r]);
  const int64_t m_tiles = (int64_t(max_qo) + pr.block_m - 1) / pr.block_m;
  std::vector<Group> groups;
  for (int64_t r = 0; r < pr.batch; ++r) {
    const int qo = pr.qo_indptr[r + 1] - pr.qo_indptr[r];
    const int kv = request_keys(pr, r);
    for (int m0 = 0, m = 0; m0 < qo; m0 += pr.block_m, ++m) {
      const int64_t kv_tiles = query_tile_kv_tiles(qo, kv, pr.causal, pr.window_left, m0, pr.block_m, pr.block_n);
      // The kernels' runs: equal, the last shorter, some possibly empty.
      const int64_t per_split = (kv_tiles + pr.kv_splits - 1) / pr.kv_splits;
      for (int s = 0; s < pr.kv_splits; ++s) {
        const int64_t run = std::clamp<int64_t>(kv_tiles - s * per_split, 0, per_split);
        groups.push_back({kTileStartCost + run, static_cast<int32_t>(r), m, s});
      }
    }
  }
  // Longest first; equal costs in list order (deterministic).
  std::stable_sort(groups.begin(), groups.end(), [](const Group& a, const Group& b) { return a.cost > b.cost; });
  // The least loaded slot next (ties: the lower slot), as keys load x 1024 + slot (loads are
  // whole KV tiles; slots < 1024). A group's heads are equal tiles, so the slots they take come
  // from two sorted queues: the slots by key before the group (`sorted`), and the ones it has
  // already loaded, in the order it loaded them (`loaded`: picks come in increasing key order, so
  // their new keys do too). The next head takes the smaller front; after the group one merge
  // restores the order. The same assignment as a min-heap of the keys (checked on 1080 steps), at
  // O(heads + slots) a group in place of a sift-down a tile (9760 tiles: 384 -> 81 us on a 2-core
  // VM, where the heap's data-dependent branches cost ~40 ns a tile).
  constexpr int64_t kSlotBits = 10;
  constexpr int64_t kSlotMask = (int64_t(1) << kSlotBits) - 1;
  constexpr int64_t kNone = INT64_MAX;  // each queue's end: never the smaller front
  const size_t slots = size_t(pr.slots), heads = size_t(pr.num_qo_heads);
  std::vector<int64_t> sorted(slots + 1), loaded(heads + 1), merged(slots + 1);
  for (size_t s = 0; s < slots; ++s) sorted[s] = int64_t(s);  // loads 0, slots ascending
  sorted[slots] = kNone;
  const int64_t tiles = int64_t(groups.size()) * pr.num_qo_heads;
  scratch.resize(size_t(tiles));  // the slot of each tile, in assignment order
  int64_t* slot_of = scratch.data();
  for (const Group& g : groups) {
    const int64_t step = g.cost << kSlotBits;
    size_t next_sorted = 0, next_loaded = 0;
    loaded[0] = kNone;
    // Branch-free: the smaller front by a select (the two queues' turns are data-dependent).
    for (size_t h = 0; h < heads; ++h) {
      const int64_t a = sorted[next_sorted], b = loaded[next_loaded];
      const bool from_sorted = a < b;
      const int64_t key = (from_sorted ? a : b) + step;
      next_sorted += from_sorted;
      next_loaded += !from_sorted;
      loaded[h] = key;
      loaded[h + 1] = kNone;
      *slot_of++ = key & kSlotMask;
    }
    // The slots not taken (sorted's rest) with the ones taken (loaded's rest), in key order.
    // (std::merge: the taken keys mostly land after the rest, so its branch predicts well; a
    // branch-free merge measured 1.8x slower, its loads chained through the two cursors.)
    std::merge(sorted.begin() + std::ptrdiff_t(next_sorted), sorted.begin() + std::ptrdiff_t(slots),
               loaded.begin() + std::ptrdiff_t(next_loaded), loaded.begin() + std::ptrdiff_t(heads), merged.begin());
    merged[slots] = kNone;
    sorted.swap(merged);
    res.longest = std::max(res.longest, double(g.cost));
    res.total += double(g.cost) * pr.num_qo_heads;
  }
  res.makespan = pr.slots > 0 ? double(sorted[slots - 1] >> kSlotBits) : 0.0;  // the most loaded slot
  // Each slot's tiles in assignment order: a counting sort by slot, the positions recomputed in
  // the same group order.
  std::fill(slot_begin, slot_begin + pr.slots + 1, 0);
  for (int64_t t = 0; t < tiles; ++t) ++slot_begin[scratch[size_t(t)] + 1];
  for (int s = 0; s < pr.slots; ++s) slot_begin[s + 1] += slot_begin[s];
  std::vector<int32_t> next(slot_begin, slot_begin + pr.slots);
  int64_t t = 0;
  for (const Group& g : groups) {
    const int64_t first = (int64_t(g.request) * pr.num_qo_heads * m_tiles + g.m_tile) * pr.kv_splits + g.split;
    const int64_t head_stride = m_tiles * pr.kv_splits;
    for (int h = 0; h < pr.num_qo_heads; ++h, ++t) {
      positions[next[size_t(scratch[size_t(t)])]++] = static_cast<int32_t>(first + h * head_stride);
    }
  }
  res.tiles = tiles;
  return res;
}

}  // namespace tessera::plan
