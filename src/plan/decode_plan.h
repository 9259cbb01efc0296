// The decode planner: once per serving step, on the CPU, it turns the batch description (query
// lengths, the page table as a BSR view, the head configuration) into the work list that every
// layer's decode kernel runs: which CTA reads which (request, KV head, token range), where split
// chunks park their partial states, and how the partials of each (request, KV head) are merged.
//
// Objective: the step's critical path (makespan), under a cost model of the decode kernel
// (CostModel: a task costs a start-up latency plus its K/V bytes at one CTA slot's share of the
// read bandwidth; a merge costs a start-up plus its partial rows at one CTA's merge rate; the
// constants were measured on the H200, notes/decode_plan.md). The kernel's CTAs take tasks in
// launch order as CTA slots free up, so the planner emits them longest first and the schedule is
// list scheduling (LPT) over the wave's slots; it estimates that schedule's makespan for a few
// chunk lengths and keeps the best:
//  - no split; the smallest chunk whose list fits one wave (a batch that under-fills the GPU);
//    and a geometric ladder of chunk lengths around the one whose cost equals the average load
//    per slot (a skewed batch: its long requests are split to about that load and short ones fill
//    in). Long requests are cut into equal chunks (page-aligned), so no short remainder chunk.
//  - a batch whose longest request is no longer than the average load per slot, or no longer than
//    the minimum chunk, is never split (no estimate is made: splitting only adds work).
// A split (request, KV head) merges its chunk partials in the CTA that finishes the last of them;
// with many chunks the merge is a two-level tree (about sqrt(chunks) groups, each merged by the
// CTA finishing the group's last chunk, into a group partial; the last group's merger merges the
// group partials) wherever the model says the tree ends earlier than one CTA merging everything
// (one CTA merges at ~23 GB/s: 200 chunks of 8 rows would take ~15 us on their own).
// A work item covers every KV head of its token range: the decode kernel runs one CTA task per
// (item, KV head), task t being item t / num_kv_heads and head t % num_kv_heads, so the hardware
// hands tasks to SMs as they free up. (One item per head made the planner write num_kv_heads times
// the bytes: 2048 items of 40 bytes at 256 requests x 8 KV heads, most of its time.)
//
// CTA shape: the decode kernel has a default shape (ctas_per_sm CTAs per SM) and, where the GPU
// holds it, a one-CTA-per-SM shape with twice the warps and stage bytes (one_cta_per_sm_shape),
// whose CTA streams at the whole SM's rate. The planner estimates both (the second only when the
// batch's unsplit items fit num_sms CTAs) and takes the one-per-SM plan when its makespan is at
// most 1/16 longer than the default plan's (it writes fewer partials and merges) and it leaves
// every item unsplit, or the capacity says the shape pays for split lists as well
// (OneCtaPerSmUse::kAlsoSplitLists: hd256, whose default CTA has only 2 warps). Where the
// capacity says it always pays (kWheneverItFits: one KV head), the default shape is not estimated
// at all when the batch fits. A plan's shape can be pinned (CUDA-graph capture fixed the kernel).
//
// Requests with no query token this step get no work. Deterministic, allocation-free after
// construction (every buffer is sized from PlanCapacity, so the device copy of the plan has fixed
// addresses for CUDA-graph replay), pure C++.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "format/bsr.h"

namespace tessera::plan {

// When the planner takes the decode kernel's one-CTA-per-SM shape, where the kernel has it and the
// step's unsplit items fit num_sms CTAs (see the header comment).
enum class OneCtaPerSmUse : int8_t {
  kUnsplitLists,    // for a list that splits nothing, when its makespan is within 1/16 of the default's
  kAlsoSplitLists,  // for split lists too, by the same comparison (hd256)
  kWheneverItFits,  // always, without estimating the default shape (one KV head, see decode_api.cpp)
};

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
  OneCtaPerSmUse one_cta_per_sm_use = OneCtaPerSmUse::kUnsplitLists;  // ... and when it is taken
  int32_t window_left = -1; // >= 0: sliding window; only keys the window can see are planned
};

// The decode kernel's CTA shapes: the default one (PlanCapacity::ctas_per_sm CTAs per SM), and one
// CTA per SM with twice the warps and stage bytes.
enum class CtaShape : int8_t { kDefault, kOneCtaPerSm };

