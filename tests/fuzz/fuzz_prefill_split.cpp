// libFuzzer target: the paged prefill's split planner (plan/prefill_split.h) on arbitrary batches.
// BatchPrefillPaged::plan validates qo_indptr and hands the page table's host copies over as they
// are (run() checks them), so the tables here are anything: non-monotone indptr, negative or huge
// last-page lengths, windows past every request. Under ASan + UBSan nothing may misbehave, the
// count stays in [1, max(1, max_splits)], and the estimates are finite, non-negative and the
// chosen one no worse than no split. Anything else aborts (a finding).
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "fuzz/fuzz_input.h"
#include "plan/prefill_split.h"

using namespace tessera;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  fuzz::FuzzInput in(data, size);
  const int head_dims[] = {128, 64, 256};
  const int block_ms[] = {128, 192, 64};
  const int block_ns[] = {128, 80, 176};
  const int page_sizes[] = {16, 1, 8, 64, 256, 7};
  plan::PrefillSplitProblem p;
  p.head_dim = in.pick(head_dims);
  p.block_m = in.pick(block_ms);
  p.block_n = in.pick(block_ns);
  p.page_size = in.pick(page_sizes);
  p.num_qo_heads = static_cast<int>(in.range(1, 128));
  p.causal = in.flag();
  p.window_left = in.flag() ? static_cast<int>(in.range(-1, 0x7fffffff)) : -1;
  p.slots = static_cast<int>(in.range(0, 300));
  p.max_splits = static_cast<int>(in.range(0, 300));
  p.batch = in.range(0, 40);
  std::vector<int32_t> qo(p.batch + 1, 0), kv(p.batch + 1, 0), last(p.batch + 1, 0);
  for (int64_t r = 0; r < p.batch; ++r) {
    qo[r + 1] = qo[r] + static_cast<int32_t>(in.range(0, in.flag() ? 5000 : 300));
    kv[r + 1] = static_cast<int32_t>(in.flag() ? int64_t(in.bits(4)) : int64_t(kv[r]) + in.range(0, 4096));
    last[r] = in.flag() ? static_cast<int32_t>(in.bits(4)) : static_cast<int32_t>(in.range(0, p.page_size));
  }
  p.qo_indptr = qo.data();
  p.kv_indptr = kv.data();
  p.last_page_len = last.data();
  const plan::PrefillSplitChoice c =
      plan::choose_prefill_split(p, plan::hopper_prefill_split_cost(p.head_dim, p.block_m, p.page_size));
  const bool ok = c.splits >= 1 && c.splits <= std::max(1, p.max_splits) && !std::isnan(c.estimated_us) &&
                  !std::isnan(c.unsplit_us) && c.estimated_us >= 0 && c.estimated_us <= c.unsplit_us;
  if (!ok) {
    std::fprintf(stderr, "fuzz_prefill_split: splits %d of at most %d, estimate %g, unsplit %g\n", c.splits,
                 p.max_splits, c.estimated_us, c.unsplit_us);
    std::abort();
  }
  return 0;
}
