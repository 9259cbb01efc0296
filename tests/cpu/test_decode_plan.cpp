// The decode planner and the BSR view of the page table: coverage, balance, merge map,
// determinism, capacity errors. Pure CPU.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <numeric>
#include <random>
#include <vector>

#include "common/decode_plan_check.h"
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

// The plan keeps every rule of the shared checker (tests/common/decode_plan_check.h).
void check_plan(const Plan& plan, const Batch& b, const PlanCapacity& cap, const DecodePlanner& planner,
                int32_t granularity = 16) {
  EXPECT_EQ(testing_support::check_decode_plan(plan, b.bsr(), b.qo_indptr.data(), cap, planner, granularity), "");
}

// The tests' own model of a plan's run (not the planner's estimate): tasks in launch order onto
// the CTA slot that frees first, each costing the start-up plus its bytes at min(the CTA's peak,
// the bandwidth / the tasks of its round); each merge row starts when its last slot is written
// and costs its start plus its partial rows.
double simulated_us(const Plan& plan, const PlanCapacity& cap, const CostModel& cost = {}) {
  const bool wide = plan.shape == CtaShape::kOneCtaPerSm;
  const double peak = wide ? cost.one_cta_per_sm_peak_bytes_per_us : cost.cta_peak_bytes_per_us;
  const double bandwidth = cost.sm_read_bytes_per_us * cap.num_sms;
  const int64_t n = plan.num_tasks, w = plan.wave_ctas;
  std::vector<double> slots(w, 0.0);
  std::vector<double> slot_ready(plan.num_slots(), 0.0);
  double end = 0;
  int64_t index = 0;
  for (const Task& t : plan.tasks()) {
    // The round's CTAs fill every SM before doubling up; the CTAs of the busiest SMs share what
    // the others (at their peak) leave of the bandwidth.
    const int64_t round_tasks = std::min(w, n - index / w * w), sms = cap.num_sms;
    const int64_t per_sm = (round_tasks + sms - 1) / sms;
    const int64_t busiest = (round_tasks - (per_sm - 1) * sms) * per_sm;
    const double left = bandwidth - double(round_tasks - busiest) * peak;
    const double sm_cap = per_sm > 1 ? cost.shared_sm_peak_bytes_per_us / double(per_sm) : peak;
    const double rate = std::min({peak, sm_cap, std::max(bandwidth / double(w), left / double(busiest))});
    ++index;
    auto first_free = std::min_element(slots.begin(), slots.end());
    *first_free += cost.task_start_us + double(t.kv_end - t.kv_begin) * 4.0 * cap.head_dim / rate;
    end = std::max(end, *first_free);
    if (t.partial_slot >= 0) slot_ready[t.partial_slot] = *first_free;
  }
  const double row_us = (4.0 * cap.head_dim + 4) / cost.merge_bytes_per_us;
  auto merge_end = [&](const MergeRow& m) {
    double ready = 0;
    for (int32_t s = m.first_slot; s < m.first_slot + m.num_slots; ++s) ready = std::max(ready, slot_ready[s]);
    const int64_t rows = plan.slot_row_offset[m.first_slot + 1] - plan.slot_row_offset[m.first_slot];
    return ready + cost.merge_start_us + double(m.num_slots * rows) * row_us;
  };
  for (const MergeRow& m : plan.merges) {  // groups first (they fill their parents' slots)
    if (m.target_slot >= 0) slot_ready[m.target_slot] = merge_end(m);
  }
  for (const MergeRow& m : plan.merges) {
    if (m.target_slot < 0) end = std::max(end, merge_end(m));
  }
  return end;
}

// Lower bound of any plan's makespan: every K/V byte streamed at the whole GPU's rate, after one
// task start-up.
double lower_bound_us(const Batch& b, const PlanCapacity& cap, const CostModel& cost = {}) {
  int64_t tokens = 0;
  for (size_t r = 0; r < b.last.size(); ++r) {
    if (b.qo_indptr[r + 1] > b.qo_indptr[r]) tokens += b.bsr().row_tokens(static_cast<int32_t>(r));
  }
  return cost.task_start_us + double(tokens) * cap.num_kv_heads * 4.0 * cap.head_dim /
                                  std::min(cost.sm_read_bytes_per_us * cap.num_sms,
                                           cost.cta_peak_bytes_per_us * cap.num_sms * cap.ctas_per_sm);
}

