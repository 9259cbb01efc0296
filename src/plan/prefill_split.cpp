#include "plan/prefill_split.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace tessera::plan {

PrefillSplitCost hopper_prefill_split_cost(int head_dim, int block_m, int page_size) {
  PrefillSplitCost c;
  // The family's rate per SM, as TFLOP/s over the H200's 132 SMs. Pages of 64 tokens or more read
  // as fast as a ragged tensor (hd128 8K: 680; hd256 765, hd64 550; bench/results/2026-12-01_h200_
  // 8e515cb_prefill.json); smaller pages are copy-request-bound (page 16: 0.80 / 0.70 / 0.87 of
  // that, notes/prefill_hopper.md; hd128 fitted on the split sweep: 540).
  const bool small_pages = page_size < 64;
  const double tflops = head_dim == 256 ? (small_pages ? 535.0 : 765.0)
                        : head_dim == 64 ? (small_pages ? 480.0 : 550.0)
                                         : (small_pages ? 540.0 : 680.0);
  const double flops_per_key = 4.0 * block_m * head_dim;
  c.kv_tile_us = flops_per_key * 128.0 / (tflops * 1e12 / 132.0) * 1e6;
  // Fitted on the same sweep (q128 over 8K / 32K, 1-2 requests, 1-16 splits: the model within 5%
  // of every measured time, notes/prefill_paged.md).
  c.tile_start_us = 2.0;
  c.partial_gb_per_s = 3000.0;
  c.merge_launch_us = 4.0;
  return c;
}

PrefillSplitChoice choose_prefill_split(const PrefillSplitProblem& pr, const PrefillSplitCost& cost) {
  PrefillSplitChoice best;
  const int64_t rows = pr.batch > 0 ? pr.qo_indptr[pr.batch] - pr.qo_indptr[0] : 0;
  const double kv_tile_us = cost.kv_tile_us * pr.block_n / 128.0;
  // The model's step time at `splits` (< 0: nothing to compute).
  auto estimate = [&](int splits) {
    double longest = 0.0, total = 0.0;
    for (int64_t r = 0; r < pr.batch; ++r) {
      // Lengths past 2^30 only steer the estimate, and the band's int arithmetic stays in range.
      const int qo = std::min(pr.qo_indptr[r + 1] - pr.qo_indptr[r], int32_t(1) << 30);
      const int64_t pages = int64_t(pr.kv_indptr[r + 1]) - pr.kv_indptr[r];
      // run() rejects a table whose lengths the kernels cannot take; here they only steer the split.
      const int64_t keys = pages <= 0 ? 0 : (pages - 1) * pr.page_size + pr.last_page_len[r];
      const int kv = static_cast<int>(std::clamp<int64_t>(keys, 0, int64_t(1) << 30));
      for (int m0 = 0; m0 < qo; m0 += pr.block_m) {
        const int64_t tiles = query_tile_kv_tiles(qo, kv, pr.causal, pr.window_left, m0, pr.block_m, pr.block_n);
        const int64_t run = (tiles + splits - 1) / splits;
        longest = std::max(longest, cost.tile_start_us + run * kv_tile_us);
        total += splits * cost.tile_start_us + tiles * kv_tile_us;
      }
    }
    if (longest == 0.0) return -1.0;
    total *= pr.num_qo_heads;
    const double waves = std::ceil(total / (double(pr.slots) * longest));
    double us = waves * longest;
    if (splits > 1) {
      const double bytes = double(rows) * pr.num_qo_heads * pr.packed_heads * splits * (pr.head_dim + 1) * 4.0 * 2.0;
      us += cost.merge_launch_us + bytes / (cost.partial_gb_per_s * 1e3);
    }
    return us;
  };
  best.unsplit_us = best.estimated_us = std::max(0.0, estimate(1));
  if (best.unsplit_us == 0.0) return best;  // nothing to compute
  // Every count up to 16, then a ladder (each estimate walks every query tile).
  constexpr int kLadder[] = {20, 24, 32, 40, 48, 64, 80, 96, 128, 160, 192, 256};
  auto consider = [&](int splits) {
    const double us = estimate(splits);
    if (us < best.estimated_us) {
      best.splits = splits;
      best.estimated_us = us;
    }
  };
  for (int splits = 2; splits <= std::min(16, pr.max_splits); ++splits) consider(splits);
  for (int splits : kLadder) {
    if (splits <= pr.max_splits) consider(splits);
  }
  return best;
}

}  // namespace tessera::plan
