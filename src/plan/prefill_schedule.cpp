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

// Slot keys: (load, slot, tiles) packed high to low, load << (kSlotBits + count bits) | slot << count
// bits | the slot's tiles so far (loads are whole KV tiles; slots < 1024). Two slots never tie in
// (load, slot), so the least loaded slot is the smallest key, ties go to the lower slot, and the
// count below never decides an order: a pick adds cost << (kSlotBits + count bits) + 1. With the
// count in the key every pick's logged key says where its tile goes in its slot's list (see
// assign_tiles). Where load, slot and count would not fit 62 bits (never a serving step) the count
// bits are 0 and the counts come from the log instead.
constexpr int64_t kSlotBits = 10;
constexpr int64_t kSlotMask = (int64_t(1) << kSlotBits) - 1;
constexpr int64_t kNone = INT64_MAX;  // a queue's end: never the smaller front

// The groups longest first, equal costs in list order (the order they were listed in): a
// counting sort by cost where the costs span a short range (every serving step: costs are KV
// tiles), else a comparison sort of the keys. low / high: the least and greatest cost listed.
const std::vector<uint64_t>& sort_groups(PrefillScheduleScratch& scratch, int64_t low, int64_t high) {
  std::vector<uint64_t>& groups = scratch.groups;
  if (groups.empty()) return groups;
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
// would pass that front: those rounds go in bulk (round i appends the live keys + i x c, in their
// order). After the batch one merge in place restores `sorted`. The same assignment as a min-heap
// of the keys tile by tile (tests/cpu/test_prefill_schedule.cpp checks it), at O(slots) a batch
// and a few instructions a tile, where a merge per group, a branch-free pick per tile and a
// counting sort of the picks cost ~10 ns a tile (notes/prefill_paged.md).
//
// `loaded` is a log of every pick (scratch.picks): each appends its slot's new key and the queue
// consumes from the front, so once every batch is done the log holds each tile's slot in pick
// order and, in the key's count bits, its index in that slot's list (count_bits > 0), so the
// caller writes every tile's position once, straight into its place in the output. The per-slot
// lists of fixed capacity copied out afterwards, and the table of each tile's position they read,
// were a quarter of the instructions; the per-slot counts kept beside the keys, a read-modify-write
// a pick and another a tile in the scatter, 13% and 27% of the schedule's samples at
// serving_b1024 GQA 4 (notes/prefill_paged.md, 2026-12-05).
void assign_tiles(const std::vector<uint64_t>& order, int64_t heads, size_t slots, int count_bits,
                  PrefillScheduleScratch& scratch, PrefillScheduleResult& res) {
  const int load_shift = int(kSlotBits) + count_bits;
  const int64_t tick = count_bits > 0 ? 1 : 0;  // a pick's count increment
  std::vector<int64_t>& keys = scratch.keys;
  keys.resize(slots + 1);
  int64_t* sorted = keys.data();
  for (size_t s = 0; s < slots; ++s) sorted[s] = int64_t(s) << count_bits;  // loads 0, slots ascending
  sorted[slots] = kNone;
  scratch.picks.resize(order.size() * size_t(heads));
  int64_t* loaded = scratch.picks.data();
  res.longest = res.total = 0.0;
  size_t back = 0;  // the log's end: the tiles picked so far
  for (size_t g = 0; g < order.size();) {
    const int64_t cost = group_cost(order[g]);
    size_t end = g + 1;
    while (end < order.size() && group_cost(order[end]) == cost) ++end;
    int64_t left = int64_t(end - g) * heads;  // the batch's tiles
    res.longest = std::max(res.longest, double(cost));
    res.total += double(cost) * double(left);
    g = end;
    const int64_t step = (cost << load_shift) + tick;
    size_t taken = 0, front = back;  // sorted[taken ..) not taken; loaded[front .. back) live
    while (left > 0) {
      const int64_t a = sorted[taken];  // kNone once every slot is taken
      const size_t live = back - front;
      if (live > 0 && a > loaded[back - 1] && left >= int64_t(live)) {
        // Whole rounds through `loaded` before `sorted`'s front: round i's last pick is the last
        // loaded key + i x c.
        const int64_t gap = a == kNone ? kNone : (a - loaded[back - 1] - 1) / step + 1;
        const int64_t rounds = std::min(left / int64_t(live), gap);
        for (int64_t r = 1; r <= rounds; ++r) {
          const int64_t add = r * step;
          int64_t* to = loaded + back + size_t(r - 1) * live;
          for (size_t i = 0; i < live; ++i) to[i] = loaded[front + i] + add;
        }
        front += size_t(rounds) * live;
        back += size_t(rounds) * live;
        left -= rounds * int64_t(live);
        continue;
      }
      // A run from `sorted` (its keys below `loaded`'s front; with nothing loaded, below the first
      // pick's) or from `loaded` (below `sorted`'s front, at most one round).
      const bool from_sorted = live == 0 || a < loaded[front];
      const int64_t* from = from_sorted ? sorted + taken : loaded + front;
      const int64_t below = from_sorted ? (live > 0 ? loaded[front] : a + step) : a;
      const int64_t most = std::min<int64_t>(left, from_sorted ? int64_t(slots - taken) : int64_t(live));
      const int64_t n = std::max<int64_t>(1, std::lower_bound(from, from + most, below) - from);  // (sorted)
      for (int64_t i = 0; i < n; ++i) loaded[back + size_t(i)] = from[i] + step;
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
  res.makespan = slots > 0 ? double(sorted[slots - 1] >> load_shift) : 0.0;  // the most loaded slot
}

// The longest request's query rows and the requests' query tiles ((request, m_tile) pairs with
// rows): the caller's, from its own pass over qo_indptr (plan()), or counted here.
struct QueryCounts {
  int max_qo;
  int64_t tiles;
};
QueryCounts query_counts(const PrefillScheduleProblem& pr) {
  if (pr.max_qo_len >= 0 && pr.query_tiles >= 0) return {static_cast<int>(pr.max_qo_len), pr.query_tiles};
  QueryCounts counts{0, 0};
  for (int64_t r = 0; r < pr.batch; ++r) {
    const int qo = std::max(pr.qo_indptr[r + 1] - pr.qo_indptr[r], 0);
    counts.max_qo = std::max(counts.max_qo, qo);
    counts.tiles += query_tiles(qo, pr.block_m);
  }
  return counts;
}

// The scatter below writes `positions` a tile at a time across every slot's list at once, so
// each cache line is written by picks far apart; where the list is not in the caches (a serving
// step's plan(): the step's other work ran in between) each line's first write misses, one at a
// time. A read of every line first, in address order, lets the hardware prefetch them as a stream:
// serving_b1024 GQA 4, caches evicted before each call, 35.8 -> 28.0 us (hot 20.8; development
// CPU; notes/prefill_paged.md).
void touch_for_writes(const int32_t* positions, int64_t count) {
  constexpr int64_t kPerLine = 64 / sizeof(int32_t);
  int32_t sum = 0;
  for (int64_t i = 0; i < count; i += kPerLine) sum += static_cast<const volatile int32_t*>(positions)[i];
  (void)sum;
}

}  // namespace

int64_t prefill_schedule_tiles(const PrefillScheduleProblem& pr) {
  return query_counts(pr).tiles * pr.num_qo_heads * pr.kv_splits;
}


PrefillScheduleResult schedule_prefill(const PrefillScheduleProblem& pr, int32_t* slot_begin, int32_t* positions,
                                       PrefillScheduleScratch& scratch) {
  PrefillScheduleResult res;
  // The problem's fields as locals (the group stores below, uint64_t, may alias its int64_t ones:
  // kept in the struct they were reloaded per group), and a one-tile request listed without the
  // loop: serving_b1024 GQA 4 25 -> 23 us on the development CPU.
  const int64_t batch = pr.batch;
  const int32_t* const qo_indptr = pr.qo_indptr;
  const int block_m = pr.block_m, block_n = pr.block_n, splits = pr.kv_splits, window_left = pr.window_left;
  const bool causal = pr.causal;
  const QueryCounts counts = query_counts(pr);
  const int max_qo = counts.max_qo;
  const int64_t m_pairs = counts.tiles;  // (request, m_tile) pairs with rows
  const int64_t m_tiles = (int64_t(max_qo) + block_m - 1) / block_m;
  const int64_t heads = pr.num_qo_heads, head_stride = m_tiles * splits;
  std::vector<uint64_t>& groups = scratch.groups;
  groups.resize(size_t(m_pairs) * size_t(splits));
  uint64_t* group = groups.data();
  int64_t low = INT64_MAX, high = 0;  // the costs' range (the sort's)
  auto add = [&](int64_t cost, int64_t first) {
    low = std::min(low, cost);
    high = std::max(high, cost);
    *group++ = group_key(cost, first);
  };
  for (int64_t r = 0; r < batch; ++r) {
    const int qo = qo_indptr[r + 1] - qo_indptr[r];
    if (qo <= 0) continue;
    const int kv = request_keys(pr, r);
    const int64_t request_first = r * heads * m_tiles * splits;
    if (qo <= block_m && splits == 1) {  // one query tile, unsplit: most of a serving step's requests
      add(kTileStartCost + only_query_tile_kv_tiles(qo, kv, window_left, block_n), request_first);
      continue;
    }
    for (int m0 = 0, m = 0; m0 < qo; m0 += block_m, ++m) {
      const int64_t kv_tiles = query_tile_kv_tiles(qo, kv, causal, window_left, m0, block_m, block_n);
      const int64_t first = request_first + int64_t(m) * splits;
      if (splits == 1) {  // (a 64-bit division a query tile otherwise)
        add(kTileStartCost + kv_tiles, first);
        continue;
      }
      // The kernels' runs: equal, the last shorter, some possibly empty.
      const int64_t per_split = (kv_tiles + splits - 1) / splits;
      for (int s = 0; s < splits; ++s) {
        add(kTileStartCost + std::clamp<int64_t>(kv_tiles - s * per_split, 0, per_split), first + s);
      }
    }
  }
  const std::vector<uint64_t>& order = sort_groups(scratch, low, high);
  const int64_t tiles = int64_t(order.size()) * heads;
  const size_t slots = size_t(pr.slots);
  // The count bits: a slot holds at most every tile, and no load passes the mean load before its
  // last pick plus that pick, high x tiles / slots + high. Keys stay below 2^62 (kNone above them).
  int count_bits = 0;
  if (tiles > 0 && slots > 0) {
    const int bits = 64 - __builtin_clzll(uint64_t(tiles));
    const uint64_t most_load = uint64_t(high) * uint64_t(tiles) / slots + uint64_t(high);
    if ((64 - __builtin_clzll(most_load | 1)) + int(kSlotBits) + bits <= 62) count_bits = bits;
  }
  assign_tiles(order, heads, slots, count_bits, scratch, res);
  // Each slot's place in the output from its final key's count (or from the log), then every
  // tile to its place, in pick order: a group's heads are its first position + h x head_stride.
  const int64_t* const log = scratch.picks.data();  // each tile's slot key after its pick
  std::vector<int32_t>& count = scratch.counts;
  count.assign(slots, 0);
  const int64_t count_mask = (int64_t(1) << count_bits) - 1;
  if (count_bits > 0) {
    for (size_t s = 0; s < slots; ++s) {
      const int64_t key = scratch.keys[s];
      count[size_t((key >> count_bits) & kSlotMask)] = static_cast<int32_t>(key & count_mask);
    }
  } else {
    for (int64_t t = 0; t < tiles; ++t) ++count[size_t(log[t] & kSlotMask)];
  }
  slot_begin[0] = 0;
  for (size_t s = 0; s < slots; ++s) slot_begin[s + 1] = slot_begin[s] + count[s];
  touch_for_writes(positions, tiles);
  const int32_t heads32 = static_cast<int32_t>(heads), head_stride32 = static_cast<int32_t>(head_stride);
  const int64_t* pick = log;
  if (count_bits > 0) {
    // A pick's key holds its tile's index in the slot's list + 1: no cursor to carry from tile to
    // tile.
    int32_t* const place = count.data();  // slot_begin - 1
    for (size_t s = 0; s < slots; ++s) place[s] = slot_begin[s] - 1;
    for (const uint64_t key : order) {
      const int32_t first = static_cast<int32_t>(group_first(key));
      for (int32_t h = 0; h < heads32; ++h, ++pick) {
        positions[place[(*pick >> count_bits) & kSlotMask] + int32_t(*pick & count_mask)] = first + h * head_stride32;
      }
    }
  } else {
    int32_t* const cursor = count.data();  // each slot's next output index
    for (size_t s = 0; s < slots; ++s) cursor[s] = slot_begin[s];
    for (const uint64_t key : order) {
      const int32_t first = static_cast<int32_t>(group_first(key));
      for (int32_t h = 0; h < heads32; ++h) positions[cursor[*pick++ & kSlotMask]++] = first + h * head_stride32;
    }
  }
  res.tiles = tiles;
  return res;
}

}  // namespace tessera::plan
