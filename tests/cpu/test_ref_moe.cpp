// The fp64 MoE reference: routing against a brute-force sort, grouped top-k and bias semantics,
// the SwiGLU expert against its formula written out, and the layer against the explicit sum.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <set>
#include <stdexcept>
#include <utility>
#include <vector>

#include "reference/attention_ref.h"  // round_to_mantissa
#include "reference/moe_ref.h"

namespace tessera::ref {
namespace {

constexpr double kTol = 1e-12;

std::vector<float> random_floats(size_t n, std::mt19937& rng, float lo, float hi) {
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> x(n);
  for (float& e : x) e = dist(rng);
  return x;
}

std::vector<double> scores_of(const float* logits, int num_experts, RouterScore kind) {
  std::vector<double> s(num_experts);
  double sum = 0.0;
  for (int e = 0; e < num_experts; ++e) {
    s[e] = kind == RouterScore::kSoftmax ? std::exp(double(logits[e]))  // small logits: no shift
                                         : 1.0 / (1.0 + std::exp(-double(logits[e])));
    sum += s[e];
  }
  if (kind == RouterScore::kSoftmax) {
    for (double& x : s) x /= sum;
  }
  return s;
}

// Ids of `pool` ranked by decreasing key, ties toward the lower id: sort (-key, id) pairs.
std::vector<int> ranked(const std::vector<int>& pool, const std::vector<double>& key) {
  std::vector<std::pair<double, int>> order;
  for (int e : pool) order.push_back({-key[e], e});
  std::sort(order.begin(), order.end());
  std::vector<int> ids;
  for (const auto& entry : order) ids.push_back(entry.second);
  return ids;
}

// The groups a DeepSeek-V3 router keeps: the best topk_groups by the sum of their two largest
// biased scores.
std::set<int> kept_groups(const std::vector<double>& biased, const RouterParams& p) {
  const int size = p.num_experts / p.num_groups;
  std::vector<double> group_score(p.num_groups);
  std::vector<int> groups(p.num_groups);
  for (int g = 0; g < p.num_groups; ++g) {
    groups[g] = g;
    std::vector<double> members(biased.begin() + g * size, biased.begin() + (g + 1) * size);
    const auto best = std::max_element(members.begin(), members.end());
    const double first = *best;
    members.erase(best);
    group_score[g] = first + *std::max_element(members.begin(), members.end());
  }
  const std::vector<int> order = ranked(groups, group_score);
  return std::set<int>(order.begin(), order.begin() + p.topk_groups);
}

// Brute-force routing of one token: rank every allowed expert, take the first top_k.
void brute_force_route(const float* logits, const RouterParams& p, std::vector<int32_t>& expert,
                       std::vector<double>& weight) {
  const std::vector<double> score = scores_of(logits, p.num_experts, p.score);
  std::vector<double> biased = score;
  for (size_t e = 0; e < p.selection_bias.size(); ++e) biased[e] += p.selection_bias[e];
  std::vector<int> pool;
  const std::set<int> groups = p.num_groups > 1 ? kept_groups(biased, p) : std::set<int>{};
  for (int e = 0; e < p.num_experts; ++e) {
    if (p.num_groups <= 1 || groups.count(e / (p.num_experts / p.num_groups))) pool.push_back(e);
  }
  const std::vector<int> order = ranked(pool, biased);
  expert.assign(order.begin(), order.begin() + p.top_k);
  weight.clear();
  double sum = 0.0;
  for (int e : expert) sum += score[e];
  for (int e : expert) weight.push_back(score[e] / (p.renormalize ? sum : 1.0) * p.routed_scaling);
}

void expect_matches_brute_force(const std::vector<float>& logits, int64_t tokens,
                                const RouterParams& p) {
  const Routing got = route(logits.data(), tokens, p);
  ASSERT_EQ(got.expert.size(), size_t(tokens * p.top_k));
  ASSERT_EQ(got.weight.size(), size_t(tokens * p.top_k));
  double worst = 0.0;
  for (int64_t t = 0; t < tokens; ++t) {
    std::vector<int32_t> expert;
    std::vector<double> weight;
    brute_force_route(logits.data() + t * p.num_experts, p, expert, weight);
    const std::vector<int32_t> got_expert(got.expert.begin() + t * p.top_k,
                                          got.expert.begin() + (t + 1) * p.top_k);
    EXPECT_EQ(got_expert, expert) << "token " << t;
    for (int k = 0; k < p.top_k; ++k) {
      worst = std::max(worst, std::abs(got.weight[t * p.top_k + k] - weight[k]));
    }
  }
  EXPECT_LE(worst, kTol);
}

RouterParams router(int num_experts, int top_k, RouterScore score) {
  RouterParams p;
  p.num_experts = num_experts;
  p.top_k = top_k;
  p.score = score;
  return p;
}

// ---- routing ---------------------------------------------------------------------------------

TEST(RefMoE, RouteSoftmaxTopKMatchesSort) {
  std::mt19937 rng(301);
  const int tokens = 37, experts = 16;
  const std::vector<float> logits = random_floats(tokens * experts, rng, -3, 3);
  expect_matches_brute_force(logits, tokens, router(experts, 4, RouterScore::kSoftmax));
}

TEST(RefMoE, RouteSigmoidTopKMatchesSort) {
  std::mt19937 rng(302);
  const int tokens = 37, experts = 16;
  const std::vector<float> logits = random_floats(tokens * experts, rng, -3, 3);
  RouterParams p = router(experts, 6, RouterScore::kSigmoid);
  p.routed_scaling = 2.5;
  expect_matches_brute_force(logits, tokens, p);
}

TEST(RefMoE, TiesBreakTowardLowerId) {
  const std::vector<float> logits = {0.5f, 2.0f, 2.0f, -1.0f, 2.0f, 0.5f, 0.5f, 0.5f};
  const Routing r = route(logits.data(), 1, router(8, 5, RouterScore::kSoftmax));
  EXPECT_EQ(r.expert, (std::vector<int32_t>{1, 2, 4, 0, 5}));
}

TEST(RefMoE, RenormalizeSumsToRoutedScaling) {
  std::mt19937 rng(303);
  const int tokens = 21, experts = 12, top_k = 3;
  const std::vector<float> logits = random_floats(tokens * experts, rng, -3, 3);
  for (RouterScore kind : {RouterScore::kSoftmax, RouterScore::kSigmoid}) {
    RouterParams p = router(experts, top_k, kind);
    p.routed_scaling = 2.5;
    const Routing raw = route(logits.data(), tokens, p);
    p.renormalize = true;
    const Routing norm = route(logits.data(), tokens, p);
    EXPECT_EQ(norm.expert, raw.expert);
    for (int t = 0; t < tokens; ++t) {
      double sum = 0.0, raw_sum = 0.0;
      for (int k = 0; k < top_k; ++k) {
        sum += norm.weight[t * top_k + k];
        raw_sum += raw.weight[t * top_k + k];
      }
      EXPECT_NEAR(sum, 2.5, kTol) << "token " << t;
      for (int k = 0; k < top_k; ++k) {  // same proportions as without renormalising
        EXPECT_NEAR(norm.weight[t * top_k + k], raw.weight[t * top_k + k] * 2.5 / raw_sum, kTol);
      }
    }
    expect_matches_brute_force(logits, tokens, p);
  }
}

TEST(RefMoE, GroupedTopKPicksOnlyFromKeptGroups) {
  // 8 experts in 4 groups of 2; keep 2 groups, choose 2 experts. Expert 0 is the single best,
  // but its partner is poor, so group 0 (top-2 sum ~1.0) loses to groups 1 (~1.76) and 2 (~1.64).
  const std::vector<float> logits = {5, -5, 2, 2, 1.5f, 1.5f, -1, -1};
  RouterParams p = router(8, 2, RouterScore::kSigmoid);
  const Routing flat = route(logits.data(), 1, p);
  EXPECT_EQ(flat.expert, (std::vector<int32_t>{0, 2}));
  p.num_groups = 4;
  p.topk_groups = 2;
  const Routing grouped = route(logits.data(), 1, p);
  EXPECT_EQ(grouped.expert, (std::vector<int32_t>{2, 3}));
  EXPECT_NEAR(grouped.weight[0], 1.0 / (1.0 + std::exp(-2.0)), kTol);
  p.top_k = 4;  // exactly the experts of the kept groups; expert 0 still excluded
  EXPECT_EQ(route(logits.data(), 1, p).expert, (std::vector<int32_t>{2, 3, 4, 5}));
  p.top_k = 2;
  p.topk_groups = 3;  // group 0 (~1.0) now beats group 3 (~0.54) and expert 0 is back
  EXPECT_EQ(route(logits.data(), 1, p).expert, (std::vector<int32_t>{0, 2}));
}

TEST(RefMoE, GroupedTopKMatchesBruteForce) {
  std::mt19937 rng(304);
  const int tokens = 29, experts = 32;
  const std::vector<float> logits = random_floats(tokens * experts, rng, -3, 3);
  RouterParams p = router(experts, 6, RouterScore::kSigmoid);
  p.num_groups = 8;
  p.topk_groups = 3;
  p.renormalize = true;
  p.routed_scaling = 2.5;
  std::uniform_real_distribution<double> bias(-0.3, 0.3);
  for (int e = 0; e < experts; ++e) p.selection_bias.push_back(bias(rng));
  expect_matches_brute_force(logits, tokens, p);

  // Every chosen expert lies in a kept group, computed independently.
  const Routing r = route(logits.data(), tokens, p);
  for (int t = 0; t < tokens; ++t) {
    std::vector<double> biased = scores_of(logits.data() + t * experts, experts, p.score);
    for (int e = 0; e < experts; ++e) biased[e] += p.selection_bias[e];
    const std::set<int> kept = kept_groups(biased, p);
    for (int k = 0; k < p.top_k; ++k) {
      EXPECT_TRUE(kept.count(r.expert[t * p.top_k + k] / (experts / p.num_groups)))
          << "token " << t << " slot " << k;
    }
  }
}

TEST(RefMoE, BiasChangesSelectionNotWeights) {
  const std::vector<float> logits = {2, 1, 0, -1};
  RouterParams p = router(4, 2, RouterScore::kSoftmax);
  EXPECT_EQ(route(logits.data(), 1, p).expert, (std::vector<int32_t>{0, 1}));
  p.selection_bias = {0, 0, 0, 10};  // lifts the weakest expert to the top of the selection
  const Routing r = route(logits.data(), 1, p);
  EXPECT_EQ(r.expert, (std::vector<int32_t>{3, 0}));
  const double sum = std::exp(2.0) + std::exp(1.0) + 1.0 + std::exp(-1.0);
  EXPECT_NEAR(r.weight[0], std::exp(-1.0) / sum, kTol);  // the unbiased softmax score
  EXPECT_NEAR(r.weight[1], std::exp(2.0) / sum, kTol);

  std::mt19937 rng(305);
  const int tokens = 25, experts = 10;
  const std::vector<float> many = random_floats(tokens * experts, rng, -2, 2);
  RouterParams q = router(experts, 3, RouterScore::kSoftmax);
  std::uniform_real_distribution<double> bias(-0.2, 0.2);
  for (int e = 0; e < experts; ++e) q.selection_bias.push_back(bias(rng));
  expect_matches_brute_force(many, tokens, q);
}

// ---- experts and the layer -------------------------------------------------------------------

double silu(double g) { return g / (1.0 + std::exp(-g)); }

TEST(RefMoE, SwigluMatchesHandFormula) {
  {  // hidden = inter = 1: y = silu(x wg) (x wu) wd
    const float x = 2, w_gate_up[2] = {1, 3}, w_down = 0.5f;
    double y;
    swiglu_expert(&x, w_gate_up, &w_down, 1, 1, &y);
    EXPECT_NEAR(y, silu(2.0) * 6.0 * 0.5, kTol);
  }
  // hidden = 2, inter = 2, every term written out.
  std::mt19937 rng(306);
  const std::vector<float> x = random_floats(2, rng, -1, 1);
  const std::vector<float> w = random_floats(2 * 4, rng, -1, 1);  // [hidden][g0 g1 u0 u1]
  const std::vector<float> d = random_floats(2 * 2, rng, -1, 1);  // [inter][hidden]
  const double g0 = x[0] * double(w[0]) + x[1] * double(w[4]);
  const double g1 = x[0] * double(w[1]) + x[1] * double(w[5]);
  const double u0 = x[0] * double(w[2]) + x[1] * double(w[6]);
  const double u1 = x[0] * double(w[3]) + x[1] * double(w[7]);
  const double h0 = silu(g0) * u0, h1 = silu(g1) * u1;
  double y[2];
  swiglu_expert(x.data(), w.data(), d.data(), 2, 2, y);
  EXPECT_NEAR(y[0], h0 * d[0] + h1 * d[2], kTol);
  EXPECT_NEAR(y[1], h0 * d[1] + h1 * d[3], kTol);
}

TEST(RefMoE, SwigluSaturatedGateStaysFinite) {
  const float x = 1, w_gate_up[2] = {-800, 1}, w_down = 1;  // e^800 overflows: silu -> -0
  double y;
  swiglu_expert(&x, w_gate_up, &w_down, 1, 1, &y);
  EXPECT_EQ(y, 0.0);
}

TEST(RefMoE, MoeLayerEqualsExplicitSum) {
  std::mt19937 rng(307);
  const int tokens = 5, hidden = 8, inter = 4, experts = 6, top_k = 2;
  const std::vector<float> x = random_floats(tokens * hidden, rng, -1, 1);
  const std::vector<float> w_gate_up = random_floats(experts * hidden * 2 * inter, rng, -1, 1);
  const std::vector<float> w_down = random_floats(experts * inter * hidden, rng, -1, 1);
  const std::vector<float> logits = random_floats(tokens * experts, rng, -2, 2);
  RouterParams p = router(experts, top_k, RouterScore::kSoftmax);
  p.renormalize = true;
  const Routing routing = route(logits.data(), tokens, p);

  std::vector<double> y;
  moe_layer(x.data(), tokens, hidden, inter, w_gate_up.data(), w_down.data(), routing, top_k, y);
  ASSERT_EQ(y.size(), size_t(tokens * hidden));
  double worst = 0.0;
  std::vector<double> part(hidden);
  for (int t = 0; t < tokens; ++t) {
    std::vector<double> want(hidden, 0.0);
    for (int k = 0; k < top_k; ++k) {
      const int e = routing.expert[t * top_k + k];
      swiglu_expert(x.data() + t * hidden, w_gate_up.data() + e * hidden * 2 * inter,
                    w_down.data() + e * inter * hidden, hidden, inter, part.data());
      for (int c = 0; c < hidden; ++c) want[c] += routing.weight[t * top_k + k] * part[c];
    }
    for (int c = 0; c < hidden; ++c) worst = std::max(worst, std::abs(y[t * hidden + c] - want[c]));
  }
  EXPECT_LE(worst, kTol);
  EXPECT_GT(std::abs(y[0]), 0.0);  // the sum is not trivially zero
}

// The permutation, worked by hand: 3 tokens x top-2 over 3 experts, segments aligned to 4, one id
// dropped (-1) and one out of range (7).
TEST(RefMoe, PermuteByHand) {
  // (t0: e1, e0) (t1: e1, -1) (t2: e2, 7)
  const std::vector<int32_t> ids = {1, 0, 1, -1, 2, 7};
  const Permutation p = permute(ids.data(), 3, 2, 3, 4, 20);
  // counts 1, 2, 1 -> padded 4, 4, 4
  EXPECT_EQ(p.offsets, (std::vector<int32_t>{0, 4, 8, 12}));
  std::vector<int32_t> tokens(20, -1);
  tokens[0] = 0;                // expert 0: t0
  tokens[4] = 0;                // expert 1: t0, then t1
  tokens[5] = 1;
  tokens[8] = 2;                // expert 2: t2
  EXPECT_EQ(p.permuted_token, tokens);
  EXPECT_EQ(p.inverse, (std::vector<int32_t>{4, 0, 5, -1, 8, -1}));
  // Without alignment the segments are packed; empty experts have empty segments.
  const Permutation q = permute(ids.data(), 3, 2, 5, 1, 4);
  EXPECT_EQ(q.offsets, (std::vector<int32_t>{0, 1, 3, 4, 4, 4}));
  EXPECT_THROW(permute(ids.data(), 3, 2, 3, 4, 11), std::invalid_argument);  // capacity below 12 rows
}

// ---- the grouped GEMM, the combine and their naive 16-bit versions ------------------------------

// w[e] = (e + 1) x identity: every row in expert e's segment comes out scaled by e + 1; the empty
// expert and the rows outside every segment (a leading gap and a tail) stay 0.
TEST(RefMoeGroupedGemm, IdentityWeightsScaleEachSegment) {
  const int k = 8, n = 8, experts = 3;
  const int64_t rows = 11;
  const std::vector<int32_t> offsets = {2, 5, 5, 9};  // rows 0-1 before, 9-10 after; expert 1 empty
  std::mt19937 rng(401);
  const std::vector<float> a = random_floats(rows * k, rng, -1, 1);
  std::vector<float> w(experts * n * k, 0.f);
  for (int e = 0; e < experts; ++e) {
    for (int j = 0; j < n; ++j) w[(e * n + j) * k + j] = float(e + 1);
  }
  std::vector<double> out;
  grouped_gemm(a.data(), rows, k, w.data(), experts, n, offsets.data(), false, out);
  ASSERT_EQ(out.size(), size_t(rows * n));
  for (int64_t r = 0; r < rows; ++r) {
    const int scale = r < 2 ? 0 : r < 5 ? 1 : r < 9 ? 3 : 0;
    for (int j = 0; j < n; ++j) EXPECT_EQ(out[r * n + j], scale * double(a[r * k + j])) << r << ", " << j;
  }
}

TEST(RefMoeGroupedGemm, HandWorkedProducts) {
  // One expert, w's rows are the output columns: out = a w^T.
  const std::vector<float> a = {1, 2, 3, 4};         // [2, 2]
  const std::vector<float> w = {1, 0, 1, 1, -2, 5};  // [1, 3, 2]
  const std::vector<int32_t> offsets = {0, 2};
  std::vector<double> out;
  grouped_gemm(a.data(), 2, 2, w.data(), 1, 3, offsets.data(), false, out);
  EXPECT_EQ(out, (std::vector<double>{1, 3, 8, 3, 7, 14}));
  // Two experts, one row each: each row meets its own expert's weights.
  const std::vector<float> w2 = {1, 0, 0, 1, 0, 1, 1, 0};  // expert 0 identity, expert 1 swap
  const std::vector<int32_t> two = {0, 1, 2};
  grouped_gemm(a.data(), 2, 2, w2.data(), 2, 2, two.data(), false, out);
  EXPECT_EQ(out, (std::vector<double>{1, 2, 4, 3}));
}

TEST(RefMoeGroupedGemm, SwigluOnKnownValues) {
  // k = 1, a = 1: the accumulators are w's rows; n = 6: gates (0, 2, -3), ups (5, 3, 0.5).
  const float a = 1;
  const std::vector<float> w = {0, 2, -3, 5, 3, 0.5f};
  const std::vector<int32_t> offsets = {0, 1};
  std::vector<double> out;
  grouped_gemm(&a, 1, 1, w.data(), 1, 6, offsets.data(), true, out);
  ASSERT_EQ(out.size(), 3u);
  EXPECT_EQ(out[0], 0.0);  // silu(0) = 0
  EXPECT_NEAR(out[1], 2.0 / (1.0 + std::exp(-2.0)) * 3.0, kTol);
  EXPECT_NEAR(out[2], -3.0 / (1.0 + std::exp(3.0)) * 0.5, kTol);
  // A gate far below zero saturates to -0 without overflow trouble.
  const std::vector<float> sat = {-800, 1};
  grouped_gemm(&a, 1, 1, sat.data(), 1, 2, offsets.data(), true, out);
  EXPECT_EQ(out[0], 0.0);
}

TEST(RefMoeGroupedGemm, EqualsPerExpertTripleLoop) {
  std::mt19937 rng(402);
  const int k = 24, n = 16, experts = 5;
  const std::vector<int32_t> offsets = {1, 4, 4, 11, 12, 20};
  const int64_t rows = 23;
  const std::vector<float> a = random_floats(rows * k, rng, -1, 1);
  const std::vector<float> w = random_floats(experts * n * k, rng, -1, 1);
  for (bool swiglu : {false, true}) {
    std::vector<double> out;
    grouped_gemm(a.data(), rows, k, w.data(), experts, n, offsets.data(), swiglu, out);
    const int cols = swiglu ? n / 2 : n;
    ASSERT_EQ(out.size(), size_t(rows * cols));
    for (int64_t r = 0; r < rows; ++r) {
      int e = -1;
      for (int x = 0; x < experts; ++x) {
        if (r >= offsets[x] && r < offsets[x + 1]) e = x;
      }
      for (int j = 0; j < cols; ++j) {
        auto dot = [&](int col) {
          double s = 0;
          for (int i = 0; i < k; ++i) s += double(a[r * k + i]) * w[(e * n + col) * k + i];
          return s;
        };
        const double want = e < 0 ? 0.0 : swiglu ? silu(dot(j)) * dot(n / 2 + j) : dot(j);
        EXPECT_NEAR(out[r * cols + j], want, kTol) << "row " << r << " col " << j;
      }
    }
  }
}

TEST(RefMoeGroupedGemm, RejectsOffsetsOutsideTheRows) {
  const std::vector<float> a(8 * 8, 1.f), w(2 * 8 * 8, 1.f);
  std::vector<double> out;
  const std::vector<int32_t> past = {0, 4, 9}, decreasing = {0, 5, 4}, odd_swiglu = {0, 4, 8};
  EXPECT_THROW(grouped_gemm(a.data(), 8, 8, w.data(), 2, 8, past.data(), false, out), std::invalid_argument);
  EXPECT_THROW(grouped_gemm(a.data(), 8, 8, w.data(), 2, 8, decreasing.data(), false, out), std::invalid_argument);
  EXPECT_THROW(grouped_gemm(a.data(), 8, 8, w.data(), 2, 7, odd_swiglu.data(), true, out), std::invalid_argument);
}

// The naive version rounds where the unfused composition stores: integer sums below 256 are exact
// in bf16 (so it equals the exact one), and random ones land on bf16 values within half an ulp of
// the fp32 sum.
TEST(RefMoeGroupedGemm, NaiveLowpRoundsTheStoredOutputs) {
  std::mt19937 rng(403);
  const int k = 16, n = 24, experts = 3;
  const std::vector<int32_t> offsets = {0, 5, 9, 16};
  std::uniform_int_distribution<int> small(-2, 2);
  std::vector<float> ai(16 * k), wi(experts * n * k);
  for (float& v : ai) v = float(small(rng));
  for (float& v : wi) v = float(small(rng));  // |sum| <= 16 x 4 = 64
  std::vector<double> exact, naive;
  grouped_gemm(ai.data(), 16, k, wi.data(), experts, n, offsets.data(), false, exact);
  grouped_gemm_naive_lowp(ai.data(), 16, k, wi.data(), experts, n, offsets.data(), false, 7, naive);
  EXPECT_EQ(naive, exact);

  const std::vector<float> a = random_floats(16 * k, rng, -1, 1);
  const std::vector<float> w = random_floats(experts * n * k, rng, -1, 1);
  for (bool swiglu : {false, true}) {
    grouped_gemm(a.data(), 16, k, w.data(), experts, n, offsets.data(), swiglu, exact);
    grouped_gemm_naive_lowp(a.data(), 16, k, w.data(), experts, n, offsets.data(), swiglu, 7, naive);
    ASSERT_EQ(naive.size(), exact.size());
    std::vector<double> fp32;
    grouped_gemm_naive_lowp(a.data(), 16, k, w.data(), experts, n, offsets.data(), swiglu, 23, fp32);
    double worst = 0, worst_fp32 = 0, scale = 0;
    for (size_t i = 0; i < exact.size(); ++i) {
      EXPECT_EQ(naive[i], double(round_to_mantissa(float(naive[i]), 7))) << "not a bf16 value at " << i;
      // kNone rounds once: within half an ulp (2^-8 relative) of the (nearly exact) fp32 sum.
      if (!swiglu) {
        EXPECT_LE(std::abs(naive[i] - exact[i]), 0x1p-8 * std::abs(exact[i]) + 1e-6) << i;
      }
      worst = std::max(worst, std::abs(naive[i] - exact[i]));
      worst_fp32 = std::max(worst_fp32, std::abs(fp32[i] - exact[i]));
      scale = std::max(scale, std::abs(exact[i]));
    }
    EXPECT_GT(worst, 0.0);                 // it does round
    EXPECT_LE(worst, 0x1p-5 * scale);      // SwiGLU's four roundings: a few ulps of the largest output
    EXPECT_LE(worst_fp32, 1e-5 * scale);   // 23 bits: only the fp32 sums remain
  }
}

TEST(RefMoeCombine, HandWorked) {
  const std::vector<float> y = {1, 2, 3, 4, 5, 6, 7, 8};  // 4 rows of 2
  const std::vector<int32_t> inverse = {2, 0, 1, -1, -1, -1};  // t2: every copy dropped
  const std::vector<float> weights = {0.5f, 0.25f, 2, 9, 1, 1};
  const std::vector<float> shared = {10, 20, 30, 40, 50, 60};
  std::vector<double> out;
  combine(y.data(), 4, 2, inverse.data(), weights.data(), 3, 2, nullptr, out);
  EXPECT_EQ(out, (std::vector<double>{2.75, 3.5, 6, 8, 0, 0}));
  combine(y.data(), 4, 2, inverse.data(), weights.data(), 3, 2, shared.data(), out);
  EXPECT_EQ(out, (std::vector<double>{12.75, 23.5, 36, 48, 50, 60}));
  // Every value above is a bf16 value: the naive fp32 sum rounded once equals it.
  std::vector<double> naive;
  combine_naive_lowp(y.data(), 4, 2, inverse.data(), weights.data(), 3, 2, shared.data(), 7, naive);
  EXPECT_EQ(naive, out);
  const std::vector<int32_t> past = {4, 0, 1, -1, -1, -1};
  EXPECT_THROW(combine(y.data(), 4, 2, past.data(), weights.data(), 3, 2, nullptr, out), std::invalid_argument);
}

TEST(RefMoeCombine, NaiveRoundsOnceAfterFp32Sums) {
  std::mt19937 rng(404);
  const int tokens = 9, top_k = 3, hidden = 16, rows = 30;
  const std::vector<float> y = random_floats(rows * hidden, rng, -2, 2);
  const std::vector<float> shared = random_floats(tokens * hidden, rng, -2, 2);
  const std::vector<float> weights = random_floats(tokens * top_k, rng, 0, 1);
  std::vector<int32_t> inverse(tokens * top_k);
  std::uniform_int_distribution<int> row(-1, rows - 1);
  for (int32_t& r : inverse) r = row(rng);
  std::vector<double> exact, naive;
  combine(y.data(), rows, hidden, inverse.data(), weights.data(), tokens, top_k, shared.data(), exact);
  combine_naive_lowp(y.data(), rows, hidden, inverse.data(), weights.data(), tokens, top_k, shared.data(), 10,
                     naive);
  for (size_t i = 0; i < exact.size(); ++i) {
    EXPECT_LE(std::abs(naive[i] - exact[i]), 0x1p-11 * std::abs(exact[i]) + 1e-6) << i;  // half an fp16 ulp
  }
}

// The parts composed the way fused_moe composes them (permute, grouped GEMM up + SwiGLU in the
// kernels' [E, 2I, H] layout, grouped GEMM down in [E, H, I], combine) equal moe_layer, which walks
// the (token, k) copies directly in its own transposed layouts.
TEST(RefMoeGroupedGemm, PartsComposeToMoeLayer) {
  std::mt19937 rng(405);
  const int tokens = 7, hidden = 16, inter = 8, experts = 5, top_k = 2;
  const std::vector<float> x = random_floats(tokens * hidden, rng, -1, 1);
  const std::vector<float> w_gate_up = random_floats(experts * hidden * 2 * inter, rng, -1, 1);
  const std::vector<float> w_down = random_floats(experts * inter * hidden, rng, -1, 1);
  const std::vector<float> logits = random_floats(tokens * experts, rng, -2, 2);
  RouterParams p = router(experts, top_k, RouterScore::kSoftmax);
  const Routing routing = route(logits.data(), tokens, p);
  std::vector<double> want;
  moe_layer(x.data(), tokens, hidden, inter, w_gate_up.data(), w_down.data(), routing, top_k, want);

  // The kernels' layouts: w1[e, j, i] = w_gate_up[e, i, j], w2[e, c, j] = w_down[e, j, c].
  std::vector<float> w1(w_gate_up.size()), w2(w_down.size());
  for (int e = 0; e < experts; ++e) {
    for (int i = 0; i < hidden; ++i) {
      for (int j = 0; j < 2 * inter; ++j) {
        w1[(size_t(e) * 2 * inter + j) * hidden + i] = w_gate_up[(size_t(e) * hidden + i) * 2 * inter + j];
      }
    }
    for (int j = 0; j < inter; ++j) {
      for (int c = 0; c < hidden; ++c) w2[(size_t(e) * hidden + c) * inter + j] = w_down[(size_t(e) * inter + j) * hidden + c];
    }
  }
  for (int align : {1, 4}) {
    const int64_t capacity = int64_t(tokens) * top_k + experts * (align - 1);
    const Permutation perm = permute(routing.expert.data(), tokens, top_k, experts, align, capacity);
    const int64_t rows = perm.offsets.back();
    std::vector<float> px(size_t(rows) * hidden, 0.f);
    for (int64_t r = 0; r < rows; ++r) {
      if (perm.permuted_token[r] >= 0) std::copy_n(x.data() + perm.permuted_token[r] * hidden, hidden, px.data() + r * hidden);
    }
    std::vector<double> h, y, got;
    grouped_gemm(px.data(), rows, hidden, w1.data(), experts, 2 * inter, perm.offsets.data(), true, h);
    const std::vector<float> hf(h.begin(), h.end());  // fp32 here: the fp64 layer keeps h exact
    grouped_gemm(hf.data(), rows, inter, w2.data(), experts, hidden, perm.offsets.data(), false, y);
    const std::vector<float> yf(y.begin(), y.end());
    std::vector<float> weights(routing.weight.begin(), routing.weight.end());
    combine(yf.data(), rows, hidden, perm.inverse.data(), weights.data(), tokens, top_k, nullptr, got);
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], want[i], 1e-5) << "align " << align << " at " << i;
  }
}

