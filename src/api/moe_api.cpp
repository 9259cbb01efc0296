// tessera::moe_route / moe_permute: validation, then the kernels of src/kernels/moe/.
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "core/arg_check.h"
#include "kernels/moe/moe_params.h"
#include "tessera/moe.h"

namespace tessera {
namespace {

// A row-major contiguous 2-D int32 / fp32 tensor of [rows, cols].
void check_matrix(const detail::ArgCheck& check, const TensorView& t, const char* name, DType dtype, int64_t rows,
                  int64_t cols) {
  check.tensor(t, name, 2);
  check.dtype(t, name, {dtype});
  check.dim(t, name, 0, rows, "the token count");
  check.dim(t, name, 1, cols, "top_k");
  TESSERA_REQUIRE(check, t.is_contiguous(), name, "must be row-major contiguous, got " + t.describe());
  check.output_layout(t, name);
}

}  // namespace

void moe_route(const MoeRouteArgs& a, cudaStream_t stream) {
  const detail::ArgCheck check("moe_route");
  check.tensor(a.logits, "logits", 2);
  check.dtype(a.logits, "logits", {DType::kFP32, DType::kBF16, DType::kFP16});
  const int64_t tokens = a.logits.size(0), experts = a.logits.size(1);
  TESSERA_REQUIRE(check, experts >= 1 && experts <= kernels::moe::kMaxRouteExperts, "logits",
                  "num_experts (dim 1) must be in 1.." + std::to_string(kernels::moe::kMaxRouteExperts) + ", got " +
                      std::to_string(experts));
  TESSERA_REQUIRE(check, a.logits.stride[1] == 1 || experts == 1, "logits", "the expert dim must be contiguous");
  TESSERA_REQUIRE(check, tokens < (int64_t(1) << 31), "logits", "more than 2^31 - 1 tokens");
  TESSERA_REQUIRE(check, a.top_k >= 1 && a.top_k <= experts && a.top_k <= kernels::moe::kMaxRouteTopK, "top_k",
                  "must be in 1..min(num_experts, " + std::to_string(kernels::moe::kMaxRouteTopK) + "), got " +
                      std::to_string(a.top_k));
  TESSERA_REQUIRE(check, a.score == MoeScore::kSoftmax || a.score == MoeScore::kSigmoid, "score",
                  "must be kSoftmax or kSigmoid");
  TESSERA_REQUIRE(check, a.num_groups >= 1 && a.num_groups <= kernels::moe::kMaxRouteGroups, "num_groups",
                  "must be in 1.." + std::to_string(kernels::moe::kMaxRouteGroups));
  if (a.num_groups > 1) {
    TESSERA_REQUIRE(check, experts % a.num_groups == 0, "num_groups",
                    "must divide num_experts (" + std::to_string(experts) + ")");
    TESSERA_REQUIRE(check, a.topk_groups >= 1 && a.topk_groups <= a.num_groups, "topk_groups",
                    "must be in 1..num_groups");
    TESSERA_REQUIRE(check, a.top_k <= a.topk_groups * (experts / a.num_groups), "top_k",
                    "exceeds the experts of the topk_groups kept groups");
  }
  TESSERA_REQUIRE(check, a.routed_scaling == a.routed_scaling, "routed_scaling", "is NaN");
  if (a.selection_bias.data != nullptr) {
    check.tensor(a.selection_bias, "selection_bias", 1);
    check.dtype(a.selection_bias, "selection_bias", {DType::kFP32});
    check.dim(a.selection_bias, "selection_bias", 0, experts, "num_experts");
    TESSERA_REQUIRE(check, a.selection_bias.stride[0] == 1 || experts == 1, "selection_bias", "must be contiguous");
  }
  check_matrix(check, a.topk_ids, "topk_ids", DType::kInt32, tokens, a.top_k);
  check_matrix(check, a.topk_weights, "topk_weights", DType::kFP32, tokens, a.top_k);
  check.disjoint(a.topk_ids, "topk_ids", a.topk_weights, "topk_weights");
  if (a.selection_bias.data != nullptr) {
    check.disjoint(a.topk_ids, "topk_ids", a.selection_bias, "selection_bias");
    check.disjoint(a.topk_weights, "topk_weights", a.selection_bias, "selection_bias");
  }
  check.disjoint(a.topk_ids, "topk_ids", a.logits, "logits");
  check.disjoint(a.topk_weights, "topk_weights", a.logits, "logits");

  kernels::moe::RouteParams p;
  p.logits = a.logits.data;
  p.logits_dtype = a.logits.dtype;
  p.logits_stride = a.logits.stride[0];
  p.bias = a.selection_bias.data != nullptr ? static_cast<const float*>(a.selection_bias.data) : nullptr;
  p.tokens = tokens;
  p.num_experts = static_cast<int>(experts);
  p.top_k = a.top_k;
  p.sigmoid = a.score == MoeScore::kSigmoid;
  p.renormalize = a.renormalize;
  p.num_groups = a.num_groups;
  p.topk_groups = a.num_groups > 1 ? a.topk_groups : 1;
  p.routed_scaling = a.routed_scaling;
  p.ids = static_cast<int32_t*>(a.topk_ids.data);
  p.weights = static_cast<float*>(a.topk_weights.data);
  kernels::moe::launch_route(p, stream);
}

namespace {
// The shape rules the sizing helpers share; counts beyond 2^31 rows are refused by moe_permute.
void check_permute_shape(const detail::ArgCheck& check, int64_t tokens, int64_t top_k, int64_t num_experts,
                         int64_t align) {
  TESSERA_REQUIRE(check, tokens >= 0 && tokens < (int64_t(1) << 31), "tokens", "must be in 0..2^31 - 1");
  TESSERA_REQUIRE(check, top_k >= 1 && top_k <= 64, "top_k", "must be in 1..64, got " + std::to_string(top_k));
  TESSERA_REQUIRE(check, num_experts >= 1 && num_experts <= kernels::moe::kMaxPermuteExperts, "num_experts",
                  "must be in 1.." + std::to_string(kernels::moe::kMaxPermuteExperts) + ", got " +
                      std::to_string(num_experts));
  TESSERA_REQUIRE(check, align >= 1 && align <= 1024, "align", "must be in 1..1024, got " + std::to_string(align));
}
}  // namespace

int64_t moe_permute_capacity(int64_t tokens, int top_k, int num_experts, int align) {
  const detail::ArgCheck check("moe_permute_capacity");
  check_permute_shape(check, tokens, top_k, num_experts, align);
  return tokens * top_k + int64_t(num_experts) * (align - 1);
}

std::size_t moe_permute_workspace_bytes(int64_t tokens, int top_k, int num_experts) {
  const detail::ArgCheck check("moe_permute_workspace_bytes");
  check_permute_shape(check, tokens, top_k, num_experts, 1);
  const int64_t entries = tokens * top_k;
  const int64_t ranks = (entries + 63) / 64 * 64;  // the chunk bases start 256 bytes after an aligned base
  return std::size_t(ranks + kernels::moe::permute_chunks(entries) * num_experts) * sizeof(int32_t);
}

void moe_permute(const MoePermuteArgs& a, cudaStream_t stream) {
  const detail::ArgCheck check("moe_permute");
  check.tensor(a.topk_ids, "topk_ids", 2);
  check.dtype(a.topk_ids, "topk_ids", {DType::kInt32});
  TESSERA_REQUIRE(check, a.topk_ids.is_contiguous(), "topk_ids", "must be row-major contiguous, got " + a.topk_ids.describe());
  const int64_t tokens = a.topk_ids.size(0);
  TESSERA_REQUIRE(check, a.topk_ids.size(1) >= 1 && a.topk_ids.size(1) <= 64, "topk_ids",
                  "top_k (dim 1) must be in 1..64, got " + std::to_string(a.topk_ids.size(1)));
  TESSERA_REQUIRE(check, tokens < (int64_t(1) << 31), "topk_ids", "more than 2^31 - 1 tokens");
  const int top_k = static_cast<int>(a.topk_ids.size(1));
  check_permute_shape(check, tokens, top_k, a.num_experts, a.align);
  const int64_t entries = tokens * top_k;
  TESSERA_REQUIRE(check, entries + int64_t(a.num_experts) * a.align < (int64_t(1) << 31), "topk_ids",
                  "tokens x top_k + num_experts x align must stay below 2^31");
  const int64_t capacity = moe_permute_capacity(tokens, top_k, a.num_experts, a.align);
  check.index_array(a.expert_offsets, "expert_offsets");
  check.dim(a.expert_offsets, "expert_offsets", 0, a.num_experts + 1, "num_experts + 1");
  check.index_array(a.permuted_token, "permuted_token");
  TESSERA_REQUIRE(check, a.permuted_token.size(0) >= capacity, "permuted_token",
                  "holds " + std::to_string(a.permuted_token.size(0)) + " rows; moe_permute_capacity is " +
                      std::to_string(capacity));
  check_matrix(check, a.inverse, "inverse", DType::kInt32, tokens, top_k);
  const std::size_t ws = moe_permute_workspace_bytes(tokens, top_k, a.num_experts);
  TESSERA_REQUIRE(check, a.workspace != nullptr || ws == 0, "workspace", "must not be null");
  TESSERA_REQUIRE(check, a.workspace_size >= ws, "workspace_size",
                  std::to_string(a.workspace_size) + " bytes is less than the " + std::to_string(ws) +
                      " moe_permute_workspace_bytes gives");
  TESSERA_REQUIRE(check, reinterpret_cast<uintptr_t>(a.workspace) % alignof(int32_t) == 0, "workspace",
                  "must be 4-byte aligned (it holds int32 arrays)");
  const bool rows = !a.x.empty_view() || a.x.data != nullptr;
  if (rows) {
    check.tensor(a.x, "x", 2);
    check.dtype(a.x, "x", {DType::kBF16, DType::kFP16});
    check.dim(a.x, "x", 0, tokens, "topk_ids' token count");
    check.vectorizable_rows(a.x, "x");
    check.tensor(a.permuted_x, "permuted_x", 2);
    check.dtype(a.permuted_x, "permuted_x", {a.x.dtype});
    check.dim(a.permuted_x, "permuted_x", 1, a.x.size(1), "x's hidden size");
    TESSERA_REQUIRE(check, a.permuted_x.size(0) >= capacity, "permuted_x",
                    "holds " + std::to_string(a.permuted_x.size(0)) + " rows; moe_permute_capacity is " +
                        std::to_string(capacity));
    check.vectorizable_rows(a.permuted_x, "permuted_x");
    check.output_layout(a.permuted_x, "permuted_x");
  }
  // Outputs and the workspace apart from each other and from every input.
  const TensorView ws_view = TensorView::contiguous(a.workspace, DType::kInt32, {int64_t(ws / sizeof(int32_t))});
  std::vector<std::pair<const TensorView*, const char*>> outs = {{&a.expert_offsets, "expert_offsets"},
                                                                  {&a.permuted_token, "permuted_token"},
                                                                  {&a.inverse, "inverse"}};
  if (ws > 0) outs.push_back({&ws_view, "workspace"});
  if (rows) outs.push_back({&a.permuted_x, "permuted_x"});
  for (const auto& [o, name] : outs) {
    check.disjoint(*o, name, a.topk_ids, "topk_ids");
    if (rows) check.disjoint(*o, name, a.x, "x");
    for (const auto& [o2, name2] : outs) {
      if (o < o2) check.disjoint(*o, name, *o2, name2);
    }
  }

  kernels::moe::PermuteParams p;
  p.ids = static_cast<const int32_t*>(a.topk_ids.data);
  p.entries = entries;
  p.top_k = top_k;
  p.num_experts = a.num_experts;
  p.align = a.align;
  p.capacity = a.permuted_token.size(0);
  p.offsets = static_cast<int32_t*>(a.expert_offsets.data);
  p.permuted_token = static_cast<int32_t*>(a.permuted_token.data);
  p.inverse = static_cast<int32_t*>(a.inverse.data);
  p.rank = static_cast<int32_t*>(a.workspace);
  p.chunk_base = p.rank + (entries + 63) / 64 * 64;
  if (rows) {
    p.x = a.x.data;
    p.permuted_x = a.permuted_x.data;
    p.hidden = a.x.size(1);
    p.x_stride = a.x.stride[0];
    p.permuted_x_stride = a.permuted_x.stride[0];
  }
  kernels::moe::launch_permute(p, stream);
}

}  // namespace tessera
