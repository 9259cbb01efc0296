// Argument validation shared by every public entry point. Each failure throws tessera::Error naming
// the entry point, the argument and the rule:
//   tessera::merge_state: argument 's_a': dtype must be fp32, got bf16
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "tessera/error.h"
#include "tessera/kv_cache.h"
#include "tessera/tensor.h"

// check: an ArgCheck; the message expression is evaluated only when `ok` is false.
#define TESSERA_REQUIRE(check, ok, arg, message) \
  do {                                           \
    if (!(ok)) (check).fail(arg, message);       \
  } while (0)

namespace tessera::detail {

class ArgCheck {
 public:
  explicit ArgCheck(const char* entry_point) : entry_(entry_point) {}
  const char* entry_point() const { return entry_; }

  [[noreturn]] void fail(const char* arg, const std::string& rule) const;
  // Prefer TESSERA_REQUIRE (below), which builds the message only on failure: entry points run
  // per layer per step, and eagerly built messages cost microseconds per call.
  void require(bool ok, const char* arg, const std::string& rule) const {
    if (!ok) fail(arg, rule);
  }

  // Non-null data (unless the tensor has no elements), right rank, on the expected device.
  void tensor(const TensorView& t, const char* arg, int rank, Device device = Device::kCUDA) const;
  void dtype(const TensorView& t, const char* arg, std::initializer_list<DType> allowed) const;
  void dim(const TensorView& t, const char* arg, int d, int64_t expected,
           const char* expected_name) const;
  // The last dim has stride 1, the data pointer and every other stride allow 16-byte vectors.
  void vectorizable_rows(const TensorView& t, const char* arg) const;
  void same_shape(const TensorView& a, const char* a_name, const TensorView& b,
                  const char* b_name) const;

  // An output written by several threads: every dim of size > 1 has a positive stride and no two
  // elements share an address (strides, sorted, each at least the extent of the dims below).
  void output_layout(const TensorView& t, const char* arg) const;
  // `out` and `in` share no byte: see views_overlap for how far that is decided exactly.
  void disjoint(const TensorView& out, const char* out_name, const TensorView& in,
                const char* in_name) const;
  // The strides of dims 0..2 of a 4-D page tensor fit in int32 (the kernels' per-row address
  // math uses 32-bit strides and 64-bit products).
  void page_strides_32bit(const TensorView& t, const char* arg) const;
  // A paged cache's layout is one of the KVLayout values (an integer cast into the enum is not).
  void kv_layout(KVLayout layout, const char* arg) const;
  // A 1-D int32 index array with stride 1.
  void index_array(const TensorView& t, const char* arg) const;

  // Attention head configuration: num_kv_heads >= 1 divides num_qo_heads (GQA/MQA groups), and
  // head_dim is one of `supported` (the head dims this build instantiated).
  void head_config(int64_t num_qo_heads, int64_t num_kv_heads, int64_t head_dim,
                   const std::vector<int>& supported) const;

  // A CSR offset array on the host: starts at 0, non-decreasing, ends at most at `max_end` (or
  // exactly at it when `exact_end`).
  void indptr_host(const int32_t* indptr, int64_t count, const char* arg, int64_t max_end,
                   bool exact_end) const;

 private:
  const char* entry_;
};

std::string shape_string(const TensorView& t);

// First and one-past-last byte a view can touch (its span), for overlap checks.
std::pair<uintptr_t, uintptr_t> byte_span(const TensorView& t);
bool same_view(const TensorView& a, const TensorView& b);

// Whether two views share a byte of some element.
//   kNone: they do not (proved). kShared: they do (proved). kUnknown: not decided (treated as an
//   overlap by the checks, so a layout outside the rule below is refused, never let through).
// The rule, O(rank) plus at most 2^rank steps, and only when the byte spans intersect:
//   - disjoint byte spans, or a view without elements: kNone;
//   - the same element size and the same lattice: after flipping negative strides (which moves the
//     origin to the lowest element) and dropping dims of size 1 or stride 0, the same multiset of
//     (size, stride) pairs. Then b's elements are a's shifted by d bytes, and an element of each
//     shares a byte iff some difference sum_k c_k * stride_k, |c_k| <= size_k - 1, lies within one
//     element of d. When the lattice is nested (strides sorted ascending, each at least the extent
//     1 + sum (size_i - 1) * stride_i of the dims below: what output_layout requires of every
//     output, so an output and an input of its lattice are always decided; met by row-major
//     tensors, their slices, and the K and V halves of a combined [num_pages, 2, ...] cache), a
//     descent from the largest stride decides it exactly with at most two candidate c_k per dim:
//     kNone or kShared;
//   - anything else whose spans intersect (different shapes, strides or element sizes, a lattice
//     that is not nested, offsets that overflow int64): kUnknown.
enum class Overlap { kNone, kShared, kUnknown };
Overlap views_overlap(const TensorView& a, const TensorView& b);

}  // namespace tessera::detail
