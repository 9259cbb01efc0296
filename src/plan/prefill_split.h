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

#include <algorithm>
#include <cstdint>

#include "kernels/attention/common/mask.cuh"

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

// The query tiles of block_m rows that a request of qo_len >= 0 rows takes. Most requests of a
// serving step are one tile, and the 64-bit division this skips for them was most of the cost of
// the planners' per-request loops.
inline int64_t query_tiles(int64_t qo_len, int64_t block_m) {
  return qo_len <= block_m ? int64_t(qo_len > 0) : (qo_len + block_m - 1) / block_m;
}

// The KV tiles of block_n keys that keys [begin, end) meet, 0 <= begin < end < 2^31 and block_n >=
// 1: the quotients in unsigned 32 bits, as shifts where block_n is a power of two (the hd64 /
// hd128 paged tiles): a 64-bit division took a tenth of the fixed grid's schedule at serving_b1024
// (notes/prefill_paged.md).
inline int64_t kv_tiles_between(int begin, int end, int block_n) {
  const uint32_t n = static_cast<uint32_t>(block_n), last = uint32_t(end) + n - 1;
  if ((n & (n - 1)) == 0) {
    const int shift = __builtin_ctz(n);
    return int64_t((last >> shift) - (uint32_t(begin) >> shift));
  }
  return int64_t(last / n - uint32_t(begin) / n);
}

// The KV tiles of block_n keys that the query tile of rows [m0, m0 + block_m) visits, as the
// kernels count them (tile_scheduler_sm90.cuh): those meeting the mask band of any of its rows.
// Inline: the planners call it per query tile (the fixed grid's schedule once a step, the split
// estimate once a candidate count), and the call cost as much as the arithmetic.
inline int64_t query_tile_kv_tiles(int qo_len, int kv_len, bool causal, int window_left, int m0, int block_m,
                                   int block_n) {
  // A window of kv_len keys or more excludes nothing (and its band arithmetic could overflow int):
  // none, as the entry points pass it to the kernels.
  const kernels::MaskBand band{qo_len, kv_len, kv_len - qo_len, causal, window_left >= kv_len ? -1 : window_left};
  const int last_row = std::min(m0 + block_m, band.qo_len) - 1;
  const int begin = band.key_begin(m0), end = band.key_end(last_row);
  return end > begin ? kv_tiles_between(begin, end, block_n) : 0;
}

// query_tile_kv_tiles of a request's only query tile (0 < qo_len <= block_m, m0 = 0): its last
// row is the request's, whose band ends at the last key (bottom-right alignment, causal or not),
// so only a window moves the start. Most of a serving step's requests are one tile, and the
// band's general case was most of the cost of listing them (notes/prefill_paged.md, 2026-12-05).
inline int64_t only_query_tile_kv_tiles(int qo_len, int kv_len, int window_left, int block_n) {
  const int begin = window_left >= 0 && window_left < kv_len ? std::max(kv_len - qo_len - window_left, 0) : 0;
  return kv_len > begin ? kv_tiles_between(begin, kv_len, block_n) : 0;
}

}  // namespace tessera::plan
