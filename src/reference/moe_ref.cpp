// CPU reference for the Mixture-of-Experts layer (fp64). Conventions: moe_ref.h.
#include "reference/moe_ref.h"

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

}  // namespace tessera::ref
