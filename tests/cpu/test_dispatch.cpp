// The prefill dispatcher's choices and errors, decided without a GPU.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "dispatch/prefill_dispatch.h"

namespace tessera {
namespace {

using ::testing::HasSubstr;

TEST(PrefillDispatch, AutoPicksPortableFromSm80) {
  for (auto [major, minor] : {std::pair{8, 0}, {8, 6}, {8, 9}, {9, 0}, {10, 0}}) {
    const auto c = dispatch::choose_prefill(AttentionPath::kAuto, major, minor, DType::kBF16, 128);
    EXPECT_TRUE(c.ok) << major << "." << minor << ": " << c.why_not;
    EXPECT_EQ(c.path, AttentionPath::kPortable);
  }
}

TEST(PrefillDispatch, OldGpuIsAnError) {
  const auto c = dispatch::choose_prefill(AttentionPath::kAuto, 7, 5, DType::kBF16, 128);
  EXPECT_FALSE(c.ok);
  EXPECT_THAT(c.why_not, HasSubstr("older than sm_80"));
}

TEST(PrefillDispatch, ForcedHopperIsAnErrorUntilBuilt) {
  const auto c = dispatch::choose_prefill(AttentionPath::kHopper, 9, 0, DType::kBF16, 128);
  EXPECT_FALSE(c.ok);
  EXPECT_THAT(c.why_not, HasSubstr("Hopper prefill family is not in this build"));
}

TEST(PrefillDispatch, UncompiledHeadDimIsAnError) {
  const auto c = dispatch::choose_prefill(AttentionPath::kPortable, 9, 0, DType::kBF16, 96);
  EXPECT_FALSE(c.ok);
  EXPECT_THAT(c.why_not, HasSubstr("head_dim 96 is not compiled"));
}

TEST(PrefillDispatch, CompiledListMatchesBuildSwitch) {
  const auto dims = dispatch::compiled_prefill_head_dims();
  EXPECT_FALSE(dims.empty());
  for (int d : dims) EXPECT_TRUE(d == 64 || d == 128 || d == 256);
}

}  // namespace
}  // namespace tessera

#include "core/fast_divisor.h"

namespace {

// The kernels' page arithmetic: exact for every page size 1..256 (and a few large divisors) over
// the whole non-negative int32 range (dense near 0, sampled above).
TEST(FastDivisor, MatchesIntegerDivision) {
  std::vector<uint32_t> divisors;
  for (uint32_t d = 1; d <= 256; ++d) divisors.push_back(d);
  for (uint32_t d : {1000u, 4097u, 65536u, 999983u, 0x7fffffffu}) divisors.push_back(d);
  for (uint32_t d : divisors) {
    const tessera::detail::FastDivisor f = tessera::detail::fast_divisor(d);
    for (uint64_t n = 0; n < (uint64_t(1) << 31); n += n < 70000 ? 1 : 104729) {
      ASSERT_EQ(tessera::detail::fast_divide(static_cast<uint32_t>(n), f), n / d) << n << " / " << d;
    }
    ASSERT_EQ(tessera::detail::fast_divide(0x7fffffffu, f), 0x7fffffffu / d) << d;
  }
}

}  // namespace