// The decode kernel's costs, as the planner models them (measured on the H200 at hd128,
// notes/decode_plan.md "Cost model"). Times in microseconds, rates in bytes per us. A task
// streams its K/V at min(its CTA's peak, the read bandwidth / the tasks streaming with it), the
// tasks of a round being those that share the wave's slots: a full wave splits the bandwidth
// (b16 x 8K split in two: 16.7 GB/s per CTA), a partial round leaves each CTA more of it, up to
// the CTA's peak (b17 x 8K unsplit, 136 CTAs of the default shape: 27 GB/s each) or, on an SM
// holding two, half of that SM's peak (b1 x 32K in 21 chunks, 168 CTAs: 23.6 GB/s each).
struct CostModel {
  double sm_read_bytes_per_us = 35000;   // the read bandwidth per SM (the read ceiling, 4.62 TB/s / 132)
  double cta_peak_bytes_per_us = 27000;  // a default-shape CTA alone on its SM
  double shared_sm_peak_bytes_per_us = 47000;  // an SM holding several of them (all together)
  double one_cta_per_sm_peak_bytes_per_us = 34000;  // a CTA of the one-CTA-per-SM shape
  double task_start_us = 2.0;     // a task's first K/V tile: work item, page ids, first stages
  double merge_start_us = 1.9;    // the last chunk's combine, partial write and count, the merge's
                                  // row statistics and output
  double merge_bytes_per_us = 23000;  // one CTA staging and folding partial rows (66 KB in 2.9 us)
};

struct SplitPolicy {
  int32_t min_chunk_tokens = 128;  // a split never makes chunks shorter than this (two K/V stages)
  int32_t granularity = 16;        // chunk lengths are multiples of lcm(page_size, granularity)
  // A split list's chunk partials: at most this many per CTA slot of the wave (bounds the
  // workspace; the chunk ladder's shortest rungs are skipped when they would exceed it).
  int32_t max_chunks_per_slot = 2;
  bool merge_tree = true;          // two-level merges where the model says they end earlier
  // false: no request is ever split (one work item per request and KV head, whatever the batch).
  // With the kernel shape pinned too (pin_shape), a request's plan, and so its output bits, no
  // longer depends on the rest of the batch (BatchDecoder's batch_invariant mode).
  bool split = true;
  // > 0: every request longer than this many tokens splits into chunks of at most this length
  // (chunk_length(): balanced, multiples of the granule), whatever the rest of the step, in place
  // of the cost model's step-wide choice; each request's merge is decided by its own chunk count.
  // With the shape pinned, a request's plan then depends on its own length alone, and long
  // requests still spread over many CTAs (BatchDecoder's batch_invariant mode with a chunk).
  int32_t fixed_chunk_tokens = 0;
  // > 0: the chunk partials the workspace holds (else max_chunks_per_slot x the wave); a plan
  // with a fixed chunk that needs more is refused.
  int64_t max_chunk_partials = 0;
  CostModel cost;
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
// A merge row folds the partials of consecutive slots into O / LSE (target_slot -1) or, in a
// two-level merge, into the group partial `target_slot`, after which the merging CTA counts at
// merge row `parent` (the CTA that completes the parent's count merges it).
struct MergeRow {  // one (request, KV head), or one group of its chunks
  int32_t request;
  int32_t kv_head;
  int32_t first_slot;
  int32_t num_slots;
  int32_t target_slot;  // -1: writes O / LSE; else the group partial's slot
  int32_t parent;       // -1: none; else the merge row that merges target_slot
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
  int32_t chunk_tokens = 0;               // the longest chunk of a split request (a request's
                                          // chunks are equal but its last); 0 when none is split
  int32_t wave_ctas = 0;                  // CTA slots it was balanced for: num_sms x ctas_per_sm,
                                          // or num_sms (one CTA per SM)
  CtaShape shape = CtaShape::kDefault;    // the kernel shape it was balanced for
  double estimated_us = 0;                // the cost model's makespan of this plan
  int32_t split_rows = 0;                 // (request, KV head) pairs split into chunks

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
  std::size_t merges = 0;       // MergeRow[max_merges]
  std::size_t slot_rows = 0;    // int64_t[max_slots + 1]
  std::size_t merge_counters = 0;  // int32_t[max_merges]: slots finished per merge row, zeroed
                                   // by every plan copy and reset by the CTA that merges
  std::size_t plan_bytes = 0;   // end of the plan arrays: the per-step copy
  std::size_t partial_o = 0;    // float[max_partial_rows x head_dim]
  std::size_t partial_lse = 0;  // float[max_partial_rows]
  std::size_t total = 0;
};

class DecodePlanner {
 public:
  // entry_point: the public entry that owns this planner, named by its errors
  // ("tessera::BatchDecoder: argument 'max_batch_size': ...", "tessera::BatchDecoder::plan: ...").
  explicit DecodePlanner(const PlanCapacity& capacity, const SplitPolicy& policy = {},
                         const char* entry_point = "DecodePlanner");

  // Plans one step. kv: the page table's BSR view (host); qo_indptr: host [batch + 1]. The result
  // stays valid until the next call. With `image` (host memory of at least layout().plan_bytes
  // bytes, ideally pinned), the whole plan image is written there as well, the work items
  // directly (no second pass over them), and the result's work list points into it.
  const Plan& plan(const format::BsrLayout& kv, const int32_t* qo_indptr, void* image = nullptr);

