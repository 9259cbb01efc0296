// The decode planner: once per serving step, on the CPU, it turns the batch description (query
// lengths, the page table as a BSR view, the head configuration) into the work list that every
// layer's decode kernel runs: which CTA reads which (request, KV head, token range), where split
// chunks park their partial states, and which partials each (request, KV head) merges.
//
// Split-KV (flash-decoding) comes from a cost model: the cost of a work item is the KV tokens it
// reads. The planner picks the smallest chunk length (a multiple of the page-aligned granularity,
// at least min_chunk_tokens) whose work list still fits one wave of CTAs (num_sms x ctas_per_sm);
// when even unsplit requests overfill the wave, only requests longer than the average load per
// CTA slot are split, to that length, so a skewed batch's few long requests do not form the tail.
// Requests no longer than the chunk write their output directly; longer ones are split into chunks
// merged afterwards. Work is ordered longest first (ties by request, then chunk). A work item
// covers every KV head of its token range: the decode kernel runs one CTA task per (item, KV
// head), task t being item t / num_kv_heads and head t % num_kv_heads, so the hardware hands
// tasks to SMs as they free up. (One item per head made the planner write num_kv_heads times the
// bytes: 2048 items of 40 bytes at 256 requests x 8 KV heads, most of its time.)
//
// CTA shape: the decode kernel has a default shape (ctas_per_sm CTAs per SM) and, where the GPU
// holds it, a one-CTA-per-SM shape with twice the warps and stage bytes (one_cta_per_sm_shape).
// The planner balances the list for both and takes the one-per-SM plan when it fits one wave of
// num_sms CTAs, its longest task is at most ctas_per_sm x the default plan's (a CTA of that shape
// streams as fast as the default shape's CTAs of one SM) with a 1/16 margin, and it leaves every
// item unsplit -- a batch
// whose (request, KV head) items about fill the SMs then runs without partials or merges -- or the
// capacity says the shape pays for split lists as well (one_cta_per_sm_for_splits: hd256, whose
// default CTA has only 2 warps). A plan's shape can be pinned (CUDA-graph capture fixed the
// kernel).
//
// Requests with no query token this step get no work. Deterministic, allocation-free after
// construction (every buffer is sized from PlanCapacity, so
// the device copy of the plan has fixed addresses for CUDA-graph replay), pure C++.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "format/bsr.h"

