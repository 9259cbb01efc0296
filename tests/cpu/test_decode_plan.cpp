// The decode planner and the BSR view of the page table: coverage, balance, merge map,
// determinism, capacity errors. Pure CPU.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "format/bsr.h"
#include "plan/decode_plan.h"
#include "tessera/error.h"

namespace tessera::plan {
namespace {

using ::testing::HasSubstr;

// A page table for the given KV lengths (pages handed out in order).
struct Batch {
  int32_t page_size;
  std::vector<int32_t> kv_indptr{0}, kv_indices, last, qo_indptr{0};
  Batch(int32_t page, const std::vector<int64_t>& kv_len, int32_t qo_len = 1) : page_size(page) {
    for (int64_t len : kv_len) {
      const int32_t pages = static_cast<int32_t>((len + page - 1) / page);
      for (int32_t p = 0; p < pages; ++p) kv_indices.push_back(static_cast<int32_t>(kv_indices.size()));
      kv_indptr.push_back(kv_indptr.back() + pages);
      last.push_back(pages == 0 ? 0 : static_cast<int32_t>(len - int64_t(pages - 1) * page));
      qo_indptr.push_back(qo_indptr.back() + qo_len);
    }
  }
  format::BsrLayout bsr() const {
    return format::bsr_from_page_table(page_size, static_cast<int32_t>(last.size()), kv_indptr.data(),
                                       kv_indices.data(), last.data());
  }
};

PlanCapacity h200_decode(int32_t max_batch, int32_t max_qo_len = 1) {
  PlanCapacity c;
  c.max_batch_size = max_batch;
  c.max_qo_len = max_qo_len;
  c.num_qo_heads = 32;
  c.num_kv_heads = 8;
  c.head_dim = 128;
  c.num_sms = 132;
  c.ctas_per_sm = 4;
  return c;
}

// Every (request, head) is covered once: [0, kv_len) in ascending chunks of at most chunk_tokens,
// split ones through their merge row's slots; the list fits the wave when anything is split.
void check_plan(const Plan& plan, const Batch& b, const PlanCapacity& cap) {
  const int32_t batch = static_cast<int32_t>(b.last.size());
  const int32_t group = cap.num_qo_heads / cap.num_kv_heads;
  const format::BsrLayout kv = b.bsr();
  const std::vector<Task> tasks = plan.tasks();
  ASSERT_EQ(static_cast<int32_t>(tasks.size()), plan.num_tasks);
  ASSERT_EQ(plan.num_tasks, static_cast<int32_t>(plan.work.size()) * cap.num_kv_heads);
  std::vector<std::vector<const Task*>> items(size_t(batch) * cap.num_kv_heads);
  for (const Task& w : tasks) items[size_t(w.request) * cap.num_kv_heads + w.kv_head].push_back(&w);
  int32_t merges_seen = 0;
  for (int32_t r = 0; r < batch; ++r) {
    for (int32_t h = 0; h < cap.num_kv_heads; ++h) {
      const auto& list = items[size_t(r) * cap.num_kv_heads + h];
      ASSERT_FALSE(list.empty()) << "request " << r << " head " << h << " has no work";
      const int64_t qo_len = b.qo_indptr[r + 1] - b.qo_indptr[r];
      const int64_t first_key =
          cap.window_left >= 0 ? std::max<int64_t>(0, kv.row_tokens(r) - qo_len - cap.window_left) : 0;
      int64_t pos = first_key;
      for (const Task* w : list) {
        EXPECT_EQ(w->kv_begin, pos) << "request " << r << ": chunks must be contiguous";
        EXPECT_GE(w->kv_end, w->kv_begin);
        if (plan.chunk_tokens > 0) {
          EXPECT_LE(w->kv_end - w->kv_begin, plan.chunk_tokens);
          EXPECT_EQ((w->kv_begin - first_key) % plan.chunk_tokens, 0);
        }
        pos = w->kv_end;
      }
      EXPECT_EQ(pos, kv.row_tokens(r)) << "request " << r << ": chunks must end at kv_len";
      if (list.size() == 1) {
        EXPECT_EQ(list[0]->partial_slot, -1) << "an unsplit request writes its output directly";
        EXPECT_EQ(list[0]->merge, -1);
        continue;
      }
      const auto m = std::find_if(plan.merges.begin(), plan.merges.end(),
                                  [&](const MergeRow& mr) { return mr.request == r && mr.kv_head == h; });
      ASSERT_NE(m, plan.merges.end()) << "split request " << r << " has no merge row";
      ++merges_seen;
      ASSERT_EQ(m->num_slots, static_cast<int32_t>(list.size()));
      for (size_t i = 0; i < list.size(); ++i) {
        EXPECT_EQ(list[i]->partial_slot, m->first_slot + static_cast<int32_t>(i));
        EXPECT_EQ(list[i]->merge, static_cast<int32_t>(m - plan.merges.begin()));
        EXPECT_EQ(plan.slot_row_offset[m->first_slot + i],
                  plan.slot_row_offset[m->first_slot] + int64_t(i) * (b.qo_indptr[r + 1] - b.qo_indptr[r]) * group)
            << "a merge row's slots are consecutive with equal rows";
        const int64_t rows = plan.slot_row_offset[m->first_slot + i + 1] - plan.slot_row_offset[m->first_slot + i];
        EXPECT_EQ(rows, int64_t(b.qo_indptr[r + 1] - b.qo_indptr[r]) * group);
      }
    }
  }
  EXPECT_EQ(merges_seen, static_cast<int32_t>(plan.merges.size()));
  int64_t total = 0, longest = 0;
  for (int32_t r = 0; r < batch; ++r) {
    total += kv.row_tokens(r);
    longest = std::max(longest, kv.row_tokens(r));
  }
  const int64_t unsplit_items = int64_t(batch) * cap.num_kv_heads;
  if (plan.chunk_tokens > 0 && unsplit_items <= plan.wave_ctas) {
    EXPECT_LE(plan.num_tasks, plan.wave_ctas) << "a split plan fits one wave";
  }
  if (unsplit_items > plan.wave_ctas) {
    // Overfilled: no item is longer than the average load per CTA slot (rounded up to a granule,
    // and never below the minimum chunk).
    const int64_t average = (total * cap.num_kv_heads + plan.wave_ctas - 1) / plan.wave_ctas;
    for (const Task& w : tasks) {
      EXPECT_LE(w.kv_end - w.kv_begin, std::max<int64_t>(average + 255, 256 + 255));
    }
  }
}

TEST(DecodePlan, FullBatchIsNotSplit) {
  const PlanCapacity cap = h200_decode(256);
  DecodePlanner planner(cap);
  Batch b(16, std::vector<int64_t>(64, 4096));  // 64 x 8 = 512 items <= 528 CTAs
  const Plan& plan = planner.plan(b.bsr(), b.qo_indptr.data());
  check_plan(plan, b, cap);
  EXPECT_EQ(plan.chunk_tokens, 0);
  EXPECT_TRUE(plan.merges.empty());
  EXPECT_EQ(plan.num_tasks, 512);
}

TEST(DecodePlan, SlidingWindowPlansOnlyTheVisibleKeys) {
  PlanCapacity cap = h200_decode(256, 4);
  cap.window_left = 1000;
  DecodePlanner planner(cap);
  // qo_len 2: the first row sees keys from kv_len - 2 - 1000 on; short requests are read whole.
  Batch b(16, {100000, 700, 1002, 0, 5}, 2);
  const Plan& plan = planner.plan(b.bsr(), b.qo_indptr.data());
  check_plan(plan, b, cap);
  int64_t read = 0;
  std::vector<int32_t> first(5, INT32_MAX);
  for (const Task& w : plan.tasks()) {
    read += w.kv_end - w.kv_begin;
    first[w.request] = std::min(first[w.request], w.kv_begin);
  }
  EXPECT_EQ(first[0], 100000 - 2 - 1000);
  EXPECT_EQ(first[1], 0);
  EXPECT_EQ(first[2], 0);
  EXPECT_EQ(first[4], 0);
  EXPECT_EQ(read, (1002 + 700 + 1002 + 0 + 5) * int64_t(cap.num_kv_heads));
}

TEST(DecodePlan, LongRequestsOfAnOverfilledBatchAreSplitToTheAverageLoad) {
  const PlanCapacity cap = h200_decode(256);
  DecodePlanner planner(cap);
  // 255 x 1024 tokens and one 65536-token request: 256 x 8 = 2048 items overfill 528 CTAs. The
  // average load per CTA slot is (255 x 1024 + 65536) x 8 / 528 = 4949 tokens, so the long one is
  // split into 4960-token chunks (a granule multiple) and the short ones stay whole.
  std::vector<int64_t> kv(255, 1024);
  kv.push_back(65536);
  Batch b(16, kv);
  const Plan& plan = planner.plan(b.bsr(), b.qo_indptr.data());
  check_plan(plan, b, cap);
  EXPECT_EQ(plan.chunk_tokens, 4960);
  EXPECT_EQ(plan.merges.size(), 8u);
  EXPECT_EQ(plan.num_tasks, 255 * 8 + 14 * 8);  // ceil(65536 / 4960) = 14 chunks per head
  EXPECT_EQ(plan.work.size(), 255u + 14u) << "one work item per (request, chunk) for all heads";
  EXPECT_LE(plan.num_tasks, planner.max_work_items());
  EXPECT_LE(plan.num_slots(), planner.max_slots());
}

TEST(DecodePlan, SingleLongRequestIsSplitToFillTheWave) {
  const PlanCapacity cap = h200_decode(256);
  DecodePlanner planner(cap);
  Batch b(16, {32768});
  const Plan& plan = planner.plan(b.bsr(), b.qo_indptr.data());
  check_plan(plan, b, cap);
  EXPECT_EQ(plan.chunk_tokens, 512);  // 8 heads x 64 chunks = 512 <= 528; 496 would give 544
  EXPECT_EQ(plan.merges.size(), 8u);
  EXPECT_EQ(plan.num_tasks, 512);
}

TEST(DecodePlan, ChunkIsTheSmallestThatFits) {
  const PlanCapacity cap = h200_decode(256);
  std::mt19937 rng(5);
  std::uniform_int_distribution<int64_t> len(1, 20000);
  for (int trial = 0; trial < 50; ++trial) {
    std::vector<int64_t> kv(1 + trial % 24);
    for (auto& x : kv) x = len(rng);
    Batch b(trial % 2 ? 16 : 1, kv);
    DecodePlanner planner(cap);
    const Plan& plan = planner.plan(b.bsr(), b.qo_indptr.data());
    check_plan(plan, b, cap);
    if (plan.chunk_tokens > 256) {
      // One granule less would overfill the wave.
      const int64_t smaller = plan.chunk_tokens - 16;
      int64_t items = 0;
      for (int64_t x : kv) items += x <= smaller ? 1 : (x + smaller - 1) / smaller;
      EXPECT_GT(items * cap.num_kv_heads, plan.wave_ctas) << "trial " << trial;
    }
  }
}

TEST(DecodePlan, SkewedBatchSplitsOnlyTheLongRequests) {
  const PlanCapacity cap = h200_decode(256);
  DecodePlanner planner(cap);
  std::vector<int64_t> kv(40, 300);
  kv[7] = 30000;  // Zipf-like: one long request among short ones
  Batch b(16, kv);
  const Plan& plan = planner.plan(b.bsr(), b.qo_indptr.data());
  check_plan(plan, b, cap);
  ASSERT_GT(plan.chunk_tokens, 0);
  for (const MergeRow& m : plan.merges) EXPECT_EQ(m.request, 7);
  EXPECT_EQ(plan.work.front().request, 7) << "longest first";
}

// ---- The one-CTA-per-SM kernel shape ---------------------------------------------------------------
PlanCapacity h200_decode_two_shapes(int32_t max_batch) {
  PlanCapacity c = h200_decode(max_batch);
  c.ctas_per_sm = 2;  // the default shape at hd128 on an H200
  c.one_cta_per_sm_shape = true;
  return c;
}

TEST(DecodePlan, BatchThatFillsTheSmsRunsUnsplitWithOneCtaPerSm) {
  // 16 x 8192 tokens x 8 KV heads = 128 items for 132 SMs: unsplit with one CTA per SM, rather
  // than 256 chunks of 4096 (and their merges) with two, which is all a capacity without the
  // one-CTA-per-SM shape can do.
  Batch b(16, std::vector<int64_t>(16, 8192));
  for (bool has_shape : {true, false}) {
    PlanCapacity cap = h200_decode_two_shapes(256);
    cap.one_cta_per_sm_shape = has_shape;
    DecodePlanner planner(cap);
    const Plan& plan = planner.plan(b.bsr(), b.qo_indptr.data());
    SCOPED_TRACE(has_shape ? "with the one-CTA-per-SM shape" : "default shape only");
    check_plan(plan, b, cap);
    EXPECT_EQ(plan.shape, has_shape ? CtaShape::kOneCtaPerSm : CtaShape::kDefault);
    EXPECT_EQ(plan.chunk_tokens, has_shape ? 0 : 4096);
    EXPECT_EQ(plan.num_tasks, has_shape ? 128 : 256);
    EXPECT_EQ(plan.wave_ctas, has_shape ? 132 : 264);
    EXPECT_EQ(plan.merges.size(), has_shape ? 0u : 128u);
  }
}

TEST(DecodePlan, OneCtaPerSmOnlyWhereItsLongestTaskIsNoWorse) {
  const PlanCapacity cap = h200_decode_two_shapes(256);
  struct Expect {
    std::vector<int64_t> kv_len;
    CtaShape shape;
    int32_t chunk_tokens;
  };
  std::vector<int64_t> skewed(16, 2048);
  skewed[3] = 32768;
  const std::vector<Expect> cases = {
      // One request: 16 chunks of 2048 on 132 SMs would do (2048 <= 2 x 1008 within the 1/16
      // margin), but a split list keeps the default shape unless the capacity says otherwise.
      {{32768}, CtaShape::kDefault, 1008},
      // 9 x 8192 = 72 items: unsplit on 72 SMs (8192) loses to 3 chunks each on 216 slots (2 x 2736).
      {std::vector<int64_t>(9, 8192), CtaShape::kDefault, 2736},
      // 17 x 8192 = 136 items overfill the 132 SMs.
      {std::vector<int64_t>(17, 8192), CtaShape::kDefault, 0},
      // 64 x 4096 = 512 items overfill both waves: never split, default shape.
      {std::vector<int64_t>(64, 4096), CtaShape::kDefault, 0},
      // One long request among short ones: 16 chunks of 2048 for it on 264 slots; on 132 SMs it
      // could not be split at all (15 short requests x 8 heads leave 12 CTAs).
      {skewed, CtaShape::kDefault, 2048},
  };
  for (const Expect& e : cases) {
    Batch b(16, e.kv_len);
    DecodePlanner planner(cap);
    const Plan& plan = planner.plan(b.bsr(), b.qo_indptr.data());
    SCOPED_TRACE(::testing::Message() << e.kv_len.size() << " requests, longest "
                                      << *std::max_element(e.kv_len.begin(), e.kv_len.end()));
    check_plan(plan, b, cap);
    EXPECT_EQ(plan.shape, e.shape);
    EXPECT_EQ(plan.chunk_tokens, e.chunk_tokens);
    EXPECT_EQ(plan.wave_ctas, e.shape == CtaShape::kOneCtaPerSm ? 132 : 264);
    EXPECT_LE(plan.num_tasks, planner.max_work_items());
    EXPECT_LE(plan.num_slots(), planner.max_slots());
  }
}

TEST(DecodePlan, OneCtaPerSmForSplitListsWhereTheCapacitySaysItPays) {
  PlanCapacity cap = h200_decode_two_shapes(256);
  cap.head_dim = 256;
  cap.one_cta_per_sm_for_splits = true;
  DecodePlanner planner(cap);
  Batch one(16, {32768});
  const Plan& plan = planner.plan(one.bsr(), one.qo_indptr.data());
  check_plan(plan, one, cap);
  EXPECT_EQ(plan.shape, CtaShape::kOneCtaPerSm);
  EXPECT_EQ(plan.chunk_tokens, 2048);  // 8 heads x 16 chunks = 128 <= 132 CTAs
  EXPECT_EQ(plan.num_tasks, 128);
  // Still not where its longest task would be worse: 9 x 8192 stays on the default shape.
  Batch nine(16, std::vector<int64_t>(9, 8192));
  EXPECT_EQ(planner.plan(nine.bsr(), nine.qo_indptr.data()).shape, CtaShape::kDefault);
}

TEST(DecodePlan, RequestsWithoutQueriesDoNotCountAgainstTheOneCtaPerSmWave) {
  // 20 requests x 8 heads = 160 items would overfill 132 SMs, but 5 have no query this step: the
  // 15 others (120 items) run unsplit with one CTA per SM.
  const PlanCapacity cap = h200_decode_two_shapes(256);
  Batch b(16, std::vector<int64_t>(20, 4096));
  for (int32_t r = 0, q = 0; r < 20; ++r) {
    q += r % 4 == 1 ? 0 : 1;
    b.qo_indptr[r + 1] = q;
  }
  DecodePlanner planner(cap);
  const Plan& plan = planner.plan(b.bsr(), b.qo_indptr.data());
  EXPECT_EQ(plan.shape, CtaShape::kOneCtaPerSm);
  EXPECT_EQ(plan.chunk_tokens, 0);
  EXPECT_EQ(plan.num_tasks, 120);
  for (const Task& t : plan.tasks()) {
    EXPECT_NE(t.request % 4, 1) << "request " << t.request << " has no query but got work";
    EXPECT_EQ(t.kv_end - t.kv_begin, 4096);
  }
}

TEST(DecodePlan, OneCtaPerSmShapeNeedsTwoDefaultCtasPerSm) {
  PlanCapacity cap = h200_decode_two_shapes(256);
  cap.ctas_per_sm = 1;
  try {
    DecodePlanner planner(cap);
    ADD_FAILURE() << "a default shape of one CTA per SM leaves nothing for the other shape to win";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("one_cta_per_sm_shape"));
  }
}

TEST(DecodePlan, PinnedShapeHoldsForEveryLaterPlan) {
  const PlanCapacity cap = h200_decode_two_shapes(256);
  Batch fills(16, std::vector<int64_t>(16, 8192));
  Batch overfills(16, std::vector<int64_t>(64, 4096));
  DecodePlanner planner(cap);
  planner.pin_shape(CtaShape::kDefault);
  EXPECT_EQ(planner.plan(fills.bsr(), fills.qo_indptr.data()).shape, CtaShape::kDefault);
  planner.pin_shape(CtaShape::kOneCtaPerSm);
  const Plan& plan = planner.plan(overfills.bsr(), overfills.qo_indptr.data());
  check_plan(plan, overfills, cap);
  EXPECT_EQ(plan.shape, CtaShape::kOneCtaPerSm);
  EXPECT_EQ(plan.wave_ctas, 132);
  EXPECT_LE(plan.num_tasks, planner.max_work_items());
  // Overfilled and skewed: the long request is split to the average load of the smaller wave.
  std::vector<int64_t> skewed(200, 1024);
  skewed[11] = 131072;
  Batch skew(16, skewed);
  const Plan& split = planner.plan(skew.bsr(), skew.qo_indptr.data());
  check_plan(split, skew, cap);
  EXPECT_EQ(split.shape, CtaShape::kOneCtaPerSm);
  EXPECT_GT(split.chunk_tokens, 0);
  EXPECT_LE(split.num_tasks, planner.max_work_items());
  EXPECT_LE(split.num_slots(), planner.max_slots());
  EXPECT_LE(split.partial_rows(), planner.max_partial_rows());

  DecodePlanner without(h200_decode(256));
  try {
    without.pin_shape(CtaShape::kOneCtaPerSm);
    ADD_FAILURE() << "pinning a shape the capacity lacks should be rejected";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("one_cta_per_sm_shape"));
  }
}

