// CPU reference for merging attention states (fp64). Rule: include/tessera/merge.h.
//   s = log(sum_i e^s_i),  o = sum_i o_i e^(s_i - s)
// A state with s = -inf is skipped entirely (its o is never read, so it may hold anything); all
// -inf gives o = 0, s = -inf; a NaN LSE makes the whole merged row NaN; a NaN in some o_i reaches
// only that element of the output.
#include "reference/merge_ref.h"

#include <cmath>
#include <limits>

namespace tessera::ref {

void merge_n(const double* o_parts, const double* s_parts, int n, int head_dim, double* o_out,
             double* s_out) {
  constexpr double kNegInf = -std::numeric_limits<double>::infinity();
  double m = kNegInf;
  bool has_nan = false;
  for (int i = 0; i < n; ++i) {
    has_nan |= std::isnan(s_parts[i]);
    if (s_parts[i] > m) m = s_parts[i];
  }
  if (has_nan) {
    *s_out = std::numeric_limits<double>::quiet_NaN();
    for (int c = 0; c < head_dim; ++c) o_out[c] = *s_out;
    return;
  }
  for (int c = 0; c < head_dim; ++c) o_out[c] = 0.0;
  if (m == kNegInf) {  // no state has a visible key
    *s_out = kNegInf;
    return;
  }
  // Subtract the max before exponentiating so large LSEs do not overflow.
  double sum = 0.0;
  for (int i = 0; i < n; ++i) {
    if (s_parts[i] != kNegInf) sum += std::exp(s_parts[i] - m);
  }
  const double s = m + std::log(sum);
  for (int i = 0; i < n; ++i) {
    if (s_parts[i] == kNegInf) continue;
    const double w = std::exp(s_parts[i] - s);
    const double* o_i = o_parts + static_cast<size_t>(i) * head_dim;
    for (int c = 0; c < head_dim; ++c) o_out[c] += o_i[c] * w;
  }
  *s_out = s;
}

void merge_two(const double* o_a, double s_a, const double* o_b, double s_b, int head_dim,
               double* o_out, double* s_out) {
  constexpr double kNegInf = -std::numeric_limits<double>::infinity();
  if (std::isnan(s_a) || std::isnan(s_b)) {
    *s_out = std::numeric_limits<double>::quiet_NaN();
    for (int c = 0; c < head_dim; ++c) o_out[c] = *s_out;
    return;
  }
  // Written symmetrically in (a, b) so that the merge is exactly commutative.
  if (s_a == kNegInf || s_b == kNegInf) {
    const bool a_empty = s_a == kNegInf, b_empty = s_b == kNegInf;
    const double* o = a_empty ? o_b : o_a;
    for (int c = 0; c < head_dim; ++c) o_out[c] = (a_empty && b_empty) ? 0.0 : o[c];
    *s_out = a_empty ? s_b : s_a;
    return;
  }
  const double m = s_a > s_b ? s_a : s_b;
  const double s = m + std::log(std::exp(s_a - m) + std::exp(s_b - m));
  const double w_a = std::exp(s_a - s), w_b = std::exp(s_b - s);
  for (int c = 0; c < head_dim; ++c) o_out[c] = o_a[c] * w_a + o_b[c] * w_b;
  *s_out = s;
}

}  // namespace tessera::ref