namespace tessera::plan {

// Fixed at creation; a step that exceeds it is rejected with tessera::Error.
struct PlanCapacity {
  int32_t max_batch_size = 0;
  int32_t max_qo_len = 1;   // query tokens per request: 1 for decode, up to 8 for verification
  int32_t num_qo_heads = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
  int32_t num_sms = 0;      // of the GPU the plan runs on
  int32_t ctas_per_sm = 1;  // resident CTAs of the decode kernel per SM (its default shape)
  bool one_cta_per_sm_shape = false;  // the kernel also has the one-CTA-per-SM shape here
  bool one_cta_per_sm_for_splits = false;  // ... and it pays for split lists too (see the planner)
  int32_t window_left = -1; // >= 0: sliding window; only keys the window can see are planned
};

// The decode kernel's CTA shapes: the default one (PlanCapacity::ctas_per_sm CTAs per SM), and one
// CTA per SM with twice the warps and stage bytes.
enum class CtaShape : int8_t { kDefault, kOneCtaPerSm };

struct SplitPolicy {
  int32_t waves = 1;               // a split list may fill this many waves of CTAs
  int32_t min_chunk_tokens = 256;  // a split never makes chunks shorter than this
  int32_t granularity = 16;        // chunk lengths are multiples of lcm(page_size, granularity)
};

// Per request, what the kernels need to find its rows; every work item carries its request's
// copy, so a CTA's first load of the plan tells it everything (no dependent load).
struct RequestInfo {
  int32_t q_start;     // first query row (qo_indptr[r])
  int32_t qo_len;
  int32_t kv_len;
  int32_t page_begin;  // kv_indptr[r]: its first entry of kv_indices
};

struct WorkItem {  // one request's query rows over a token range, for every KV head
  int32_t request;
  int32_t kv_begin;      // tokens [kv_begin, kv_end) of the request's KV (a window starts late)
  int32_t kv_end;
  int32_t partial_slot;  // -1: writes O / LSE directly; else KV head 0's partial-state slot
  int32_t merge;         // KV head 0's merge row when split (-1 otherwise)
  int32_t slot_stride;   // split: KV head h's slot is partial_slot + h x slot_stride, its merge
                         // row merge + h
  RequestInfo req;
};

// What one CTA task of the decode kernel does: a work item for one KV head.
struct Task {
  int32_t request;
  int32_t kv_head;
  int32_t kv_begin;
  int32_t kv_end;
  int32_t partial_slot;  // -1: writes O / LSE directly
  int32_t merge;         // -1 unless split
};

// The task `kv_head` of work item `w` (the decode kernel derives it the same way).
#if defined(__CUDACC__)
__host__ __device__
#endif
inline Task task_of(const WorkItem& w, int32_t kv_head) {
  const bool split = w.partial_slot >= 0;
  return {w.request, kv_head, w.kv_begin, w.kv_end, split ? w.partial_slot + kv_head * w.slot_stride : -1,
          split ? w.merge + kv_head : -1};
}

// The slots of one merge row are consecutive (first_slot .. first_slot + num_slots - 1) and hold
// the same rows (the request's qo_len x group), so slot s's rows start at
// slot_row_offset[first_slot] + (s - first_slot) x rows.
struct MergeRow {  // one (request, KV head) whose chunk partials are merged into O / LSE
  int32_t request;
  int32_t kv_head;
  int32_t first_slot;
  int32_t num_slots;
};

// The work list of a plan: a view of the planner's own storage, or of the image plan() emitted
// it into (so the items are written once, straight into the pinned staging buffer).
class WorkList {
 public:
  const WorkItem* data() const { return data_; }
  std::size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  const WorkItem& operator[](std::size_t i) const { return data_[i]; }
  const WorkItem& front() const { return data_[0]; }
  const WorkItem& back() const { return data_[size_ - 1]; }
  const WorkItem* begin() const { return data_; }
  const WorkItem* end() const { return data_ + size_; }

 private:
  friend class DecodePlanner;
  const WorkItem* data_ = nullptr;
  std::size_t size_ = 0;
};

struct Plan {
  WorkList work;                          // launch order; each item runs once per KV head
  int32_t num_tasks = 0;                  // work items x KV heads: the CTAs' worth of work
  std::vector<MergeRow> merges;
  std::vector<RequestInfo> requests;      // [batch] (each work item carries its own copy)
  std::vector<int64_t> slot_row_offset;   // [slots + 1]: partial rows (qo_len x group) before slot s
  int32_t chunk_tokens = 0;               // chosen chunk length; 0 when nothing is split
  int32_t wave_ctas = 0;                  // CTAs of the wave it was balanced for: num_sms x
                                          // ctas_per_sm x waves, or num_sms x waves (one per SM)
  CtaShape shape = CtaShape::kDefault;    // the kernel shape it was balanced for

