// tessera::moe_route / moe_permute: validation, then the kernels of src/kernels/moe/.
#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "core/arg_check.h"
#include "dispatch/moe_dispatch.h"
#include "kernels/moe/grouped_gemm_params.h"
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

// The router's rules (moe_route, and fused_moe under its own name for the logits): logits
// [tokens, num_experts] with a contiguous expert dim, the top-k / group options, the bias.
void check_route_options(const detail::ArgCheck& check, const TensorView& logits, const char* logits_name, int top_k,
                         MoeScore score, int num_groups, int topk_groups, float routed_scaling,
                         const TensorView& selection_bias) {
  check.tensor(logits, logits_name, 2);
  check.dtype(logits, logits_name, {DType::kFP32, DType::kBF16, DType::kFP16});
  const int64_t tokens = logits.size(0), experts = logits.size(1);
  TESSERA_REQUIRE(check, experts >= 1 && experts <= kernels::moe::kMaxRouteExperts, logits_name,
                  "num_experts (dim 1) must be in 1.." + std::to_string(kernels::moe::kMaxRouteExperts) + ", got " +
                      std::to_string(experts));
  TESSERA_REQUIRE(check, logits.stride[1] == 1 || experts == 1, logits_name, "the expert dim must be contiguous");
  TESSERA_REQUIRE(check, tokens < (int64_t(1) << 31), logits_name, "more than 2^31 - 1 tokens");
  TESSERA_REQUIRE(check, top_k >= 1 && top_k <= experts && top_k <= kernels::moe::kMaxRouteTopK, "top_k",
                  "must be in 1..min(num_experts, " + std::to_string(kernels::moe::kMaxRouteTopK) + "), got " +
                      std::to_string(top_k));
  TESSERA_REQUIRE(check, score == MoeScore::kSoftmax || score == MoeScore::kSigmoid, "score",
                  "must be kSoftmax or kSigmoid");
  TESSERA_REQUIRE(check, num_groups >= 1 && num_groups <= kernels::moe::kMaxRouteGroups, "num_groups",
                  "must be in 1.." + std::to_string(kernels::moe::kMaxRouteGroups));
  if (num_groups > 1) {
    TESSERA_REQUIRE(check, experts % num_groups == 0, "num_groups",
                    "must divide num_experts (" + std::to_string(experts) + ")");
    TESSERA_REQUIRE(check, topk_groups >= 1 && topk_groups <= num_groups, "topk_groups", "must be in 1..num_groups");
    TESSERA_REQUIRE(check, top_k <= topk_groups * (experts / num_groups), "top_k",
                    "exceeds the experts of the topk_groups kept groups");
  }
  TESSERA_REQUIRE(check, routed_scaling == routed_scaling, "routed_scaling", "is NaN");
  if (selection_bias.data != nullptr || !selection_bias.empty_view()) {
    check.tensor(selection_bias, "selection_bias", 1);
    check.dtype(selection_bias, "selection_bias", {DType::kFP32});
    check.dim(selection_bias, "selection_bias", 0, experts, "num_experts");
    TESSERA_REQUIRE(check, selection_bias.stride[0] == 1 || experts == 1, "selection_bias", "must be contiguous");
  }
}

// moe_route's rules, then the kernel's parameters (fused_moe builds them before any launch).
kernels::moe::RouteParams route_params(const detail::ArgCheck& check, const MoeRouteArgs& a) {
  check_route_options(check, a.logits, "logits", a.top_k, a.score, a.num_groups, a.topk_groups, a.routed_scaling,
                      a.selection_bias);
  const int64_t tokens = a.logits.size(0), experts = a.logits.size(1);
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
  return p;
}

}  // namespace

