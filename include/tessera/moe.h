// Mixture-of-Experts layer parts: routing (router logits -> top-k experts and weights) and the
// permutation of token copies into per-expert segments (the grouped GEMM's input layout).
//
// Everything runs on the device without a host synchronisation (the per-expert offsets are
// computed there), so the parts can be captured in a CUDA graph; results are deterministic (the
// same inputs give bitwise the same outputs).
//
// The grouped GEMM (moe_grouped_gemm), the combine (moe_combine) and the whole layer (fused_moe)
// follow; on Hopper (sm_90a) the GEMM is a TMA + wgmma kernel, elsewhere a portable mma.sync one.
#pragma once

#include <cstddef>
#include <cstdint>

#include "tessera/stream.h"
#include "tessera/tensor.h"

namespace tessera {

enum class MoeScore : int { kSoftmax = 0, kSigmoid = 1 };

// Router: logits [tokens, num_experts] (fp32, bf16 or fp16; rows may be strided, the expert dim is
// contiguous) -> topk_ids [tokens, top_k] int32 and topk_weights [tokens, top_k] fp32 (both
// row-major contiguous), experts by decreasing selection score.
//   score      softmax over the experts (fp32), or an independent sigmoid per expert;
//   selection  by score + selection_bias[e] when a bias is given (DeepSeek-V3: the bias steers the
//              choice only); ties break toward the lower expert id; NaN scores are chosen last;
//   groups     num_groups > 1: the experts form num_groups equal groups, a group scores the sum of
//              its two best selection scores, only the topk_groups best groups are eligible
//              (DeepSeek-V3's grouped top-k; num_groups <= 32);
//   weights    the unbiased scores of the chosen experts, divided by their sum when renormalize,
//              times routed_scaling.
// num_experts <= 512, top_k <= min(num_experts, 32) (and <= topk_groups x the group size when
// grouped). Known gaps: fp32 scores that underflow to 0 for every chosen expert make renormalised
// weights NaN (0 / 0; the fp64 reference keeps them finite), and a NaN score ties with a real -inf
// one (bias -inf), the lower id winning.
struct MoeRouteArgs {
  TensorView logits;
  TensorView selection_bias;  // optional [num_experts] fp32
  int top_k = 0;
  MoeScore score = MoeScore::kSoftmax;
  bool renormalize = false;
  int num_groups = 1;
  int topk_groups = 1;
  float routed_scaling = 1.f;
  TensorView topk_ids;
  TensorView topk_weights;
};

void moe_route(const MoeRouteArgs& args, cudaStream_t stream);

// Permutation: the (token, k) copies grouped by expert, in (token, k) order within an expert.
// Expert e's rows are [expert_offsets[e], expert_offsets[e + 1]); every segment starts at a
// multiple of `align` and is padded to one (align = the grouped GEMM's M tile, or 1). Ids outside
// [0, num_experts) are dropped (no row, inverse -1): an expert-parallel rank passes -1 for the
// experts it does not hold. Empty experts are normal.
//   permuted_token [capacity] int32: the token of each row; -1 on padding and past the last row;
//   inverse [tokens, top_k] int32: the row of each (token, k) copy (-1 when dropped);
//   permuted_x [capacity, hidden] (optional, x's dtype): x's rows copied in that order, padding
//     rows inside the segments zeroed, rows past expert_offsets[num_experts] left alone.
// capacity >= moe_permute_capacity(tokens, top_k, num_experts, align): the row count is only known
// on the device, so buffers are sized for the worst case. Limits: top_k <= 64, num_experts <= 1024,
// align <= 1024, tokens x top_k + num_experts x align < 2^31. Every output, the workspace and the
// inputs are pairwise disjoint.
struct MoePermuteArgs {
  TensorView topk_ids;  // [tokens, top_k] int32, row-major contiguous
  int num_experts = 0;
  int align = 1;
  TensorView x;               // optional [tokens, hidden] bf16 / fp16, hidden contiguous
  TensorView permuted_x;      // [capacity, hidden] when x is given
  TensorView expert_offsets;  // [num_experts + 1] int32
  TensorView permuted_token;  // [capacity] int32
  TensorView inverse;         // [tokens, top_k] int32, row-major contiguous
  void* workspace = nullptr;  // moe_permute_workspace_bytes(...) bytes, 4-byte aligned
  std::size_t workspace_size = 0;
};

int64_t moe_permute_capacity(int64_t tokens, int top_k, int num_experts, int align);
std::size_t moe_permute_workspace_bytes(int64_t tokens, int top_k, int num_experts);
void moe_permute(const MoePermuteArgs& args, cudaStream_t stream);

// Grouped GEMM over the experts' row segments: for every expert e and row r in
// [expert_offsets[e], expert_offsets[e + 1]):
//   kNone    out[r, n] = sum_k a[r, k] weights[e, n, k]                       (N = weights.size(1))
//   kSwiGLU  out[r, j] = silu(g) * u, g = (a w^T)[r, j], u = (a w^T)[r, I + j] (I = N / 2: the
//            first half of each expert's rows is the gate projection, the second the up one)
// bf16 or fp16 in and out (one dtype), fp32 accumulation. The segment bounds are read on the
// device (moe_permute's expert_offsets, any alignment), so the call is CUDA-graph capturable;
// experts with no rows cost nothing. Rows of `a` / `out` outside every segment are not read into
// any result and not written. a [rows, K] and out [rows, N or I] have contiguous columns and
// row strides that are multiples of 8 elements; weights [E, N, K] has a contiguous K dim; K, N
// (and I) are multiples of 8; rows < 2^31. expert_offsets must be non-decreasing within
// [0, rows] (moe_permute's is); it is read on the device, where the host cannot check it, so a
// broken array is made safe there rather than trusted: each offset is clamped to [0, rows] and
// raised to the largest offset before it, so no tile reaches outside a / out (the results of a
// broken array are unspecified, never out-of-bounds).
// Gathered rows: with a_rows given, row r of the product reads a[a_rows[r]] (a is then [tokens, K],
// any number of rows), so moe_permute's permuted_token feeds the GEMM without the permuted copy
// of x; rows = a_rows.size(0) = out.size(0). a_rows is device data: an entry outside
// [0, a.size(0)) (moe_permute's -1 on padding rows) reads a row of zeros.
enum class MoeActivation : int { kNone = 0, kSwiGLU = 1 };

struct MoeGroupedGemmArgs {
  TensorView a;               // [rows, K], or [tokens, K] with a_rows
  TensorView weights;         // [num_experts, N, K]
  TensorView expert_offsets;  // [num_experts + 1] int32, device
  MoeActivation activation = MoeActivation::kNone;
  TensorView out;             // [rows, N] (kNone) or [rows, N / 2] (kSwiGLU)
  TensorView a_rows;          // optional [rows] int32, device: the row of `a` each product row reads
};
void moe_grouped_gemm(const MoeGroupedGemmArgs& args, cudaStream_t stream);

// Combine: out[t, :] = sum_k topk_weights[t, k] * expert_out[inverse[t, k], :] (+ shared_out[t, :]),
// summed in fp32 in k order (deterministic), copies with inverse -1 (dropped) skipped. inverse is
// device data the host cannot check: an entry outside [0, rows) is skipped like -1, never read.
struct MoeCombineArgs {
  TensorView expert_out;    // [rows, hidden] bf16 / fp16, hidden contiguous
  TensorView inverse;       // [tokens, top_k] int32 (moe_permute's), row-major contiguous
  TensorView topk_weights;  // [tokens, top_k] fp32, row-major contiguous
  TensorView shared_out;    // optional [tokens, hidden], expert_out's dtype: added (shared experts)
  TensorView out;           // [tokens, hidden], expert_out's dtype
};
void moe_combine(const MoeCombineArgs& args, cudaStream_t stream);

// The whole MoE layer: (route) -> permute -> grouped GEMM up + SwiGLU -> grouped GEMM down ->
// combine with the routing weights, plus optional shared experts (a dense SwiGLU MLP over every
// token, added by the combine). Routing comes either from router_logits (with the MoeRouteArgs
// options below; topk_ids / topk_weights may then be given to receive it) or, with no logits,
// from the caller's topk_ids / topk_weights. Intermediates live in `workspace`
// (fused_moe_workspace_bytes); nothing is allocated. Deterministic; graph-capturable.
struct FusedMoeArgs {
  TensorView x;              // [tokens, hidden] bf16 / fp16, hidden contiguous
  TensorView w1;             // [num_experts, 2 * inter, hidden]: gate rows, then up rows
  TensorView w2;             // [num_experts, hidden, inter]
  TensorView router_logits;  // optional [tokens, num_experts]
  int top_k = 0;
  MoeScore score = MoeScore::kSoftmax;
  bool renormalize = false;
  int num_groups = 1;
  int topk_groups = 1;
  float routed_scaling = 1.f;
  TensorView selection_bias;  // optional [num_experts] fp32
  TensorView topk_ids;        // [tokens, top_k] int32: input without logits, optional output with
  TensorView topk_weights;    // [tokens, top_k] fp32: likewise
  TensorView shared_w1;       // optional [2 * shared_inter, hidden]
  TensorView shared_w2;       // optional [hidden, shared_inter] (with shared_w1)
  TensorView out;             // [tokens, hidden], x's dtype
  void* workspace = nullptr;  // fused_moe_workspace_bytes(...) bytes, 16-byte aligned
  std::size_t workspace_size = 0;
};
std::size_t fused_moe_workspace_bytes(int64_t tokens, int64_t hidden, int64_t inter, int num_experts, int top_k,
                                      int64_t shared_inter = 0);
void fused_moe(const FusedMoeArgs& args, cudaStream_t stream);

}  // namespace tessera
