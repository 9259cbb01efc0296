// kernels/common/fast_divisor.h: the multiply-high division the Hopper prefill decodes list
// positions with gives n / d and n % d exactly, for every divisor a list shape can have and every
// position below 2^31, against the hardware division.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <vector>

#include "kernels/common/fast_divisor.h"

using tessera::kernels::FastDivisor;

namespace {

void expect_exact(int32_t d, int32_t n) {
  const FastDivisor f(d);
  const int32_t q = f.div(n);
  ASSERT_EQ(q, n / d) << "n = " << n << ", d = " << d;
  ASSERT_EQ(f.mod(n, q), n % d) << "n = " << n << ", d = " << d;
}

// Dividends where a wrong multiplier shows first: around multiples of d and at the top of the range.
std::vector<int32_t> edges(int32_t d) {
  std::vector<int32_t> n;
  for (const int64_t k : {int64_t(1), int64_t(2), int64_t(1000), int64_t(INT32_MAX) / d}) {
    const int64_t m = k * d;
    for (const int64_t x : {m - 1, m, m + 1}) {
      if (x >= 0 && x <= INT32_MAX) n.push_back(int32_t(x));
    }
  }
  for (const int64_t x : {int64_t(0), int64_t(1), int64_t(INT32_MAX), int64_t(INT32_MAX) - 1, int64_t(INT32_MAX) - d}) {
    n.push_back(int32_t(x));
  }
  return n;
}

TEST(FastDivisor, EveryDividendBelow2To16ForSmallDivisors) {
  for (int32_t d = 1; d <= 300; ++d) {
    const FastDivisor f(d);
    for (int32_t n = 0; n < (1 << 16); ++n) {
      const int32_t q = f.div(n);
      ASSERT_EQ(q, n / d) << "n = " << n << ", d = " << d;
    }
  }
}

TEST(FastDivisor, EdgesAndRandomDividendsForManyDivisors) {
  std::mt19937 rng(7);
  std::uniform_int_distribution<int32_t> dividend(0, INT32_MAX);
  std::vector<int32_t> divisors;
  for (int32_t d = 1; d <= 5000; ++d) divisors.push_back(d);
  for (int s = 13; s <= 30; ++s) {
    for (const int32_t d : {(1 << s) - 1, 1 << s, (1 << s) + 1}) divisors.push_back(d);
  }
  divisors.push_back(INT32_MAX);
  std::uniform_int_distribution<int32_t> large(5001, INT32_MAX);
  for (int i = 0; i < 2000; ++i) divisors.push_back(large(rng));
  for (const int32_t d : divisors) {
    for (const int32_t n : edges(d)) expect_exact(d, n);
    for (int i = 0; i < 200; ++i) expect_exact(d, dividend(rng));
  }
}

TEST(FastDivisor, ZeroIsTakenAsOne) {
  const FastDivisor f(0);
  EXPECT_EQ(f.divisor, 1u);
  EXPECT_EQ(f.div(12345), 12345);
}

}  // namespace
