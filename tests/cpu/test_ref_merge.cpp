// The fp64 merge reference against the formula of include/tessera/merge.h and its invariants.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "reference/merge_ref.h"

namespace tessera::ref {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kTol = 1e-12;
constexpr int kHeadDim = 24;

std::vector<double> random_values(size_t n, std::mt19937& rng, double lo = -1.0, double hi = 1.0) {
  std::uniform_real_distribution<double> dist(lo, hi);
  std::vector<double> x(n);
  for (double& e : x) e = dist(rng);
  return x;
}

double max_abs_diff(const std::vector<double>& a, const std::vector<double>& b) {
  double worst = 0.0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::isnan(a[i]) || std::isnan(b[i])) return kInf;
    worst = std::max(worst, std::abs(a[i] - b[i]));
  }
  return worst;
}

struct State {
  std::vector<double> o;
  double s;
};

State merge2(const State& a, const State& b) {
  State out{std::vector<double>(a.o.size()), 0.0};
  merge_two(a.o.data(), a.s, b.o.data(), b.s, static_cast<int>(a.o.size()), out.o.data(), &out.s);
  return out;
}

TEST(RefMerge, MergeTwoMatchesFormula) {
  std::mt19937 rng(201);
  for (int trial = 0; trial < 50; ++trial) {
    const State a{random_values(kHeadDim, rng), random_values(1, rng, -5, 5)[0]};
    const State b{random_values(kHeadDim, rng), random_values(1, rng, -5, 5)[0]};
    const State got = merge2(a, b);
    // Straight from the definition; the LSEs are small, so nothing overflows.
    const double s = std::log(std::exp(a.s) + std::exp(b.s));
    std::vector<double> o(kHeadDim);
    for (int c = 0; c < kHeadDim; ++c) {
      o[c] = a.o[c] * std::exp(a.s - s) + b.o[c] * std::exp(b.s - s);
    }
    EXPECT_NEAR(got.s, s, kTol);
    EXPECT_LE(max_abs_diff(got.o, o), kTol);
  }
}

TEST(RefMerge, MergeTwoIsStableForLargeLse) {
  std::mt19937 rng(202);
  const State a{random_values(kHeadDim, rng), 1000.0};  // e^1000 overflows a double
  const State b{random_values(kHeadDim, rng), 999.0};
  const State got = merge2(a, b);
  const double w_b = 1.0 / (1.0 + std::exp(1.0));  // e^999 / (e^1000 + e^999)
  EXPECT_NEAR(got.s, 1000.0 + std::log1p(std::exp(-1.0)), kTol);
  for (int c = 0; c < kHeadDim; ++c) {
    EXPECT_NEAR(got.o[c], a.o[c] * (1 - w_b) + b.o[c] * w_b, kTol);
  }
}

TEST(RefMerge, MergeTwoIsCommutative) {
  std::mt19937 rng(203);
  for (int trial = 0; trial < 50; ++trial) {
    const State a{random_values(kHeadDim, rng), random_values(1, rng, -20, 20)[0]};
    const State b{random_values(kHeadDim, rng), random_values(1, rng, -20, 20)[0]};
    const State ab = merge2(a, b), ba = merge2(b, a);
    EXPECT_EQ(ab.s, ba.s);
    EXPECT_EQ(ab.o, ba.o);
  }
}

TEST(RefMerge, NegInfStateContributesNothing) {
  std::mt19937 rng(204);
  const State empty{random_values(kHeadDim, rng), -kInf};  // o is garbage, not zeros
  const State b{random_values(kHeadDim, rng), 0.7};
  for (const State& got : {merge2(empty, b), merge2(b, empty)}) {
    EXPECT_EQ(got.s, b.s);
    EXPECT_EQ(got.o, b.o);
  }
}

TEST(RefMerge, BothNegInfGiveZerosAndNegInf) {
  std::mt19937 rng(205);
  const State a{random_values(kHeadDim, rng), -kInf}, b{random_values(kHeadDim, rng), -kInf};
  const State got = merge2(a, b);
  EXPECT_EQ(got.s, -kInf);
  EXPECT_EQ(got.o, std::vector<double>(kHeadDim, 0.0));
}