TEST(DecodePlan, FullBatchIsNotSplit) {
  const PlanCapacity cap = h200_decode(256);
  DecodePlanner planner(cap);
  Batch b(16, std::vector<int64_t>(64, 4096));  // 64 x 8 = 512 items <= 528 CTAs
  const Plan& plan = planner.plan(b.bsr(), b.qo_indptr.data());
  check_plan(plan, b, cap, planner);
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
  check_plan(plan, b, cap, planner);
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

TEST(DecodePlan, LongRequestsOfAnOverfilledBatchAreSplitNearTheAverageLoad) {
  const PlanCapacity cap = h200_decode(256);
  DecodePlanner planner(cap);
  // 255 x 1024 tokens and one 65536-token request: 256 x 8 = 2048 items overfill 528 CTAs. The
  // average load per CTA slot is (255 x 1024 + 65536) x 8 / 528 = 4949 tokens: the long request
  // is split into chunks near it, the short ones stay whole, and the step ends near the average.
  std::vector<int64_t> kv(255, 1024);
  kv.push_back(65536);
  Batch b(16, kv);
  const Plan& plan = planner.plan(b.bsr(), b.qo_indptr.data());
  check_plan(plan, b, cap, planner);
  EXPECT_EQ(plan.split_rows, 8);
  for (const MergeRow& m : plan.merges) EXPECT_EQ(m.request, 255);
  EXPECT_GE(plan.chunk_tokens, 4949 / 2);
  EXPECT_LE(plan.chunk_tokens, 2 * 4949);
  EXPECT_EQ(plan.work.front().request, 255) << "its chunks start first";
  EXPECT_LE(simulated_us(plan, cap), 1.15 * lower_bound_us(b, cap));
}

TEST(DecodePlan, SingleLongRequestIsSplitToFillTheWave) {
  const PlanCapacity cap = h200_decode(256);  // 4 CTAs per SM: 528 slots
  DecodePlanner planner(cap);
  Batch b(16, {32768});
  const Plan& plan = planner.plan(b.bsr(), b.qo_indptr.data());
  check_plan(plan, b, cap, planner);
  EXPECT_EQ(plan.split_rows, 8);
  EXPECT_GT(plan.num_tasks, 132) << "more CTAs than SMs";
  EXPECT_LE(plan.num_tasks, 528) << "one wave";
  // Each head's many chunks of 4 rows merge in two levels.
  EXPECT_GT(plan.merges.size(), 8u);
  EXPECT_LE(simulated_us(plan, cap), 1.25 * lower_bound_us(b, cap) + 2 * CostModel{}.merge_start_us);
}

TEST(DecodePlan, FewChunksMergeInOneLevel) {
  PlanCapacity cap = h200_decode(256);
  cap.ctas_per_sm = 2;
  DecodePlanner planner(cap);
  Batch b(16, {32768});  // 33 chunks of 4 rows per head: one CTA merges them sooner than a tree
  const Plan& plan = planner.plan(b.bsr(), b.qo_indptr.data());
  check_plan(plan, b, cap, planner);
  EXPECT_EQ(plan.num_tasks, 264);
  EXPECT_EQ(plan.merges.size(), 8u);
  SplitPolicy flat;
  flat.merge_tree = false;
  PlanCapacity gqa8 = cap;  // 1 KV head, group 8: 8 rows per partial
  gqa8.num_qo_heads = 8;
  gqa8.num_kv_heads = 1;
  DecodePlanner tree(gqa8), one_level(gqa8, flat);
  const Plan& t = tree.plan(b.bsr(), b.qo_indptr.data());
  check_plan(t, b, gqa8, tree);
  EXPECT_GT(t.merges.size(), 1u) << "many chunks of 8 rows merge in two levels";
  const double tree_us = simulated_us(t, gqa8);
  const Plan& o = one_level.plan(b.bsr(), b.qo_indptr.data());
  check_plan(o, b, gqa8, one_level);
  EXPECT_EQ(o.merges.size(), 1u);
  EXPECT_LT(tree_us, simulated_us(o, gqa8));
}

// Batches an engine meets, and adversarial ones: the step's makespan (the tests' own model of
// the plan, simulated_us) stays within 1.3x the lower bound plus a few fixed costs (the task
// start-ups and merges that any split plan pays, and one minimum chunk of tail), and never
// exceeds the unsplit plan's.
TEST(DecodePlan, MakespanNearTheLowerBoundOnSkewedAndAdversarialBatches) {
  std::mt19937 rng(11);
  auto uniform = [&](int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); };
  std::vector<std::pair<std::string, std::vector<int64_t>>> batches;
  {
    std::vector<int64_t> kv(63, 16);
    kv.insert(kv.begin() + 17, 65536);
    batches.push_back({"one huge among 63 tiny", kv});
  }
  batches.push_back({"all tiny", std::vector<int64_t>(256, 7)});
  batches.push_back({"all huge", std::vector<int64_t>(8, 65536)});
  {
    std::vector<int64_t> kv(100, 0);
    kv[5] = 20000;
    kv[50] = 3000;
    batches.push_back({"many empty", kv});
  }
  {
    std::vector<int64_t> kv;
    for (int i = 0; i < 28; ++i) kv.push_back(uniform(40, 900));
    kv.insert(kv.end(), {32768, 20000, 12000, 10000});
    std::shuffle(kv.begin(), kv.end(), rng);
    batches.push_back({"heavy tail (a few 10K-32K, median ~300)", kv});
  }
  {
    std::vector<int64_t> kv;
    for (int i = 0; i < 63; ++i) kv.push_back(uniform(16, 2048));
    kv.push_back(32768);
    batches.push_back({"one 32K among 63 of 16-2K", kv});
  }
  for (int trial = 0; trial < 12; ++trial) {  // Pareto tails (alpha 0.5), capped at 64K
    std::vector<int64_t> kv(1 + uniform(0, 200));
    for (auto& x : kv) {
      const double u = std::uniform_real_distribution<double>(0, 1)(rng);
      x = static_cast<int64_t>(std::min(65536.0, 16.0 * std::pow(1.0 - u, -2.0)));
    }
    batches.push_back({"heavy-tailed trial " + std::to_string(trial), kv});
  }
  for (int trial = 0; trial < 12; ++trial) {
    std::vector<int64_t> kv(1 + uniform(0, 40));
    for (auto& x : kv) x = uniform(1, 20000);
    batches.push_back({"uniform random trial " + std::to_string(trial), kv});
  }
  SplitPolicy never;
  never.min_chunk_tokens = 1 << 30;
  for (int32_t kv_heads : {8, 1}) {
    PlanCapacity cap = h200_decode(256);
    cap.ctas_per_sm = 2;  // hd128 on an H200
    cap.num_kv_heads = kv_heads;
    cap.num_qo_heads = 8 * kv_heads;
    const CostModel cost;
    const double slot_us_per_token = 4.0 * cap.head_dim / (cost.sm_read_bytes_per_us / cap.ctas_per_sm);  // full wave
    for (const auto& [name, kv] : batches) {
      SCOPED_TRACE(name + ", " + std::to_string(kv_heads) + " KV heads");
      Batch b(16, kv);
      DecodePlanner planner(cap), unsplit(cap, never);
      const Plan& plan = planner.plan(b.bsr(), b.qo_indptr.data());
      check_plan(plan, b, cap, planner);
      const double us = simulated_us(plan, cap), lb = lower_bound_us(b, cap);
      const double fixed = 2 * cost.task_start_us + 2 * cost.merge_start_us + 256 * slot_us_per_token;
      EXPECT_LE(us, 1.3 * lb + fixed) << "lower bound " << lb << " us";
      const double unsplit_us = simulated_us(unsplit.plan(b.bsr(), b.qo_indptr.data()), cap);
      EXPECT_LE(us, unsplit_us * 1.0001) << "splitting made the step longer";
      if (getenv("PLAN_RATIOS")) printf("%-45s h%d  sim %8.1f  lb %8.1f  ratio %.3f  unsplit %8.1f  est %8.1f\n", name.c_str(), kv_heads, us, lb, us / lb, unsplit_us, plan.estimated_us);
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
  check_plan(plan, b, cap, planner);
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
    check_plan(plan, b, cap, planner);
    EXPECT_EQ(plan.shape, has_shape ? CtaShape::kOneCtaPerSm : CtaShape::kDefault);
    EXPECT_EQ(plan.chunk_tokens, has_shape ? 0 : 4096);
    EXPECT_EQ(plan.num_tasks, has_shape ? 128 : 256);
    EXPECT_EQ(plan.wave_ctas, has_shape ? 132 : 264);
    EXPECT_EQ(plan.merges.size(), has_shape ? 0u : 128u);
  }
}

TEST(DecodePlan, OneCtaPerSmOnlyWhereItsMakespanIsNoWorse) {
  const PlanCapacity cap = h200_decode_two_shapes(256);
  struct Expect {
    std::vector<int64_t> kv_len;
    CtaShape shape;
    int32_t chunk_tokens;
  };
  std::vector<int64_t> skewed(16, 2048);
  skewed[3] = 32768;
  const std::vector<Expect> cases = {
      // One request: 33 chunks of 1008 on 264 slots; the one-per-SM list would split too, and a
      // split list keeps the default shape unless the capacity says otherwise.
      {{32768}, CtaShape::kDefault, 1008},
      // 9 x 8192 = 72 items: unsplit on 72 SMs loses to 3 chunks each, 216 CTAs in one round;
      // 7 chunks in two rounds are estimated within 2% of it and ran 4.5% slower (H200).
      {std::vector<int64_t>(9, 8192), CtaShape::kDefault, 2736},
      // 17 x 8192 = 136 items overfill the 132 SMs: 3 chunks each, 408 tasks in 2 rounds.
      {std::vector<int64_t>(17, 8192), CtaShape::kDefault, 2736},
      // 64 x 4096 = 512 items overfill both waves: never split, default shape.
      {std::vector<int64_t>(64, 4096), CtaShape::kDefault, 0},
      // One long request among short ones: it is split, the short ones fill in.
      {skewed, CtaShape::kDefault, 1824},
  };
  for (const Expect& e : cases) {
    Batch b(16, e.kv_len);
    DecodePlanner planner(cap);
    const Plan& plan = planner.plan(b.bsr(), b.qo_indptr.data());
    SCOPED_TRACE(::testing::Message() << e.kv_len.size() << " requests, longest "
                                      << *std::max_element(e.kv_len.begin(), e.kv_len.end()));
    check_plan(plan, b, cap, planner);
    EXPECT_EQ(plan.shape, e.shape);
    EXPECT_EQ(plan.chunk_tokens, e.chunk_tokens);
    EXPECT_EQ(plan.wave_ctas, e.shape == CtaShape::kOneCtaPerSm ? 132 : 264);
  }
}

TEST(DecodePlan, OneCtaPerSmForSplitListsWhereTheCapacitySaysItPays) {
  PlanCapacity cap = h200_decode_two_shapes(256);
  cap.head_dim = 256;
  cap.one_cta_per_sm_use = OneCtaPerSmUse::kAlsoSplitLists;
  DecodePlanner planner(cap);
  Batch one(16, {32768});
  const Plan& plan = planner.plan(one.bsr(), one.qo_indptr.data());
  check_plan(plan, one, cap, planner);
  EXPECT_EQ(plan.shape, CtaShape::kOneCtaPerSm);
  EXPECT_EQ(plan.chunk_tokens, 2048);  // 8 heads x 16 chunks = 128 <= 132 CTAs
  EXPECT_EQ(plan.num_tasks, 128);
  // Still not where its longest task would be worse: 9 x 8192 stays on the default shape.
  Batch nine(16, std::vector<int64_t>(9, 8192));
  EXPECT_EQ(planner.plan(nine.bsr(), nine.qo_indptr.data()).shape, CtaShape::kDefault);
}

TEST(DecodePlan, OneKvHeadBatchesTakeTheOneCtaPerSmShapeWheneverTheyFitIt) {
  // One KV head, group 8 (BatchDecoder's capacity there): every batch whose unsplit items fit
  // the 132 SMs plans in the one-CTA-per-SM shape, split or not; 133 requests cannot, and plan
  // in the default shape.
  PlanCapacity cap = h200_decode_two_shapes(256);
  cap.num_kv_heads = 1;
  cap.num_qo_heads = 8;
  cap.one_cta_per_sm_use = OneCtaPerSmUse::kWheneverItFits;
  DecodePlanner planner(cap);
  std::vector<int64_t> skewed(64, 300);
  skewed[5] = 65536;
  skewed[40] = 16;
  const std::vector<std::vector<int64_t>> fitting = {
      {32768}, {131072}, std::vector<int64_t>(8, 4096), std::vector<int64_t>(16, 8192), skewed,
      std::vector<int64_t>(132, 2048), std::vector<int64_t>(100, 7), {0, 5000, 0}};
  for (const std::vector<int64_t>& kv : fitting) {
    Batch b(16, kv);
    const Plan& plan = planner.plan(b.bsr(), b.qo_indptr.data());
    check_plan(plan, b, cap, planner);
    EXPECT_EQ(plan.shape, CtaShape::kOneCtaPerSm) << kv.size() << " requests";
    EXPECT_EQ(plan.wave_ctas, 132);
  }
  Batch over(16, std::vector<int64_t>(133, 2048));
  const Plan& plan = planner.plan(over.bsr(), over.qo_indptr.data());
  check_plan(plan, over, cap, planner);
  EXPECT_EQ(plan.shape, CtaShape::kDefault);
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
  check_plan(plan, overfills, cap, planner);
  EXPECT_EQ(plan.shape, CtaShape::kOneCtaPerSm);
  EXPECT_EQ(plan.wave_ctas, 132);
  EXPECT_LE(plan.num_tasks, planner.max_work_items());
  // Overfilled and skewed: the long request is split to the average load of the smaller wave.
  std::vector<int64_t> skewed(200, 1024);
  skewed[11] = 131072;
  Batch skew(16, skewed);
  const Plan& split = planner.plan(skew.bsr(), skew.qo_indptr.data());
  check_plan(split, skew, cap, planner);
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
    check_plan(plan, b, cap, planner);
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
  check_plan(plan, b, cap, planner);
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

TEST(DecodePlan, ErrorsNameTheOwningEntryPoint) {
  PlanCapacity cap = h200_decode(4);
  DecodePlanner planner(cap, {}, "BatchDecoder");
  Batch big(16, {10, 10, 10, 10, 10});
  try {
    planner.plan(big.bsr(), big.qo_indptr.data());
    ADD_FAILURE() << "expected an error";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("tessera::BatchDecoder::plan: argument 'kv_indptr'"));
  }
  cap.max_batch_size = (1 << 20) + 1;  // past the planner's limit: an argument error, no bad_alloc
  try {
    DecodePlanner huge(cap, {}, "BatchDecoder");
    ADD_FAILURE() << "expected an error";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("tessera::BatchDecoder: argument 'max_batch_size'"));
  }
}

