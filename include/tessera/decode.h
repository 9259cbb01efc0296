// Batch decode over a paged KV cache, with plan / run (FlashInfer's split between a host planner
// called once per serving step and a launch called once per layer).
//
//   tessera::DecodeConfig cfg;                    // fixed for the engine's lifetime
//   cfg.num_qo_heads = 32; cfg.num_kv_heads = 8; cfg.head_dim = 128; cfg.page_size = 16;
//   cfg.max_batch_size = 256;
//   void* ws; cudaMalloc(&ws, tessera::BatchDecoder::workspace_bytes(cfg));
//   tessera::BatchDecoder decoder(cfg, ws, tessera::BatchDecoder::workspace_bytes(cfg));
//   for each step:
//     decoder.plan(host_qo_indptr, table, stream);          // host work + one async copy
//     for each layer: decoder.run(q, cache, table, o, lse, stream);
//
// Each request has qo_len query tokens (1 for plain decode, up to max_qo_len for speculative
// verification) that are the last qo_len positions of its sequence; the query heads of one GQA
// group share every K/V load. Long requests are split into KV chunks processed in parallel and
// merged (flash-decoding) when the batch alone would not fill the GPU; the plan decides, from the
// GPU's SM count and the kernel's occupancy.
//
// CUDA graphs: every device buffer run() touches in the workspace has a fixed address and size
// (sized from the config at construction) and run()'s launches have fixed grids, so a run()
// captured once replays correctly for any later step, provided plan() is called (outside the
// graph) before each replay and the tensors given to the captured run() keep their addresses.
// A replay checks nothing, so once a run() was captured, plan() requires num_pages >= 0 (every page
// id is checked) and rejects steps with more query rows, page-table entries or pages than the
// captured buffers hold.
//
// Ordering: plan() and run() of one decoder share its workspace: issue them on one stream (or
// order the streams). Layers running concurrently need a decoder (and workspace) each.
// Results are deterministic for a given plan; whether a request is split depends on the rest of
// the batch and on the GPU, so the same request can differ in the last bits between batches.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "tessera/dtype.h"
#include "tessera/kv_cache.h"
#include "tessera/stream.h"
#include "tessera/tensor.h"

namespace tessera {

struct DecodeConfig {
  int num_qo_heads = 0;
  int num_kv_heads = 0;       // divides num_qo_heads; group = num_qo_heads / num_kv_heads <= 16
  int head_dim = 0;           // 64, 128 or 256 (as compiled)
  int page_size = 0;          // 1..256
  DType dtype = DType::kBF16; // of q, the pages and o: bf16 or fp16
  KVLayout layout = KVLayout::kNHD;
  int max_batch_size = 0;     // requests per step, at most
  int max_qo_len = 1;         // query tokens per request per step, 1..8
  bool causal = true;         // bottom-right; only matters when qo_len > 1
  int window_left = -1;       // >= 0: sliding window (keys j >= i + kv_len - qo_len - window_left)
  float scale = 0.f;          // 0: 1 / sqrt(head_dim)
  float soft_cap = 0.f;       // > 0: logits = soft_cap * tanh(scale * q.k / soft_cap)
  // K/V pipeline stages of the decode kernel. 0 (default): 3 where the GPU's shared memory per
  // block allows it (A100, H100/H200), else 2 (sm_86/sm_89: 99 KB). 2 or 3 forces that count
  // (tests, ablation); a count this GPU cannot hold is an error.
  int pipeline_stages = 0;
  // CTA shape of the decode kernel. 0 (default): plan() picks per step between the default shape
  // (two CTAs per SM) and, where the GPU holds it (sm_90's shared memory; head_dim 128 and 256; 3
  // stages), one CTA per SM with twice the warps: mostly for a batch whose (request, KV head)
  // pairs about fill the SMs, which then runs unsplit (and for split lists at head_dim 256).
  // 1 or 2 forces a shape (tests, ablation; 2 is the default shape, which fits once per SM on an
  // A100); 1 where it does not exist is an error. A captured run() fixes the shape for the plans
  // that follow it: with 0, the one-CTA-per-SM shape only when max_batch_size x num_kv_heads <=
  // the SM count (no step can overfill it), else the default shape.
  int ctas_per_sm = 0;
  // Programmatic dependent launch (where the GPU runs the kernel's sm_90+ code; plain launches
  // otherwise): run()'s kernel may start launching
  // while the kernel ahead of it in the stream finishes, and waits for that kernel's completion
  // before it touches any memory but the decoder's own plan (written only by plan()'s copy), so
  // results are the same. It hides the launch gap between the two kernels and the plan's first
  // read (a few microseconds, which a short decode step feels). False: plain launches. The
  // kernel ahead must not write this decoder's workspace.
  bool programmatic_launch = true;
  // Batch-invariant mode: a request's output bits depend on its own inputs only, not on the rest
  // of the batch (FlashInfer / vLLM's batch invariance; needed for reproducible sampling across
  // batch compositions). plan() splits every request longer than batch_invariant_chunk_tokens
  // into chunks of at most that many tokens (balanced: a request's own length decides them),
  // merges each request's chunks by its own chunk count, and keeps one CTA shape (the default
  // one, or ctas_per_sm's), whatever else the step holds. The cost is the split the balancing
  // planner would not have chosen (bench/results: batch_invariant rows).
  bool batch_invariant = false;
  // The mode's chunk: a multiple of 16 and of page_size, >= 128; 0: requests are never split (a
  // long request then streams through one CTA per KV head: a 32K request among short ones takes
  // as long as one CTA reading 32K keys). Measured on the H200 against the planner's own plan
  // (bench/results/2026-12-02_h200_3aa3c31_batch_invariant_cost.json, nine decode cases, uniform
  // and skewed): 1024 keeps 0.82-1.01x (the worst a 1-KV-head batch with one 32K request), 2048
  // 0.66-1.01x, 4096 0.40-1.01x, never splitting 0.04-1.00x.
  int batch_invariant_chunk_tokens = 1024;
  // The chunk partials (chunks x KV heads of the split requests) a batch-invariant step may hold,
  // which sizes the workspace; plan() refuses a step that needs more. 0: 8 x max_batch_size x
  // num_kv_heads (every request up to 8 chunks), at least the balancing planner's own bound.
  int batch_invariant_max_chunks = 0;
};

// What the last plan() decided (for logging and benchmarks).
struct DecodePlanInfo {
  int num_work_items = 0;   // CTAs' worth of work
  int num_split_requests = 0;  // (request, KV head) pairs split into chunks
  int num_merge_rows = 0;   // merges of chunk partials (more than the split pairs where a pair's
                            // many chunks merge in two levels)
  int chunk_tokens = 0;     // chunk target of split requests (each chunk at most this long); 0
                            // when nothing was split
  double estimated_us = 0;  // the planner's cost model of the step's decode time (0 when it had
                            // nothing to decide: no request longer than the average load)
  int grid_ctas = 0;        // CTAs the decode kernel launches
  int ctas_per_sm = 0;      // the CTA shape the plan was balanced for: 2 the default shape, 1 the
                            // one-CTA-per-SM shape (a shape id: the default fits once per SM on an A100)
};

class BatchDecoder {
 public:
  // Device workspace bytes a decoder with this config needs on the current GPU. The caller
  // allocates it once (any cudaMalloc'ed buffer of at least this size) and keeps it alive.
  static std::size_t workspace_bytes(const DecodeConfig& config);

