// Kernel selection for prefill attention: by compute capability, problem and the forced path.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kernels/attention/prefill_params.h"
#include "kernels/attention/sm90/prefill_sm90_launch.h"
#include "tessera/attention.h"
#include "tessera/dtype.h"

namespace tessera::dispatch {

// Head dims / dtypes this build instantiated for the portable prefill family (the list of
// src/dispatch/instantiations.h.in, narrowed by TESSERA_HEAD_DIMS / TESSERA_DTYPES).
std::vector<int> compiled_prefill_head_dims();
bool prefill_dtype_compiled(DType dtype);

struct PrefillChoice {
  AttentionPath path = AttentionPath::kAuto;  // kPortable or kHopper when ok
  bool ok = false;
  std::string why_not;  // when !ok: which rule the request broke
};

// Shared memory per block the kernels may use on the current GPU (its opt-in maximum), or less
// after limit_shared_memory_per_block(bytes) (0 lifts the limit): tests use it to run the tile
// shapes that GPUs with less shared memory get (the compact hd256 prefill, 2-stage decode).
int shared_memory_per_block();
void limit_shared_memory_per_block(int bytes);

// What of the problem the choice depends on, besides the GPU, dtype and head dim.
struct PrefillProblem {
  bool paged = false;
  int page_size = 0;  // paged: tokens per page (the Hopper family boxes multiples of 8, gathers the rest)
  int64_t tiles = 0;  // (request, query head, 128-row query tile) triples of the launch
  int shared_memory_per_block = 0;  // what the GPU allows (shared_memory_per_block()); 0: not checked
};

// Pure decision (no GPU needed): which family runs `requested` on a GPU of capability
// cc_major.cc_minor. kAuto takes the Hopper family where it is built, runs on the GPU (sm_90)
// and supports the problem, and the portable family otherwise (a supported configuration on every
// GPU from sm_80 on, not a fallback); a forced family that cannot run is an error saying why.
PrefillChoice choose_prefill(AttentionPath requested, int cc_major, int cc_minor, DType dtype, int head_dim,
                             const PrefillProblem& problem = {});

// The Hopper family's tile order and scheduler for a problem (the measured policy of
// notes/prefill_hopper.md), unless a test or benchmark forced one (nullptr lifts it).
// shared_memory_per_block: what the GPU allows (shared_memory_per_block()), 0 not checked; it
// bounds the K / V tile width (choose_prefill_sm90_block_n). l2_cache_bytes: the GPU's L2
// (l2_cache_bytes()), 0 unknown; it decides whether a one-tile grid keeps a head's query tiles
// together.
kernels::sm90::PrefillSm90Schedule choose_prefill_sm90_schedule(const kernels::PrefillParams& params, int head_dim,
                                                                int num_sms, int shared_memory_per_block = 0,
                                                                int64_t l2_cache_bytes = 0);
void force_prefill_sm90_schedule(const kernels::sm90::PrefillSm90Schedule* schedule);
// Keys per K / V tile (PrefillSm90Schedule::block_n) for a problem: hd128 with ragged K / V takes
// 192 where rows see many keys (PrefillParams::work_weighted_row_keys), every other case the head
// dim's default; a forced width (tests, benchmarks; 0 lifts it) wins where the source has it.
// PrefillParams::work_weighted_row_keys of a ragged batch from its host indptrs.
int64_t work_weighted_row_keys(const int32_t* host_qo_indptr, const int32_t* host_kv_indptr, int64_t batch,
                               bool causal, int window_left);
int choose_prefill_sm90_block_n(const kernels::PrefillParams& params, int head_dim, int shared_memory_per_block);
void force_prefill_sm90_block_n(int keys);
// Packed GQA for the Hopper family (PrefillParams::gqa_pack: log2 of the query heads a tile packs
// per token, 0 for none): possible where the group (num_qo_heads / num_kv_heads) is a power of
// two from 2 to 64, and taken wherever possible (measured never slower; prefill_dispatch.cpp).
// Tests and benchmarks force it on (GqaPack::kAlways, the same as kAuto today) or off.
enum class GqaPack { kAuto, kNever, kAlways };
int prefill_gqa_pack_limit(int num_qo_heads, int num_kv_heads);  // the pack the group allows (0: none)
int choose_prefill_gqa_pack(const kernels::PrefillParams& params);
void force_prefill_gqa_pack(GqaPack mode);
GqaPack forced_prefill_gqa_pack();

// BatchPrefillPaged::plan's split count, forced by a test or benchmark (0: the planner's choice;
// capped by the config's max_kv_splits).
void force_prefill_kv_splits(int splits);
int forced_prefill_kv_splits();

// SMs of the current GPU and its compute capability as major * 10 + minor (read once per device).
int sm_count();
int compute_capability();
// The current GPU's L2 cache in bytes.
int64_t l2_cache_bytes();

}  // namespace tessera::dispatch
