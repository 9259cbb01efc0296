// Exact attention over ragged batches (prefill / extend).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "tessera/kv_cache.h"
#include "tessera/stream.h"
#include "tessera/tensor.h"

namespace tessera {

// Which kernel family runs. kAuto lets the dispatcher choose by GPU and problem; the others force
// a family (for tests and ablations) and fail with tessera::Error when it cannot run the problem
// on this GPU or was not compiled.
enum class AttentionPath : int { kAuto = 0, kPortable = 1, kHopper = 2 };

const char* attention_path_name(AttentionPath path);

// Batch prefill over ragged Q and ragged K/V (FlashAttention "varlen"):
//   q [total_q, num_qo_heads, head_dim], k/v [total_kv, num_kv_heads, head_dim] (bf16 or fp16,
//   head_dim contiguous, rows and heads may be strided), request i owns q rows
//   [qo_indptr[i], qo_indptr[i+1]) and kv rows [kv_indptr[i], kv_indptr[i+1]); qo_len may differ
//   from kv_len (chunked prefill: the queries are the last qo_len positions of the sequence).
//   o [total_q, num_qo_heads, head_dim] has q's dtype; lse [total_q, num_qo_heads] fp32 (natural
//   log) is optional (leave it an empty TensorView).
// The index arrays are device int32 tensors; host copies are required too (the launch is sized
// from them, as a serving engine's planner would) and are checked. q, o and lse may hold more
// rows than qo_indptr[batch] (fixed-size buffers, e.g. for CUDA graphs): rows past it are neither
// read nor written. Outputs must not overlap any input, index arrays included.
struct PrefillArgs {
  TensorView q, k, v;
  TensorView qo_indptr, kv_indptr;
  const int32_t* host_qo_indptr = nullptr;
  const int32_t* host_kv_indptr = nullptr;
  TensorView o;
  TensorView lse;             // optional
  bool causal = false;        // bottom-right aligned: row i sees keys j <= i + kv_len - qo_len
  int window_left = -1;       // >= 0: also requires j >= i + kv_len - qo_len - window_left
  float scale = 0.f;          // 0: 1 / sqrt(head_dim); otherwise finite and > 0
  float soft_cap = 0.f;       // > 0: logits = soft_cap * tanh(scale * q.k / soft_cap)
  AttentionPath path = AttentionPath::kAuto;
};

// Outputs (o, lse) must not overlap each other or the inputs. Asynchronous on `stream`; holds no
// memory beyond o and lse.
void batch_prefill(const PrefillArgs& args, cudaStream_t stream);

// The family kAuto picks for this problem on the current GPU (without running anything).
AttentionPath choose_prefill_path(const PrefillArgs& args);

// Batch prefill / extend over a paged KV cache: ragged queries (request i's rows
// [qo_indptr[i], qo_indptr[i+1]) are the last qo_len positions of its sequence) against the
// request's pages (cache layout NHD or HND, strided pages allowed, same dtype as q). The same
// kernels as batch_prefill with a paged K / V loader; masks, variants and outputs as PrefillArgs.
// On sm_90 the Hopper family reads every page size: multiples of 8 tokens by TMA boxes, the others
// (1, 7, 100, ...) gathered by its producer warps with 16-byte copies.
// The page table's host copies are required: the launch is sized from them and every page id is
// checked against the cache (O(pages) on the host).
struct PagedPrefillArgs {
  TensorView q;
  TensorView qo_indptr;
  const int32_t* host_qo_indptr = nullptr;
  PagedKVCache cache;
  PageTable table;
  TensorView o;
  TensorView lse;  // optional
  bool causal = false;
  int window_left = -1;
  float scale = 0.f;
  float soft_cap = 0.f;
  AttentionPath path = AttentionPath::kAuto;
};

void batch_prefill_paged(const PagedPrefillArgs& args, cudaStream_t stream);

// The family kAuto picks for this paged problem on the current GPU (without running anything).
AttentionPath choose_prefill_paged_path(const PagedPrefillArgs& args);
// Paged prefill / extend with plan / run and a KV split: where a step's query tiles alone under-
// fill the GPU (a short chunk of new tokens over a long history, few heads), plan() splits every
// query tile's keys into runs processed as their own work tiles, whose fp32 partial states run()
// merges (one more launch). The split count is uniform over the step. On sm_90 (the Hopper family
// reads the pages) it comes from that family's cost model (src/plan/prefill_split.h: wave-
// quantised makespan of the work tiles plus the partials' traffic and the merge), and a step of
// two Hopper tiles per SM or more is not split; elsewhere the portable family splits into enough
// CTAs for four per SM, each run at least 256 keys. A request with few keys then has empty runs,
// which cost one work-tile start each. The caller owns the workspace (workspace_bytes(config)).
//
//   tessera::BatchPrefillPaged prefill(config, ws, tessera::BatchPrefillPaged::workspace_bytes(config));
//   per step: prefill.plan(host_qo_indptr, table, stream);   per layer: prefill.run(args, stream);
//
// CUDA graphs (config.cuda_graph): plan() copies the step (its batch size, longest query, split
// count, its qo_indptr, kv_indptr and kv_last_page_len, and a static schedule: every work tile,
// longest first, on the CTA with the least work so far) into the workspace with one asynchronous
// copy on its stream, and run() launches grids of a fixed size whose CTAs read the step from
// there (each CTA its list of tiles, then a merge that does nothing where the step is not split),
// so a run() captured once replays correctly for any later step that plan() was called for
// (outside the graph, before the replay). Such a run() reads the planned
// index arrays, not its arguments' device qo_indptr / kv_indptr / kv_last_page_len; it reads the
// arguments' kv_indices, q, the cache, o and lse, which must keep their addresses. A replay checks
// nothing: once a run() was captured, plan() requires num_pages (every page id is checked against
// it) and rejects steps with more query rows, page-table entries or cache pages than the captured
// run() was given, or more requests than max_batch_size. Eager run()s of a cuda_graph config run
// the same kernels (results bitwise equal to a replay of the same step); against a config without
// cuda_graph they cost the merge's launch on unsplit steps and the schedule's host time in plan()
// (notes/prefill_paged.md has both measured), and the family is fixed by the plan: run()'s dtype
// must take the family plan() scheduled for (set path where the dtype could change it), and its
// arguments' host index arrays must be the planned ones. plan() and run() share the workspace:
// issue them on one stream (or order the streams); plan() waits on the host only for its previous
// copy, not for a run() still reading the step.
// The fixed grid in eager mode (max_batch_size >= 1 without cuda_graph): plan() copies the step and
// its schedule as above whenever the step's requests differ in query rows or keys, and run() takes
// the fixed grid for it; steps of equal requests keep the one-tile grid (last_plan().fixed_grid
// says which). Measured on the H200 (notes/prefill_paged.md): 1.10-1.53x on 25 of 27 random
// serving steps of 2-64 requests, even on the other two, 0.97-1.01x on uniform steps (which is why
// they keep the other grid). The workspace must then be device memory, plan() costs the schedule
// (~8 ns a work tile on the host) and one copy on its stream, and run()'s host index arrays must
// be the planned ones. Either grid computes the same tiles, splits and merge: bitwise equal on the
// Hopper family; the portable step kernel differs from its one-tile kernel in the last bit of a
// few elements (another kernel's instruction schedule), both within the tolerance rule.
// Not yet: split counts per request (one count per step).
struct PagedPrefillConfig {
  int num_qo_heads = 0;
  int head_dim = 0;
  int page_size = 0;        // of the cache run() gets
  int max_q_rows = 0;       // query rows of a step (total_q), at most
  int max_kv_splits = 16;   // the split count never exceeds this (it sizes the workspace)
  AttentionPath path = AttentionPath::kAuto;  // the family run() may use (run()'s args.path must agree)
  // The mask run() will take, for plan()'s cost estimate only: run() applies its own arguments'
  // mask, whatever these say (a different one only makes the split less well chosen).
  bool causal = false;
  int window_left = -1;
  bool cuda_graph = false;  // run() may be captured into a CUDA graph (see above)
  // Requests per step, at most: required (>= 1) with cuda_graph. Given without cuda_graph, it
  // sizes the step's image in the workspace so that plan() can run steps whose requests differ on
  // the fixed grid too (see "The fixed grid in eager mode" above).
  int max_batch_size = 0;
  // Batch invariance: every step splits each query tile's keys into exactly max_kv_splits runs
  // (1: no split), whatever else the batch holds, and the portable family keeps one grid for every
  // step (the one-tile grid in eager mode, the fixed grid with cuda_graph), so a request's output
  // bits depend on its own tokens only, not on the other requests or the step's composition. The
  // cost is the split the step would not have chosen: empty runs of short requests (each a tile
  // start) and the merge on every step with max_kv_splits > 1, or no split on under-filled steps
  // with max_kv_splits 1.
  bool batch_invariant = false;
  // The cache's KV heads (0: not given). Given, with num_qo_heads / num_kv_heads a power of two
  // from 2 to 64, the Hopper family packs a KV head's query heads into one tile (token-major rows:
  // a decode-like request fills a tile with its group instead of one row), so a fixed-grid step
  // lists and schedules group-times fewer tiles; every step of the object, eager or fixed grid,
  // packs alike (a KV split's runs follow the tiles' heights: batch_invariant relies on that).
  // Not given, the object never packs. run() requires the cache to have these heads.
  int num_kv_heads = 0;
};

struct PagedPrefillPlanInfo {
  int kv_splits = 1;        // runs per query tile (1: no split, no partials, no merge)
  int64_t query_tiles = 0;  // (request, head, 128-row tile) CTAs of the portable unsplit grid with rows
  // The family the plan was made for: kPortable, kHopper (an automatic config's run() still lets
  // the dispatcher confirm it for its dtype, and takes the portable family where Hopper was not
  // built for that dtype), or the config's path when unsplit (kAuto: batch_prefill_paged's choice).
  AttentionPath path = AttentionPath::kAuto;
  double estimated_us = 0.0;  // the Hopper cost model's step time for kv_splits (0: no estimate made)
  bool fixed_grid = false;    // run() takes the fixed grid over plan()'s static schedule
  int gqa_pack = 0;           // log2 of the query heads a Hopper tile packs per token (0: none)
};

class BatchPrefillPaged {
 public:
  static std::size_t workspace_bytes(const PagedPrefillConfig& config);
  // With cuda_graph, also allocates a pinned host buffer for the step's image (and checks that
  // the workspace is device memory).
  BatchPrefillPaged(const PagedPrefillConfig& config, void* workspace, std::size_t workspace_size);
  ~BatchPrefillPaged();
  BatchPrefillPaged(const BatchPrefillPaged&) = delete;
  BatchPrefillPaged& operator=(const BatchPrefillPaged&) = delete;