// The naive 16-bit layer: with 23 mantissa bits (fp32 everywhere) it matches moe_layer plus the
// shared expert; with 7 (bf16) it stays within a few ulps; dropped copies contribute nothing.
TEST(RefMoeLayer, NaiveLowpLayerWithSharedExpert) {
  std::mt19937 rng(406);
  const int tokens = 6, hidden = 16, inter = 8, shared_inter = 4, experts = 4, top_k = 2;
  const std::vector<float> x = random_floats(tokens * hidden, rng, -1, 1);
  const std::vector<float> w_gate_up = random_floats(experts * hidden * 2 * inter, rng, -0.5, 0.5);
  const std::vector<float> w_down = random_floats(experts * inter * hidden, rng, -0.5, 0.5);
  const std::vector<float> s_gate_up = random_floats(hidden * 2 * shared_inter, rng, -0.5, 0.5);
  const std::vector<float> s_down = random_floats(shared_inter * hidden, rng, -0.5, 0.5);
  const std::vector<float> logits = random_floats(tokens * experts, rng, -2, 2);
  const Routing routing = route(logits.data(), tokens, router(experts, top_k, RouterScore::kSoftmax));
  std::vector<double> want;
  moe_layer(x.data(), tokens, hidden, inter, w_gate_up.data(), w_down.data(), routing, top_k, want);
  std::vector<double> s(hidden);
  for (int t = 0; t < tokens; ++t) {
    swiglu_expert(x.data() + t * hidden, s_gate_up.data(), s_down.data(), hidden, shared_inter, s.data());
    for (int c = 0; c < hidden; ++c) want[t * hidden + c] += s[c];
  }
  const SharedExpert shared{s_gate_up.data(), s_down.data(), shared_inter};
  std::vector<double> fp32, bf16;
  moe_layer_naive_lowp(x.data(), tokens, hidden, inter, w_gate_up.data(), w_down.data(), routing, top_k, shared, 23,
                       fp32);
  moe_layer_naive_lowp(x.data(), tokens, hidden, inter, w_gate_up.data(), w_down.data(), routing, top_k, shared, 7,
                       bf16);
  double scale = 0, err_fp32 = 0, err_bf16 = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    scale = std::max(scale, std::abs(want[i]));
    err_fp32 = std::max(err_fp32, std::abs(fp32[i] - want[i]));
    err_bf16 = std::max(err_bf16, std::abs(bf16[i] - want[i]));
  }
  EXPECT_LE(err_fp32, 1e-5 * scale);
  EXPECT_GT(err_bf16, 0.0);
  EXPECT_LE(err_bf16, 0x1p-5 * scale);  // a few bf16 ulps of the largest output

  // A dropped copy (-1) adds nothing: the same as weight 0 on a real expert.
  Routing dropped = routing, zeroed = routing;
  dropped.expert[3] = -1;
  zeroed.weight[3] = 0.0;
  std::vector<double> a, b;
  moe_layer_naive_lowp(x.data(), tokens, hidden, inter, w_gate_up.data(), w_down.data(), dropped, top_k, {}, 7, a);
  moe_layer_naive_lowp(x.data(), tokens, hidden, inter, w_gate_up.data(), w_down.data(), zeroed, top_k, {}, 7, b);
  EXPECT_EQ(a, b);
}

}  // namespace
}  // namespace tessera::ref