TEST(RefMerge, NaNPropagatesToWhatItTouches) {
  std::mt19937 rng(206);
  // A NaN LSE poisons the whole merged row, from either side.
  const State nan_s{random_values(kHeadDim, rng), kNaN};
  const State b{random_values(kHeadDim, rng), 0.3};
  for (const State& got : {merge2(nan_s, b), merge2(b, nan_s)}) {
    EXPECT_TRUE(std::isnan(got.s));
    for (double x : got.o) EXPECT_TRUE(std::isnan(x));
  }
  // A NaN output element poisons that element only.
  State nan_o{random_values(kHeadDim, rng), -0.4};
  nan_o.o[5] = kNaN;
  const State got = merge2(nan_o, b);
  EXPECT_TRUE(std::isfinite(got.s));
  for (int c = 0; c < kHeadDim; ++c) EXPECT_EQ(std::isnan(got.o[c]), c == 5) << "element " << c;
}

// merge_n over n parts stored [n][head_dim].
State merge_parts(const std::vector<State>& parts) {
  std::vector<double> o, s;
  for (const State& p : parts) {
    o.insert(o.end(), p.o.begin(), p.o.end());
    s.push_back(p.s);
  }
  State out{std::vector<double>(kHeadDim), 0.0};
  merge_n(o.data(), s.data(), static_cast<int>(parts.size()), kHeadDim, out.o.data(), &out.s);
  return out;
}

std::vector<State> random_states(int n, std::mt19937& rng) {
  std::vector<State> parts;
  for (int i = 0; i < n; ++i) {
    parts.push_back({random_values(kHeadDim, rng), random_values(1, rng, -8, 8)[0]});
  }
  return parts;
}

TEST(RefMerge, MergeNEqualsFoldedMergeTwo) {
  std::mt19937 rng(207);
  for (int n : {2, 3, 5, 9}) {
    SCOPED_TRACE(n);
    std::vector<State> parts = random_states(n, rng);
    parts[1].s = -kInf;  // an empty chunk among them
    State folded = parts[0];
    for (int i = 1; i < n; ++i) folded = merge2(folded, parts[i]);
    const State got = merge_parts(parts);
    EXPECT_NEAR(got.s, folded.s, kTol);
    EXPECT_LE(max_abs_diff(got.o, folded.o), kTol);
  }
}

TEST(RefMerge, MergeNDoesNotDependOnOrder) {
  std::mt19937 rng(208);
  std::vector<State> parts = random_states(6, rng);
  const State want = merge_parts(parts);
  std::shuffle(parts.begin(), parts.end(), rng);
  const State got = merge_parts(parts);
  EXPECT_NEAR(got.s, want.s, kTol);
  EXPECT_LE(max_abs_diff(got.o, want.o), kTol);
}

TEST(RefMerge, MergeNOfOneIsIdentity) {
  std::mt19937 rng(209);
  const std::vector<State> one = random_states(1, rng);
  const State got = merge_parts(one);
  EXPECT_EQ(got.s, one[0].s);
  EXPECT_EQ(got.o, one[0].o);
}

TEST(RefMerge, MergeNAllNegInfGiveZerosAndNegInf) {
  std::mt19937 rng(210);
  std::vector<State> parts = random_states(4, rng);
  for (State& p : parts) p.s = -kInf;
  const State got = merge_parts(parts);
  EXPECT_EQ(got.s, -kInf);
  EXPECT_EQ(got.o, std::vector<double>(kHeadDim, 0.0));
}

TEST(RefMerge, MergeNPropagatesNaN) {
  std::mt19937 rng(211);
  std::vector<State> parts = random_states(4, rng);
  parts[2].s = kNaN;
  const State got = merge_parts(parts);
  EXPECT_TRUE(std::isnan(got.s));
  for (double x : got.o) EXPECT_TRUE(std::isnan(x));
}

}  // namespace
}  // namespace tessera::ref