TEST(DecodePlan, PageSizeSetsTheGranularityAndEmptyRequestsGetOneItem) {
  const PlanCapacity cap = h200_decode(256);
  for (int32_t page : {1, 16, 64, 256}) {
    DecodePlanner planner(cap);
    Batch b(page, {0, 16385, 54, 1});
    const Plan& plan = planner.plan(b.bsr(), b.qo_indptr.data());
    check_plan(plan, b, cap);
    if (plan.chunk_tokens > 0) EXPECT_EQ(plan.chunk_tokens % std::max(page, 16), 0) << page;
    for (const Task& w : plan.tasks()) {
      if (w.request == 0) EXPECT_EQ(w.kv_end, 0);
    }
  }
}

TEST(DecodePlan, MultiTokenQueriesSizePartialRows) {
  const PlanCapacity cap = h200_decode(16, 8);
  DecodePlanner planner(cap);
  Batch b(16, {20000, 100}, 5);
  const Plan& plan = planner.plan(b.bsr(), b.qo_indptr.data());
  check_plan(plan, b, cap);
  EXPECT_LE(plan.partial_rows(), planner.max_partial_rows());
  EXPECT_GE(planner.workspace_bytes(), size_t(plan.partial_rows()) * (128 + 1) * 4);
}

TEST(DecodePlan, DeterministicAndReusable) {
  const PlanCapacity cap = h200_decode(64);
  DecodePlanner a(cap), b(cap);
  Batch x(16, {5000, 1, 7000, 300, 0, 12345});
  Batch y(16, {100, 200});
  const Plan& pa = a.plan(x.bsr(), x.qo_indptr.data());
  const std::vector<WorkItem> first(pa.work.begin(), pa.work.end());
  a.plan(y.bsr(), y.qo_indptr.data());  // a different step in between
  const Plan& again = a.plan(x.bsr(), x.qo_indptr.data());
  const Plan& pb = b.plan(x.bsr(), x.qo_indptr.data());
  ASSERT_EQ(again.work.size(), first.size());
  ASSERT_EQ(pb.work.size(), first.size());
  for (size_t i = 0; i < first.size(); ++i) {
    EXPECT_EQ(std::memcmp(&again.work[i], &first[i], sizeof(WorkItem)), 0);
    EXPECT_EQ(std::memcmp(&pb.work[i], &first[i], sizeof(WorkItem)), 0);
  }
}