// The shared plan checker is not vacuous: plans broken on purpose fail it.
TEST(DecodePlan, CheckerCatchesBrokenPlans) {
  const PlanCapacity cap = h200_decode(8);
  DecodePlanner planner(cap);
  Batch b(16, {40000, 300, 7});
  const Plan& plan = planner.plan(b.bsr(), b.qo_indptr.data());
  ASSERT_EQ(testing_support::check_decode_plan(plan, b.bsr(), b.qo_indptr.data(), cap, planner), "");
  ASSERT_FALSE(plan.merges.empty());
  Plan broken = plan;
  broken.merges[0].num_slots -= 1;
  EXPECT_NE(testing_support::check_decode_plan(broken, b.bsr(), b.qo_indptr.data(), cap, planner), "");
  broken = plan;
  broken.slot_row_offset.back() += 1;
  EXPECT_NE(testing_support::check_decode_plan(broken, b.bsr(), b.qo_indptr.data(), cap, planner), "");
  broken = plan;
  broken.split_rows += 1;
  EXPECT_NE(testing_support::check_decode_plan(broken, b.bsr(), b.qo_indptr.data(), cap, planner), "");
  Batch longer(16, {40016, 300, 7});  // the same plan no longer covers the first request's keys
  EXPECT_NE(testing_support::check_decode_plan(plan, longer.bsr(), longer.qo_indptr.data(), cap, planner), "");
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

// The page-id check (a vectorised range pass, then a search for the message): the first id outside
// the cache is the one named, wherever it lies and whichever side it is on, and ids past the
// table's last entry are never read.
TEST(BsrLayout, PageIdCheckNamesTheFirstIdOutsideTheCache) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 200; ++trial) {
    const int32_t rows = 1 + int32_t(rng() % 40), pages = 1 + int32_t(rng() % 500);
    std::vector<int32_t> indptr{0}, last;
    for (int32_t r = 0; r < rows; ++r) {
      indptr.push_back(indptr.back() + int32_t(rng() % 9));
      last.push_back(1 + int32_t(rng() % 16));
    }
    const int32_t n = indptr.back();
    std::vector<int32_t> ids(size_t(n) + 8, -5);  // (past the end: outside the cache, never read)
    for (int32_t i = 0; i < n; ++i) ids[size_t(i)] = int32_t(rng() % uint32_t(pages));
    const auto bsr = format::bsr_from_page_table(16, rows, indptr.data(), ids.data(), last.data());
    ASSERT_EQ(format::check_bsr(bsr, pages), "") << "trial " << trial;
    if (n == 0) continue;
    int32_t first = n;
    for (int bad = 0; bad < 1 + int(rng() % 3); ++bad) {
      const int32_t at = int32_t(rng() % uint32_t(n));
      ids[size_t(at)] = rng() % 2 ? -1 - int32_t(rng() % 100) : pages + int32_t(rng() % 100);
      first = std::min(first, at);
    }
    EXPECT_THAT(format::check_bsr(bsr, pages),
                HasSubstr("page id " + std::to_string(ids[size_t(first)]) + " at index " + std::to_string(first) + " "))
        << "trial " << trial;
    EXPECT_EQ(format::check_bsr(bsr, -1), "") << "trial " << trial;  // (ids not checked)
  }
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
  EXPECT_GE(l.plan_bytes - l.merge_counters, size_t(planner.max_merges()) * sizeof(int32_t));
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

