#include "core/arg_check.h"

#include <algorithm>
#include <cstdint>
#include <sstream>
#include <utility>

namespace tessera::detail {

std::string shape_string(const TensorView& t) {
  std::ostringstream os;
  os << "[";
  for (int i = 0; i < t.rank; ++i) os << (i ? ", " : "") << t.shape[i];
  os << "]";
  return os.str();
}

std::pair<uintptr_t, uintptr_t> byte_span(const TensorView& t) {
  const uintptr_t base = reinterpret_cast<uintptr_t>(t.data);
  if (t.numel() == 0) return {base, base};
  int64_t lo = 0, hi = 0;  // element offsets of the extreme elements
  const int64_t size = static_cast<int64_t>(dtype_size(t.dtype));
  const std::pair<uintptr_t, uintptr_t> everything{0, UINTPTR_MAX};  // offsets past int64
  for (int i = 0; i < t.rank; ++i) {
    int64_t reach = 0;
    if (__builtin_mul_overflow(t.shape[i] - 1, t.stride[i], &reach)) return everything;
    int64_t& extreme = reach < 0 ? lo : hi;
    if (__builtin_add_overflow(extreme, reach, &extreme)) return everything;
  }
  int64_t lo_bytes = 0, end_bytes = 0;
  if (__builtin_mul_overflow(lo, size, &lo_bytes) || __builtin_add_overflow(hi, int64_t(1), &hi) ||
      __builtin_mul_overflow(hi, size, &end_bytes)) {
    return everything;
  }
  return {base + static_cast<uintptr_t>(lo_bytes), base + static_cast<uintptr_t>(end_bytes)};
}

namespace {

// One dim of a view's element lattice: size > 1, stride > 0 (in elements).
struct LatticeDim {
  int64_t size, stride;
};

int64_t floor_div(int64_t a, int64_t b) {  // b > 0
  const int64_t q = a / b;
  return (a % b != 0 && a < 0) ? q - 1 : q;
}
int64_t ceil_div(int64_t a, int64_t b) { return -floor_div(-a, b); }  // b > 0

// The lattice of `t`: its dims of size > 1 and nonzero stride, negative strides flipped, sorted by
// (stride, size); and the address of its lowest element. False when an offset overflows int64.
bool lattice_of(const TensorView& t, LatticeDim* dims, int* count, uintptr_t* origin) {
  int64_t lowest = 0;  // element offset of the lowest element from t.data
  int n = 0;
  for (int i = 0; i < t.rank; ++i) {
    const int64_t size = t.shape[i], stride = t.stride[i];
    if (size <= 1 || stride == 0) continue;
    int64_t reach = 0;
    if (stride == INT64_MIN || __builtin_mul_overflow(size - 1, stride, &reach)) return false;
    if (stride < 0 && __builtin_add_overflow(lowest, reach, &lowest)) return false;
    dims[n++] = {size, stride < 0 ? -stride : stride};
  }
  for (int k = 1; k < n; ++k) {  // insertion sort: at most kMaxRank dims
    for (int j = k; j > 0 && (dims[j].stride < dims[j - 1].stride ||
                              (dims[j].stride == dims[j - 1].stride && dims[j].size < dims[j - 1].size));
         --j) {
      std::swap(dims[j], dims[j - 1]);
    }
  }
  int64_t lowest_bytes = 0;
  if (__builtin_mul_overflow(lowest, static_cast<int64_t>(dtype_size(t.dtype)), &lowest_bytes)) return false;
  *count = n;
  *origin = reinterpret_cast<uintptr_t>(t.data) + static_cast<uintptr_t>(lowest_bytes);  // mod 2^64
  return true;
}

// Whether r = sum_{i <= k} c_i * dims[i].stride for some |c_i| <= dims[i].size - 1, where reach[i]
// is the largest such sum over dims 0..i. Exact; for a nested lattice (each stride > the reach of
// the dims below) at most two c_k fit at each level, so at most 2^(k+1) leaves are visited.
bool reachable(const LatticeDim* dims, const int64_t* reach, int k, int64_t r) {
  if (k < 0) return r == 0;
  if (r > reach[k] || r < -reach[k]) return false;
  const int64_t stride = dims[k].stride, below = k > 0 ? reach[k - 1] : 0, top = dims[k].size - 1;
  const int64_t lo = std::max(-top, ceil_div(r - below, stride));
  const int64_t hi = std::min(top, floor_div(r + below, stride));
  for (int64_t c = lo; c <= hi; ++c) {
    if (reachable(dims, reach, k - 1, r - c * stride)) return true;
  }
  return false;
}

}  // namespace

Overlap views_overlap(const TensorView& a, const TensorView& b) {
  if (a.numel() == 0 || b.numel() == 0) return Overlap::kNone;
  const auto sa = byte_span(a), sb = byte_span(b);
  if (!(sa.first < sb.second && sb.first < sa.second)) return Overlap::kNone;
  const int64_t elem = static_cast<int64_t>(dtype_size(a.dtype));
  if (static_cast<int64_t>(dtype_size(b.dtype)) != elem) return Overlap::kUnknown;
  LatticeDim da[TensorView::kMaxRank], db[TensorView::kMaxRank];
  int na = 0, nb = 0;
  uintptr_t oa = 0, ob = 0;
  if (!lattice_of(a, da, &na, &oa) || !lattice_of(b, db, &nb, &ob) || na != nb) return Overlap::kUnknown;
  int64_t reach[TensorView::kMaxRank];
  for (int k = 0; k < na; ++k) {
    if (da[k].size != db[k].size || da[k].stride != db[k].stride) return Overlap::kUnknown;
    const int64_t below = k > 0 ? reach[k - 1] : 0;
    if (da[k].stride <= below) return Overlap::kUnknown;  // not nested
    int64_t span = 0;
    if (__builtin_mul_overflow(da[k].size - 1, da[k].stride, &span) ||
        __builtin_add_overflow(below, span, &reach[k]) || reach[k] > (int64_t(1) << 61)) {
      return Overlap::kUnknown;
    }
  }
  // b's elements are a's moved by d bytes. Element e of a and element f of b share a byte iff
  // |(e - f) * elem - d| < elem: e - f is d / elem when elem divides d, else one of the two
  // integers around d / elem.
  const int64_t d = static_cast<int64_t>(ob - oa);
  const int64_t q = floor_div(d, elem);
  const bool exact = q * elem == d;
  const bool shared = reachable(da, reach, na - 1, q) || (!exact && reachable(da, reach, na - 1, q + 1));
  return shared ? Overlap::kShared : Overlap::kNone;
}

bool same_view(const TensorView& a, const TensorView& b) {
  if (a.data != b.data || a.dtype != b.dtype || a.rank != b.rank) return false;
  for (int i = 0; i < a.rank; ++i) {
    if (a.shape[i] != b.shape[i] || (a.shape[i] > 1 && a.stride[i] != b.stride[i])) return false;
  }
  return true;
}

void ArgCheck::fail(const char* arg, const std::string& rule) const {
  throw Error(std::string("tessera::") + entry_ + ": argument '" + arg + "': " + rule);
}

void ArgCheck::tensor(const TensorView& t, const char* arg, int rank, Device device) const {
  TESSERA_REQUIRE(*this, t.rank == rank, arg,
                         "must have rank " + std::to_string(rank) + ", got rank " + std::to_string(t.rank) +
                             " " + shape_string(t));
  for (int i = 0; i < t.rank; ++i) {
    TESSERA_REQUIRE(*this, t.shape[i] >= 0, arg, "has a negative size in dim " + std::to_string(i));
  }
  TESSERA_REQUIRE(*this, t.data != nullptr || t.numel() == 0, arg, "has a null data pointer");
  TESSERA_REQUIRE(*this, t.device == device, arg,
                         std::string("must be in ") + (device == Device::kCUDA ? "device" : "host") +
                             " memory");
  // Every element at its natural alignment: a misaligned fp32 access faults the kernel, and the
  // fault is sticky (it ruins the CUDA context).
  const size_t element = dtype_size(t.dtype);
  TESSERA_REQUIRE(*this, t.numel() == 0 || reinterpret_cast<uintptr_t>(t.data) % element == 0, arg,
                  "data pointer is not aligned to its " + std::to_string(element) + "-byte elements");
  // Its farthest element's byte offset fits in int64 (the kernels' address math is 64-bit).
  if (t.numel() > 0) {
    unsigned __int128 extent = 0;
    for (int i = 0; i < t.rank; ++i) {
      const int64_t stride = t.stride[i];
      const unsigned __int128 magnitude = stride < 0 ? -static_cast<__int128>(stride) : stride;
      extent += magnitude * static_cast<unsigned __int128>(t.shape[i] - 1);
    }
    extent = (extent + 1) * element;
    TESSERA_REQUIRE(*this, extent <= static_cast<unsigned __int128>(INT64_MAX), arg,
                    "shape " + shape_string(t) + " and its strides reach past 2^63 bytes");
  }
}

void ArgCheck::kv_layout(KVLayout layout, const char* arg) const {
  TESSERA_REQUIRE(*this, layout == KVLayout::kNHD || layout == KVLayout::kHND, arg,
                  "layout must be NHD or HND, got the value " + std::to_string(static_cast<int>(layout)));
}

void ArgCheck::dtype(const TensorView& t, const char* arg,
                     std::initializer_list<DType> allowed) const {
  std::string names;
  for (DType d : allowed) {
    if (d == t.dtype) return;
    names += (names.empty() ? "" : " or ") + std::string(dtype_name(d));
  }
  fail(arg, "dtype must be " + names + ", got " + dtype_name(t.dtype));
}

void ArgCheck::dim(const TensorView& t, const char* arg, int d, int64_t expected,
                   const char* expected_name) const {
  TESSERA_REQUIRE(*this, t.size(d) == expected, arg,
                         "dim " + std::to_string(d) + " must equal " + expected_name + " = " +
                             std::to_string(expected) + ", got " + std::to_string(t.size(d)) + " (shape " +
                             shape_string(t) + ")");
}

void ArgCheck::vectorizable_rows(const TensorView& t, const char* arg) const {
  const int64_t elems_per_16b = 16 / static_cast<int64_t>(dtype_size(t.dtype));
  TESSERA_REQUIRE(*this, t.stride_of(-1) == 1 || t.size(-1) == 1, arg,
                         "the last dim (head_dim) must be contiguous (stride 1), got stride " +
                             std::to_string(t.stride_of(-1)));
  TESSERA_REQUIRE(*this, t.size(-1) % elems_per_16b == 0, arg,
                         "the last dim must be a multiple of " + std::to_string(elems_per_16b) +
                             " elements (16 bytes), got " + std::to_string(t.size(-1)));
  TESSERA_REQUIRE(*this, reinterpret_cast<std::uintptr_t>(t.data) % 16 == 0, arg,
                         "data pointer must be 16-byte aligned");
  for (int i = 0; i + 1 < t.rank; ++i) {
    TESSERA_REQUIRE(*this, t.stride[i] % elems_per_16b == 0 || t.shape[i] == 1, arg,
                           "stride of dim " + std::to_string(i) + " (" + std::to_string(t.stride[i]) +
                               ") must be a multiple of 16 bytes");
  }
}

void ArgCheck::same_shape(const TensorView& a, const char* a_name, const TensorView& b,
                          const char* b_name) const {
  bool same = a.rank == b.rank;
  for (int i = 0; same && i < a.rank; ++i) same = a.shape[i] == b.shape[i];
  TESSERA_REQUIRE(*this, same, b_name,
                         "shape " + shape_string(b) + " must equal the shape of '" + a_name + "' " +
                             shape_string(a));
}

void ArgCheck::output_layout(const TensorView& t, const char* arg) const {
  // Dims of size > 1, innermost (smallest stride) first.
  int dims[TensorView::kMaxRank];
  int n = 0;
  for (int i = 0; i < t.rank; ++i) {
    if (t.shape[i] <= 1) continue;
    TESSERA_REQUIRE(*this, t.stride[i] > 0, arg,
                           "is written by the kernel, so dim " + std::to_string(i) +
                               " must have a positive stride, got " + std::to_string(t.stride[i]));
    dims[n++] = i;
  }
  for (int k = 1; k < n; ++k) {  // insertion sort by stride: at most kMaxRank dims
    for (int j = k; j > 0 && t.stride[dims[j]] < t.stride[dims[j - 1]]; --j) std::swap(dims[j], dims[j - 1]);
  }
  int64_t extent = 1;  // elements spanned by the dims placed so far
  for (int k = 0; k < n; ++k) {
    const int i = dims[k];
    TESSERA_REQUIRE(*this, t.stride[i] >= extent, arg,
                           "is written by the kernel, so its elements must not overlap: dim " + std::to_string(i) +
                               " has stride " + std::to_string(t.stride[i]) + " inside the " +
                               std::to_string(extent) + "-element extent of the dims below it");
    extent = t.stride[i] * (t.shape[i] - 1) + extent;
  }
}

void ArgCheck::disjoint(const TensorView& out, const char* out_name, const TensorView& in,
                        const char* in_name) const {
  const Overlap overlap = views_overlap(out, in);
  if (overlap == Overlap::kNone) return;
  fail(out_name, std::string("must not overlap '") + in_name + "' (an output may not alias an input)" +
                     (overlap == Overlap::kShared
                          ? ""
                          : "; their byte ranges intersect and their layouts differ (or are not "
                            "nested), so they cannot be proved disjoint: views of one buffer are "
                            "accepted when they have the same shape and strides"));
}

void ArgCheck::index_array(const TensorView& t, const char* arg) const {
  tensor(t, arg, 1);
  dtype(t, arg, {DType::kInt32});
  TESSERA_REQUIRE(*this, t.stride[0] == 1 || t.shape[0] <= 1, arg,
                         "must be contiguous (stride 1), got stride " + std::to_string(t.stride[0]));
}

void ArgCheck::head_config(int64_t num_qo_heads, int64_t num_kv_heads, int64_t head_dim,
                           const std::vector<int>& supported) const {
  TESSERA_REQUIRE(*this, num_kv_heads >= 1, "num_kv_heads", "must be at least 1, got " + std::to_string(num_kv_heads));
  TESSERA_REQUIRE(*this, num_qo_heads >= 1, "num_qo_heads", "must be at least 1, got " + std::to_string(num_qo_heads));
  TESSERA_REQUIRE(*this, num_qo_heads % num_kv_heads == 0, "num_qo_heads",
                         "must be a multiple of num_kv_heads (GQA group), got " + std::to_string(num_qo_heads) +
                             " query heads for " + std::to_string(num_kv_heads) + " KV heads");
  std::string list;
  for (int d : supported) {
    if (d == head_dim) return;
    list += (list.empty() ? "" : ", ") + std::to_string(d);
  }
  fail("head_dim", "must be one of the compiled head dims {" + list + "}, got " +
                       std::to_string(head_dim));
}

void ArgCheck::page_strides_32bit(const TensorView& t, const char* arg) const {
  for (int d = 0; d < 3; ++d) {
    TESSERA_REQUIRE(*this, t.stride[d] >= 0 && t.stride[d] < (int64_t(1) << 31), arg,
                    "stride " + std::to_string(t.stride[d]) + " of dim " + std::to_string(d) +
                        " must be in 0..2^31 - 1");
  }
}

void ArgCheck::indptr_host(const int32_t* indptr, int64_t count, const char* arg,
                           int64_t max_end, bool exact_end) const {
  if (count <= 0) return;
  TESSERA_REQUIRE(*this, indptr[0] == 0, arg, "must start at 0, got " + std::to_string(indptr[0]));
  for (int64_t i = 1; i < count; ++i) {
    // The message is built only on failure: this loop runs per call over the whole batch.
    if (indptr[i] < indptr[i - 1]) {
      fail(arg, "must be non-decreasing, but entry " + std::to_string(i) + " (" +
                    std::to_string(indptr[i]) + ") < entry " + std::to_string(i - 1) + " (" +
                    std::to_string(indptr[i - 1]) + ")");
    }
  }
  const int64_t end = indptr[count - 1];
  if (exact_end) {
    TESSERA_REQUIRE(*this, end == max_end, arg,
                           "last entry must equal " + std::to_string(max_end) + ", got " + std::to_string(end));
  } else {
    TESSERA_REQUIRE(*this, end <= max_end, arg,
                           "last entry " + std::to_string(end) + " exceeds " + std::to_string(max_end));
  }
}

}  // namespace tessera::detail