TEST(DecodePlan, CapacityAndInputErrors) {
  DecodePlanner planner(h200_decode(2, 1));
  Batch big(16, {10, 10, 10});
  try {
    planner.plan(big.bsr(), big.qo_indptr.data());
    ADD_FAILURE() << "expected an error";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("'kv_indptr'"));
    EXPECT_THAT(e.what(), HasSubstr("exceeds the planner's max_batch_size 2"));
  }
  Batch multi(16, {10}, 2);
  EXPECT_THROW(planner.plan(multi.bsr(), multi.qo_indptr.data()), Error);
  Batch bad(16, {10, 20});
  bad.last[1] = 17;
  try {
    planner.plan(bad.bsr(), bad.qo_indptr.data());
    ADD_FAILURE() << "expected an error";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("kv_last_page_len: value 17 at index 1 is outside 1..16"));
  }
  PlanCapacity gqa = h200_decode(4);
  gqa.num_kv_heads = 5;
  EXPECT_THROW(DecodePlanner{gqa}, Error);
}

TEST(BsrLayout, PageTableViewAndChecks) {
  Batch b(16, {0, 1, 16, 17, 54});
  const format::BsrLayout kv = b.bsr();
  EXPECT_EQ(kv.row_tokens(0), 0);
  EXPECT_EQ(kv.row_tokens(1), 1);
  EXPECT_EQ(kv.row_tokens(2), 16);
  EXPECT_EQ(kv.row_tokens(3), 17);
  EXPECT_EQ(kv.row_tokens(4), 54);
  EXPECT_EQ(format::check_bsr(kv, static_cast<int64_t>(b.kv_indices.size())), "");
  EXPECT_THAT(format::check_bsr(kv, 3), HasSubstr("kv_indices: page id 3"));
  Batch c = b;
  c.kv_indptr[2] = 5;  // entry 3 (2) now falls below entry 2
  EXPECT_THAT(format::check_bsr(c.bsr(), -1), HasSubstr("non-decreasing"));
}

}  // namespace
}  // namespace tessera::plan

