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

// A group is (request, m_tile, split): its query heads are equal tiles. Sorted as one key, cost
// descending then first position ascending (the list order, so equal costs stay in list order):
// (~cost) << 31 | first, with cost < 2^32 (keys < 2^30, block_n >= 1) and first < 2^31.
constexpr int kFirstBits = 31;
uint64_t group_key(int64_t cost, int64_t first) {
  return (uint64_t(~uint32_t(cost)) << kFirstBits) | uint64_t(first);
}
int64_t group_cost(uint64_t key) { return int64_t(~uint32_t(key >> kFirstBits)); }
int64_t group_first(uint64_t key) { return int64_t(key & ((uint64_t(1) << kFirstBits) - 1)); }

// Slot keys: load x 1024 + slot (loads are whole KV tiles; slots < 1024), so the least loaded slot
// is the smallest key and ties go to the lower slot.
constexpr int64_t kSlotBits = 10;
constexpr int64_t kSlotMask = (int64_t(1) << kSlotBits) - 1;
constexpr int64_t kNone = INT64_MAX;  // a queue's end: never the smaller front

// The groups longest first, equal costs in list order (the order they were listed in): a
// counting sort by cost where the costs span a short range (every serving step: costs are KV
// tiles), else a comparison sort of the keys.
const std::vector<uint64_t>& sort_groups(PrefillScheduleScratch& scratch) {
  std::vector<uint64_t>& groups = scratch.groups;
  if (groups.empty()) return groups;
  int64_t low = group_cost(groups[0]), high = low;
  for (const uint64_t key : groups) {
    low = std::min(low, group_cost(key));
    high = std::max(high, group_cost(key));
  }
  const int64_t range = high - low + 1;
  if (range > 4 * int64_t(groups.size()) + 64) {
    std::sort(groups.begin(), groups.end());
    return groups;
  }
  std::vector<int32_t>& bucket = scratch.bucket;  // bucket[c]: where cost high - c starts
  bucket.assign(size_t(range) + 1, 0);
  for (const uint64_t key : groups) ++bucket[size_t(high - group_cost(key)) + 1];
  for (size_t c = 1; c < bucket.size(); ++c) bucket[c] += bucket[c - 1];
  scratch.sorted_groups.resize(groups.size());
  for (const uint64_t key : groups) scratch.sorted_groups[size_t(bucket[size_t(high - group_cost(key))]++)] = key;
  return scratch.sorted_groups;
}

