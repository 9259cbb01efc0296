// libFuzzer target: the paged prefill's split planner (plan/prefill_split.h) on arbitrary batches.
// BatchPrefillPaged::plan validates qo_indptr and hands the page table's host copies over as they
// are (run() checks them), so the tables here are anything: non-monotone indptr, negative or huge
// last-page lengths, windows past every request. Under ASan + UBSan nothing may misbehave, the
// count stays in [1, max(1, max_splits)], and the estimates are finite, non-negative and the
// chosen one no worse than no split. Where the table is one plan() accepts (kv_indptr
// non-decreasing, last-page lengths in 1..page_size), the fixed-grid schedule (plan/
// prefill_schedule.h) of the chosen split must list every tile with rows exactly once in slot lists
// that cover [0, tiles). Anything else aborts (a finding).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "fuzz/fuzz_input.h"
#include "plan/prefill_schedule.h"
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
  bool valid = p.slots >= 1;
  for (int64_t r = 0; r < p.batch && valid; ++r) {
    const int64_t pages = int64_t(kv[r + 1]) - kv[r];
    valid = pages >= 0 && (pages == 0 || (last[r] >= 1 && last[r] <= p.page_size)) && kv[r] >= 0 && kv[r + 1] <= (1 << 24);
  }
  if (!valid) return 0;
  plan::PrefillScheduleProblem sp;
  sp.qo_indptr = p.qo_indptr;
  sp.kv_indptr = p.kv_indptr;
  sp.last_page_len = p.last_page_len;
  sp.page_size = p.page_size;
  sp.batch = p.batch;
  sp.num_qo_heads = p.num_qo_heads;
  sp.block_m = p.block_m;
  sp.block_n = p.block_n;
  sp.causal = p.causal;
  sp.window_left = p.window_left;
  sp.kv_splits = c.splits;
  sp.slots = p.slots;
  int32_t max_qo = 0;
  for (int64_t r = 0; r < p.batch; ++r) max_qo = std::max(max_qo, qo[r + 1] - qo[r]);
  const int64_t m_tiles = (int64_t(max_qo) + sp.block_m - 1) / sp.block_m;
  if (p.batch * sp.num_qo_heads * m_tiles * sp.kv_splits > (int64_t(1) << 22)) return 0;  // bounded per input
  const int64_t tiles = plan::prefill_schedule_tiles(sp);
  std::vector<int32_t> slot_begin(static_cast<size_t>(sp.slots) + 1), positions(static_cast<size_t>(tiles));
  plan::PrefillScheduleScratch scratch;
  const plan::PrefillScheduleResult res = plan::schedule_prefill(sp, slot_begin.data(), positions.data(), scratch);
  std::vector<char> seen(size_t(p.batch * sp.num_qo_heads * m_tiles * sp.kv_splits), 0);
  bool listed = res.tiles == tiles && slot_begin[0] == 0 && slot_begin[size_t(sp.slots)] == tiles;
  for (int s = 0; s < sp.slots && listed; ++s) listed = slot_begin[size_t(s)] <= slot_begin[size_t(s) + 1];
  for (int64_t t = 0; t < tiles && listed; ++t) {
    const int32_t pos = positions[size_t(t)];
    listed = pos >= 0 && size_t(pos) < seen.size() && !seen[size_t(pos)];
    if (!listed) break;
    seen[size_t(pos)] = 1;
    const int64_t pair = pos / sp.kv_splits / m_tiles, m_tile = pos / sp.kv_splits - pair * m_tiles;
    const int64_t request = pair / sp.num_qo_heads;
    listed = m_tile * sp.block_m < qo[size_t(request) + 1] - qo[size_t(request)];
  }
  if (!listed) {
    std::fprintf(stderr, "fuzz_prefill_split: the schedule of %lld tiles over %d slots is not a partition\n",
                 static_cast<long long>(tiles), sp.slots);
    std::abort();
  }
  return 0;
}