  // Once per step, on the host: the query lengths (host_qo_indptr, [batch + 1]) and the page
  // table's host copies decide the split. Without cuda_graph and max_batch_size it allocates
  // nothing and touches no device memory (stream is unused). With cuda_graph (or max_batch_size,
  // for a step it puts on the fixed grid) it copies the step into the workspace on
  // `stream` (asynchronous; waits on the host only for the previous plan's copy to have left the
  // staging buffer) and must not be called while `stream` is being captured. num_pages (the
  // cache's pages), when >= 0, has every host page id checked against it here; once a run() was
  // captured it is required.
  void plan(const int32_t* host_qo_indptr, const PageTable& table, cudaStream_t stream = nullptr,
            int64_t num_pages = -1);
  // Per layer: the arguments of batch_prefill_paged for the planned step (validated the same way;
  // their qo_indptr / page table must be the planned ones).
  void run(const PagedPrefillArgs& args, cudaStream_t stream);
  PagedPrefillPlanInfo last_plan() const { return info_; }

 private:
  struct FixedGrid;  // cuda_graph or max_batch_size: the step's staging image, the captured buffers' bounds
  PagedPrefillConfig config_;
  float* workspace_ = nullptr;
  bool planned_ = false;
  int64_t planned_rows_ = 0;
  int64_t planned_batch_ = 0;
  int num_sms_ = 0;
  bool hopper_reads_pages_ = false;  // the Hopper family runs this config's paged prefill here
  int gqa_pack_ = 0;                 // packed GQA of every Hopper launch (PrefillParams::gqa_pack)
  PagedPrefillPlanInfo info_;
  std::unique_ptr<FixedGrid> fixed_;
};

}  // namespace tessera