// LPT, every tile to the least loaded slot, taken a batch of equal costs at a time. Within a batch
// (cost c) the picks come from two sorted queues: the slots not yet taken, by key (`sorted`), and
// the ones the batch has loaded, in the order it loaded them (`loaded`: each pick is the smallest
// key, and each loaded key is a pick + c, so they come in increasing order and span less than c).
// The next tile takes the smaller front, a run at a time: from `sorted` while its keys lie below
// `loaded`'s front, from `loaded` while below `sorted`'s. Once `sorted`'s front lies past the last
// loaded key, the picks cycle through `loaded` in its order, round after round, until a round
// would pass that front: those rounds go in bulk (the loaded keys + rounds x c, their order kept).
// After the batch one merge in place restores `sorted`. Each tile's position goes straight to the
// end of its slot's list (lists of `capacity` entries; false when one would overflow). The same
// assignment as a min-heap of the keys tile by tile (tests/cpu/test_prefill_schedule.cpp checks
// it), at O(slots) a batch and a few instructions a tile, where a merge per group, a branch-free
// pick per tile and a counting sort of the picks cost ~10 ns a tile (notes/prefill_paged.md).
bool assign_tiles(const std::vector<uint64_t>& order, int64_t heads, size_t slots, const int32_t* tile_position,
                  int64_t capacity, PrefillScheduleScratch& scratch, PrefillScheduleResult& res) {
  std::vector<int64_t>& keys = scratch.keys;
  const size_t ring = 2 * slots + 2;  // `loaded`: live entries <= slots; a run appends <= slots
  keys.resize(slots + 1 + ring);
  int64_t* sorted = keys.data();
  int64_t* loaded = sorted + slots + 1;
  for (size_t s = 0; s < slots; ++s) sorted[s] = int64_t(s);  // loads 0, slots ascending
  sorted[slots] = kNone;
  scratch.lists.resize(slots * size_t(capacity));
  int32_t* lists = scratch.lists.data();
  std::vector<int32_t>& length = scratch.lengths;
  length.assign(slots, 0);
  res.longest = res.total = 0.0;
  const int32_t* position = tile_position;  // the next tile's
  for (size_t g = 0; g < order.size();) {
    const int64_t cost = group_cost(order[g]);
    size_t end = g + 1;
    while (end < order.size() && group_cost(order[end]) == cost) ++end;
    int64_t left = int64_t(end - g) * heads;  // the batch's tiles
    res.longest = std::max(res.longest, double(cost));
    res.total += double(cost) * double(left);
    g = end;
    const int64_t step = cost << kSlotBits;
    size_t taken = 0, front = 0, back = 0;  // sorted[taken ..) not taken; loaded[front .. back) live
    while (left > 0) {
      const int64_t a = sorted[taken];  // kNone once every slot is taken
      const size_t live = back - front;
      if (live > 0 && a > loaded[back - 1] && left >= int64_t(live)) {
        // Whole rounds through `loaded` before `sorted`'s front: round i's last pick is the last
        // loaded key + i x c. Slot k of the round takes every live-th tile from the k-th on.
        const int64_t gap = a == kNone ? kNone : (a - loaded[back - 1] - 1) / step + 1;
        const int64_t n = int64_t(live), rounds = std::min(left / n, gap);
        for (size_t i = front; i < back; ++i) {
          const uint32_t slot = static_cast<uint32_t>(loaded[i] & kSlotMask);
          if (length[slot] + rounds > capacity) return false;
          int32_t* to = lists + size_t(slot) * size_t(capacity) + length[slot];
          const int32_t* from = position + (i - front);
          for (int64_t r = 0; r < rounds; ++r, from += n) to[r] = *from;
          length[slot] += static_cast<int32_t>(rounds);
          loaded[i] += rounds * step;
        }
        position += n * rounds;
        left -= n * rounds;
        continue;
      }
      if (back + slots > ring) {  // room for a run: the live entries to the start
        std::copy(loaded + front, loaded + back, loaded);
        back = live;
        front = 0;
      }
      // A run from `sorted` (its keys below `loaded`'s front; with nothing loaded, below the first
      // pick's) or from `loaded` (below `sorted`'s front, at most one round).
      const bool from_sorted = live == 0 || a < loaded[front];
      const int64_t* from = from_sorted ? sorted + taken : loaded + front;
      const int64_t below = from_sorted ? (live > 0 ? loaded[front] : a + step) : a;
      const int64_t most = std::min<int64_t>(left, from_sorted ? int64_t(slots - taken) : int64_t(live));
      const int64_t n = std::max<int64_t>(1, std::lower_bound(from, from + most, below) - from);  // (sorted)
      for (int64_t i = 0; i < n; ++i) {
        const int64_t key = from[i];
        const uint32_t slot = static_cast<uint32_t>(key & kSlotMask);
        loaded[back + size_t(i)] = key + step;
        if (length[slot] == capacity) return false;
        lists[size_t(slot) * size_t(capacity) + size_t(length[slot]++)] = position[i];
      }
      position += n;
      back += size_t(n);
      (from_sorted ? taken : front) += size_t(n);
      left -= n;
    }
    if (taken == 0) continue;  // (a batch without tiles: heads 0)
    // The slots not taken (sorted[taken ..)) with the loaded ones, in key order, in place: the
    // output lags the rest's cursor by the loaded keys not yet placed, so nothing is overwritten
    // before it is read, and once they are placed the rest is where it belongs.
    if (taken == slots || sorted[slots - 1] < loaded[front]) {  // the loaded keys all come last
      std::copy(sorted + taken, sorted + slots, sorted);
      std::copy(loaded + front, loaded + back, sorted + (slots - taken));
    } else {
      // The rest's keys below the first loaded one move down as a block; the others interleave.
      size_t rest = size_t(std::lower_bound(sorted + taken, sorted + slots, loaded[front]) - sorted);
      std::copy(sorted + taken, sorted + rest, sorted);
      size_t out = rest - taken;
      while (front < back) sorted[out++] = sorted[rest] < loaded[front] ? sorted[rest++] : loaded[front++];
    }
  }
  res.makespan = slots > 0 ? double(sorted[slots - 1] >> kSlotBits) : 0.0;  // the most loaded slot
  return true;
}

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
                                       PrefillScheduleScratch& scratch) {
  PrefillScheduleResult res;
  int max_qo = 0;
  for (int64_t r = 0; r < pr.batch; ++r) max_qo = std::max(max_qo, pr.qo_indptr[r + 1] - pr.qo_indptr[r]);
  const int64_t m_tiles = (int64_t(max_qo) + pr.block_m - 1) / pr.block_m;
  const int64_t heads = pr.num_qo_heads, head_stride = m_tiles * pr.kv_splits;
  std::vector<uint64_t>& groups = scratch.groups;
  groups.clear();
  for (int64_t r = 0; r < pr.batch; ++r) {
    const int qo = pr.qo_indptr[r + 1] - pr.qo_indptr[r];
    const int kv = request_keys(pr, r);
    for (int m0 = 0, m = 0; m0 < qo; m0 += pr.block_m, ++m) {
      const int64_t kv_tiles = query_tile_kv_tiles(qo, kv, pr.causal, pr.window_left, m0, pr.block_m, pr.block_n);
      // The kernels' runs: equal, the last shorter, some possibly empty.
      const int64_t per_split = (kv_tiles + pr.kv_splits - 1) / pr.kv_splits;
      const int64_t first = (r * heads * m_tiles + m) * pr.kv_splits;
      for (int s = 0; s < pr.kv_splits; ++s) {
        const int64_t run = std::clamp<int64_t>(kv_tiles - s * per_split, 0, per_split);
        groups.push_back(group_key(kTileStartCost + run, first + s));
      }
    }
  }
  const std::vector<uint64_t>& order = sort_groups(scratch);
  const int64_t tiles = int64_t(order.size()) * heads;
  const size_t slots = size_t(pr.slots);
  // Each tile's list position, in pick order (the sorted groups, each group's heads in order).
  scratch.tile_position.resize(size_t(tiles));
  int32_t* position = scratch.tile_position.data();
  const int32_t heads32 = static_cast<int32_t>(heads), head_stride32 = static_cast<int32_t>(head_stride);
  for (const uint64_t key : order) {
    const int32_t first = static_cast<int32_t>(group_first(key));
    for (int32_t h = 0; h < heads32; ++h) position[h] = first + h * head_stride32;
    position += heads32;
  }
  // Lists of twice the mean length to start with (LPT balances loads, not counts: a slot of long
  // tiles holds few); doubled until every slot's fits.
  int64_t capacity = std::min<int64_t>(tiles, 2 * (tiles / int64_t(slots)) + 64);
  while (!assign_tiles(order, heads, slots, scratch.tile_position.data(), capacity, scratch, res)) capacity *= 2;
  slot_begin[0] = 0;
  for (size_t s = 0; s < slots; ++s) {
    slot_begin[s + 1] = slot_begin[s] + scratch.lengths[s];
    std::copy(scratch.lists.data() + s * size_t(capacity), scratch.lists.data() + s * size_t(capacity) + scratch.lengths[s],
              positions + slot_begin[s]);
  }
  res.tiles = tiles;
  return res;
}

}  // namespace tessera::plan
