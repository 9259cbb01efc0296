// The fixed-grid prefill's static schedule (plan/prefill_schedule.h): every work tile with query
// rows listed exactly once, in slot lists the kernels walk; each slot heaviest first; the makespan
// within Graham's bound of the lower bound; deterministic. Random and adversarial batches.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <queue>
#include <random>
#include <string>
#include <vector>

#include "common/prefill_batch.h"
#include "plan/prefill_schedule.h"
#include "plan/prefill_split.h"

using namespace tessera::plan;

namespace {

using Batch = tessera::testing::PrefillBatch;

struct Scheduled {
  std::vector<int32_t> slot_begin, positions;
  PrefillScheduleResult result;
};

PrefillScheduleProblem problem_of(const Batch& b, int heads, int splits, int slots, int block_m = 128) {
  PrefillScheduleProblem p;
  p.qo_indptr = b.qo_indptr.data();
  p.kv_indptr = b.kv_indptr.data();
  p.last_page_len = b.last.data();
  p.page_size = 16;
  p.batch = b.size();
  p.num_qo_heads = heads;
  p.block_m = block_m;
  p.block_n = 128;
  p.causal = true;
  p.kv_splits = splits;
  p.slots = slots;
  return p;
}

Scheduled run(const PrefillScheduleProblem& p) {
  Scheduled s;
  s.slot_begin.assign(size_t(p.slots) + 1, -1);
  s.positions.assign(size_t(prefill_schedule_tiles(p)), -1);
  PrefillScheduleScratch scratch;
  s.result = schedule_prefill(p, s.slot_begin.data(), s.positions.data(), scratch);
  return s;
}

// A group's cost as the scheduler models it: the KV tiles of the split's run (the kernels' cut:
// equal runs, the last shorter, some empty) plus the start-up.
int64_t group_cost(const Batch& b, const PrefillScheduleProblem& p, int64_t request, int64_t m_tile, int64_t split) {
  const int qo = b.qo_indptr[request + 1] - b.qo_indptr[request];
  const int64_t pages = b.kv_indptr[request + 1] - b.kv_indptr[request];
  const int kv = pages ? static_cast<int>((pages - 1) * p.page_size + b.last[size_t(request)]) : 0;
  const int64_t tiles = query_tile_kv_tiles(qo, kv, p.causal, p.window_left, static_cast<int>(m_tile * p.block_m),
                                            p.block_m, p.block_n);
  const int64_t per = (tiles + p.kv_splits - 1) / p.kv_splits;
  return kTileStartCost + std::clamp<int64_t>(tiles - split * per, 0, per);
}

// Checks the invariants; returns a description of the first broken one ("" when all hold).
std::string check(const Batch& b, const PrefillScheduleProblem& p, const Scheduled& s) {
  int max_qo = 0;
  for (int64_t r = 0; r < b.size(); ++r) max_qo = std::max(max_qo, b.qo_indptr[r + 1] - b.qo_indptr[r]);
  const int64_t m_tiles = (max_qo + p.block_m - 1) / p.block_m;
  if (s.slot_begin[0] != 0) return "slot_begin[0] != 0";
  for (int i = 0; i < p.slots; ++i) {
    if (s.slot_begin[i + 1] < s.slot_begin[i]) return "slot_begin decreases at " + std::to_string(i);
  }
  if (s.slot_begin[p.slots] != int64_t(s.positions.size()) || s.result.tiles != int64_t(s.positions.size())) {
    return "the lists do not hold every tile";
  }
  // Every (request, head, m_tile, split) with rows exactly once.
  std::vector<int> seen(size_t(b.size() * p.num_qo_heads * m_tiles * p.kv_splits), 0);
  for (int32_t pos : s.positions) {
    if (pos < 0 || size_t(pos) >= seen.size()) return "position " + std::to_string(pos) + " out of range";
    ++seen[size_t(pos)];
  }
  for (size_t pos = 0; pos < seen.size(); ++pos) {
    const int64_t tile = int64_t(pos) / p.kv_splits, pair = tile / m_tiles, m_tile = tile - pair * m_tiles;
    const int64_t request = pair / p.num_qo_heads;
    const bool has_rows = m_tile * p.block_m < b.qo_indptr[request + 1] - b.qo_indptr[request];
    if (seen[pos] != (has_rows ? 1 : 0)) return "position " + std::to_string(pos) + " listed " + std::to_string(seen[pos]) + " times";
  }
  // Each slot heaviest first; the loads as reported; Graham's bound for greedy list scheduling.
  auto cost = [&](int32_t pos) {
    const int64_t tile = pos / p.kv_splits, split = pos - tile * p.kv_splits;
    const int64_t pair = tile / m_tiles, m_tile = tile - pair * m_tiles, request = pair / p.num_qo_heads;
    return double(group_cost(b, p, request, m_tile, split));
  };
  double makespan = 0.0, total = 0.0, longest = 0.0;
  for (int i = 0; i < p.slots; ++i) {
    double load = 0.0, previous = 1e300;
    for (int32_t c = s.slot_begin[i]; c < s.slot_begin[i + 1]; ++c) {
      const double t = cost(s.positions[size_t(c)]);
      if (t > previous) return "slot " + std::to_string(i) + " is not heaviest first";
      previous = t;
      load += t;
      longest = std::max(longest, t);
    }
    makespan = std::max(makespan, load);
    total += load;
  }
  if (std::abs(makespan - s.result.makespan) > 1e-6 * (1 + makespan)) return "makespan differs from the lists'";
  if (makespan > total / p.slots + longest + 1e-9) return "makespan above total / slots + longest";
  return "";
}


// The schedule as LPT states it, tile by tile with a min-heap of (load, slot): the groups
// (request, m_tile, split) longest first, equal costs in list order, each group's heads in order;
// each slot's list in assignment order. The scheduler must give exactly these lists.
Scheduled reference_lpt(const Batch& b, const PrefillScheduleProblem& p) {
  int max_qo = 0;
  for (int64_t r = 0; r < b.size(); ++r) max_qo = std::max(max_qo, b.qo_indptr[r + 1] - b.qo_indptr[r]);
  const int64_t m_tiles = (max_qo + p.block_m - 1) / p.block_m;
  struct Group {
    int64_t cost, first;
  };
  std::vector<Group> groups;
  for (int64_t r = 0; r < b.size(); ++r) {
    for (int m = 0; m * p.block_m < b.qo_indptr[r + 1] - b.qo_indptr[r]; ++m) {
      for (int s = 0; s < p.kv_splits; ++s) {
        groups.push_back({group_cost(b, p, r, m, s), (r * p.num_qo_heads * m_tiles + m) * p.kv_splits + s});
      }
    }
  }
  std::stable_sort(groups.begin(), groups.end(), [](const Group& x, const Group& y) { return x.cost > y.cost; });
  using Load = std::pair<int64_t, int>;  // (load, slot): the smallest first, ties to the lower slot
  std::priority_queue<Load, std::vector<Load>, std::greater<Load>> heap;
  for (int s = 0; s < p.slots; ++s) heap.push({0, s});
  std::vector<std::vector<int32_t>> lists(size_t(p.slots));
  Scheduled out;
  for (const Group& g : groups) {
    for (int h = 0; h < p.num_qo_heads; ++h) {
      Load least = heap.top();
      heap.pop();
      lists[size_t(least.second)].push_back(static_cast<int32_t>(g.first + h * m_tiles * p.kv_splits));
      least.first += g.cost;
      heap.push(least);
      out.result.makespan = std::max(out.result.makespan, double(least.first));
    }
  }
  out.slot_begin.push_back(0);
  for (const auto& list : lists) {
    out.positions.insert(out.positions.end(), list.begin(), list.end());
    out.slot_begin.push_back(static_cast<int32_t>(out.positions.size()));
  }
  return out;
}

}  // namespace

