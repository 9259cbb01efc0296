// CPU reference for merging attention states (fp64). See include/tessera/merge.h for the rule.
#pragma once

#include <cstdint>
#include <vector>

namespace tessera::ref {

// One row: o_a, o_b, o_out hold head_dim values; s values are natural-log LSE.
void merge_two(const double* o_a, double s_a, const double* o_b, double s_b, int head_dim,
               double* o_out, double* s_out);

// n states of one row: o_parts[n][head_dim] contiguous, s_parts[n].
void merge_n(const double* o_parts, const double* s_parts, int n, int head_dim, double* o_out,
             double* s_out);

}  // namespace tessera::ref
