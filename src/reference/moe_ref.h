// CPU reference for the Mixture-of-Experts layer (fp64): routing, top-k, SwiGLU experts, combine,
// the permutation and the grouped GEMM, plus naive 16-bit versions that set the kernels' tolerances.
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

// ---- Grouped GEMM, combine (tessera::moe_grouped_gemm / moe_combine's math) ----------------------
// Layouts are the kernels' own, dense: a [rows, k], w [num_experts, n, k] (each expert's n rows of
// k), offsets [num_experts + 1] non-decreasing within [0, rows] (offsets[0] may be > 0).

// For every expert e and row r in [offsets[e], offsets[e + 1]): acc[r, j] = sum_i a[r, i] w[e, j, i].
// out is resized to [rows, n], or with swiglu to [rows, n / 2] holding silu(g) * u, g = acc[r, j],
// u = acc[r, n / 2 + j]; rows outside every segment hold 0.
void grouped_gemm(const float* a, int64_t rows, int k, const float* w, int num_experts, int n,
                  const int32_t* offsets, bool swiglu, std::vector<double>& out);

// The same computation done naively in a 16-bit precision (`mantissa_bits` 7: bf16, 10: fp16), as
// the unfused composition would (PyTorch's bf16 path): fp32 sums in k order rounded to 16 bits
// (the GEMM's stored output); with swiglu, silu(g) computed in fp32 from the rounded g and rounded,
// then times the rounded u, rounded again. Its max error against grouped_gemm sets the kernels'
// tolerance (the FlashAttention rule: at most 2x it plus a small floor).
void grouped_gemm_naive_lowp(const float* a, int64_t rows, int k, const float* w, int num_experts,
                             int n, const int32_t* offsets, bool swiglu, int mantissa_bits,
                             std::vector<double>& out);

// out[t, c] = sum_j weights[t, j] * expert_out[inverse[t, j], c] (+ shared_out[t, c]), copies with
// inverse < 0 (dropped) skipped; a token with every copy dropped and no shared_out gets 0.
// expert_out [rows, hidden]; inverse, weights [tokens, top_k]; shared_out [tokens, hidden] or null;
// out resized to [tokens, hidden].
void combine(const float* expert_out, int64_t rows, int hidden, const int32_t* inverse,
             const float* weights, int64_t tokens, int top_k, const float* shared_out,
             std::vector<double>& out);

// The combine as its contract computes it in a 16-bit precision: products and sums in fp32 in k
// order, shared_out added last, one rounding to `mantissa_bits`.
void combine_naive_lowp(const float* expert_out, int64_t rows, int hidden, const int32_t* inverse,
                        const float* weights, int64_t tokens, int top_k, const float* shared_out,
                        int mantissa_bits, std::vector<double>& out);

// An optional shared expert (a dense SwiGLU MLP over every token, added with weight 1), in
// moe_layer's layouts: w_gate_up [hidden, 2 * inter], w_down [inter, hidden]. inter 0: none.
struct SharedExpert {
  const float* w_gate_up = nullptr;
  const float* w_down = nullptr;
  int inter = 0;
};

// moe_layer (plus the shared expert) done naively in a 16-bit precision, the unfused composition
// of the library's parts with every stored intermediate rounded to `mantissa_bits`: per (token, k)
// copy, the gate / up GEMM and SwiGLU as grouped_gemm_naive_lowp (rounded g and u, rounded silu,
// rounded h), the down projection summed in fp32 and rounded (the expert output), the shared
// expert the same way; then the combine as combine_naive_lowp. Copies with a negative expert id
// are dropped. Same layouts as moe_layer; y resized to [tokens, hidden].
void moe_layer_naive_lowp(const float* x, int64_t tokens, int hidden, int inter,
                          const float* w_gate_up, const float* w_down, const Routing& routing,
                          int top_k, const SharedExpert& shared, int mantissa_bits,
                          std::vector<double>& y);

}  // namespace tessera::ref