  // Upper bounds implied by the capacity: what the device workspace must hold. max_work_items
  // bounds the tasks (a captured launch's grid) and so the items too.
  int32_t max_work_items() const { return max_work_; }
  int32_t max_slots() const { return max_slots_; }
  int32_t max_merges() const { return max_merges_; }
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
  // CTA slots of one kernel shape and the bytes per microsecond one of its CTAs can stream.
  struct Wave {
    int32_t ctas;
    double cta_peak_bytes_per_us;
  };
  struct Choice {
    int64_t chunk;  // chunk target in tokens (>= longest: nothing split)
    double makespan_us;
  };
  struct SplitCount {
    int64_t items;        // tasks: work items x KV heads
    int64_t chunk_slots;  // partial slots of the split rows
  };
  // With task_limit, counting stops once the tasks pass it: items is then only known to exceed it
  // (and chunk_slots is partial).
  SplitCount split_count(int64_t chunk, int64_t task_limit = INT64_MAX) const;
  // Chunks of a request of `len` tokens under the chunk target (equal lengths, granule-aligned).
  int64_t chunk_length(int64_t len, int64_t chunk) const;
  // Microseconds per K/V token of one KV head while `concurrent` tasks stream.
  double token_us(const Wave& wave, int64_t concurrent) const;
  double task_us(int64_t tokens, const Wave& wave) const;  // in a full wave
  // When the merge of `slots` partials of `rows` rows ends after the last chunk, and the group
  // count of its two-level merge (1: one level).
  double merge_us(int64_t slots, int64_t rows, int32_t* groups) const;
  // The costs of the estimate's items when the chunks give `tasks` tasks: items placed from item
  // last_round on are in the last (partial) round and stream at last_token, the others at
  // full_token; each also pays start. One function for makespan_us and choose_chunk's bound, so
  // both compute the same values.
  struct ItemCosts {
    int64_t last_round;
    double full_token, last_token, start;
  };
  ItemCosts item_costs(int64_t tasks, const Wave& wave) const;
  // The cost model's makespan of the list that `chunk` gives, on `wave` (list scheduling in
  // launch order over the slots; items under 1/8 of the chunk's cost fill the slots as a fluid).
  // `tasks`: split_count(chunk).items where the caller has it (-1: counted here).
  double makespan_us(int64_t chunk, const Wave& wave, int64_t tasks = -1) const;
  // The best chunk target for `wave` (see the file comment).
  Choice choose_chunk(const Wave& wave, int64_t longest) const;

  [[noreturn]] void fail(const char* arg, const std::string& rule) const;
  [[noreturn]] void fail_plan(const char* arg, const std::string& rule) const;
  void reserve_buffers();
  void sort_by_length(int64_t longest);  // keys_, longest first (ties by request)

  PlanCapacity cap_;
  SplitPolicy policy_;
  std::string entry_point_;
  int32_t group_ = 1;
  int32_t max_work_ = 0;
  int32_t max_slots_ = 0;
  int32_t max_merges_ = 0;
  int64_t max_chunk_partials_ = 0;  // chunk partials the workspace holds
  int64_t granule_ = 16;  // of the current plan: lcm(page_size, policy granularity)
  bool shape_pinned_ = false;
  CtaShape pinned_shape_ = CtaShape::kDefault;
  WorkspaceLayout layout_;
  Plan plan_;
  std::vector<WorkItem> work_storage_;  // the work list when plan() is given no image
  std::vector<int64_t> keys_;     // (INT32_MAX - kv_len) << 32 | request: longest first
  std::vector<int64_t> kv_len_;   // per request, this step: the keys it reads (its cost)
  std::vector<int32_t> first_key_;  // per request: its first key the window can see (0 without)
  std::vector<uint8_t> has_query_;  // per request: qo_len > 0 (otherwise no work at all)
  std::vector<int32_t> rows_;       // per request: qo_len x group (rows of each partial slot)
  // The requests with a query, longest first: KV lengths, rows, prefix sums of the lengths.
  std::vector<int64_t> sorted_len_;
  std::vector<int32_t> sorted_rows_;
  std::vector<int64_t> prefix_len_;
  int64_t num_with_query_ = 0;
  int64_t len_total_ = 0;
  std::vector<int64_t> emit_keys_;  // (INT32_MAX - chunk length) << 32 | request, split ones
  std::vector<int64_t> split_keys_;  // launch order when something is split (and the radix sort's scratch)
  mutable std::vector<double> loads_;  // per machine group of the makespan estimate (a min-heap)
  mutable std::vector<double> pending_merges_;  // merges waiting for the estimate's current batch
};

}  // namespace tessera::plan
