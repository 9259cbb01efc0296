// The fp64 MoE reference: routing against a brute-force sort, grouped top-k and bias semantics,
// the SwiGLU expert against its formula written out, and the layer against the explicit sum.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <set>
#include <utility>
#include <vector>

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

}  // namespace
}  // namespace tessera::ref