TEST(PrefillSchedule, BalancesAMixedStepAsWellAsTheDynamicHardware) {
  // mixed_b16 of the prefill_plan suite: 4 chunks of 512 over 16K, each beside 3 decode-like
  // requests of 1 token over 4K; 32 heads, 132 slots. Round-robin over the list measured 0.75x
  // of the one-tile grid; LPT is within 4% of the lower bound.
  Batch b;
  for (int i = 0; i < 4; ++i) {
    b.add(512, 16384);
    for (int j = 0; j < 3; ++j) b.add(1, 4096);
  }
  const PrefillScheduleProblem p = problem_of(b, 32, 1, 132);
  const Scheduled s = run(p);
  EXPECT_EQ(check(b, p, s), "");
  const double lower = std::max(s.result.longest, s.result.total / 132);
  EXPECT_LE(s.result.makespan, 1.04 * lower);
}

TEST(PrefillSchedule, InvariantsOnRandomAndAdversarialBatches) {
  std::mt19937 rng(7);
  std::vector<Batch> batches;
  {  // one huge request among many tiny ones
    Batch b;
    b.add(128, 65536);
    for (int i = 0; i < 63; ++i) b.add(1 + i % 3, 100 + 37 * i);
    batches.push_back(b);
  }
  {  // all tiny, some empty
    Batch b;
    for (int i = 0; i < 100; ++i) b.add(i % 4, i % 5 == 0 ? 0 : 1 + i);
    batches.push_back(b);
  }
  {  // all huge
    Batch b;
    for (int i = 0; i < 3; ++i) b.add(2048, 8192);
    batches.push_back(b);
  }
  {  // nothing at all
    Batch b;
    b.add(0, 0);
    batches.push_back(b);
  }
  for (int t = 0; t < 20; ++t) {  // random, heavy-tailed lengths
    Batch b;
    const int n = 1 + static_cast<int>(rng() % 40);
    for (int i = 0; i < n; ++i) {
      const int kv = static_cast<int>(std::pow(2.0, 4 + (rng() % 1200) / 100.0));
      b.add(static_cast<int32_t>(std::min<int>(kv, 1 + rng() % 700)), kv);
    }
    batches.push_back(b);
  }
  for (size_t i = 0; i < batches.size(); ++i) {
    for (int splits : {1, 3, 16}) {
      for (int slots : {1, 7, 132, 264}) {
        for (int block_m : {64, 128, 192}) {
          const PrefillScheduleProblem p = problem_of(batches[i], 1 + static_cast<int>(i % 8), splits, slots, block_m);
          const Scheduled s = run(p);
          SCOPED_TRACE("batch " + std::to_string(i) + " splits " + std::to_string(splits) + " slots " +
                       std::to_string(slots) + " block_m " + std::to_string(block_m));
          EXPECT_EQ(check(batches[i], p, s), "");
          const Scheduled again = run(p);
          EXPECT_EQ(again.positions, s.positions) << "not deterministic";
          EXPECT_EQ(again.slot_begin, s.slot_begin);
        }
      }
    }
  }
}