void moe_route(const MoeRouteArgs& a, cudaStream_t stream) {
  const detail::ArgCheck check("moe_route");
  kernels::moe::launch_route(route_params(check, a), stream);
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

namespace {
// moe_permute's rules, then the kernels' parameters.
kernels::moe::PermuteParams permute_params(const detail::ArgCheck& check, const MoePermuteArgs& a) {
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
  return p;
}
}  // namespace

void moe_permute(const MoePermuteArgs& a, cudaStream_t stream) {
  const detail::ArgCheck check("moe_permute");
  kernels::moe::launch_permute(permute_params(check, a), stream);
}

// ---- Grouped GEMM, combine, the whole layer -----------------------------------------------------

namespace {

// A 16-bit matrix whose rows the kernels read or write in 16-byte vectors.
void check_rows_16bit(const detail::ArgCheck& check, const TensorView& t, const char* name, int rank) {
  check.tensor(t, name, rank);
  check.dtype(t, name, {DType::kBF16, DType::kFP16});
  check.vectorizable_rows(t, name);
}

// A grouped GEMM operand as the copy engine reads it (TMA on Hopper; the portable kernel gets the
// same rule so both families take the same calls): every dim of more than one element has a
// positive stride below 2^40 bytes.
void check_gemm_strides(const detail::ArgCheck& check, const TensorView& t, const char* name) {
  for (int d = 0; d + 1 < t.rank; ++d) {
    TESSERA_REQUIRE(check, t.shape[d] <= 1 || (t.stride[d] > 0 && t.stride[d] < (int64_t(1) << 39)), name,
                    "stride of dim " + std::to_string(d) + " (" + std::to_string(t.stride[d]) +
                        ") must be positive and below 2^39 elements (the grouped GEMM's copy engine)");
  }
}

// The tiles of the largest grouped GEMM launch (16-row tiles, 64-column tiles) must number < 2^31.
void check_tile_count(const detail::ArgCheck& check, const char* name, int64_t rows, int64_t experts, int64_t n) {
  const int64_t tiles = (rows / 16 + experts) * ((n + 63) / 64);
  // Rows below 2^31 - 256: a tile's row index (its first row plus up to 255) stays an int.
  TESSERA_REQUIRE(check, rows < (int64_t(1) << 31) - 256 && tiles < (int64_t(1) << 31), name,
                  "too many rows x columns for one launch (" + std::to_string(rows) + " rows, " + std::to_string(n) +
                      " columns)");
}

// weights [E, N, K] against a [rows, K] and out [rows, N or N / 2], or with gathered rows
// (a_rows, [rows] int32) a [any, K]; returns the GEMM's params (offsets as given).
kernels::moe::GroupedGemmParams grouped_gemm_params(const detail::ArgCheck& check, const TensorView& a,
                                                    const char* a_name, const TensorView& w, const char* w_name,
                                                    bool swiglu, const TensorView& out, const char* out_name,
                                                    const TensorView* a_rows = nullptr) {
  check_rows_16bit(check, a, a_name, 2);
  check_rows_16bit(check, w, w_name, 3);
  check.dtype(w, w_name, {a.dtype});
  check_rows_16bit(check, out, out_name, 2);
  check.dtype(out, out_name, {a.dtype});
  check_gemm_strides(check, a, a_name);
  check_gemm_strides(check, w, w_name);
  check_gemm_strides(check, out, out_name);
  const bool gathered = a_rows != nullptr;
  if (gathered) check.index_array(*a_rows, "a_rows");
  const int64_t rows = gathered ? a_rows->size(0) : a.size(0), k = a.size(1), experts = w.size(0), n = w.size(1);
  TESSERA_REQUIRE(check, experts >= 1 && experts <= kernels::moe::kMaxGemmExperts, w_name,
                  "num_experts (dim 0) must be in 1.." + std::to_string(kernels::moe::kMaxGemmExperts) + ", got " +
                      std::to_string(experts));
  TESSERA_REQUIRE(check, k >= 8 && k < (int64_t(1) << 31), a_name,
                  "the reduction dim (dim 1) must be at least 8, got " + std::to_string(k));
  check.dim(w, w_name, 2, k, (std::string(a_name) + "'s dim 1").c_str());
  TESSERA_REQUIRE(check, n >= 8 && n % (swiglu ? 16 : 8) == 0 && n < (int64_t(1) << 31), w_name,
                  std::string("dim 1 (N) must be a positive multiple of ") + (swiglu ? "16 (gate and up halves of a multiple of 8 each)" : "8") +
                      ", got " + std::to_string(n));
  check.dim(out, out_name, 0, rows, gathered ? "a_rows' size" : (std::string(a_name) + "'s rows").c_str());
  check.dim(out, out_name, 1, swiglu ? n / 2 : n, swiglu ? "N / 2 (SwiGLU)" : "N");
  check.output_layout(out, out_name);
  check.disjoint(out, out_name, a, a_name);
  check.disjoint(out, out_name, w, w_name);
  if (gathered) check.disjoint(out, out_name, *a_rows, "a_rows");
  check_tile_count(check, a_name, rows, experts, n);
  TESSERA_REQUIRE(check, a.size(0) < (int64_t(1) << 31), a_name, "more than 2^31 - 1 rows");

  kernels::moe::GroupedGemmParams p;
  p.dtype = a.dtype;
  p.a = a.data;
  p.a_stride = a.size(0) > 1 ? a.stride[0] : k;
  p.a_rows = a.size(0);
  if (gathered) p.a_row_index = static_cast<const int32_t*>(a_rows->data);
  p.w = w.data;
  p.w_stride_expert = experts > 1 ? w.stride[0] : n * k;
  p.w_stride_row = n > 1 ? w.stride[1] : k;
  p.out = out.data;
  p.out_stride = rows > 1 ? out.stride[0] : out.size(1);
  p.rows = rows;
  p.num_experts = static_cast<int>(experts);
  p.n = static_cast<int>(n);
  p.k = static_cast<int>(k);
  p.epilogue = swiglu ? kernels::moe::GemmEpilogue::kSwiGLU : kernels::moe::GemmEpilogue::kStore;
  p.expected_rows_per_expert = rows / experts;
  return p;
}

// The combine's tensors: expert_out [rows, H], inverse / weights [T, k], shared [T, H], out [T, H].
void check_combine(const detail::ArgCheck& check, const MoeCombineArgs& a) {
  check_rows_16bit(check, a.expert_out, "expert_out", 2);
  check.tensor(a.inverse, "inverse", 2);
  check_matrix(check, a.inverse, "inverse", DType::kInt32, a.inverse.size(0), a.inverse.size(1));
  const int64_t tokens = a.inverse.size(0), top_k = a.inverse.size(1);
  TESSERA_REQUIRE(check, top_k >= 1 && top_k <= 64, "inverse", "top_k (dim 1) must be in 1..64, got " + std::to_string(top_k));
  TESSERA_REQUIRE(check, tokens < (int64_t(1) << 31), "inverse", "more than 2^31 - 1 tokens");
  check_matrix(check, a.topk_weights, "topk_weights", DType::kFP32, tokens, top_k);
  check_rows_16bit(check, a.out, "out", 2);
  check.dtype(a.out, "out", {a.expert_out.dtype});
  check.dim(a.out, "out", 0, tokens, "inverse's token count");
  check.dim(a.out, "out", 1, a.expert_out.size(1), "expert_out's hidden size");
  check.output_layout(a.out, "out");
  const bool shared = a.shared_out.data != nullptr || !a.shared_out.empty_view();
  if (shared) {
    check_rows_16bit(check, a.shared_out, "shared_out", 2);
    check.dtype(a.shared_out, "shared_out", {a.expert_out.dtype});
    check.same_shape(a.out, "out", a.shared_out, "shared_out");
    check.disjoint(a.out, "out", a.shared_out, "shared_out");
  }
  check.disjoint(a.out, "out", a.expert_out, "expert_out");
  check.disjoint(a.out, "out", a.inverse, "inverse");
  check.disjoint(a.out, "out", a.topk_weights, "topk_weights");
}

kernels::moe::CombineParams combine_params(const MoeCombineArgs& a) {
  kernels::moe::CombineParams p;
  p.dtype = a.expert_out.dtype;
  p.y = a.expert_out.data;
  p.y_stride = a.expert_out.size(0) > 1 ? a.expert_out.stride[0] : a.expert_out.size(1);
  p.y_rows = a.expert_out.size(0);
  p.inverse = static_cast<const int32_t*>(a.inverse.data);
  p.weights = static_cast<const float*>(a.topk_weights.data);
  if (a.shared_out.data != nullptr) {
    p.shared = a.shared_out.data;
    p.shared_stride = a.shared_out.size(0) > 1 ? a.shared_out.stride[0] : a.shared_out.size(1);
  }
  p.out = a.out.data;
  p.out_stride = a.out.size(0) > 1 ? a.out.stride[0] : a.out.size(1);
  p.tokens = a.inverse.size(0);
  p.hidden = a.out.size(1);
  p.top_k = static_cast<int>(a.inverse.size(1));
  return p;
}

}  // namespace

void moe_grouped_gemm(const MoeGroupedGemmArgs& a, cudaStream_t stream) {
  const detail::ArgCheck check("moe_grouped_gemm");
  TESSERA_REQUIRE(check, a.activation == MoeActivation::kNone || a.activation == MoeActivation::kSwiGLU, "activation",
                  "must be kNone or kSwiGLU");
  const bool gathered = a.a_rows.data != nullptr || !a.a_rows.empty_view();
  kernels::moe::GroupedGemmParams p =
      grouped_gemm_params(check, a.a, "a", a.weights, "weights", a.activation == MoeActivation::kSwiGLU, a.out, "out",
                          gathered ? &a.a_rows : nullptr);
  check.index_array(a.expert_offsets, "expert_offsets");
  check.dim(a.expert_offsets, "expert_offsets", 0, p.num_experts + 1, "num_experts + 1");
  check.disjoint(a.out, "out", a.expert_offsets, "expert_offsets");
  if (p.rows == 0) return;
  p.offsets = static_cast<const int32_t*>(a.expert_offsets.data);
  dispatch::run_moe_grouped_gemm(p, stream);
}

void moe_combine(const MoeCombineArgs& a, cudaStream_t stream) {
  const detail::ArgCheck check("moe_combine");
  check_combine(check, a);
  if (a.inverse.size(0) == 0) return;
  kernels::moe::launch_combine(combine_params(a), stream);
}

namespace {

// Sub-buffers start at multiples of 256 bytes from the workspace's base; the base itself needs the
// 16 bytes of the kernels' vector loads and TMA boxes.
constexpr std::size_t kWorkspaceAlign = 256;
constexpr std::size_t kWorkspaceBaseAlign = 16;
std::size_t round_up(std::size_t bytes) { return (bytes + kWorkspaceAlign - 1) / kWorkspaceAlign * kWorkspaceAlign; }

// fused_moe's intermediates, carved from the workspace in this order (each at a multiple of 256
// bytes from its base).
struct FusedMoeLayout {
  std::size_t ids = 0, weights = 0, offsets = 0, permuted_token = 0, inverse = 0, permute_ws = 0, permuted_x = 0,
              act = 0, y = 0, shared_act = 0, shared_out = 0, total = 0;
  std::size_t permute_ws_bytes = 0;
};
FusedMoeLayout fused_moe_layout(int64_t tokens, int64_t hidden, int64_t inter, int num_experts, int top_k,
                                int64_t shared_inter) {
  const int64_t rows = tokens * top_k;  // align 1: the kernels take segments at any row
  const std::size_t e16 = 2;
  FusedMoeLayout l;
  std::size_t at = 0;
  // Sizes are bounded by check_fused_shape (rows < 2^31, hidden and inter < 2^30: each buffer
  // below 2^62 bytes), and the sum is checked on top, so no size wraps.
  auto take = [&](std::size_t bytes) {
    const std::size_t here = at;
    if (__builtin_add_overflow(at, round_up(bytes), &at)) throw Error("tessera::fused_moe: the workspace size overflows");
    return here;
  };
  l.ids = take(std::size_t(rows) * 4);
  l.weights = take(std::size_t(rows) * 4);
  l.offsets = take(std::size_t(num_experts + 1) * 4);
  l.permuted_token = take(std::size_t(rows) * 4);
  l.inverse = take(std::size_t(rows) * 4);
  l.permute_ws_bytes = moe_permute_workspace_bytes(tokens, top_k, num_experts);
  l.permute_ws = take(l.permute_ws_bytes);
  // x's rows for the first GEMM: gathered in its loads, or copied here (dispatch::fused_moe_rows).
  if (dispatch::fused_moe_rows(inter) == dispatch::FusedMoeRows::kCopy) l.permuted_x = take(std::size_t(rows) * hidden * e16);
  l.act = take(std::size_t(rows) * inter * e16);
  l.y = take(std::size_t(rows) * hidden * e16);
  if (shared_inter > 0) {
    l.shared_act = take(std::size_t(tokens) * shared_inter * e16);
    l.shared_out = take(std::size_t(tokens) * hidden * e16);
  }
  l.total = at;
  return l;
}

// The names the shape rules report: the sizing helper's own parameters, or the tensors of
// fused_moe they come from.
struct FusedShapeNames {
  const char *tokens, *hidden, *inter, *experts, *top_k, *shared_inter;
};
constexpr FusedShapeNames kSizingNames = {"tokens", "hidden", "inter", "num_experts", "top_k", "shared_inter"};
constexpr FusedShapeNames kFusedMoeNames = {"x", "x", "w1", "w1", "top_k", "shared_w1"};

void check_fused_shape(const detail::ArgCheck& check, int64_t tokens, int64_t hidden, int64_t inter, int64_t experts,
                       int64_t top_k, int64_t shared_inter, const FusedShapeNames& n) {
  TESSERA_REQUIRE(check, tokens >= 0 && tokens < (int64_t(1) << 31), n.tokens, "the token count must be in 0..2^31 - 1");
  TESSERA_REQUIRE(check, hidden >= 8 && hidden % 8 == 0, n.hidden,
                  "the hidden size must be a positive multiple of 8, got " + std::to_string(hidden));
  TESSERA_REQUIRE(check, inter >= 8 && inter % 8 == 0, n.inter,
                  "the intermediate size must be a positive multiple of 8, got " + std::to_string(inter));
  TESSERA_REQUIRE(check, experts >= 1 && experts <= kernels::moe::kMaxGemmExperts, n.experts,
                  "num_experts must be in 1.." + std::to_string(kernels::moe::kMaxGemmExperts) + ", got " +
                      std::to_string(experts));
  TESSERA_REQUIRE(check, top_k >= 1 && top_k <= std::min<int64_t>(experts, kernels::moe::kMaxRouteTopK), n.top_k,
                  "must be in 1..min(num_experts, " + std::to_string(kernels::moe::kMaxRouteTopK) + "), got " +
                      std::to_string(top_k));
  TESSERA_REQUIRE(check, shared_inter >= 0 && shared_inter % 8 == 0, n.shared_inter,
                  "the shared experts' intermediate size must be 0 or a positive multiple of 8, got " +
                      std::to_string(shared_inter));
  // The permuted rows: below the grouped GEMM's 2^31 - 256 and, with the experts, the permutation's 2^31.
  TESSERA_REQUIRE(check, tokens * top_k < (int64_t(1) << 31) - 256 && tokens * top_k + experts < (int64_t(1) << 31),
                  n.tokens, "tokens x top_k (+ num_experts) must stay below 2^31 - 256");
  TESSERA_REQUIRE(check, hidden < (int64_t(1) << 30), n.hidden, "the hidden size must be below 2^30");
  TESSERA_REQUIRE(check, inter < (int64_t(1) << 30), n.inter, "the intermediate size must be below 2^30");
  TESSERA_REQUIRE(check, shared_inter < (int64_t(1) << 30), n.shared_inter,
                  "the shared experts' intermediate size must be below 2^30");
}

}  // namespace

std::size_t fused_moe_workspace_bytes(int64_t tokens, int64_t hidden, int64_t inter, int num_experts, int top_k,
                                      int64_t shared_inter) {
  const detail::ArgCheck check("fused_moe_workspace_bytes");
  check_fused_shape(check, tokens, hidden, inter, num_experts, top_k, shared_inter, kSizingNames);
  return fused_moe_layout(tokens, hidden, inter, num_experts, top_k, shared_inter).total;
}

void fused_moe(const FusedMoeArgs& a, cudaStream_t stream) {
  const detail::ArgCheck check("fused_moe");
  check_rows_16bit(check, a.x, "x", 2);
  check_rows_16bit(check, a.w1, "w1", 3);
  check_rows_16bit(check, a.w2, "w2", 3);
  const int64_t tokens = a.x.size(0), hidden = a.x.size(1), experts = a.w1.size(0);
  TESSERA_REQUIRE(check, a.w1.size(1) % 2 == 0, "w1", "dim 1 must be 2 x inter (gate rows, then up rows), got " + std::to_string(a.w1.size(1)));
  const int64_t inter = a.w1.size(1) / 2;
  check_fused_shape(check, tokens, hidden, inter, experts, a.top_k, 0, kFusedMoeNames);
  check.dtype(a.w1, "w1", {a.x.dtype});
  check.dtype(a.w2, "w2", {a.x.dtype});
  check.dim(a.w1, "w1", 2, hidden, "x's hidden size");
  check.dim(a.w2, "w2", 0, experts, "w1's num_experts");
  check.dim(a.w2, "w2", 1, hidden, "x's hidden size");
  check.dim(a.w2, "w2", 2, inter, "inter (w1's dim 1 / 2)");
  check_rows_16bit(check, a.out, "out", 2);
  check.dtype(a.out, "out", {a.x.dtype});
  check.same_shape(a.x, "x", a.out, "out");
  check.output_layout(a.out, "out");
  const bool has_logits = a.router_logits.data != nullptr || !a.router_logits.empty_view();
  const bool has_ids = a.topk_ids.data != nullptr || !a.topk_ids.empty_view();
  const bool has_weights = a.topk_weights.data != nullptr || !a.topk_weights.empty_view();
  TESSERA_REQUIRE(check, has_logits || (has_ids && has_weights), "router_logits",
                  "is required unless topk_ids and topk_weights give the routing");
  TESSERA_REQUIRE(check, has_ids == has_weights, "topk_ids", "and topk_weights come together");
  if (has_logits) {
    // moe_route's rules, under this entry point's names (it checks them again, cheaply).
    check.tensor(a.router_logits, "router_logits", 2);
    check.dim(a.router_logits, "router_logits", 0, tokens, "x's token count");
    check.dim(a.router_logits, "router_logits", 1, experts, "w1's num_experts");
    check_route_options(check, a.router_logits, "router_logits", a.top_k, a.score, a.num_groups, a.topk_groups,
                        a.routed_scaling, a.selection_bias);
  } else {
    TESSERA_REQUIRE(check, a.selection_bias.data == nullptr, "selection_bias",
                    "steers routing from router_logits; without logits it has no effect");
  }
  if (has_ids) {
    check_matrix(check, a.topk_ids, "topk_ids", DType::kInt32, tokens, a.top_k);
    check_matrix(check, a.topk_weights, "topk_weights", DType::kFP32, tokens, a.top_k);
  }
  const bool shared = a.shared_w1.data != nullptr || !a.shared_w1.empty_view();
  int64_t shared_inter = 0;
  if (shared) {
    check_rows_16bit(check, a.shared_w1, "shared_w1", 2);
    check_rows_16bit(check, a.shared_w2, "shared_w2", 2);
    check.dtype(a.shared_w1, "shared_w1", {a.x.dtype});
    check.dtype(a.shared_w2, "shared_w2", {a.x.dtype});
    TESSERA_REQUIRE(check, a.shared_w1.size(0) % 16 == 0 && a.shared_w1.size(0) > 0, "shared_w1",
                    "dim 0 must be 2 x shared_inter, a positive multiple of 16, got " + std::to_string(a.shared_w1.size(0)));
    shared_inter = a.shared_w1.size(0) / 2;
    TESSERA_REQUIRE(check, shared_inter < (int64_t(1) << 30), "shared_w1",
                    "the shared experts' intermediate size must be below 2^30");
    check.dim(a.shared_w1, "shared_w1", 1, hidden, "x's hidden size");
    check.dim(a.shared_w2, "shared_w2", 0, hidden, "x's hidden size");
    check.dim(a.shared_w2, "shared_w2", 1, shared_inter, "shared_inter (shared_w1's dim 0 / 2)");
  } else {
    TESSERA_REQUIRE(check, a.shared_w2.data == nullptr, "shared_w2", "is given without shared_w1");
  }
  const FusedMoeLayout l = fused_moe_layout(tokens, hidden, inter, int(experts), a.top_k, shared_inter);
  TESSERA_REQUIRE(check, a.workspace != nullptr || l.total == 0, "workspace", "must not be null");
  TESSERA_REQUIRE(check, a.workspace_size >= l.total, "workspace_size",
                  std::to_string(a.workspace_size) + " bytes is less than the " + std::to_string(l.total) +
                      " fused_moe_workspace_bytes gives");
  TESSERA_REQUIRE(check, reinterpret_cast<uintptr_t>(a.workspace) % kWorkspaceBaseAlign == 0, "workspace",
                  "must be 16-byte aligned");
  // Every output apart from every input and from the workspace.
  const TensorView ws_view = TensorView::contiguous(a.workspace, DType::kBF16, {int64_t(l.total / 2)});
  std::vector<std::pair<const TensorView*, const char*>> inputs = {{&a.x, "x"}, {&a.w1, "w1"}, {&a.w2, "w2"}};
  if (has_logits) inputs.push_back({&a.router_logits, "router_logits"});
  if (a.selection_bias.data != nullptr) inputs.push_back({&a.selection_bias, "selection_bias"});
  if (shared) {
    inputs.push_back({&a.shared_w1, "shared_w1"});
    inputs.push_back({&a.shared_w2, "shared_w2"});
  }
  if (has_ids && !has_logits) {
    inputs.push_back({&a.topk_ids, "topk_ids"});
    inputs.push_back({&a.topk_weights, "topk_weights"});
  }
  std::vector<std::pair<const TensorView*, const char*>> outputs = {{&a.out, "out"}};
  if (l.total > 0) outputs.push_back({&ws_view, "workspace"});
  if (has_ids && has_logits) {
    outputs.push_back({&a.topk_ids, "topk_ids"});
    outputs.push_back({&a.topk_weights, "topk_weights"});
  }
  for (const auto& [o, oname] : outputs) {
    for (const auto& [i, iname] : inputs) check.disjoint(*o, oname, *i, iname);
    for (const auto& [o2, oname2] : outputs) {
      if (o < o2) check.disjoint(*o, oname, *o2, oname2);
    }
  }
  // Every step's parameters are built (and checked) before the first launch: nothing is written
  // when any rule fails. The steps' own checks run under this entry point's name; they cannot fail
  // on what passed the checks above except where noted.
  unsigned char* ws = static_cast<unsigned char*>(a.workspace);
  const int64_t rows = tokens * a.top_k;
  const TensorView ids = has_ids ? a.topk_ids : TensorView::contiguous(ws + l.ids, DType::kInt32, {tokens, a.top_k});
  const TensorView weights =
      has_ids ? a.topk_weights : TensorView::contiguous(ws + l.weights, DType::kFP32, {tokens, a.top_k});
  kernels::moe::RouteParams route;
  if (has_logits) {
    // Into the caller's topk tensors, or the workspace's.
    MoeRouteArgs r;
    r.logits = a.router_logits;
    r.selection_bias = a.selection_bias;
    r.top_k = a.top_k;
    r.score = a.score;
    r.renormalize = a.renormalize;
    r.num_groups = a.num_groups;
    r.topk_groups = a.topk_groups;
    r.routed_scaling = a.routed_scaling;
    r.topk_ids = ids;
    r.topk_weights = weights;
    route = route_params(check, r);
  }
  const TensorView offsets = TensorView::contiguous(ws + l.offsets, DType::kInt32, {experts + 1});
  const TensorView inverse = TensorView::contiguous(ws + l.inverse, DType::kInt32, {tokens, a.top_k});
  const bool copy_rows = dispatch::fused_moe_rows(inter) == dispatch::FusedMoeRows::kCopy;
  const TensorView permuted_x = TensorView::contiguous(ws + l.permuted_x, a.x.dtype, {rows, hidden});
  const TensorView act = TensorView::contiguous(ws + l.act, a.x.dtype, {rows, inter});
  const TensorView y = TensorView::contiguous(ws + l.y, a.x.dtype, {rows, hidden});
  MoePermuteArgs perm;
  perm.topk_ids = ids;
  perm.num_experts = int(experts);
  perm.align = 1;
  if (copy_rows) {
    perm.x = a.x;
    perm.permuted_x = permuted_x;
  }
  perm.expert_offsets = offsets;
  perm.permuted_token = TensorView::contiguous(ws + l.permuted_token, DType::kInt32, {rows});
  perm.inverse = inverse;
  perm.workspace = ws + l.permute_ws;
  perm.workspace_size = l.permute_ws_bytes;
  const kernels::moe::PermuteParams permute = permute_params(check, perm);
  // The permuted rows are x's and the activations have w2's K: their rules name those.
  kernels::moe::GroupedGemmParams up =
      copy_rows ? grouped_gemm_params(check, permuted_x, "x", a.w1, "w1", true, act, "w1")
                : grouped_gemm_params(check, a.x, "x", a.w1, "w1", true, act, "w1", &perm.permuted_token);
  up.offsets = static_cast<const int32_t*>(offsets.data);
  kernels::moe::GroupedGemmParams down = grouped_gemm_params(check, act, "w2", a.w2, "w2", false, y, "x");
  down.offsets = up.offsets;
  MoeCombineArgs c;
  c.expert_out = y;
  c.inverse = inverse;
  c.topk_weights = weights;
  c.out = a.out;
  kernels::moe::GroupedGemmParams shared_up, shared_down;
  if (shared) {
    // The shared experts: a dense SwiGLU MLP over every token, one "expert" owning all rows.
    const TensorView shared_act = TensorView::contiguous(ws + l.shared_act, a.x.dtype, {tokens, shared_inter});
    c.shared_out = TensorView::contiguous(ws + l.shared_out, a.x.dtype, {tokens, hidden});
    auto as_one_expert = [](const TensorView& t) {
      return TensorView::strided(t.data, t.dtype, {1, t.shape[0], t.shape[1]},
                                 {t.shape[0] * t.stride[0], t.stride[0], t.stride[1]});
    };
    shared_up = grouped_gemm_params(check, a.x, "x", as_one_expert(a.shared_w1), "shared_w1", true, shared_act,
                                    "shared_w1");
    shared_down = grouped_gemm_params(check, shared_act, "shared_w2", as_one_expert(a.shared_w2), "shared_w2", false,
                                      c.shared_out, "x");
  }
  check_combine(check, c);
  const kernels::moe::CombineParams combine = combine_params(c);
  if (tokens == 0) return;

  if (has_logits) kernels::moe::launch_route(route, stream);
  kernels::moe::launch_permute(permute, stream);
  dispatch::run_moe_grouped_gemm(up, stream);
  dispatch::run_moe_grouped_gemm(down, stream);
  if (shared) {
    dispatch::run_moe_grouped_gemm(shared_up, stream);
    dispatch::run_moe_grouped_gemm(shared_down, stream);
  }
  kernels::moe::launch_combine(combine, stream);
}

}  // namespace tessera