  // Validates the config (tessera::Error naming the field and the rule) for the current GPU and
  // allocates one pinned host staging buffer for the plan. No device allocation.
  BatchDecoder(const DecodeConfig& config, void* workspace, std::size_t workspace_size);
  ~BatchDecoder();
  BatchDecoder(const BatchDecoder&) = delete;
  BatchDecoder& operator=(const BatchDecoder&) = delete;

  // Once per step, on the host: reads host_qo_indptr ([batch + 1]) and the page table's host
  // copies (table.host_indptr, host_indices, host_last_page_len are required and checked). Page
  // ids are checked by default: with num_pages >= 0 each id against [0, num_pages) here (and run()
  // then requires a cache of at least num_pages pages); with -1 (the default) plan() takes the
  // ids' range in one pass (~3 us at 32K pages) and run() checks it against the cache it gets; an
  // engine whose allocator guarantees its ids may opt out with kSkipPageIdCheck. Balances the work
  // and copies the plan into the workspace with one cudaMemcpyAsync on `stream`. Waits (on the
  // host) only for the previous plan's copy to have left the staging buffer.
  static constexpr int64_t kSkipPageIdCheck = -2;
  void plan(const int32_t* host_qo_indptr, const PageTable& table, cudaStream_t stream,
            int64_t num_pages = -1);

  // Per layer: q [rows, num_qo_heads, head_dim] with rows >= the plan's total_q (request i's rows
  // start at its qo_indptr[i]; a CUDA-graph user passes fixed max-size buffers), the
  // cache (layout and dtype of the config; strided pages allowed), the page table the last plan()
  // saw (only its device kv_indices is read: the rest travels in the plan), o shaped like q in
  // the config's dtype, and lse [rows, num_qo_heads] fp32 (optional: an empty TensorView). Rows
  // past the plan's total_q are not written. qo_len may exceed kv_len: rows that see no key give
  // o = 0 and lse = -inf (so does a request with no KV). Asynchronous on `stream`; no host
  // synchronisation, no allocation.
  void run(const TensorView& q, const PagedKVCache& cache, const PageTable& table,
           const TensorView& o, const TensorView& lse, cudaStream_t stream);

  const DecodeConfig& config() const;
  DecodePlanInfo last_plan() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace tessera