namespace tessera::plan {
namespace {

// The batch-invariance tests' capacity (an H200 at hd128, both CTA shapes) and request 0 (20K keys)
// alone, beside 63 short ones (one of them 4100 keys), and beside 3 other long ones.
PlanCapacity invariance_capacity() {
  PlanCapacity c = h200_decode(64);
  c.ctas_per_sm = 2;
  c.one_cta_per_sm_shape = true;
  return c;
}
std::vector<Batch> invariance_batches() {
  std::vector<int64_t> crowd_len(64, 300);
  crowd_len[0] = 20000;
  crowd_len[7] = 4100;
  return {Batch(16, {20000}), Batch(16, crowd_len), Batch(16, {20000, 18000, 17000, 9000})};
}

// Batch-invariant plans (SplitPolicy::split = false, shape pinned): a request's work items are the
// same in any batch, while the default policy plans the same request differently by batch (so
// the test can tell the modes apart).
TEST(DecodePlan, BatchInvariantPlansGiveARequestTheSameItemsInEveryBatch) {
  const PlanCapacity cap = invariance_capacity();
  const std::vector<Batch> batches = invariance_batches();
  const Batch &alone = batches[0], &crowd = batches[1], &long_ones = batches[2];
  auto items_of_request0 = [](const Plan& p) {
    std::vector<std::pair<int32_t, int32_t>> ranges;
    for (const WorkItem& w : p.work)
      if (w.request == 0) ranges.push_back({w.kv_begin, w.kv_end});
    std::sort(ranges.begin(), ranges.end());
    return ranges;
  };
  SplitPolicy invariant;
  invariant.split = false;
  DecodePlanner fixed(cap, invariant);
  fixed.pin_shape(CtaShape::kDefault);
  DecodePlanner balanced(cap);
  std::vector<std::vector<std::pair<int32_t, int32_t>>> fixed_items, balanced_items;
  std::vector<CtaShape> fixed_shapes;
  for (const Batch* b : {&alone, &crowd, &long_ones}) {
    const Plan& f = fixed.plan(b->bsr(), b->qo_indptr.data());
    check_plan(f, *b, cap, fixed);
    fixed_items.push_back(items_of_request0(f));
    fixed_shapes.push_back(f.shape);
    const Plan& d = balanced.plan(b->bsr(), b->qo_indptr.data());
    balanced_items.push_back(items_of_request0(d));
  }
  for (size_t i = 0; i < fixed_items.size(); ++i) {
    EXPECT_EQ(fixed_items[i], fixed_items[0]) << "batch " << i;
    EXPECT_EQ(fixed_shapes[i], CtaShape::kDefault) << "batch " << i;
  }
  ASSERT_EQ(fixed_items[0].size(), 1u);  // one item: all 20000 keys
  EXPECT_EQ(fixed_items[0][0], std::make_pair(0, 20000));
  // The balancing planner splits the lone request and plans it differently in the crowd.
  EXPECT_GT(balanced_items[0].size(), 1u);
  EXPECT_NE(balanced_items[0], balanced_items[2]);
}


// Batch-invariant plans with a fixed chunk (SplitPolicy::fixed_chunk_tokens, shape pinned): a long
// request splits into the same chunks, merged the same way, alone and in any crowd; a step
// needing more chunk partials than the workspace holds is refused, naming the capacity.
TEST(DecodePlan, FixedChunkPlansGiveARequestTheSameChunksInEveryBatch) {
  const PlanCapacity cap = invariance_capacity();
  const std::vector<Batch> batches = invariance_batches();
  const Batch &alone = batches[0], &crowd = batches[1], &long_ones = batches[2];
  SplitPolicy invariant;
  invariant.fixed_chunk_tokens = 2048;
  invariant.max_chunk_partials = 4096;
  DecodePlanner fixed(cap, invariant);
  fixed.pin_shape(CtaShape::kDefault);
  struct Request0 {
    std::vector<std::pair<int32_t, int32_t>> ranges;
    std::vector<std::pair<int32_t, int32_t>> merges;  // (slots merged, output slot or -1) per merge row
    bool operator==(const Request0& o) const { return ranges == o.ranges && merges == o.merges; }
  };
  std::vector<Request0> seen;
  for (const Batch* b : {&alone, &crowd, &long_ones}) {
    const Plan& f = fixed.plan(b->bsr(), b->qo_indptr.data());
    check_plan(f, *b, cap, fixed);
    EXPECT_EQ(f.shape, CtaShape::kDefault);
    Request0 r;
    for (const WorkItem& w : f.work)
      if (w.request == 0) r.ranges.push_back({w.kv_begin, w.kv_end});
    for (const MergeRow& m : f.merges)
      if (m.request == 0) r.merges.push_back({m.num_slots, m.target_slot < 0 ? -1 : 1});
    std::sort(r.ranges.begin(), r.ranges.end());
    seen.push_back(r);
  }
  ASSERT_EQ(seen[0].ranges.size(), 10u);  // 20000 keys in 10 balanced chunks of <= 2048
  for (const auto& range : seen[0].ranges) EXPECT_LE(range.second - range.first, 2048);
  EXPECT_EQ(seen[0].ranges.back().second, 20000);
  for (size_t i = 1; i < seen.size(); ++i) EXPECT_TRUE(seen[i] == seen[0]) << "batch " << i;
  // The capacity: 4 long requests need (10 + 9 + 9 + 5) x 8 = 264 partials at most; 200 is refused.
  invariant.max_chunk_partials = 200;
  DecodePlanner small(cap, invariant);
  small.pin_shape(CtaShape::kDefault);
  try {
    small.plan(long_ones.bsr(), long_ones.qo_indptr.data());
    ADD_FAILURE() << "a step over the chunk capacity was planned";
  } catch (const tessera::Error& e) {
    EXPECT_NE(std::string(e.what()).find("batch_invariant_max_chunks"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace tessera::plan
