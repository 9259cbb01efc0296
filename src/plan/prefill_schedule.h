// The static schedule of a fixed-grid paged prefill step (BatchPrefillPaged with cuda_graph: the
// grid a CUDA graph replays is fixed, so the plan, not the hardware, balances the step): every work
// tile (request, query head, query tile, KV split) that has query rows goes, longest first, to the
// CTA slot with the least work so far (LPT: a makespan within 4/3 of the best static one), and each
// slot runs its tiles in the order they were assigned (heaviest first). Pure C++, deterministic
// (ties go to the lower slot), CPU-tested.
//
// A tile's cost is its KV tiles (the split's run of them, as the kernels cut it) plus a fixed
// start-up of kTileStartCost KV tiles (the Q load, the first product and the epilogue exposed:
// ~2 us against ~1 us a KV tile on the H200's Hopper family, plan/prefill_split.cpp).
#pragma once

#include <cstdint>
#include <vector>

#include "plan/prefill_split.h"

namespace tessera::plan {

// The step (PrefillTiling, plan/prefill_split.h: slots, 1..1024, are the fixed grid's CTAs, each
// walking one slot's list) and its split count; causal / window_left are the mask the costs assume (any
// mask runs on any schedule).
struct PrefillScheduleProblem : PrefillTiling {
  int kv_splits = 1;
  // Where the caller has them from its own pass over qo_indptr (plan()'s tile count), the longest
  // request's query rows and the requests' query tiles of block_m rows (the sum of query_tiles);
  // -1: counted here. Each pass is ~0.5 us at 1024 requests (development CPU), against plan()'s
  // target of < 50 us.
  int64_t max_qo_len = -1;
  int64_t query_tiles = -1;
};

// A tile's list position, as the fixed-grid kernels decode it: the step's m_tiles is
// ceil(longest request's query rows / block_m).
//   position = ((request * num_qo_heads + head) * m_tiles + m_tile) * kv_splits + split
constexpr int64_t kTileStartCost = 2;

struct PrefillScheduleResult {
  int64_t tiles = 0;        // positions written
  double makespan = 0.0;    // the most loaded slot, in KV tiles
  double total = 0.0;       // every slot's load
  double longest = 0.0;     // the heaviest tile
};

// The number of tiles with query rows (what schedule_prefill writes).
int64_t prefill_schedule_tiles(const PrefillScheduleProblem& problem);

// The scheduler's working memory: the caller's, reused between calls (no allocation once warm).
struct PrefillScheduleScratch {
  std::vector<uint64_t> groups;         // (cost, first position) of each (request, m_tile, split)
  std::vector<uint64_t> sorted_groups;  // longest first
  std::vector<int32_t> bucket;          // the counting sort's, by cost
  std::vector<int64_t> keys;            // the slots by load
  std::vector<int64_t> picks;           // each pick's slot key after it, in pick order
  std::vector<int32_t> counts;          // each slot's tiles, then its place in the output
};

// Writes slot_begin [slots + 1] (slot s runs positions[slot_begin[s] .. slot_begin[s + 1])) and
// positions [prefill_schedule_tiles(problem)], each < 2^31 (the caller's split cap keeps the list
// so).
PrefillScheduleResult schedule_prefill(const PrefillScheduleProblem& problem, int32_t* slot_begin, int32_t* positions,
                                       PrefillScheduleScratch& scratch);

}  // namespace tessera::plan
