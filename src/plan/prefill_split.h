// The KV split of a paged prefill step (BatchPrefillPaged::plan): how many runs each query tile's
// keys are cut into, so that a step whose query tiles under-fill the GPU (a short chunk over a
// long history, few heads) still keeps every SM busy. Pure C++, deterministic, CPU-tested.
//
// Cost model of the Hopper family (prefill_sm90.cuh: one CTA per SM walking its work tiles): a
// work tile costs a fixed start-up + epilogue latency plus its KV tiles at one SM's rate; a split
// step adds the partial states (fp32 O + LSE per query row, head and split, written by the kernel
// and read back by merge_states) at the memory bandwidth plus the merge's launch. The step's time
// is the wave-quantised makespan of equal work tiles (the persistent CTAs take them in list
// order), max(longest, ceil(total / (slots x longest)) x longest), plus that merge. The split
// count minimising it wins (ties: the smaller) among 1..16 and, where max_splits allows, a ladder
// of larger counts (20, 24, 32, ... 256: each estimate walks every query tile). Constants:
// measured on the H200 (notes/prefill_paged.md).
#pragma once

#include <cstdint>

namespace tessera::plan {

struct PrefillSplitCost {
  double kv_tile_us = 0.0;       // 128 keys of one work tile (block_m rows)
  double tile_start_us = 0.0;    // per work tile: Q load, first product, epilogue exposed
  double partial_gb_per_s = 0.0; // partial states written + read
  double merge_launch_us = 0.0;
};

// The Hopper family's figures at head_dim (64, 128 or 256) with block_m query rows per tile,
// reading pages of page_size tokens.
PrefillSplitCost hopper_prefill_split_cost(int head_dim, int block_m, int page_size);

// A paged prefill step's query tiles as the planners see them: host copies of qo_indptr [batch + 1]
// and the page table's indptr [batch + 1] (pages) and last_page_len [batch] (a request's keys:
// page_size x (pages - 1) + last_page_len), the kernel's tile, the mask the costs assume and the
// tiles running at once.
struct PrefillTiling {
  const int32_t* qo_indptr = nullptr;
  const int32_t* kv_indptr = nullptr;
  const int32_t* last_page_len = nullptr;
  int page_size = 1;
  int64_t batch = 0;
  int num_qo_heads = 0;
  int block_m = 0, block_n = 0;  // the kernel's tile: query rows x keys
  bool causal = false;
  int window_left = -1;
  int slots = 0;                 // work tiles running at once (SMs x CTAs per SM)
};

struct PrefillSplitProblem : PrefillTiling {
  int head_dim = 0;
  int max_splits = 1;
  // Query heads in each token of a tile: packed GQA's group (block_m then counts tokens of
  // block_m x packed_heads rows, num_qo_heads the KV heads), 1 unpacked. The partial states count
  // every query head.
  int packed_heads = 1;
};

struct PrefillSplitChoice {
  int splits = 1;
  double estimated_us = 0.0;   // the model's step time at `splits`
  double unsplit_us = 0.0;     // and without a split
};

PrefillSplitChoice choose_prefill_split(const PrefillSplitProblem& problem, const PrefillSplitCost& cost);

// The KV tiles of block_n keys that the query tile of rows [m0, m0 + block_m) visits, as the
// kernels count them (tile_scheduler_sm90.cuh): those meeting the mask band of any of its rows.
int64_t query_tile_kv_tiles(int qo_len, int kv_len, bool causal, int window_left, int m0, int block_m, int block_n);

}  // namespace tessera::plan
