// libFuzzer target: the decode planner on arbitrary capacities and batches. Every plan it accepts
// must pass the shared checker (every (request, KV head, key) covered once, merges well formed,
// inside the workspace bounds), be the same when planned again, and equal its image; a batch it
// refuses must be refused with tessera::Error. Anything else aborts (a finding).
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "common/decode_plan_check.h"
#include "format/bsr.h"
#include "fuzz/fuzz_input.h"
#include "plan/decode_plan.h"
#include "tessera/error.h"

using namespace tessera;

namespace {

bool same_bytes(const void* a, const void* b, size_t bytes) { return bytes == 0 || std::memcmp(a, b, bytes) == 0; }

[[noreturn]] void finding(const char* what, const std::string& detail) {
  std::fprintf(stderr, "fuzz_decode_plan: %s: %s\n", what, detail.c_str());
  std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  fuzz::FuzzInput in(data, size);
  plan::PlanCapacity cap;
  const int32_t kv_heads_options[] = {1, 2, 4, 8, 3, 32};
  const int32_t group_options[] = {1, 4, 8, 16, 2, 5};
  const int32_t head_dims[] = {128, 64, 256, 8};
  cap.num_kv_heads = in.pick(kv_heads_options);
  cap.num_qo_heads = cap.num_kv_heads * in.pick(group_options);
  cap.head_dim = in.pick(head_dims);
  cap.num_sms = static_cast<int32_t>(in.range(1, 160));
  cap.ctas_per_sm = static_cast<int32_t>(in.range(1, 4));
  cap.one_cta_per_sm_shape = cap.ctas_per_sm >= 2 && in.flag();
  const plan::OneCtaPerSmUse uses[] = {plan::OneCtaPerSmUse::kUnsplitLists, plan::OneCtaPerSmUse::kAlsoSplitLists,
                                       plan::OneCtaPerSmUse::kWheneverItFits};
  cap.one_cta_per_sm_use = in.pick(uses);
  cap.max_qo_len = static_cast<int32_t>(in.range(1, 8));
  cap.max_batch_size = static_cast<int32_t>(in.range(1, 300));
  cap.window_left = in.flag() ? static_cast<int32_t>(in.range(0, 5000)) : -1;
  plan::SplitPolicy policy;
  if (in.flag()) policy.merge_tree = false;
  if (in.flag()) policy.min_chunk_tokens = static_cast<int32_t>(in.range(1, 4096));
  if (in.range(0, 7) == 0) policy.split = false;  // batch-invariant plans
  const int32_t page_sizes[] = {16, 1, 64, 256, 7, 32};
  const int32_t page = in.pick(page_sizes);

  // The batch: lengths from a few scales (tiny, short, long, huge) so that skew is common.
  const int32_t batch = static_cast<int32_t>(in.range(0, cap.max_batch_size + 1));
  std::vector<int32_t> indptr{0}, indices, last, qo{0};
  for (int32_t r = 0; r < batch && !in.empty(); ++r) {
    const int64_t scales[] = {8, 512, 4096, 65536};
    const int64_t len = in.range(0, scales[in.range(0, 3)]);
    const int32_t pages = static_cast<int32_t>((len + page - 1) / page);
    if (indices.size() + pages > (1u << 20)) break;
    for (int32_t p = 0; p < pages; ++p) indices.push_back(static_cast<int32_t>(indices.size()));
    indptr.push_back(indptr.back() + pages);
    last.push_back(pages == 0 ? 0 : static_cast<int32_t>(len - int64_t(pages - 1) * page));
    qo.push_back(qo.back() + static_cast<int32_t>(in.range(0, cap.max_qo_len + (in.range(0, 15) == 0))));
  }
  const int32_t rows = static_cast<int32_t>(last.size());
  const format::BsrLayout kv = format::bsr_from_page_table(page, rows, indptr.data(), indices.data(), last.data());

  try {
    plan::DecodePlanner planner(cap, policy);
    if (cap.one_cta_per_sm_shape && in.range(0, 7) == 0) planner.pin_shape(plan::CtaShape::kOneCtaPerSm);
    const plan::Plan& first = planner.plan(kv, qo.data());
    const std::string bad = testing_support::check_decode_plan(first, kv, qo.data(), cap, planner, policy.granularity);
    if (!bad.empty()) finding("plan breaks a rule", bad);
    const std::vector<plan::WorkItem> items(first.work.begin(), first.work.end());
    const std::vector<plan::MergeRow> merges = first.merges;
    std::vector<unsigned char> image(planner.layout().plan_bytes);
    const plan::Plan& again = planner.plan(kv, qo.data(), image.data());
    if (again.work.size() != items.size() ||
        !same_bytes(again.work.data(), items.data(), items.size() * sizeof(plan::WorkItem)) ||
        again.merges.size() != merges.size() ||
        !same_bytes(again.merges.data(), merges.data(), merges.size() * sizeof(plan::MergeRow))) {
      finding("not deterministic", "a second plan of the same batch differs");
    }
    if (!same_bytes(image.data() + planner.layout().work, items.data(), items.size() * sizeof(plan::WorkItem))) {
      finding("image", "the plan image's work items differ from the plan's");
    }
  } catch (const Error&) {
    // A refused capacity or batch: fine, as long as it is a tessera::Error.
  }
  return 0;
}