namespace tessera::plan {
namespace {

TEST(DecodePlan, RequestsWithoutQueriesGetNoWork) {
  const PlanCapacity cap = h200_decode(8);
  DecodePlanner planner(cap);
  Batch b(16, {32768, 100});
  b.qo_indptr = {0, 0, 1};  // the long request has no query this step
  const Plan& plan = planner.plan(b.bsr(), b.qo_indptr.data());
  for (const WorkItem& w : plan.work) EXPECT_EQ(w.request, 1);
  EXPECT_EQ(plan.num_tasks, 8);
  EXPECT_EQ(plan.chunk_tokens, 0);
}

TEST(DecodePlan, BadQueryIndptr) {
  DecodePlanner planner(h200_decode(8));
  Batch b(16, {10, 20});
  b.qo_indptr = {5, 5, 6};
  EXPECT_THROW(planner.plan(b.bsr(), b.qo_indptr.data()), Error);
  b.qo_indptr = {0, 2, 1};
  EXPECT_THROW(planner.plan(b.bsr(), b.qo_indptr.data()), Error);
}

TEST(DecodePlan, BuffersKeepTheirAddressesAcrossSteps) {
  const PlanCapacity cap = h200_decode(256, 4);
  DecodePlanner planner(cap);
  Batch small(16, {100});
  const Plan& p0 = planner.plan(small.bsr(), small.qo_indptr.data());
  const WorkItem* work = p0.work.data();
  const MergeRow* merges = p0.merges.data();
  const int64_t* slots = p0.slot_row_offset.data();
  // The largest plans the capacity allows: every request, and one request split to the full wave.
  Batch full(16, std::vector<int64_t>(256, 100000), 4);
  const Plan& p1 = planner.plan(full.bsr(), full.qo_indptr.data());
  EXPECT_EQ(p1.work.data(), work);
  Batch one(16, {1 << 20}, 4);
  const Plan& p2 = planner.plan(one.bsr(), one.qo_indptr.data());
  EXPECT_EQ(p2.work.data(), work);
  EXPECT_EQ(p2.merges.data(), merges);
  EXPECT_EQ(p2.slot_row_offset.data(), slots);
  EXPECT_LE(p2.num_tasks, planner.max_work_items());
  EXPECT_LE(p2.partial_rows(), planner.max_partial_rows());
}

}  // namespace
}  // namespace tessera::plan

