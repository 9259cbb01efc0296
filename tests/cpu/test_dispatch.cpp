// The prefill dispatcher's choices and errors, decided without a GPU.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <vector>

#include "dispatch/kernel_families.h"
#include "dispatch/prefill_dispatch.h"
#include "tessera/device_info.h"

namespace tessera {
namespace {

using ::testing::HasSubstr;

TEST(PrefillDispatch, AutoPicksPortableFromSm80) {
  for (auto [major, minor] : {std::pair{8, 0}, {8, 6}, {8, 9}, {10, 0}, {12, 0}}) {
    const auto c = dispatch::choose_prefill(AttentionPath::kAuto, major, minor, DType::kBF16, 128);
    EXPECT_TRUE(c.ok) << major << "." << minor << ": " << c.why_not;
    EXPECT_EQ(c.path, AttentionPath::kPortable);
  }
}

// sm_90 takes the Hopper family wherever this build holds it and it supports the problem.
TEST(PrefillDispatch, AutoPicksHopperOnSm90WhenBuilt) {
  const auto& hopper = *dispatch::kernel_family(AttentionPath::kHopper);
  const auto c = dispatch::choose_prefill(AttentionPath::kAuto, 9, 0, DType::kBF16, 128);
  ASSERT_TRUE(c.ok) << c.why_not;
  EXPECT_EQ(c.path, hopper.built ? AttentionPath::kHopper : AttentionPath::kPortable);
  // Paged KV caches: the Hopper family reads every page size (multiples of 8 by TMA, the others
  // gathered by its producer warps, faster than the portable family there too), so auto takes it
  // and forcing it is fine.
  for (int head_dim : {64, 128, 256}) {
    for (int page_size : {8, 16, 48, 64, 256, 1, 2, 7, 12, 100}) {
      dispatch::PrefillProblem paged;
      paged.paged = true;
      paged.page_size = page_size;
      const auto p = dispatch::choose_prefill(AttentionPath::kAuto, 9, 0, DType::kBF16, head_dim, paged);
      if (!p.ok) continue;  // head_dim not compiled in this build
      EXPECT_EQ(p.path, hopper.built ? AttentionPath::kHopper : AttentionPath::kPortable)
          << "page " << page_size << " head_dim " << head_dim;
      const auto forced = dispatch::choose_prefill(AttentionPath::kHopper, 9, 0, DType::kBF16, head_dim, paged);
      EXPECT_EQ(forced.ok, hopper.built) << "page " << page_size << ": " << forced.why_not;
    }
  }
  // A launch of 2^31 query tiles or more is beyond the Hopper family's tile list.
  dispatch::PrefillProblem huge;
  huge.tiles = int64_t(1) << 31;
  const auto h = dispatch::choose_prefill(AttentionPath::kAuto, 9, 0, DType::kBF16, 128, huge);
  ASSERT_TRUE(h.ok) << h.why_not;
  EXPECT_EQ(h.path, AttentionPath::kPortable);
}

TEST(PrefillDispatch, ForcedHopperElsewhereIsAnError) {
  for (auto [major, minor] : {std::pair{8, 0}, {8, 9}, {10, 0}}) {
    const auto c = dispatch::choose_prefill(AttentionPath::kHopper, major, minor, DType::kBF16, 128);
    EXPECT_FALSE(c.ok) << major << "." << minor;
    EXPECT_THAT(c.why_not, HasSubstr(dispatch::kernel_family(AttentionPath::kHopper)->built ? "sm_90 only"
                                                                                           : "not in this build"));
  }
}

// One list names the families: the public names, `tessera info`'s path and the dispatcher agree.
TEST(PrefillDispatch, FamilyListIsTheOneSource) {
  const auto& families = dispatch::kernel_families();
  ASSERT_EQ(families.size(), 2u);
  for (const auto& f : families) {
    EXPECT_STREQ(attention_path_name(f.path), f.name);
    EXPECT_THAT(kernel_path_name(f.kernel_path), HasSubstr(f.description));
  }
  EXPECT_EQ(kernel_path_for(9, 0), dispatch::kernel_family(AttentionPath::kHopper)->built ? KernelPath::kHopperSm90a
                                                                                          : KernelPath::kPortableSm80);
  EXPECT_EQ(kernel_path_for(8, 0), KernelPath::kPortableSm80);
  EXPECT_EQ(kernel_path_for(10, 0), KernelPath::kPortableSm80);
  EXPECT_EQ(kernel_path_for(7, 5), KernelPath::kNone);
}

TEST(PrefillDispatch, OldGpuIsAnError) {
  const auto c = dispatch::choose_prefill(AttentionPath::kAuto, 7, 5, DType::kBF16, 128);
  EXPECT_FALSE(c.ok);
  EXPECT_THAT(c.why_not, HasSubstr("older than sm_80"));
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

namespace tessera {
namespace {

// The Hopper family's schedule policy (notes/prefill_hopper.md, "Schedules").
TEST(PrefillDispatch, HopperSchedulePolicy) {
  using kernels::sm90::SchedulerKind;
  using kernels::sm90::TileOrder;
  const int sms = 132;
  kernels::PrefillParams p;
  p.batch_size = 2;
  p.num_qo_heads = 32;
  p.num_kv_heads = 8;
  p.max_qo_len = 16384;
  p.causal = true;
  auto s = dispatch::choose_prefill_sm90_schedule(p, 128, sms);
  EXPECT_EQ(s.scheduler, SchedulerKind::kStaticPersistent);
  EXPECT_EQ(s.order, TileOrder::kMirroredPairs);
  EXPECT_EQ(s.run_length, 2);
  s = dispatch::choose_prefill_sm90_schedule(p, 256, sms);
  EXPECT_EQ(s.scheduler, SchedulerKind::kSingleTile);
  EXPECT_TRUE(s.heavy_first);
  // Causal pairs only where the lengths agree and the pairs keep every SM busy.
  p.uniform_lengths = false;
  s = dispatch::choose_prefill_sm90_schedule(p, 128, sms);
  EXPECT_EQ(s.scheduler, SchedulerKind::kSingleTile);
  EXPECT_EQ(s.order, TileOrder::kQueryTilesOuter);
  EXPECT_TRUE(s.heavy_first);
  p.uniform_lengths = true;
  p.max_qo_len = 512;  // 2 x 32 x 4 = 256 tiles < 2 x 132
  EXPECT_EQ(dispatch::choose_prefill_sm90_schedule(p, 128, sms).scheduler, SchedulerKind::kSingleTile);
  EXPECT_EQ(dispatch::choose_prefill_sm90_schedule(p, 128, 64).order, TileOrder::kMirroredPairs);
  // One-tile causal grids of chunked prefill (a chunk over a longer history) keep each head's
  // query tiles together once the batch's K / V outgrow the L2, so a wave does not stream every
  // head's K / V again; inside the L2, or where the tiles' costs differ more than 2x (a history
  // shorter than the chunk), the heaviest tiles of all heads go first.
  const int64_t l2 = int64_t(50) << 20;
  p.max_qo_len = 128;
  p.batch_size = 8;
  p.gqa_pack = 2;  // 8 requests x 8 KV heads x 4 tiles of 128 packed rows = 256 tiles
  p.shortest_history = 8192 - 128;
  p.total_keys = 8 * 8192;  // x 8 KV heads x 128 x 2 x 2 bytes = 268 MB
  s = dispatch::choose_prefill_sm90_schedule(p, 128, sms, 0, l2);
  EXPECT_EQ(s.scheduler, SchedulerKind::kSingleTile);
  EXPECT_EQ(s.order, TileOrder::kQueryTilesInner);
  EXPECT_TRUE(s.heavy_first);
  EXPECT_EQ(dispatch::choose_prefill_sm90_schedule(p, 128, sms, 0, 0).order, TileOrder::kQueryTilesOuter);  // L2 unknown
  p.total_keys = 2 * 8192;  // 67 MB
  EXPECT_EQ(dispatch::choose_prefill_sm90_schedule(p, 128, sms, 0, l2).order, TileOrder::kQueryTilesInner);
  p.total_keys = 8192;  // 33.5 MB: inside the L2
  EXPECT_EQ(dispatch::choose_prefill_sm90_schedule(p, 128, sms, 0, l2).order, TileOrder::kQueryTilesOuter);
  p.total_keys = 8 * 8192;
  p.shortest_history = 100;  // a history shorter than the chunk: costs spread over more than 2x
  EXPECT_EQ(dispatch::choose_prefill_sm90_schedule(p, 128, sms, 0, l2).order, TileOrder::kQueryTilesOuter);
  p.shortest_history = -1;  // not computed
  EXPECT_EQ(dispatch::choose_prefill_sm90_schedule(p, 128, sms, 0, l2).order, TileOrder::kQueryTilesOuter);
  p.gqa_pack = 0;
  p.batch_size = 2;
  p.max_qo_len = 512;
  p.total_keys = 0;
  // A KV split: persistent over the list, no pairs.
  p.kv_splits = 4;
  s = dispatch::choose_prefill_sm90_schedule(p, 128, sms);
  EXPECT_EQ(s.scheduler, SchedulerKind::kStaticPersistent);
  EXPECT_EQ(s.order, TileOrder::kQueryTilesInner);
  EXPECT_EQ(s.run_length, 1);
  p.kv_splits = 1;
  p.max_qo_len = 16384;
  p.causal = false;
  s = dispatch::choose_prefill_sm90_schedule(p, 128, sms);
  EXPECT_EQ(s.scheduler, SchedulerKind::kStaticPersistent);
  EXPECT_EQ(s.order, TileOrder::kQueryTilesInner);
  // A forced schedule wins until it is lifted.
  kernels::sm90::PrefillSm90Schedule forced;
  forced.scheduler = SchedulerKind::kSingleTile;
  dispatch::force_prefill_sm90_schedule(&forced);
  EXPECT_EQ(dispatch::choose_prefill_sm90_schedule(p, 128, sms).scheduler, SchedulerKind::kSingleTile);
  dispatch::force_prefill_sm90_schedule(nullptr);
  EXPECT_EQ(dispatch::choose_prefill_sm90_schedule(p, 128, sms).scheduler, SchedulerKind::kStaticPersistent);
}

// hd128's 192-key K / V tiles where rows see many keys (ragged K / V only, when they fit the
// GPU's shared memory); every other case the head dim's default width; a forced width where the
// source has it.
TEST(PrefillDispatch, HopperKvTileWidthPolicy) {
  const auto choices = kernels::sm90::prefill_sm90_block_n_choices(128);
  const bool wide_built = choices.count > 1;  // the Hopper family with hd128 in this build
  kernels::PrefillParams p;
  p.batch_size = 2;
  p.num_qo_heads = 32;
  p.num_kv_heads = 8;
  p.max_qo_len = 8192;
  p.work_weighted_row_keys = 8192;
  EXPECT_EQ(dispatch::choose_prefill_sm90_block_n(p, 128, 0), wide_built ? 192 : 128);
  EXPECT_EQ(dispatch::choose_prefill_sm90_schedule(p, 128, 132, 0).block_n, wide_built ? 192 : 128);
  EXPECT_EQ(dispatch::choose_prefill_sm90_block_n(p, 64, 0), 128);
  EXPECT_EQ(dispatch::choose_prefill_sm90_block_n(p, 256, 0), 80);
  if (wide_built) {
    const int wide_bytes = kernels::sm90::prefill_sm90_smem_bytes(128, 192);
    EXPECT_GT(wide_bytes, kernels::sm90::prefill_sm90_smem_bytes(128));
    EXPECT_EQ(dispatch::choose_prefill_sm90_block_n(p, 128, wide_bytes), 192);
    EXPECT_EQ(dispatch::choose_prefill_sm90_block_n(p, 128, wide_bytes - 1), 128);  // does not fit
  }
  p.work_weighted_row_keys = 1024;  // short rows: the wide tile's boundary costs more than it saves
  EXPECT_EQ(dispatch::choose_prefill_sm90_block_n(p, 128, 0), 128);
  p.work_weighted_row_keys = 0;  // not computed
  EXPECT_EQ(dispatch::choose_prefill_sm90_block_n(p, 128, 0), 128);
  p.work_weighted_row_keys = 8192;
  p.paged = true;  // the paged sources take 128-key tiles
  EXPECT_EQ(dispatch::choose_prefill_sm90_block_n(p, 128, 0), 128);
  dispatch::force_prefill_sm90_block_n(192);
  EXPECT_EQ(dispatch::choose_prefill_sm90_block_n(p, 128, 0), 128);
  p.paged = false;
  p.work_weighted_row_keys = 64;
  EXPECT_EQ(dispatch::choose_prefill_sm90_block_n(p, 128, 0), wide_built ? 192 : 128);
  EXPECT_EQ(dispatch::choose_prefill_sm90_block_n(p, 64, 0), 128);  // no such width at hd64
  dispatch::force_prefill_sm90_block_n(128);
  p.work_weighted_row_keys = 8192;
  EXPECT_EQ(dispatch::choose_prefill_sm90_block_n(p, 128, 0), 128);
  dispatch::force_prefill_sm90_block_n(0);
}

// The work-weighted keys a row sees (the K / V tile width's measure), on closed forms.
TEST(PrefillDispatch, WorkWeightedRowKeys) {
  const auto keys = [](std::vector<int32_t> qo, std::vector<int32_t> kv, bool causal, int window) {
    std::vector<int32_t> qo_indptr{0}, kv_indptr{0};
    for (size_t i = 0; i < qo.size(); ++i) {
      qo_indptr.push_back(qo_indptr.back() + qo[i]);
      kv_indptr.push_back(kv_indptr.back() + kv[i]);
    }
    return dispatch::work_weighted_row_keys(qo_indptr.data(), kv_indptr.data(), int64_t(qo.size()), causal, window);
  };
  EXPECT_EQ(keys({4096, 4096}, {4096, 4096}, false, -1), 4096);
  EXPECT_EQ(keys({8192}, {8192}, true, -1), 5461);  // rows see 1..n: (2n + 1) / 3
  EXPECT_EQ(keys({3}, {3}, true, -1), 2);            // (1 + 4 + 9) / 6 = 2.33
  EXPECT_EQ(keys({2}, {10}, true, -1), 9);           // rows see 9 and 10: 181 / 19 = 9.5
  EXPECT_EQ(keys({10}, {2}, true, -1), 1);           // 8 rows see nothing, then 1 and 2: 5 / 3
  EXPECT_EQ(keys({8192}, {8192}, true, 99), 99);     // capped at 100 from row 100 on: just under 100
  EXPECT_EQ(keys({5}, {5}, true, 2), 2);             // 1, 2, 3, 3, 3: 32 / 12 = 2.67
  EXPECT_EQ(keys({16, 1}, {16, 9000}, false, -1), (16 * 256 + 9000LL * 9000) / (16 * 16 + 9000));
  EXPECT_EQ(keys({0, 7}, {50, 0}, false, -1), 0);    // no row sees a key
  EXPECT_EQ(keys({}, {}, false, -1), 0);
}

// Packed GQA: groups that are powers of two from 2 to 64, taken wherever possible (equal long
// requests included: measured even or faster); forced off by tests and benchmarks.
TEST(PrefillDispatch, GqaPackPolicy) {
  EXPECT_EQ(dispatch::prefill_gqa_pack_limit(32, 8), 2);
  EXPECT_EQ(dispatch::prefill_gqa_pack_limit(64, 1), 6);
  EXPECT_EQ(dispatch::prefill_gqa_pack_limit(128, 1), 0);  // a 64-row O box would split a token
  EXPECT_EQ(dispatch::prefill_gqa_pack_limit(24, 2), 0);   // group 12
  EXPECT_EQ(dispatch::prefill_gqa_pack_limit(8, 8), 0);
  EXPECT_EQ(dispatch::prefill_gqa_pack_limit(8, 3), 0);
  EXPECT_EQ(dispatch::prefill_gqa_pack_limit(8, 0), 0);
  kernels::PrefillParams p;
  p.batch_size = 4;
  p.num_qo_heads = 32;
  p.num_kv_heads = 8;
  p.max_qo_len = 1;  // decode-like: 4 x 32 tiles of one row unpacked, 4 x 8 packed
  EXPECT_EQ(dispatch::choose_prefill_gqa_pack(p), 2);
  p.max_qo_len = 4096;  // equal long requests: as many tiles either way, packed too
  EXPECT_EQ(dispatch::choose_prefill_gqa_pack(p), 2);
  p.num_kv_heads = 32;
  EXPECT_EQ(dispatch::choose_prefill_gqa_pack(p), 0);
  p.num_kv_heads = 8;
  dispatch::force_prefill_gqa_pack(dispatch::GqaPack::kAlways);
  EXPECT_EQ(dispatch::choose_prefill_gqa_pack(p), 2);
  p.max_qo_len = 1;
  dispatch::force_prefill_gqa_pack(dispatch::GqaPack::kNever);
  EXPECT_EQ(dispatch::choose_prefill_gqa_pack(p), 0);
  dispatch::force_prefill_gqa_pack(dispatch::GqaPack::kAuto);
  EXPECT_EQ(dispatch::choose_prefill_gqa_pack(p), 2);
  p.max_qo_len = (1 << 30);  // rows x group would overflow 31 bits
  EXPECT_EQ(dispatch::choose_prefill_gqa_pack(p), 0);
}

}  // namespace
}  // namespace tessera

#include "dispatch/moe_dispatch.h"

namespace tessera {
namespace {

// The grouped GEMM runs its Hopper kernel exactly where the Hopper attention family runs (sm_90
// with the family built), the portable one on every other GPU from sm_80 on.
TEST(MoeDispatch, HopperKernelOnSm90WhenBuiltElsePortable) {
  const dispatch::KernelFamily* hopper = dispatch::kernel_family(AttentionPath::kHopper);
  const bool built = hopper != nullptr && hopper->built;
  EXPECT_EQ(dispatch::choose_moe_gemm(9, 0), built ? dispatch::MoeGemmFamily::kHopper : dispatch::MoeGemmFamily::kPortable);
  for (auto [major, minor] : {std::pair{8, 0}, {8, 6}, {8, 9}, {10, 0}, {12, 0}})
    EXPECT_EQ(dispatch::choose_moe_gemm(major, minor), dispatch::MoeGemmFamily::kPortable) << major << "." << minor;
}

}  // namespace
}  // namespace tessera
