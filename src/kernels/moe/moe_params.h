// What the MoE routing and permutation kernels read (host-visible, no CUDA types but the stream).
#pragma once

#include <cstdint>

#include "tessera/dtype.h"
#include "tessera/stream.h"

namespace tessera::kernels::moe {

// Router: one warp per token (moe_routing.cu).
struct RouteParams {
  const void* logits = nullptr;  // [tokens, num_experts], dtype logits_dtype
  DType logits_dtype = DType::kFP32;
  int64_t logits_stride = 0;     // elements between rows
  const float* bias = nullptr;   // [num_experts] or null
  int64_t tokens = 0;
  int num_experts = 0, top_k = 0;
  bool sigmoid = false, renormalize = false;
  int num_groups = 1, topk_groups = 1;
  float routed_scaling = 1.f;
  int32_t* ids = nullptr;        // [tokens, top_k]
  float* weights = nullptr;      // [tokens, top_k]
};
constexpr int kMaxRouteExperts = 512;  // 16 per lane
constexpr int kMaxRouteTopK = 32;
constexpr int kMaxRouteGroups = 32;   // one per lane
void launch_route(const RouteParams& p, cudaStream_t stream);

// Permutation (moe_permute.cu): entries (token, k) in chunks of kPermuteChunk, one warp per chunk.
constexpr int kPermuteChunk = 1024;
constexpr int kMaxPermuteExperts = 1024;
struct PermuteParams {
  const int32_t* ids = nullptr;     // [entries = tokens x top_k]
  int64_t entries = 0;
  int top_k = 1;
  int num_experts = 0, align = 1;
  int64_t capacity = 0;
  int32_t* offsets = nullptr;        // [num_experts + 1]
  int32_t* permuted_token = nullptr; // [capacity]
  int32_t* inverse = nullptr;        // [entries]
  // Workspace: per-entry rank within its chunk's expert run, per (chunk, expert) counts then bases.
  int32_t* rank = nullptr;           // [entries]
  int32_t* chunk_base = nullptr;     // [chunks, num_experts]
  // Rows (optional): x [tokens, hidden] -> permuted_x [capacity, hidden], 16-bit elements.
  const void* x = nullptr;
  void* permuted_x = nullptr;
  int64_t hidden = 0, x_stride = 0, permuted_x_stride = 0;
};
inline int64_t permute_chunks(int64_t entries) { return (entries + kPermuteChunk - 1) / kPermuteChunk; }
void launch_permute(const PermuteParams& p, cudaStream_t stream);

}  // namespace tessera::kernels::moe
