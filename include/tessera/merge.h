// Merging partial attention states (split-KV, shared-prefix cascades).
//
// A state is an output tensor o [rows, heads, head_dim] (bf16, fp16 or fp32) and its natural-log
// LSE s [rows, heads] (fp32). Merging (o_a, s_a) with (o_b, s_b):
//   s = log(e^s_a + e^s_b),  o = o_a * e^(s_a - s) + o_b * e^(s_b - s)
// A state with s = -inf contributes nothing; when every input is -inf the result is o = 0,
// s = -inf. NaN in an input propagates to the rows it touches only.
// All math is fp32. head_dim must be the contiguous dimension and a multiple of 16 bytes' worth of
// elements; rows and heads may be strided.
#pragma once

#include "tessera/stream.h"
#include "tessera/tensor.h"

namespace tessera {

// Out of place: (o_out, s_out) = merge((o_a, s_a), (o_b, s_b)). o_a and o_b share a dtype;
// o_out is that dtype, or bf16/fp16 when the inputs are fp32 (partials kept in fp32). s_out may be
// an empty TensorView when the LSE is not wanted.
void merge_state(const TensorView& o_a, const TensorView& s_a, const TensorView& o_b,
                 const TensorView& s_b, const TensorView& o_out, const TensorView& s_out,
                 cudaStream_t stream);

// In place: (o, s) = merge((o, s), (o_other, s_other)); o and o_other share a dtype.
void merge_state_in_place(const TensorView& o, const TensorView& s, const TensorView& o_other,
                          const TensorView& s_other, cudaStream_t stream);

// n-ary: o_parts [rows, n, heads, head_dim], s_parts [rows, n, heads] -> o_out [rows, heads,
// head_dim], s_out [rows, heads] (s_out optional). Dtype rules as merge_state.
void merge_states(const TensorView& o_parts, const TensorView& s_parts, const TensorView& o_out,
                  const TensorView& s_out, cudaStream_t stream);

}  // namespace tessera