namespace tessera::plan {
namespace {

TEST(DecodePlan, WorkspaceLayoutAndPlanImage) {
  const PlanCapacity cap = h200_decode(64, 2);
  DecodePlanner planner(cap);
  const WorkspaceLayout& l = planner.layout();
  const std::size_t offsets[] = {l.header, l.work, l.merges, l.slot_rows, l.merge_counters, l.plan_bytes, l.partial_o,
                                 l.partial_lse, l.total};
  for (size_t i = 0; i < std::size(offsets); ++i) {
    EXPECT_EQ(offsets[i] % 256, 0u) << i;
    if (i > 0) EXPECT_GE(offsets[i], offsets[i - 1]) << i;
  }
  EXPECT_GE(l.work - l.header, sizeof(PlanHeader));
  EXPECT_GE(l.merges - l.work, planner.max_work_items() * sizeof(WorkItem));
  EXPECT_GE(l.plan_bytes - l.merge_counters, size_t(planner.max_slots()) * sizeof(int32_t));
  EXPECT_GE(l.partial_lse - l.partial_o, size_t(planner.max_partial_rows()) * cap.head_dim * 4);
  EXPECT_GE(l.total - l.partial_lse, size_t(planner.max_partial_rows()) * 4);
  EXPECT_EQ(planner.workspace_bytes(), l.total);

  Batch b(16, {40000, 3, 700, 0}, 2);
  const Plan& plan = planner.plan(b.bsr(), b.qo_indptr.data());
  ASSERT_GT(plan.merges.size(), 0u);
  std::vector<unsigned char> image(l.plan_bytes, 0xAB);
  planner.write_image(image.data());
  PlanHeader h;
  std::memcpy(&h, image.data() + l.header, sizeof(h));
  EXPECT_EQ(h.num_work, plan.num_tasks) << "the kernel's loop bound: tasks";
  EXPECT_EQ(h.num_merges, static_cast<int32_t>(plan.merges.size()));
  EXPECT_EQ(h.num_slots, plan.num_slots());
  EXPECT_EQ(h.chunk_tokens, plan.chunk_tokens);
  ASSERT_EQ(plan.requests.size(), 4u);
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(plan.requests[r].q_start, b.qo_indptr[r]);
    EXPECT_EQ(plan.requests[r].qo_len, b.qo_indptr[r + 1] - b.qo_indptr[r]);
    EXPECT_EQ(plan.requests[r].kv_len, b.bsr().row_tokens(r));
    EXPECT_EQ(plan.requests[r].page_begin, b.kv_indptr[r]);
  }
  for (const WorkItem& w : plan.work) {
    EXPECT_EQ(std::memcmp(&w.req, &plan.requests[w.request], sizeof(RequestInfo)), 0)
        << "a work item carries its request's row info";
  }
  for (size_t m = 0; m < plan.merges.size(); ++m) {
    int32_t counter;
    std::memcpy(&counter, image.data() + l.merge_counters + m * sizeof(int32_t), sizeof(counter));
    EXPECT_EQ(counter, 0) << "merge counters start every step at 0";
  }
  EXPECT_EQ(std::memcmp(image.data() + l.work, plan.work.data(), plan.work.size() * sizeof(WorkItem)), 0);
  EXPECT_EQ(std::memcmp(image.data() + l.merges, plan.merges.data(), plan.merges.size() * sizeof(MergeRow)), 0);
  EXPECT_EQ(std::memcmp(image.data() + l.slot_rows, plan.slot_row_offset.data(),
                        plan.slot_row_offset.size() * sizeof(int64_t)), 0);
}

// plan() given the image writes the same bytes as plan() followed by write_image(), emitting the
// work items straight into it, and its work list then points there.
TEST(DecodePlan, PlanIntoTheImageEqualsWriteImage) {
  const PlanCapacity cap = h200_decode(64, 2);
  DecodePlanner direct(cap), copied(cap);
  const WorkspaceLayout& l = direct.layout();
  for (const Batch& b : {Batch(16, {40000, 3, 700, 0}, 2), Batch(16, {100, 200, 300}),
                         Batch(1, std::vector<int64_t>(64, 4096))}) {
    std::vector<unsigned char> a(l.plan_bytes, 0xAB), c(l.plan_bytes, 0xAB);
    const Plan& pd = direct.plan(b.bsr(), b.qo_indptr.data(), a.data());
    copied.plan(b.bsr(), b.qo_indptr.data());
    copied.write_image(c.data());
    EXPECT_EQ(std::memcmp(a.data(), c.data(), l.plan_bytes), 0);
    EXPECT_EQ(static_cast<const void*>(pd.work.data()), static_cast<const void*>(a.data() + l.work));
    ASSERT_GT(pd.work.size(), 0u);
  }
}

}  // namespace
}  // namespace tessera::plan
