#include "common/decode_plan_check.h"

#include <algorithm>
#include <numeric>
#include <sstream>
#include <vector>

namespace tessera::testing_support {
namespace {

struct Fail {
  std::ostringstream s;
  template <typename T>
  Fail& operator<<(const T& v) {
    s << v;
    return *this;
  }
};

}  // namespace

std::string check_decode_plan(const plan::Plan& plan, const format::BsrLayout& kv, const int32_t* qo_indptr,
                              const plan::PlanCapacity& cap, const plan::DecodePlanner& planner,
                              int32_t granularity) {
  using plan::MergeRow;
  using plan::Task;
  const int32_t batch = kv.num_rows;
  const int32_t heads = cap.num_kv_heads;
  const int32_t group = cap.num_qo_heads / cap.num_kv_heads;
  const int64_t granule = std::lcm<int64_t>(kv.block_size, granularity);
  auto fail = [](Fail& f) { return f.s.str(); };
  Fail f;
  if (plan.num_tasks != static_cast<int64_t>(plan.work.size()) * heads) return fail(f << "num_tasks is not items x heads");
  if (plan.num_tasks > planner.max_work_items()) return fail(f << plan.num_tasks << " tasks exceed max_work_items");
  if (plan.num_slots() > planner.max_slots()) return fail(f << plan.num_slots() << " slots exceed max_slots");
  if (static_cast<int64_t>(plan.merges.size()) > planner.max_merges()) return fail(f << "merge rows exceed max_merges");
  if (plan.partial_rows() > planner.max_partial_rows()) return fail(f << "partial rows exceed max_partial_rows");
  for (int32_t s = 0; s < plan.num_slots(); ++s) {
    if (plan.slot_row_offset[s + 1] < plan.slot_row_offset[s]) return fail(f << "slot offsets decrease at " << s);
  }
  const std::vector<Task> tasks = plan.tasks();
  std::vector<int32_t> slot_writers(plan.num_slots(), 0);
  std::vector<int32_t> children(plan.merges.size(), 0);
  for (size_t m = 0; m < plan.merges.size(); ++m) {
    const MergeRow& row = plan.merges[m];
    if (row.num_slots < 2) return fail(f << "merge row " << m << " merges " << row.num_slots << " partials");
    if (row.first_slot < 0 || row.first_slot + row.num_slots > plan.num_slots()) {
      return fail(f << "merge row " << m << " reaches past the slots");
    }
    if (row.target_slot < 0) {
      if (row.parent != -1) return fail(f << "root merge row " << m << " has a parent");
      continue;
    }
    if (row.target_slot >= plan.num_slots() || row.parent < 0 || row.parent >= static_cast<int32_t>(plan.merges.size())) {
      return fail(f << "group merge row " << m << " has a bad target or parent");
    }
    const MergeRow& up = plan.merges[row.parent];
    if (up.target_slot != -1) return fail(f << "merge row " << m << ": more than two levels");
    if (up.request != row.request || up.kv_head != row.kv_head) return fail(f << "merge row " << m << "'s parent is another pair's");
    if (row.target_slot < up.first_slot || row.target_slot >= up.first_slot + up.num_slots) {
      return fail(f << "merge row " << m << " writes outside its parent's slots");
    }
    ++slot_writers[row.target_slot];
    ++children[row.parent];
  }
  std::vector<std::vector<const Task*>> pairs(size_t(batch) * heads);
  for (const Task& t : tasks) {
    if (t.request < 0 || t.request >= batch || t.kv_head < 0 || t.kv_head >= heads) return fail(f << "task out of range");
    pairs[size_t(t.request) * heads + t.kv_head].push_back(&t);
  }
  std::vector<int32_t> roots_seen(plan.merges.size(), 0);
  int32_t split_pairs = 0;
  for (int32_t r = 0; r < batch; ++r) {
    const int64_t qo_len = qo_indptr[r + 1] - qo_indptr[r];
    const int64_t rows = qo_len * group;
    const int64_t tokens = kv.row_tokens(r);
    const int64_t first_key = cap.window_left >= 0 ? std::max<int64_t>(0, tokens - qo_len - cap.window_left) : 0;
    for (int32_t h = 0; h < heads; ++h) {
      auto list = pairs[size_t(r) * heads + h];
      if (qo_len == 0) {
        if (!list.empty()) return fail(f << "request " << r << " has no query but got work");
        continue;
      }
      if (list.empty()) return fail(f << "request " << r << " head " << h << " has no work");
      std::sort(list.begin(), list.end(), [](const Task* a, const Task* b) { return a->kv_begin < b->kv_begin; });
      int64_t pos = first_key;
      for (size_t i = 0; i < list.size(); ++i) {
        const Task* t = list[i];
        if (t->kv_begin != pos || t->kv_end < t->kv_begin) {
          return fail(f << "request " << r << " head " << h << ": chunks are not contiguous at key " << pos);
        }
        if (list.size() > 1) {
          const int64_t length = t->kv_end - t->kv_begin, first_length = list[0]->kv_end - list[0]->kv_begin;
          if (length > plan.chunk_tokens) return fail(f << "request " << r << ": a chunk longer than chunk_tokens");
          if ((t->kv_begin - first_key) % granule != 0) return fail(f << "request " << r << ": a chunk off the granule");
          if (i + 1 < list.size() && length != first_length) return fail(f << "request " << r << ": unequal chunks");
        }
        pos = t->kv_end;
      }
      if (pos != tokens) return fail(f << "request " << r << " head " << h << ": chunks end at " << pos << ", not " << tokens);
      if (list.size() == 1) {
        if (list[0]->partial_slot != -1 || list[0]->merge != -1) return fail(f << "request " << r << ": unsplit but parked");
        continue;
      }
      ++split_pairs;
      int32_t root = -1;
      for (const Task* t : list) {
        if (t->partial_slot < 0 || t->partial_slot >= plan.num_slots()) return fail(f << "request " << r << ": bad slot");
        if (t->merge < 0 || t->merge >= static_cast<int32_t>(plan.merges.size())) return fail(f << "request " << r << ": bad merge row");
        ++slot_writers[t->partial_slot];
        const MergeRow& m = plan.merges[t->merge];
        if (m.request != r || m.kv_head != h) return fail(f << "request " << r << ": merged by another pair's row");
        if (t->partial_slot < m.first_slot || t->partial_slot >= m.first_slot + m.num_slots) {
          return fail(f << "request " << r << ": its slot is outside its merge row");
        }
        ++children[t->merge];
        const int32_t top = m.parent >= 0 ? m.parent : t->merge;
        if (root >= 0 && top != root) return fail(f << "request " << r << " head " << h << ": two root merges");
        root = top;
      }
      ++roots_seen[root];
      const MergeRow& m = plan.merges[root];
      for (int32_t s = m.first_slot; s < m.first_slot + m.num_slots; ++s) {
        if (plan.slot_row_offset[s + 1] - plan.slot_row_offset[s] != rows) return fail(f << "request " << r << ": slot rows");
      }
    }
  }
  for (int32_t s = 0; s < plan.num_slots(); ++s) {
    if (slot_writers[s] != 1) return fail(f << "slot " << s << " is written " << slot_writers[s] << " times");
  }
  int32_t roots = 0;
  for (size_t m = 0; m < plan.merges.size(); ++m) {
    if (children[m] != plan.merges[m].num_slots) return fail(f << "merge row " << m << " waits for slots nobody fills");
    if (plan.merges[m].target_slot < 0) {
      if (roots_seen[m] != 1) return fail(f << "root merge row " << m << " belongs to " << roots_seen[m] << " pairs");
      ++roots;
    }
  }
  if (roots != split_pairs || plan.split_rows != split_pairs) return fail(f << "split pairs and root merges disagree");
  return "";
}

}  // namespace tessera::testing_support
