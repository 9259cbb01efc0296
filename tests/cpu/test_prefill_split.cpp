// The paged prefill's KV split (plan/prefill_split.h): the cost model's choices on the shapes it
// exists for (a short chunk over a long history) and the ones it must leave alone.
#include <gtest/gtest.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <random>
#include <vector>

#include "common/prefill_batch.h"
#include "plan/prefill_split.h"

using namespace tessera::plan;

namespace {

using Batch = tessera::testing::PrefillBatch;

// hd128 on the H200: 128 x 128 tiles, 132 SMs.
PrefillSplitChoice choose(const Batch& b, int heads, bool causal = true, int max_splits = 16, int window = -1,
                          int gqa_pack = 0) {
  PrefillSplitProblem p;
  p.qo_indptr = b.qo_indptr.data();
  p.kv_indptr = b.kv_indptr.data();
  p.last_page_len = b.last.data();
  p.page_size = 16;
  p.batch = static_cast<int64_t>(b.last.size());
  p.num_qo_heads = heads >> gqa_pack;
  p.packed_heads = 1 << gqa_pack;
  p.head_dim = 128;
  p.block_m = 128 >> gqa_pack;
  p.block_n = 128;
  p.causal = causal;
  p.window_left = window;
  p.slots = 132;
  p.max_splits = max_splits;
  return choose_prefill_split(p, hopper_prefill_split_cost(128, 128, 16));
}

}  // namespace

// 32 query tiles (one 128-token chunk x 32 heads) over 32K keys: split until the tiles about fill
// one wave of 132 SMs (4 x 32 = 128), not into many short runs whose partials cost more.
TEST(PrefillSplit, ShortChunkOverLongHistoryFillsOneWave) {
  Batch b;
  b.add(128, 32768);
  const PrefillSplitChoice c = choose(b, 32);
  EXPECT_EQ(c.splits, 4);
  EXPECT_LT(c.estimated_us, c.unsplit_us / 3.0) << "one wave instead of 32 of 132 SMs busy";
}

// 64 tiles: two runs each fill 128 of 132 SMs.
TEST(PrefillSplit, TwoChunksSplitInTwo) {
  Batch b;
  b.add(128, 32768);
  b.add(128, 32768);
  EXPECT_EQ(choose(b, 32).splits, 2);
}

// A step whose tiles already fill the SMs (128 of 132) is not split: a split would add a second
// wave of half-length tiles plus the merge.
TEST(PrefillSplit, FullWaveIsNotSplit) {
  Batch b;
  b.add(512, 32768);
  EXPECT_EQ(choose(b, 32).splits, 1);
}

// Short histories: a run's start-up and the merge outweigh the gain of more busy SMs.
TEST(PrefillSplit, ShortHistoryIsNotSplit) {
  Batch b;
  b.add(128, 256);
  EXPECT_EQ(choose(b, 8).splits, 1);
  Batch none;
  none.add(0, 4096);  // no query rows: nothing to estimate
  EXPECT_EQ(choose(none, 8).splits, 1);
}

// The band decides the keys: a 1K window over a 64K history is a short history (9 KV tiles a
// query tile instead of 512).
TEST(PrefillSplit, WindowLimitsTheKeysThatCount) {
  Batch b;
  b.add(128, 65536);
  const PrefillSplitChoice full = choose(b, 32, true, 16), windowed = choose(b, 32, true, 16, /*window=*/1024);
  EXPECT_EQ(full.splits, 4);
  EXPECT_LT(windowed.unsplit_us, full.unsplit_us / 20);
  EXPECT_LT(windowed.splits, full.splits);
  // A window longer than every request is none (its band arithmetic would overflow int).
  Batch many_rows;
  many_rows.add(1000, 32);
  EXPECT_EQ(choose(many_rows, 8, false, 16, INT32_MAX).unsplit_us, choose(many_rows, 8, false, 16, -1).unsplit_us);
}

