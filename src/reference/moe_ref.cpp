// CPU reference for the Mixture-of-Experts layer (fp64). Conventions: moe_ref.h.
#include "reference/moe_ref.h"

#include "reference/attention_ref.h"  // round_to_mantissa

#include <algorithm>
#include <cmath>
#include <functional>
#include <numeric>
#include <stdexcept>
#include <string>

namespace tessera::ref {
namespace {

void require(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument("tessera::ref: " + what);
}

// Orders ids by decreasing key, ties toward the lower id, NaN keys last (by id among themselves):
// a strict weak order for any keys.
void sort_by_key_desc(std::vector<int>& ids, const std::vector<double>& key) {
  std::sort(ids.begin(), ids.end(), [&](int a, int b) {
    const bool nan_a = std::isnan(key[a]), nan_b = std::isnan(key[b]);
    if (nan_a != nan_b) return nan_b;
    if (!nan_a && key[a] != key[b]) return key[a] > key[b];
    return a < b;
  });
}

void check_router(const RouterParams& p) {
  require(p.num_experts > 0, "num_experts must be positive");
  require(p.top_k >= 1 && p.top_k <= p.num_experts, "top_k must be in [1, num_experts]");
  require(p.selection_bias.empty() ||
              static_cast<int>(p.selection_bias.size()) == p.num_experts,
          "selection_bias must be empty or have num_experts entries");
  if (p.num_groups > 1) {
    require(p.num_experts % p.num_groups == 0, "num_experts must be a multiple of num_groups");
    require(p.topk_groups >= 1 && p.topk_groups <= p.num_groups,
            "topk_groups must be in [1, num_groups]");
    require(p.top_k <= p.topk_groups * (p.num_experts / p.num_groups),
            "top_k exceeds the experts of the kept groups");
  }
}

}  // namespace

Routing route(const float* logits, int64_t tokens, const RouterParams& p) {
  check_router(p);
  const int num_experts = p.num_experts;
  Routing routing;
  routing.expert.resize(static_cast<size_t>(tokens) * p.top_k);
  routing.weight.resize(static_cast<size_t>(tokens) * p.top_k);
  std::vector<double> score(num_experts), biased(num_experts);
  for (int64_t t = 0; t < tokens; ++t) {
    const float* row = logits + t * num_experts;
    // Unbiased scores: softmax over all experts, or an independent sigmoid per expert.
    if (p.score == RouterScore::kSoftmax) {
      const double m = *std::max_element(row, row + num_experts);
      double sum = 0.0;
      for (int e = 0; e < num_experts; ++e) sum += score[e] = std::exp(row[e] - m);
      for (double& s : score) s /= sum;
    } else {
      for (int e = 0; e < num_experts; ++e) score[e] = 1.0 / (1.0 + std::exp(-double(row[e])));
    }
    for (int e = 0; e < num_experts; ++e) {
      biased[e] = score[e] + (p.selection_bias.empty() ? 0.0 : p.selection_bias[e]);
    }

    // Candidate experts: all of them, or those of the best topk_groups groups, where a group's
    // score is the sum of its top-2 biased scores (DeepSeek-V3).
    std::vector<int> candidates;
    if (p.num_groups > 1) {
      const int group_size = num_experts / p.num_groups;
      std::vector<double> group_score(p.num_groups);
      for (int g = 0; g < p.num_groups; ++g) {
        std::vector<double> members(biased.begin() + g * group_size,
                                    biased.begin() + (g + 1) * group_size);
        // NaN members rank below every number (the group score is then NaN only if the group holds
        // fewer than two numbers).
        std::sort(members.begin(), members.end(), [](double a, double b) {
          if (std::isnan(a) != std::isnan(b)) return std::isnan(b);
          return !std::isnan(a) && a > b;
        });
        const int top = std::min(2, group_size);
        group_score[g] = std::accumulate(members.begin(), members.begin() + top, 0.0);
      }
      std::vector<int> groups(p.num_groups);
      std::iota(groups.begin(), groups.end(), 0);
      sort_by_key_desc(groups, group_score);
      for (int k = 0; k < p.topk_groups; ++k) {
        for (int e = 0; e < group_size; ++e) candidates.push_back(groups[k] * group_size + e);
      }
    } else {
      candidates.resize(num_experts);
      std::iota(candidates.begin(), candidates.end(), 0);
    }

    // Select by biased score; weigh by the unbiased one.
    sort_by_key_desc(candidates, biased);
    int32_t* expert = routing.expert.data() + t * p.top_k;
    double* weight = routing.weight.data() + t * p.top_k;
    double chosen_sum = 0.0;
    for (int k = 0; k < p.top_k; ++k) {
      expert[k] = candidates[k];
      weight[k] = score[candidates[k]];
      chosen_sum += weight[k];
    }
    for (int k = 0; k < p.top_k; ++k) {
      if (p.renormalize) weight[k] /= chosen_sum;
      weight[k] *= p.routed_scaling;
    }
  }
  return routing;
}

void swiglu_expert(const float* x, const float* w_gate_up, const float* w_down, int hidden,
                   int inter, double* y) {
  std::vector<double> h(static_cast<size_t>(inter));
  for (int j = 0; j < inter; ++j) {
    double gate = 0.0, up = 0.0;
    for (int i = 0; i < hidden; ++i) {
      const float* w_row = w_gate_up + static_cast<int64_t>(i) * 2 * inter;
      gate += static_cast<double>(x[i]) * w_row[j];
      up += static_cast<double>(x[i]) * w_row[inter + j];
    }
    const double silu = gate / (1.0 + std::exp(-gate));
    h[j] = silu * up;
  }
  for (int c = 0; c < hidden; ++c) {
    double acc = 0.0;
    for (int j = 0; j < inter; ++j) acc += h[j] * w_down[static_cast<int64_t>(j) * hidden + c];
    y[c] = acc;
  }
}

void moe_layer(const float* x, int64_t tokens, int hidden, int inter, const float* w_gate_up,
               const float* w_down, const Routing& routing, int top_k, std::vector<double>& y) {
  const size_t slots = static_cast<size_t>(tokens) * top_k;
  require(routing.expert.size() == slots && routing.weight.size() == slots,
          "routing must hold tokens * top_k entries");
  const int64_t gate_up_size = static_cast<int64_t>(hidden) * 2 * inter;
  const int64_t down_size = static_cast<int64_t>(inter) * hidden;
  y.assign(static_cast<size_t>(tokens) * hidden, 0.0);
  std::vector<double> expert_out(static_cast<size_t>(hidden));
  for (int64_t t = 0; t < tokens; ++t) {
    for (int k = 0; k < top_k; ++k) {
      const int64_t e = routing.expert[t * top_k + k];
      require(e >= 0, "routing.expert holds a negative expert id");
      swiglu_expert(x + t * hidden, w_gate_up + e * gate_up_size, w_down + e * down_size, hidden,
                    inter, expert_out.data());
      const double w = routing.weight[t * top_k + k];
      for (int c = 0; c < hidden; ++c) y[t * hidden + c] += w * expert_out[c];
    }
  }
}

Permutation permute(const int32_t* expert, int64_t tokens, int top_k, int num_experts, int align,
                    int64_t capacity) {
  require(num_experts >= 1 && top_k >= 1 && align >= 1 && tokens >= 0, "bad permutation shape");
  const int64_t entries = tokens * top_k;
  std::vector<int64_t> count(static_cast<size_t>(num_experts), 0);
  for (int64_t i = 0; i < entries; ++i) {
    if (expert[i] >= 0 && expert[i] < num_experts) ++count[expert[i]];
  }
  Permutation p;
  p.offsets.assign(static_cast<size_t>(num_experts) + 1, 0);
  for (int e = 0; e < num_experts; ++e) {
    const int64_t padded = (count[e] + align - 1) / align * align;
    p.offsets[e + 1] = static_cast<int32_t>(p.offsets[e] + padded);
  }
  require(p.offsets[num_experts] <= capacity, "capacity below the permuted rows");
  p.permuted_token.assign(static_cast<size_t>(capacity), -1);
  p.inverse.assign(static_cast<size_t>(entries), -1);
  std::vector<int64_t> next(p.offsets.begin(), p.offsets.end() - 1);
  for (int64_t i = 0; i < entries; ++i) {
    const int e = expert[i];
    if (e < 0 || e >= num_experts) continue;
    const int64_t row = next[e]++;
    p.inverse[i] = static_cast<int32_t>(row);
    p.permuted_token[row] = static_cast<int32_t>(i / top_k);
  }
  return p;
}

namespace {

void check_segments(int64_t rows, int k, int num_experts, int n, const int32_t* offsets, bool swiglu) {
  require(rows >= 0 && k >= 1 && n >= 1 && num_experts >= 1, "bad grouped GEMM shape");
  require(!swiglu || n % 2 == 0, "swiglu needs an even n");
  for (int e = 0; e < num_experts; ++e) {
    require(offsets[e] >= 0 && offsets[e] <= offsets[e + 1] && offsets[e + 1] <= rows,
            "offsets must be non-decreasing within [0, rows]");
  }
}

// acc[j] = sum_i a_row[i] w_e[j, i] for j < n, in Acc, each sum in i order; four output columns
// at a time (independent chains, so the loop is not one long dependency).
template <typename Acc>
void row_products(const float* a_row, const float* w_e, int k, int n, Acc* acc) {
  int j = 0;
  for (; j + 4 <= n; j += 4) {
    const float* w0 = w_e + static_cast<int64_t>(j) * k;
    const float *w1 = w0 + k, *w2 = w1 + k, *w3 = w2 + k;
    Acc s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    for (int i = 0; i < k; ++i) {
      const Acc x = static_cast<Acc>(a_row[i]);
      s0 += x * static_cast<Acc>(w0[i]);
      s1 += x * static_cast<Acc>(w1[i]);
      s2 += x * static_cast<Acc>(w2[i]);
      s3 += x * static_cast<Acc>(w3[i]);
    }
    acc[j] = s0, acc[j + 1] = s1, acc[j + 2] = s2, acc[j + 3] = s3;
  }
  for (; j < n; ++j) {
    const float* wj = w_e + static_cast<int64_t>(j) * k;
    Acc s = 0;
    for (int i = 0; i < k; ++i) s += static_cast<Acc>(a_row[i]) * static_cast<Acc>(wj[i]);
    acc[j] = s;
  }
}

double silu(double g) { return g / (1.0 + std::exp(-g)); }
float silu(float g) { return g / (1.0f + std::exp(-g)); }

// The naive 16-bit SwiGLU of one element: rounded silu of the rounded gate, times the rounded up.
float swiglu_lowp(float g, float u, int bits) {
  const float gr = round_to_mantissa(g, bits), ur = round_to_mantissa(u, bits);
  return round_to_mantissa(round_to_mantissa(silu(gr), bits) * ur, bits);
}

template <typename Acc, typename Finish>
void grouped_gemm_impl(const float* a, int64_t rows, int k, const float* w, int num_experts, int n,
                       const int32_t* offsets, bool swiglu, std::vector<double>& out, Finish finish) {
  check_segments(rows, k, num_experts, n, offsets, swiglu);
  const int out_cols = swiglu ? n / 2 : n;
  out.assign(static_cast<size_t>(rows) * out_cols, 0.0);
  std::vector<Acc> acc(static_cast<size_t>(n));
  for (int e = 0; e < num_experts; ++e) {
    const float* w_e = w + static_cast<int64_t>(e) * n * k;
    for (int64_t r = offsets[e]; r < offsets[e + 1]; ++r) {
      row_products(a + r * k, w_e, k, n, acc.data());
      finish(acc.data(), out.data() + r * out_cols);
    }
  }
}

}  // namespace

void grouped_gemm(const float* a, int64_t rows, int k, const float* w, int num_experts, int n,
                  const int32_t* offsets, bool swiglu, std::vector<double>& out) {
  const int half = n / 2;
  grouped_gemm_impl<double>(a, rows, k, w, num_experts, n, offsets, swiglu, out,
                            [&](const double* acc, double* o) {
                              if (!swiglu) {
                                std::copy(acc, acc + n, o);
                              } else {
                                for (int j = 0; j < half; ++j) o[j] = silu(acc[j]) * acc[half + j];
                              }
                            });
}

void grouped_gemm_naive_lowp(const float* a, int64_t rows, int k, const float* w, int num_experts,
                             int n, const int32_t* offsets, bool swiglu, int mantissa_bits,
                             std::vector<double>& out) {
  const int half = n / 2;
  grouped_gemm_impl<float>(a, rows, k, w, num_experts, n, offsets, swiglu, out,
                           [&](const float* acc, double* o) {
                             if (!swiglu) {
                               for (int j = 0; j < n; ++j) o[j] = round_to_mantissa(acc[j], mantissa_bits);
                             } else {
                               for (int j = 0; j < half; ++j) o[j] = swiglu_lowp(acc[j], acc[half + j], mantissa_bits);
                             }
                           });
}

namespace {

template <typename Acc, typename Finish>
void combine_impl(const float* expert_out, int64_t rows, int hidden, const int32_t* inverse,
                  const float* weights, int64_t tokens, int top_k, const float* shared_out,
                  std::vector<double>& out, Finish finish) {
  require(rows >= 0 && hidden >= 1 && tokens >= 0 && top_k >= 1, "bad combine shape");
  out.assign(static_cast<size_t>(tokens) * hidden, 0.0);
  std::vector<Acc> acc(static_cast<size_t>(hidden));
  for (int64_t t = 0; t < tokens; ++t) {
    std::fill(acc.begin(), acc.end(), Acc(0));
    for (int j = 0; j < top_k; ++j) {
      const int32_t row = inverse[t * top_k + j];
      if (row < 0) continue;
      require(row < rows, "inverse holds a row past expert_out");
      const Acc wt = static_cast<Acc>(weights[t * top_k + j]);
      const float* y = expert_out + row * hidden;
      for (int c = 0; c < hidden; ++c) acc[c] += wt * static_cast<Acc>(y[c]);
    }
    if (shared_out != nullptr) {
      for (int c = 0; c < hidden; ++c) acc[c] += static_cast<Acc>(shared_out[t * hidden + c]);
    }
    for (int c = 0; c < hidden; ++c) out[t * hidden + c] = finish(acc[c]);
  }
}

}  // namespace

void combine(const float* expert_out, int64_t rows, int hidden, const int32_t* inverse,
             const float* weights, int64_t tokens, int top_k, const float* shared_out,
             std::vector<double>& out) {
  combine_impl<double>(expert_out, rows, hidden, inverse, weights, tokens, top_k, shared_out, out,
                       [](double v) { return v; });
}

void combine_naive_lowp(const float* expert_out, int64_t rows, int hidden, const int32_t* inverse,
                        const float* weights, int64_t tokens, int top_k, const float* shared_out,
                        int mantissa_bits, std::vector<double>& out) {
  combine_impl<float>(expert_out, rows, hidden, inverse, weights, tokens, top_k, shared_out, out,
                      [mantissa_bits](float v) { return double(round_to_mantissa(v, mantissa_bits)); });
}

namespace {

// One SwiGLU expert naively in 16 bits (moe_layer's layouts): y rounded (the stored expert output).
void swiglu_expert_lowp(const float* x, const float* w_gate_up, const float* w_down, int hidden,
                        int inter, int bits, std::vector<float>& h, float* y) {
  h.assign(static_cast<size_t>(inter), 0.f);
  std::vector<float> gate(static_cast<size_t>(inter), 0.f), up(static_cast<size_t>(inter), 0.f);
  for (int i = 0; i < hidden; ++i) {  // sums in i order for every column
    const float* w_row = w_gate_up + static_cast<int64_t>(i) * 2 * inter;
    for (int j = 0; j < inter; ++j) {
      gate[j] += x[i] * w_row[j];
      up[j] += x[i] * w_row[inter + j];
    }
  }
  for (int j = 0; j < inter; ++j) h[j] = swiglu_lowp(gate[j], up[j], bits);
  for (int c = 0; c < hidden; ++c) y[c] = 0.f;
  for (int j = 0; j < inter; ++j) {
    const float* d_row = w_down + static_cast<int64_t>(j) * hidden;
    for (int c = 0; c < hidden; ++c) y[c] += h[j] * d_row[c];
  }
  for (int c = 0; c < hidden; ++c) y[c] = round_to_mantissa(y[c], bits);
}

}  // namespace

void moe_layer_naive_lowp(const float* x, int64_t tokens, int hidden, int inter,
                          const float* w_gate_up, const float* w_down, const Routing& routing,
                          int top_k, const SharedExpert& shared, int mantissa_bits,
                          std::vector<double>& y) {
  const size_t slots = static_cast<size_t>(tokens) * top_k;
  require(routing.expert.size() == slots && routing.weight.size() == slots,
          "routing must hold tokens * top_k entries");
  require(shared.inter == 0 || (shared.w_gate_up != nullptr && shared.w_down != nullptr),
          "a shared expert needs both weights");
  const int64_t gate_up_size = static_cast<int64_t>(hidden) * 2 * inter;
  const int64_t down_size = static_cast<int64_t>(inter) * hidden;
  y.assign(static_cast<size_t>(tokens) * hidden, 0.0);
  std::vector<float> h, expert_out(static_cast<size_t>(hidden)), shared_out(static_cast<size_t>(hidden));
  std::vector<float> acc(static_cast<size_t>(hidden));
  for (int64_t t = 0; t < tokens; ++t) {
    const float* xt = x + t * hidden;
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int k = 0; k < top_k; ++k) {
      const int64_t e = routing.expert[t * top_k + k];
      if (e < 0) continue;  // dropped
      swiglu_expert_lowp(xt, w_gate_up + e * gate_up_size, w_down + e * down_size, hidden, inter,
                         mantissa_bits, h, expert_out.data());
      const float w = static_cast<float>(routing.weight[t * top_k + k]);
      for (int c = 0; c < hidden; ++c) acc[c] += w * expert_out[c];
    }
    if (shared.inter > 0) {
      swiglu_expert_lowp(xt, shared.w_gate_up, shared.w_down, hidden, shared.inter, mantissa_bits,
                         h, shared_out.data());
      for (int c = 0; c < hidden; ++c) acc[c] += shared_out[c];
    }
    for (int c = 0; c < hidden; ++c) y[t * hidden + c] = round_to_mantissa(acc[c], mantissa_bits);
  }
}

}  // namespace tessera::ref