  int32_t num_slots() const { return static_cast<int32_t>(slot_row_offset.size()) - 1; }
  // Every task in launch order (task t = item t / heads, head t % heads). For tests and tools.
  std::vector<Task> tasks() const {
    std::vector<Task> all;
    const int32_t heads = work.empty() ? 0 : num_tasks / static_cast<int32_t>(work.size());
    for (const WorkItem& w : work)
      for (int32_t h = 0; h < heads; ++h) all.push_back(task_of(w, h));
    return all;
  }
  int64_t partial_rows() const { return slot_row_offset.back(); }
};

// Where each part of a plan lives in the user's device workspace: byte offsets fixed by the
// capacity (so a captured CUDA graph sees the same addresses every step), each 256-byte aligned.
// The plan arrays come first, so one host-to-device copy of the first `plan_bytes` bytes carries
// the whole plan; the fp32 partial states of split chunks follow.
struct PlanHeader {
  int32_t num_work;  // tasks: work items x KV heads
  int32_t num_merges;
  int32_t num_slots;
  int32_t chunk_tokens;
};

struct WorkspaceLayout {
  std::size_t header = 0;       // PlanHeader
  std::size_t work = 0;         // WorkItem[max_work_items] (at most one item per task)
  std::size_t merges = 0;       // MergeRow[max_slots]
  std::size_t slot_rows = 0;    // int64_t[max_slots + 1]
  std::size_t merge_counters = 0;  // int32_t[max_slots]: chunks finished per merge row, zeroed
                                   // by every plan copy and reset by the CTA that merges
  std::size_t plan_bytes = 0;   // end of the plan arrays: the per-step copy
  std::size_t partial_o = 0;    // float[max_partial_rows x head_dim]
  std::size_t partial_lse = 0;  // float[max_partial_rows]
  std::size_t total = 0;
};

class DecodePlanner {
 public:
  explicit DecodePlanner(const PlanCapacity& capacity, const SplitPolicy& policy = {});

  // Plans one step. kv: the page table's BSR view (host); qo_indptr: host [batch + 1]. The result
  // stays valid until the next call. With `image` (host memory of at least layout().plan_bytes
  // bytes, ideally pinned), the whole plan image is written there as well, the work items
  // directly (no second pass over them), and the result's work list points into it.
  const Plan& plan(const format::BsrLayout& kv, const int32_t* qo_indptr, void* image = nullptr);

  // Upper bounds implied by the capacity: what the device workspace must hold. max_work_items
  // bounds the tasks (a captured launch's grid) and so the items too.
  int32_t max_work_items() const { return max_work_; }
  int32_t max_slots() const { return max_slots_; }
  int64_t max_partial_rows() const;
  // The workspace's sub-buffers for this capacity; total is what the user allocates once.
  const WorkspaceLayout& layout() const { return layout_; }
  std::size_t workspace_bytes() const { return layout_.total; }

  // Plans every later step for one kernel shape (kOneCtaPerSm needs the capacity's
  // one_cta_per_sm_shape: tessera::Error otherwise).
  void pin_shape(CtaShape shape);

  // Writes the last plan into `image` (host memory, at least layout().plan_bytes bytes, ideally
  // pinned) at the layout's offsets, ready for one asynchronous copy to the workspace. (plan()
  // with an image does this itself.)
  void write_image(void* image) const;

 private:
  int64_t items_for_chunk(int64_t chunk) const;
  // The smallest chunk (tokens) whose work list fits `wave` CTAs, or the overfilled rule's.
  int64_t chunk_for_wave(int32_t wave, int64_t granularity, int64_t longest) const;

  PlanCapacity cap_;
  SplitPolicy policy_;
  int32_t group_ = 1;
  int32_t max_work_ = 0;
  int32_t max_slots_ = 0;
  bool shape_pinned_ = false;
  CtaShape pinned_shape_ = CtaShape::kDefault;
  WorkspaceLayout layout_;
  Plan plan_;
  std::vector<WorkItem> work_storage_;  // the work list when plan() is given no image
  std::vector<int64_t> keys_;     // (INT32_MAX - kv_len) << 32 | request: longest first
  std::vector<int64_t> kv_len_;   // per request, this step: the keys it reads (its cost)
  std::vector<int32_t> first_key_;  // per request: its first key the window can see (0 without)
  std::vector<uint8_t> has_query_;  // per request: qo_len > 0 (otherwise no work at all)
};

}  // namespace tessera::plan
