// CPU reference for the Mixture-of-Experts layer (fp64): routing, top-k, SwiGLU experts, combine.
#pragma once

#include <cstdint>
#include <vector>

namespace tessera::ref {

enum class RouterScore { kSoftmax, kSigmoid };

struct RouterParams {
  int num_experts = 0;
  int top_k = 0;
  RouterScore score = RouterScore::kSoftmax;
  bool renormalize = false;   // divide the chosen weights by their sum
  // DeepSeek-V3 style grouped top-k: experts split into num_groups equal groups; each group is
  // scored by the sum of its top-2 biased scores; the best topk_groups groups are kept and top_k
  // experts are chosen among them by biased score. num_groups <= 1 disables grouping.
  int num_groups = 1;
  int topk_groups = 1;
  // Optional per-expert bias added to the scores for *selection only* (weights use unbiased
  // scores). Empty: no bias.
  std::vector<double> selection_bias;
  double routed_scaling = 1.0;  // multiplies the final weights
};

struct Routing {
  std::vector<int32_t> expert;  // [tokens, top_k], expert ids, by decreasing selection score
  std::vector<double> weight;   // [tokens, top_k]
};

// logits: [tokens, num_experts]. Ties break toward the lower expert id.
Routing route(const float* logits, int64_t tokens, const RouterParams& params);

// One SwiGLU expert: h = silu(x W_gate) * (x W_up); y = h W_down.
// w_gate_up: [hidden, 2 * inter] (columns [0, inter) gate, [inter, 2 inter) up);
// w_down: [inter, hidden]. x: [hidden], y: [hidden].
void swiglu_expert(const float* x, const float* w_gate_up, const float* w_down, int hidden,
                   int inter, double* y);

// The whole layer: y[t] = sum_k weight[t,k] * expert_{expert[t,k]}(x[t]).
// x: [tokens, hidden]; w_gate_up: [num_experts, hidden, 2*inter]; w_down: [num_experts, inter,
// hidden]; y resized to [tokens, hidden].
void moe_layer(const float* x, int64_t tokens, int hidden, int inter, const float* w_gate_up,
               const float* w_down, const Routing& routing, int top_k, std::vector<double>& y);

// The permutation of (token, k) copies into per-expert segments (tessera::moe_permute's layout):
// expert e's rows are [offsets[e], offsets[e + 1]), each segment starts at a multiple of `align`
// and is padded to one, rows in (token, k) order within a segment; ids outside [0, num_experts)
// are dropped. permuted_token[row] = token (-1 on padding and past the last row, up to
// `capacity`); inverse[t * top_k + k] = row (-1 when dropped).
struct Permutation {
  std::vector<int32_t> offsets;         // [num_experts + 1]
  std::vector<int32_t> permuted_token;  // [capacity]
  std::vector<int32_t> inverse;         // [tokens * top_k]
};
Permutation permute(const int32_t* expert, int64_t tokens, int top_k, int num_experts, int align,
                    int64_t capacity);

}  // namespace tessera::ref
