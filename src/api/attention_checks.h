// Argument checks shared by the attention entry points (prefill, paged prefill, decode).
#pragma once

#include <cmath>
#include <initializer_list>
#include <string>
#include <utility>

#include "core/arg_check.h"

namespace tessera::detail {

inline void check_variant(const ArgCheck& check, int window_left, float scale, float soft_cap) {
  TESSERA_REQUIRE(check, window_left >= -1, "window_left",
                  "must be -1 (no window) or >= 0, got " + std::to_string(window_left));
  TESSERA_REQUIRE(check, std::isfinite(scale) && scale >= 0.f, "scale",
                  "must be finite and >= 0 (0 means 1/sqrt(head_dim))");
  TESSERA_REQUIRE(check, std::isfinite(soft_cap) && soft_cap >= 0.f, "soft_cap",
                  "must be finite and >= 0 (0 means no soft-cap)");
}

// q / o / lse of a prefill: shapes, dtypes, layouts, and no overlap with `inputs`.
inline void check_queries_and_outputs(const ArgCheck& check, const TensorView& q,
                               const TensorView& o, const TensorView& lse,
                               std::initializer_list<std::pair<const TensorView*, const char*>> inputs) {
  check.tensor(q, "q", 3);
  check.tensor(o, "o", 3);
  check.dtype(q, "q", {DType::kBF16, DType::kFP16});
  check.dtype(o, "o", {q.dtype});
  check.same_shape(q, "q", o, "o");
  check.vectorizable_rows(q, "q");
  check.vectorizable_rows(o, "o");
  if (!lse.empty_view()) {
    check.tensor(lse, "lse", 2);
    check.dtype(lse, "lse", {DType::kFP32});
    TESSERA_REQUIRE(check, lse.size(0) == q.size(0) && lse.size(1) == q.size(1), "lse",
                    "shape " + shape_string(lse) + " must be [total_q, num_qo_heads] = [" +
                        std::to_string(q.size(0)) + ", " + std::to_string(q.size(1)) + "]");
    check.output_layout(lse, "lse");
    check.disjoint(lse, "lse", o, "o");
  }
  check.output_layout(o, "o");
  check.disjoint(o, "o", q, "q");
  if (!lse.empty_view()) check.disjoint(lse, "lse", q, "q");
  for (auto [in, name] : inputs) {
    check.disjoint(o, "o", *in, name);
    if (!lse.empty_view()) check.disjoint(lse, "lse", *in, name);
  }
}

}  // namespace tessera::detail