TEST(PrefillSchedule, EqualsTileByTileLpt) {
  // Batches whose tiles come in long runs of one cost (many decode-like requests over equal
  // histories: whole rounds over the slots), of many costs (every group its own batch), and of
  // few slots (the loaded queue refilled and compacted many times within a batch).
  std::mt19937 rng(11);
  std::vector<Batch> batches;
  {  // the serving steps of the plan-time targets, scaled down
    Batch b;
    for (int i = 0; i < 256; ++i) b.add(i % 16 == 0 ? 256 : 1, 256 + static_cast<int32_t>(rng() % 7936));
    batches.push_back(b);
  }
  {  // equal requests: one cost, rounds only
    Batch b;
    for (int i = 0; i < 300; ++i) b.add(1, 2048);
    batches.push_back(b);
  }
  {  // two costs alternating, a long request first
    Batch b;
    b.add(1024, 32768);
    for (int i = 0; i < 200; ++i) b.add(1, i % 2 ? 300 : 700);
    batches.push_back(b);
  }
  {  // long tiles on all slots but one, then many short ones: that slot's list far above the
     // mean (the scheduler's lists start at twice the mean and grow)
    Batch b;
    for (int i = 0; i < 131; ++i) b.add(1, 128000);
    for (int i = 0; i < 4000; ++i) b.add(1, 1);
    batches.push_back(b);
  }
  for (int t = 0; t < 30; ++t) {  // random serving steps
    Batch b;
    const int n = 1 + static_cast<int>(rng() % 96);
    for (int i = 0; i < n; ++i) {
      const bool decode = rng() % 2 == 0;
      const int32_t qo = decode ? 1 : static_cast<int32_t>(rng() % 1100);
      b.add(qo, qo + static_cast<int32_t>(rng() % (t % 3 == 0 ? 600 : 20000)));
    }
    batches.push_back(b);
  }
  for (size_t i = 0; i < batches.size(); ++i) {
    for (int heads : {1, 3, 32}) {
      for (int slots : {1, 2, 7, 132, 1024}) {
        for (int splits : {1, 4}) {
          PrefillScheduleProblem p = problem_of(batches[i], heads, splits, slots);
          p.causal = i % 2 == 0;
          SCOPED_TRACE("batch " + std::to_string(i) + " heads " + std::to_string(heads) + " slots " +
                       std::to_string(slots) + " splits " + std::to_string(splits));
          const Scheduled s = run(p), want = reference_lpt(batches[i], p);
          ASSERT_EQ(s.slot_begin, want.slot_begin);
          ASSERT_EQ(s.positions, want.positions);
          EXPECT_EQ(s.result.makespan, want.result.makespan);
          EXPECT_EQ(check(batches[i], p, s), "");
        }
      }
    }
  }
}

TEST(PrefillSchedule, EqualsTileByTileLptWithLoadsPastTheCountBits) {
  // Slot keys hold (load, slot, tiles so far) in 62 bits; where the loads are too large for that
  // (histories near 2^29 keys in 1-key KV tiles, thousands of tiles on few slots) the counts come
  // from the pick log instead. Both ways place the tiles alike.
  Batch b;
  for (int i = 0; i < 8; ++i) b.add(1 + 290 * i, (1 << 29) - 4096 * i);
  for (int slots : {1, 7, 132}) {
    for (int splits : {1, 3}) {
      PrefillScheduleProblem p = problem_of(b, 4, splits, slots, 16);
      p.block_n = 1;
      p.causal = splits == 1;
      SCOPED_TRACE("slots " + std::to_string(slots) + " splits " + std::to_string(splits));
      const Scheduled s = run(p), want = reference_lpt(b, p);
      ASSERT_EQ(s.slot_begin, want.slot_begin);
      ASSERT_EQ(s.positions, want.positions);
      EXPECT_EQ(s.result.makespan, want.result.makespan);
      EXPECT_EQ(check(b, p, s), "");
    }
  }
}
