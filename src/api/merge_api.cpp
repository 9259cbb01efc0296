// tessera::merge_state / merge_state_in_place / merge_states: validation, then one launch.
#include <initializer_list>
#include <string>
#include <utility>

#include "core/arg_check.h"
#include "kernels/merge/merge_states.h"
#include "tessera/merge.h"

namespace tessera {
namespace {

// The output dtype allowed for input states of `in`.
void check_out_dtype(const detail::ArgCheck& check, DType in, const TensorView& o_out,
                     const char* o_out_name = "o_out") {
  if (in == DType::kFP32) {
    check.dtype(o_out, o_out_name, {DType::kFP32, DType::kBF16, DType::kFP16});
  } else {
    check.dtype(o_out, o_out_name, {in});
  }
}

// o [rows, heads, head_dim] (or stacked [rows, n, heads, head_dim]) with its LSE.
void check_state(const detail::ArgCheck& check, const TensorView& o, const char* o_name,
                 const TensorView& s, const char* s_name, int rank) {
  check.tensor(o, o_name, rank);
  check.dtype(o, o_name, {DType::kBF16, DType::kFP16, DType::kFP32});
  check.vectorizable_rows(o, o_name);
  check.tensor(s, s_name, rank - 1);
  check.dtype(s, s_name, {DType::kFP32});
  for (int d = 0; d < rank - 1; ++d) {
    TESSERA_REQUIRE(check, s.size(d) == o.size(d), s_name,
                    "shape " + detail::shape_string(s) + " must equal the leading dims of '" +
                        o_name + "' " + detail::shape_string(o));
  }
}

void check_head_dim(const detail::ArgCheck& check, const TensorView& o, const char* name) {
  const int64_t d = o.size(-1);
  // One (row, head) must fit one warp at 8 elements a thread: head_dim / 8 divides 32.
  TESSERA_REQUIRE(check, d == 8 || d == 16 || d == 32 || d == 64 || d == 128 || d == 256, name,
                  "head_dim must be one of 8, 16, 32, 64, 128, 256, got " + std::to_string(d));
}

void check_size(const detail::ArgCheck& check, const TensorView& o_out, const char* o_out_name = "o_out") {
  // The kernel's grid-stride loop runs in int32: keep the last stride step below 2^31 too.
  TESSERA_REQUIRE(check, o_out.numel() / 8 < (int64_t(1) << 31) - (int64_t(1) << 24), o_out_name,
                  "too many elements for one call");
}

void fill_output(kernels::MergeStatesParams& p, const TensorView& o_out, const TensorView& s_out) {
  p.o_out = o_out.data;
  p.o_out_row = o_out.stride[0];
  p.o_out_head = o_out.stride[1];
  p.rows = static_cast<int>(o_out.size(0));
  p.heads = static_cast<int>(o_out.size(1));
  p.head_dim = static_cast<int>(o_out.size(2));
  if (!s_out.empty_view()) {
    p.s_out = static_cast<float*>(s_out.data);
    p.s_out_row = s_out.stride[0];
    p.s_out_head = s_out.stride[1];
  }
}

// Outputs are laid out without self-overlap and touch no input, except that in place (o_out, s_out)
// are exactly (o_a, s_a).
void check_outputs(const detail::ArgCheck& check, const TensorView& o_out, const TensorView& s_out,
                   std::initializer_list<std::pair<const TensorView*, const char*>> inputs,
                   bool in_place, const char* o_out_name = "o_out", const char* s_out_name = "s_out") {
  check.output_layout(o_out, o_out_name);
  if (!s_out.empty_view()) {
    check.output_layout(s_out, s_out_name);
    check.disjoint(s_out, s_out_name, o_out, o_out_name);
  }
  int index = 0;  // in place, inputs[0] and [1] are (o_a, s_a), the outputs themselves
  for (auto [in, name] : inputs) {
    if (in_place && index++ < 2) continue;
    check.disjoint(o_out, o_out_name, *in, name);
    if (!s_out.empty_view()) check.disjoint(s_out, s_out_name, *in, name);
  }
}

// The argument names errors use: the out-of-place merge's, or the in-place one's (whose output
// is its first state).
struct MergeNames {
  const char *o_a, *s_a, *o_b, *s_b, *o_out, *s_out;
};
constexpr MergeNames kOutOfPlaceNames{"o_a", "s_a", "o_b", "s_b", "o_out", "s_out"};
constexpr MergeNames kInPlaceNames{"o", "s", "o_other", "s_other", "o", "s"};

void merge_two(const char* entry, const TensorView& o_a, const TensorView& s_a,
               const TensorView& o_b, const TensorView& s_b, const TensorView& o_out,
               const TensorView& s_out, cudaStream_t stream, bool in_place) {
  const detail::ArgCheck check(entry);
  const MergeNames& n = in_place ? kInPlaceNames : kOutOfPlaceNames;
  check_state(check, o_a, n.o_a, s_a, n.s_a, 3);
  check_state(check, o_b, n.o_b, s_b, n.s_b, 3);
  check.dtype(o_b, n.o_b, {o_a.dtype});
  check.same_shape(o_a, n.o_a, o_b, n.o_b);
  check_head_dim(check, o_a, n.o_a);
  check.tensor(o_out, n.o_out, 3);
  check_out_dtype(check, o_a.dtype, o_out, n.o_out);
  check.same_shape(o_a, n.o_a, o_out, n.o_out);
  check.vectorizable_rows(o_out, n.o_out);
  if (!s_out.empty_view()) {
    check.tensor(s_out, n.s_out, 2);
    check.dtype(s_out, n.s_out, {DType::kFP32});
    check.same_shape(s_a, n.s_a, s_out, n.s_out);
  }
  check_size(check, o_out, n.o_out);
  check_outputs(check, o_out, s_out, {{&o_a, n.o_a}, {&s_a, n.s_a}, {&o_b, n.o_b}, {&s_b, n.s_b}},
                in_place, n.o_out, n.s_out);

  kernels::MergeStatesParams p;
  p.num_states = 2;
  p.stacked = false;
  const TensorView* o_in[2] = {&o_a, &o_b};
  const TensorView* s_in[2] = {&s_a, &s_b};
  for (int i = 0; i < 2; ++i) {
    p.o_base[i] = o_in[i]->data;
    p.s_base[i] = static_cast<const float*>(s_in[i]->data);
    p.o_row[i] = o_in[i]->stride[0];
    p.o_head[i] = o_in[i]->stride[1];
    p.s_row[i] = s_in[i]->stride[0];
    p.s_head[i] = s_in[i]->stride[1];
  }
  fill_output(p, o_out, s_out);
  kernels::launch_merge_states(o_a.dtype, o_out.dtype, p, stream);
}

}  // namespace

void merge_state(const TensorView& o_a, const TensorView& s_a, const TensorView& o_b,
                 const TensorView& s_b, const TensorView& o_out, const TensorView& s_out,
                 cudaStream_t stream) {
  merge_two("merge_state", o_a, s_a, o_b, s_b, o_out, s_out, stream, /*in_place=*/false);
}

void merge_state_in_place(const TensorView& o, const TensorView& s, const TensorView& o_other,
                          const TensorView& s_other, cudaStream_t stream) {
  merge_two("merge_state_in_place", o, s, o_other, s_other, o, s, stream, /*in_place=*/true);
}

void merge_states(const TensorView& o_parts, const TensorView& s_parts, const TensorView& o_out,
                  const TensorView& s_out, cudaStream_t stream) {
  const detail::ArgCheck check("merge_states");
  check_state(check, o_parts, "o_parts", s_parts, "s_parts", 4);
  check_head_dim(check, o_parts, "o_parts");
  TESSERA_REQUIRE(check, o_parts.size(1) >= 1, "o_parts", "must hold at least one state (dim 1)");
  check.tensor(o_out, "o_out", 3);
  check_out_dtype(check, o_parts.dtype, o_out);
  check.vectorizable_rows(o_out, "o_out");
  TESSERA_REQUIRE(check, o_out.size(0) == o_parts.size(0) && o_out.size(1) == o_parts.size(2) &&
                      o_out.size(2) == o_parts.size(3),
                  "o_out",
                  "shape " + detail::shape_string(o_out) + " must be [rows, heads, head_dim] of "
                  "'o_parts' " + detail::shape_string(o_parts));
  if (!s_out.empty_view()) {
    check.tensor(s_out, "s_out", 2);
    check.dtype(s_out, "s_out", {DType::kFP32});
    TESSERA_REQUIRE(check, s_out.size(0) == o_out.size(0) && s_out.size(1) == o_out.size(1), "s_out",
                    "shape " + detail::shape_string(s_out) + " must be [rows, heads]");
  }
  check_size(check, o_out);
  check_outputs(check, o_out, s_out, {{&o_parts, "o_parts"}, {&s_parts, "s_parts"}},
                /*in_place=*/false);

  kernels::MergeStatesParams p;
  p.num_states = static_cast<int>(o_parts.size(1));
  p.stacked = true;
  p.o_base[0] = o_parts.data;
  p.s_base[0] = static_cast<const float*>(s_parts.data);
  p.o_row[0] = o_parts.stride[0];
  p.o_part = o_parts.stride[1];
  p.o_head[0] = o_parts.stride[2];
  p.s_row[0] = s_parts.stride[0];
  p.s_part = s_parts.stride[1];
  p.s_head[0] = s_parts.stride[2];
  fill_output(p, o_out, s_out);
  kernels::launch_merge_states(o_parts.dtype, o_out.dtype, p, stream);
}

}  // namespace tessera