// On random batches the cap holds, and the unsplit estimate is at least what the model's own
// rates say the work needs: every query tile's KV tiles spread over the slots, and the longest
// query tile alone (non-causal: a query tile sees all of its request's keys).
TEST(PrefillSplit, CapHoldsAndEstimatesCoverTheWork) {
  const PrefillSplitCost cost = hopper_prefill_split_cost(128, 128, 16);
  std::mt19937 rng(5);
  for (int t = 0; t < 500; ++t) {
    Batch b;
    const int n = 1 + int(rng() % 6);
    double kv_tiles = 0, longest = 0;
    for (int r = 0; r < n; ++r) {
      const int32_t kv = int32_t(rng() % 70000);
      const int32_t qo = kv == 0 ? 0 : 1 + int32_t(rng() % std::min<int32_t>(kv, 700));
      b.add(qo, kv);
      const double tiles = (kv + 127) / 128;
      kv_tiles += ((qo + 127) / 128) * tiles;
      if (qo > 0) longest = std::max(longest, cost.tile_start_us + tiles * cost.kv_tile_us);
    }
    const int cap = 1 + int(rng() % 32), heads = 1 + int(rng() % 40);
    const PrefillSplitChoice c = choose(b, heads, /*causal=*/false, cap);
    EXPECT_GE(c.splits, 1);
    EXPECT_LE(c.splits, cap);
    EXPECT_GE(c.unsplit_us * (1 + 1e-9), kv_tiles * heads * cost.kv_tile_us / 132.0);
    EXPECT_GE(c.unsplit_us * (1 + 1e-9), longest);
    EXPECT_LE(c.estimated_us, c.unsplit_us);
  }
}

// Packed GQA (group 4): 8 one-token requests over 16K keys are 8 x 8 = 64 tiles, not 256: half
// the SMs idle while each tile streams a whole history, so a split in two fills them; unpacked,
// the same step's 256 tiles take two waves, which a split cannot shorten (twice the tiles, half as
// long), and the step is left alone.
TEST(PrefillSplit, PackedDecodeRowsAreJudgedOnThePackedTiles) {
  Batch b;
  for (int r = 0; r < 8; ++r) b.add(1, 16384);
  const PrefillSplitChoice packed = choose(b, 32, true, 16, -1, 2);
  const PrefillSplitChoice unpacked = choose(b, 32, true, 16, -1, 0);
  EXPECT_EQ(unpacked.splits, 1);
  EXPECT_EQ(packed.splits, 2);
  EXPECT_LT(packed.estimated_us, 0.6 * packed.unsplit_us);
  // One token's band either way, so the tiles are equally long: the unsplit steps differ in their
  // waves only (2 against 1).
  EXPECT_NEAR(unpacked.unsplit_us, 2.0 * packed.unsplit_us, 1e-6 * unpacked.unsplit_us);
  // A chunk of 128 tokens is 32 tiles either way (packed: 4 of 32 tokens x 8 KV heads): the
  // decision stays.
  Batch chunk;
  chunk.add(128, 32768);
  EXPECT_EQ(choose(chunk, 32, true, 16, -1, 2).splits, choose(chunk, 32, true, 16, -1, 0).splits);
}

TEST(PrefillSplit, QueryTileCountsMatchTheMaskBand) {
  // query_tile_kv_tiles divides in 32 bits (shifts for a power-of-two block_n) and query_tiles
  // skips the division for one-tile requests: both against the band walked key tile by key tile
  // and a plain ceiling, over causal / windowed / plain masks, odd tile shapes and lengths.
  std::mt19937 rng(5);
  for (int t = 0; t < 4000; ++t) {
    const int qo = 1 + static_cast<int>(rng() % 700), kv = static_cast<int>(rng() % 3000);
    const bool causal = rng() % 2 == 0;
    const int window = (int[]){-1, 0, 1, 63, 500, 2999, INT_MAX}[rng() % 7];
    const int block_m = (int[]){16, 32, 64, 128, 176, 192}[rng() % 6];
    const int block_n = (int[]){1, 3, 16, 64, 128, 176}[rng() % 6];
    const tessera::kernels::MaskBand band{qo, kv, kv - qo, causal, window >= kv ? -1 : window};
    ASSERT_EQ(tessera::plan::query_tiles(qo, block_m), (qo + block_m - 1) / block_m);
    for (int m0 = 0; m0 < qo; m0 += block_m) {
      const int last_row = std::min(m0 + block_m, qo) - 1;
      int64_t want = 0;
      for (int n0 = 0; n0 < kv; n0 += block_n) {
        const int n1 = std::min(n0 + block_n, kv);
        if (n1 > band.key_begin(m0) && n0 < band.key_end(last_row)) ++want;
      }
      ASSERT_EQ(tessera::plan::query_tile_kv_tiles(qo, kv, causal, window, m0, block_m, block_n), want)
          << "qo " << qo << " kv " << kv << " causal " << causal << " window " << window << " m0 " << m0
          << " block_n " << block_n;
    }
  }
  EXPECT_EQ(tessera::plan::query_tiles(0, 128), 0);
}
