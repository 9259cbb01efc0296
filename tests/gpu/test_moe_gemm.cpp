// The grouped GEMM (moe_grouped_gemm), the combine (moe_combine) and the whole MoE layer
// (fused_moe) on the GPU against the fp64 reference (src/reference/moe_ref.h), through the public
// API only (tessera/moe.h).
//
// Tolerances (the FlashAttention rule of ../STYLE.md: max error against fp64 at most 2x that of
// the same computation done naively in the kernel's precision, plus a small floor):
//  - moe_grouped_gemm kNone on integer inputs in [-3, 3]: every product and partial sum is an
//    integer below 2^24, so the fp32 accumulation is exact in any order or K split, and the output
//    must be the exact sum rounded once to bf16 / fp16 (round to nearest even): bit for bit.
//  - random inputs, both activations: max |got - fp64| <= 2 x max |naive - fp64| + 2^-16 x
//    max |fp64|, naive = ref::grouped_gemm_naive_lowp (the unfused composition in the 16-bit
//    dtype: fp32 sums stored rounded; SwiGLU's gate, up and silu each rounded). The floor covers
//    fp32 summation-order differences only (far below a 16-bit ulp).
//  - moe_grouped_gemm with a_rows (rows gathered from x): bit for bit the same GEMM on the
//    explicitly gathered copy (same family, same tile shape: the same products in the same order),
//    and the rules above against the reference on the gathered rows; rows whose a_rows entry is
//    outside x exactly 0.
//  - moe_combine: the same rule against ref::combine_naive_lowp (the contract's computation: fp32
//    sums in k order, one rounding), floor 2^-20 x max |fp64| + 1e-6: near-exact.
//  - fused_moe: the same rule against ref::moe_layer_naive_lowp, the unfused composition with every
//    stored intermediate rounded to the 16-bit dtype: h = silu(g) * u between the two GEMMs (the
//    bf16 / fp16 activation, the main source of error: its rounding, about 2^-9 relative per
//    element, reaches the output through w2 as a sum of inter independent errors), each expert's
//    output and the shared expert's. Floor: a quarter ulp of the largest output
//    (2^-(mantissa + 2) x max |fp64|), for rounding boundaries the kernel's fp32 order crosses
//    differently from the naive one.
// Outputs are poisoned (0xFF bytes: NaN) before every run; every element a run must write is
// checked written and every element it must not write (rows outside the segments, the padding of
// strided outputs) is checked still poisoned. Inputs that must not be read into any result (rows
// of `a` outside the segments, columns past K in padded rows, expert_out rows no copy refers to,
// permuted_x rows past the last segment, rows of x no product row gathers) hold NaN.
#include <gmock/gmock.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "dispatch/moe_dispatch.h"
#include "gpu/gpu_test_util.h"
#include "reference/moe_ref.h"
#include "tessera/moe.h"

namespace tessera::testing {
namespace {

using ::testing::HasSubstr;

constexpr uint16_t kNaN16 = 0xFFFF;  // NaN in bf16 and fp16; also what poison() leaves

int mantissa_bits(DType dtype) { return dtype == DType::kBF16 ? 7 : 10; }

// A 16-bit output element as a float for expect_within_rule: the poison pattern maps to the fp32
// poison, which that counts as unwritten (not as a NaN mismatch).
float output_value(uint16_t bits, DType dtype) {
  if (bits != kNaN16) return from_bits(bits, dtype);
  const uint32_t poison = 0xFFFFFFFFu;
  float f;
  std::memcpy(&f, &poison, 4);
  return f;
}

std::unique_ptr<DeviceBuffer> device_buffer(std::size_t bytes) {
  return std::make_unique<DeviceBuffer>(std::max<std::size_t>(bytes, 16));
}

std::string dims(std::initializer_list<int64_t> v) {
  std::string s;
  for (int64_t x : v) s += (s.empty() ? "" : "x") + std::to_string(x);
  return s;
}

// Expects a tessera::Error from `call` naming `entry` and one of `args` ("argument 'x'").
template <typename Call>
void expect_arg_error(const char* entry, Call&& call, std::initializer_list<const char*> args) {
  std::string names;
  for (const char* a : args) names += std::string(names.empty() ? "" : " or ") + "'" + a + "'";
  try {
    call();
    ADD_FAILURE() << "accepted; expected an error naming " << names;
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_THAT(what, HasSubstr(std::string("tessera::") + entry));
    bool named = false;
    for (const char* a : args) named = named || what.find(std::string("argument '") + a + "'") != std::string::npos;
    EXPECT_TRUE(named) << "'" << what << "' names none of " << names;
  }
}

void sync(cudaStream_t stream, const char* what) {
  const cudaError_t status = cudaStreamSynchronize(stream);
  if (status != cudaSuccess) throw std::runtime_error(std::string(what) + " failed on the GPU: " + cudaGetErrorString(status));
}

// ---- Segment layouts ---------------------------------------------------------------------------
enum class Layout { kUniform, kSkewed, kSomeEmpty, kDecode, kPermuteAlign1, kPermuteAlign128 };

const char* layout_name(Layout l) {
  switch (l) {
    case Layout::kUniform: return "uniform";
    case Layout::kSkewed: return "all rows to one expert";
    case Layout::kSomeEmpty: return "some experts empty";
    case Layout::kDecode: return "decode (1..rows_per_expert each)";
    case Layout::kPermuteAlign1: return "moe_permute align 1";
    case Layout::kPermuteAlign128: return "moe_permute align 128";
  }
  return "?";
}

// Segment offsets [experts + 1] starting at row `lead`. The moe_permute layouts route about
// rows_per_expert x experts random (token, k) copies (every 11th dropped) through ref::permute:
// align 1 gives segments starting anywhere, align 128 padded, 128-aligned ones; both leave some
// experts empty.
std::vector<int32_t> make_offsets(Layout layout, int experts, int rows_per_expert, int lead, std::mt19937& rng) {
  std::vector<int64_t> counts(size_t(experts), 0);
  switch (layout) {
    case Layout::kUniform:
      std::fill(counts.begin(), counts.end(), rows_per_expert);
      break;
    case Layout::kSkewed:
      counts[size_t(experts / 2)] = int64_t(rows_per_expert) * experts;
      break;
    case Layout::kSomeEmpty: {
      std::uniform_int_distribution<int> pick(0, 2 * rows_per_expert);
      for (int e = 0; e < experts; ++e) counts[size_t(e)] = (e % 3 == 0 || e == experts - 1) ? 0 : pick(rng);
      if (experts > 1 && counts[1] == 0) counts[1] = 1;  // never all empty
      break;
    }
    case Layout::kDecode: {
      std::uniform_int_distribution<int> pick(1, rows_per_expert);
      for (auto& c : counts) c = pick(rng);
      break;
    }
    case Layout::kPermuteAlign1:
    case Layout::kPermuteAlign128: {
      const int align = layout == Layout::kPermuteAlign1 ? 1 : 128;
      const int top_k = std::min(2, experts);
      const int64_t tokens = std::max<int64_t>(1, int64_t(rows_per_expert) * experts / top_k);
      std::vector<int32_t> ids(size_t(tokens * top_k));
      std::uniform_int_distribution<int> pick(0, experts - 1);
      for (size_t i = 0; i < ids.size(); ++i) ids[i] = i % 11 == 5 ? -1 : pick(rng);
      const int64_t capacity = tokens * top_k + int64_t(experts) * (align - 1);
      const ref::Permutation p = ref::permute(ids.data(), tokens, top_k, experts, align, capacity);
      for (int e = 0; e < experts; ++e) counts[size_t(e)] = p.offsets[size_t(e) + 1] - p.offsets[size_t(e)];
      break;
    }
  }
  std::vector<int32_t> offsets(size_t(experts) + 1);
  offsets[0] = lead;
  for (int e = 0; e < experts; ++e) offsets[size_t(e) + 1] = int32_t(offsets[size_t(e)] + counts[size_t(e)]);
  return offsets;
}

// The expert whose segment holds row r (offsets[0] <= r < offsets[E]).
int expert_of(const std::vector<int32_t>& offsets, int64_t r) {
  return int(std::upper_bound(offsets.begin(), offsets.end(), r) - offsets.begin()) - 1;
}

// ---- Grouped GEMM problems -----------------------------------------------------------------------
enum class Fill { kIntegers, kRandom };

// splitmix64: the GEMM problems draw up to 10^8 values, where std::mt19937 with a distribution
// costs seconds of host time per test.
class FastRng {
 public:
  explicit FastRng(uint64_t seed) : state_(seed) {}
  uint64_t next() {
    uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  float uniform(float lo, float hi) { return lo + (hi - lo) * float(next() >> 40) * 0x1p-24f; }
  int small_int() { return int((next() >> 32) % 7) - 3; }  // in [-3, 3]

 private:
  uint64_t state_;
};

struct GemmCase {
  int experts = 8, k = 64, n = 64;
  MoeActivation act = MoeActivation::kNone;
  Layout layout = Layout::kUniform;
  int rows_per_expert = 16;
  int lead = 0, tail = 0;           // rows before the first segment / after the last (never written)
  int a_offset = 0, a_pad = 0;      // `a` is columns [a_offset, a_offset + K) of rows of K + a_pad
  int out_offset = 0, out_pad = 0;  // `out` likewise
  int w_pad = 0;                    // each weight row holds K + w_pad elements
  Fill fill = Fill::kRandom;
  int sample_rows = 0;              // 0: check every row; else the first / last of each segment + random ones
  int gather_tokens = 0;            // > 0: also x [gather_tokens, K] and a_rows (GemmProblem::gathered_args)
};

GemmCase gemm_case(int experts, int k, int n, Layout layout, int rows_per_expert,
                   MoeActivation act = MoeActivation::kNone, Fill fill = Fill::kRandom) {
  GemmCase c;
  c.experts = experts;
  c.k = k;
  c.n = n;
  c.layout = layout;
  c.rows_per_expert = rows_per_expert;
  c.act = act;
  c.fill = fill;
  return c;
}

// The same case with its reference computed on about `rows` sampled rows only.
GemmCase sampled(GemmCase c, int rows) {
  c.sample_rows = rows;
  return c;
}

std::string describe(const GemmCase& c, DType dtype) {
  std::string s = "E " + std::to_string(c.experts) + " K " + std::to_string(c.k) + " N " + std::to_string(c.n) +
                  (c.act == MoeActivation::kSwiGLU ? " swiglu " : " store ") + dtype_name(dtype) + " " +
                  layout_name(c.layout) + " rows/expert " + std::to_string(c.rows_per_expert) +
                  (c.fill == Fill::kIntegers ? " integers" : " random");
  if (c.lead || c.tail) s += " lead " + std::to_string(c.lead) + " tail " + std::to_string(c.tail);
  if (c.a_pad || c.out_pad || c.w_pad) {
    s += " strided a +" + std::to_string(c.a_offset) + "/" + std::to_string(c.a_pad) + " out +" +
         std::to_string(c.out_offset) + "/" + std::to_string(c.out_pad) + " w pad " + std::to_string(c.w_pad);
  }
  if (c.gather_tokens) s += " gathered from " + std::to_string(c.gather_tokens) + " tokens";
  return s;
}

// A grouped GEMM problem: `a`, the weights, the offsets and `out` on the device, the host copies
// the reference is computed from. With gather_tokens (the a_rows mode) there are also x
// [gather_tokens, K] (same row stride and column offset as `a`) and a_rows [rows] on the device,
// and `a` holds the rows of x that a_rows gathers (zeros where an entry is outside
// [0, gather_tokens)): args() is the GEMM on that explicit copy, gathered_args() the same products
// read through a_rows.
class GemmProblem {
 public:
  GemmProblem(const GemmCase& c, DType dtype, uint32_t seed)
      : c_(c), dtype_(dtype), rng_(seed), fast_(seed), gather_rng_(seed ^ 0xA5A5A5A5u) {
    for (int v = -3; v <= 3; ++v) int_bits_[v + 3] = to_bits(float(v), dtype_);
    offsets_ = make_offsets(c.layout, c.experts, c.rows_per_expert, c.lead, rng_);
    rows_ = int64_t(offsets_.back()) + c.tail;
    n_out_ = c.act == MoeActivation::kSwiGLU ? c.n / 2 : c.n;
    a_stride_ = c.k + c.a_pad;
    out_stride_ = n_out_ + c.out_pad;
    w_stride_ = c.k + c.w_pad;
    // Weights: the view's elements, NaN in the row padding.
    const int64_t w_rows = int64_t(c.experts) * c.n;
    w_vals_.resize(size_t(w_rows * c.k));
    std::vector<uint16_t> w_bits(size_t(w_rows * w_stride_), kNaN16);
    const float w_scale = 2.f / std::sqrt(float(c.k));  // keeps |g|, |u| ~ 1 at any K
    for (int64_t r = 0; r < w_rows; ++r) {
      for (int i = 0; i < c.k; ++i) {
        const uint16_t b = draw(w_scale);
        w_bits[size_t(r * w_stride_ + i)] = b;
        w_vals_[size_t(r * c.k + i)] = from_bits(b, dtype_);
      }
    }
    d_a_ = device_buffer(size_t(rows_ * a_stride_) * 2);
    d_w_ = device_buffer(w_bits.size() * 2);
    d_off_ = device_buffer(offsets_.size() * 4);
    d_out_ = device_buffer(size_t(rows_ * out_stride_) * 2);
    d_w_->upload(w_bits);
    d_off_->upload(offsets_);
    if (c.gather_tokens > 0) {
      d_x_ = device_buffer(size_t(int64_t(c.gather_tokens) * a_stride_) * 2);
      d_rows_ = device_buffer(size_t(rows_) * 4);
    }
    new_a();
  }

  // Fresh contents of `a`: values in the segment rows, NaN elsewhere (other rows, row padding). In
  // the a_rows mode a fresh a_rows and x too, `a` their explicit gather.
  void new_a() {
    ++generation_;
    a_bits_.assign(size_t(rows_ * a_stride_), kNaN16);
    if (c_.gather_tokens > 0) {
      new_gathered_a();
    } else {
      for (int64_t r = offsets_.front(); r < offsets_.back(); ++r) {
        for (int i = 0; i < c_.k; ++i) a_bits_[size_t(r * a_stride_ + c_.a_offset + i)] = draw(1.f);
      }
    }
    d_a_->upload(a_bits_);
  }

  MoeGroupedGemmArgs args() const {
    MoeGroupedGemmArgs a;
    a.a = TensorView::strided(static_cast<char*>(d_a_->get()) + 2 * c_.a_offset, dtype_, {rows_, c_.k}, {a_stride_, 1});
    a.weights = TensorView::strided(d_w_->get(), dtype_, {c_.experts, c_.n, c_.k},
                                    {int64_t(c_.n) * w_stride_, w_stride_, 1});
    a.expert_offsets = TensorView::contiguous(d_off_->get(), DType::kInt32, {c_.experts + 1});
    a.activation = c_.act;
    a.out = TensorView::strided(static_cast<char*>(d_out_->get()) + 2 * c_.out_offset, dtype_, {rows_, n_out_},
                                {out_stride_, 1});
    return a;
  }

  std::vector<uint16_t> run(cudaStream_t stream) {
    d_out_->poison();
    moe_grouped_gemm(args(), stream);
    sync(stream, "moe_grouped_gemm");
    return download();
  }

  // The a_rows mode's call: a = x [gather_tokens, K], a_rows [rows], the same weights, offsets, out.
  MoeGroupedGemmArgs gathered_args() const {
    MoeGroupedGemmArgs g = args();
    g.a = TensorView::strided(static_cast<char*>(d_x_->get()) + 2 * c_.a_offset, dtype_, {c_.gather_tokens, c_.k},
                              {a_stride_, 1});
    g.a_rows = TensorView::contiguous(d_rows_->get(), DType::kInt32, {rows_});
    return g;
  }
  std::vector<uint16_t> run_gathered(cudaStream_t stream) {
    d_out_->poison();
    moe_grouped_gemm(gathered_args(), stream);
    sync(stream, "moe_grouped_gemm with a_rows");
    return download();
  }
  std::vector<uint16_t> download() const { return d_out_->download<uint16_t>(size_t(rows_ * out_stride_)); }
  void poison_out() { d_out_->poison(); }

  // Every element inside the segments written, every other one untouched, the checked rows against
  // the reference (exact for integer inputs without SwiGLU, else the tolerance rule).
  void check(const std::vector<uint16_t>& got) const {
    const int64_t lo = offsets_.front(), hi = offsets_.back();
    int64_t touched = 0, unwritten = 0;
    std::string first_touched, first_unwritten;
    for (int64_t r = 0; r < rows_; ++r) {
      for (int64_t col = 0; col < out_stride_; ++col) {
        const bool inside = r >= lo && r < hi && col >= c_.out_offset && col < c_.out_offset + n_out_;
        const uint16_t b = got[size_t(r * out_stride_ + col)];
        if (!inside && b != kNaN16 && touched++ == 0) first_touched = dims({r, col});
        if (inside && b == kNaN16 && unwritten++ == 0) first_unwritten = dims({r, col - c_.out_offset});
      }
    }
    EXPECT_EQ(touched, 0) << "elements outside the segments / past N written, first at row x col " << first_touched;
    EXPECT_EQ(unwritten, 0) << "elements never written (still poisoned), first at " << first_unwritten;

    if (c_.gather_tokens > 0) {  // a_rows entries outside x: products of a zero row, exactly 0
      int64_t nonzero = 0, zero_rows = 0;
      std::string first_nonzero;
      for (int64_t r = lo; r < hi; ++r) {
        if (in_x(a_rows_[size_t(r)])) continue;
        ++zero_rows;
        for (int j = 0; j < n_out_; ++j) {
          if (from_bits(got[size_t(r * out_stride_ + c_.out_offset + j)], dtype_) != 0.f && nonzero++ == 0) {
            first_nonzero = dims({r, j}) + " (a_rows " + std::to_string(a_rows_[size_t(r)]) + ")";
          }
        }
      }
      EXPECT_EQ(nonzero, 0) << "elements of the " << zero_rows << " rows whose a_rows entry is outside [0, "
                            << c_.gather_tokens << ") are not 0, first at row x col " << first_nonzero;
    }

    const Reference& expected = reference();
    const std::vector<int64_t>& rows = expected.rows;
    if (rows.empty()) return;
    const std::vector<double>& want = expected.want;
    if (expected.exact) {
      int64_t wrong = 0;
      for (size_t i = 0; i < rows.size(); ++i) {
        for (int j = 0; j < n_out_; ++j) {
          const uint16_t g = got[size_t(rows[i] * out_stride_ + c_.out_offset + j)];
          const double w = want[i * size_t(n_out_) + size_t(j)];
          if (g != to_bits(float(w), dtype_) && wrong++ < 5) {
            ADD_FAILURE() << "row " << rows[i] << " col " << j << ": " << from_bits(g, dtype_) << ", want exactly "
                          << w << " rounded (" << from_bits(to_bits(float(w), dtype_), dtype_) << ")";
          }
        }
      }
      EXPECT_EQ(wrong, 0) << "of " << rows.size() * size_t(n_out_) << " checked elements";
      return;
    }
    std::vector<float> g(want.size());
    for (size_t i = 0; i < rows.size(); ++i) {
      for (int j = 0; j < n_out_; ++j) {
        g[i * size_t(n_out_) + size_t(j)] = output_value(got[size_t(rows[i] * out_stride_ + c_.out_offset + j)], dtype_);
      }
    }
    expect_within_rule(g, want, expected.naive_err, 0x1p-16 * expected.scale + 1e-7,
                       "out (" + std::to_string(rows.size()) + " rows)");
  }

  int64_t rows() const { return rows_; }
  const std::vector<int32_t>& offsets() const { return offsets_; }

 private:
  // The reference on the checked rows, computed once per contents of `a` (new_a() makes new ones):
  // the fp64 result, and unless exact (integer kStore: bit for bit) the naive 16-bit one's max
  // error against it and the largest |fp64|.
  struct Reference {
    int64_t generation = -1;
    std::vector<int64_t> rows;
    std::vector<double> want;
    bool exact = false;
    double naive_err = 0, scale = 0;
  };
  const Reference& reference() const {
    if (ref_.generation == generation_) return ref_;
    Reference r;
    r.generation = generation_;
    r.rows = rows_to_check();
    const std::vector<int64_t>& rows = r.rows;
    if (!rows.empty()) {
      // The checked rows as a compact problem of their own (same experts, same weights).
      std::vector<float> a(rows.size() * size_t(c_.k));
      std::vector<int32_t> offsets(size_t(c_.experts) + 1, 0);
      for (size_t i = 0; i < rows.size(); ++i) {
        for (int j = 0; j < c_.k; ++j) {
          a[i * size_t(c_.k) + size_t(j)] = from_bits(a_bits_[size_t(rows[i] * a_stride_ + c_.a_offset + j)], dtype_);
        }
        ++offsets[size_t(expert_of(offsets_, rows[i])) + 1];
      }
      std::partial_sum(offsets.begin(), offsets.end(), offsets.begin());
      const bool swiglu = c_.act == MoeActivation::kSwiGLU;
      const int64_t m = int64_t(rows.size());
      ref::grouped_gemm(a.data(), m, c_.k, w_vals_.data(), c_.experts, c_.n, offsets.data(), swiglu, r.want);
      r.exact = c_.fill == Fill::kIntegers && !swiglu;
      if (!r.exact) {
        std::vector<double> naive;
        ref::grouped_gemm_naive_lowp(a.data(), m, c_.k, w_vals_.data(), c_.experts, c_.n, offsets.data(), swiglu,
                                     mantissa_bits(dtype_), naive);
        for (size_t e = 0; e < r.want.size(); ++e) {
          r.naive_err = std::max(r.naive_err, std::fabs(naive[e] - r.want[e]));
          r.scale = std::max(r.scale, std::fabs(r.want[e]));
        }
      }
    }
    ref_ = std::move(r);
    return ref_;
  }

  bool in_x(int32_t t) const { return t >= 0 && t < c_.gather_tokens; }

  // The a_rows mode's new_a(): a fresh a_rows (a random token for every row, about 1 in 6 entries
  // outside [0, tokens): -1 as on moe_permute's padding, tokens, tokens + 1000, INT32_MAX,
  // INT32_MIN; the first segment row -1 and the last one `tokens` always), x (values on the
  // tokens some segment row reads, NaN on the others and in the row padding) and `a` = the
  // explicit gather (segment rows x[a_rows[r]] or zeros, NaN elsewhere).
  void new_gathered_a() {
    const int64_t tokens = c_.gather_tokens, lo = offsets_.front(), hi = offsets_.back();
    const int32_t outside[] = {-1, int32_t(tokens), int32_t(tokens + 1000), INT32_MAX, INT32_MIN};
    std::uniform_int_distribution<int32_t> token(0, int32_t(tokens - 1));
    std::uniform_int_distribution<int> kind(0, 31);
    a_rows_.resize(size_t(rows_));
    for (int32_t& t : a_rows_) {
      const int k = kind(gather_rng_);
      t = k < 5 ? outside[k] : token(gather_rng_);
    }
    if (hi > lo) {
      a_rows_[size_t(lo)] = -1;
      a_rows_[size_t(hi - 1)] = int32_t(tokens);
    }
    std::vector<char> read(size_t(tokens), 0);
    for (int64_t r = lo; r < hi; ++r) {
      if (in_x(a_rows_[size_t(r)])) read[size_t(a_rows_[size_t(r)])] = 1;
    }
    x_bits_.assign(size_t(tokens * a_stride_), kNaN16);
    for (int64_t t = 0; t < tokens; ++t) {
      if (!read[size_t(t)]) continue;
      for (int i = 0; i < c_.k; ++i) x_bits_[size_t(t * a_stride_ + c_.a_offset + i)] = draw(1.f);
    }
    const uint16_t zero = to_bits(0.f, dtype_);
    for (int64_t r = lo; r < hi; ++r) {
      const int32_t t = a_rows_[size_t(r)];
      for (int i = 0; i < c_.k; ++i) {
        a_bits_[size_t(r * a_stride_ + c_.a_offset + i)] =
            in_x(t) ? x_bits_[size_t(int64_t(t) * a_stride_ + c_.a_offset + i)] : zero;
      }
    }
    d_x_->upload(x_bits_);
    d_rows_->upload(a_rows_);
  }

  uint16_t draw(float scale) {
    if (c_.fill == Fill::kIntegers) return int_bits_[fast_.small_int() + 3];
    return to_bits(fast_.uniform(-scale, scale), dtype_);
  }

  std::vector<int64_t> rows_to_check() const {
    std::vector<int64_t> rows;
    const int64_t lo = offsets_.front(), hi = offsets_.back();
    if (c_.sample_rows == 0) {
      for (int64_t r = lo; r < hi; ++r) rows.push_back(r);
      return rows;
    }
    for (int e = 0; e < c_.experts; ++e) {
      if (offsets_[size_t(e)] == offsets_[size_t(e) + 1]) continue;
      rows.push_back(offsets_[size_t(e)]);
      rows.push_back(offsets_[size_t(e) + 1] - 1);
    }
    std::mt19937 pick_rng(static_cast<uint32_t>(rows_));
    if (int(rows.size()) > c_.sample_rows / 2) {  // many segments: a random half of the budget of their ends
      std::shuffle(rows.begin(), rows.end(), pick_rng);
      rows.resize(size_t(c_.sample_rows / 2));
    }
    std::uniform_int_distribution<int64_t> pick(lo, std::max(lo, hi - 1));
    while (hi > lo && int(rows.size()) < c_.sample_rows) rows.push_back(pick(pick_rng));
    std::sort(rows.begin(), rows.end());
    rows.erase(std::unique(rows.begin(), rows.end()), rows.end());
    return rows;
  }

  GemmCase c_;
  DType dtype_;
  std::mt19937 rng_;         // the layout
  FastRng fast_;             // the values
  std::mt19937 gather_rng_;  // a_rows
  uint16_t int_bits_[7] = {};
  std::vector<int32_t> offsets_;
  int64_t rows_ = 0, a_stride_ = 0, out_stride_ = 0, w_stride_ = 0;
  int n_out_ = 0;
  std::vector<float> w_vals_;
  std::vector<uint16_t> a_bits_, x_bits_;
  std::vector<int32_t> a_rows_;
  int64_t generation_ = 0;  // of a's contents
  mutable Reference ref_;
  std::unique_ptr<DeviceBuffer> d_a_, d_w_, d_off_, d_out_, d_x_, d_rows_;
};

// Runs `body` once per grouped-GEMM family this GPU runs (Hopper and portable on an H200), each
// forced in turn.
template <typename Body>
void for_each_gemm_family(Body&& body) {
  for (dispatch::MoeGemmFamily family : dispatch::moe_gemm_families_on_this_gpu()) {
    SCOPED_TRACE(std::string("grouped GEMM family ") + dispatch::moe_gemm_family_name(family));
    dispatch::force_moe_gemm_family(&family);
    body();
  }
  dispatch::force_moe_gemm_family(nullptr);
}

void run_gemm_case(const GemmCase& c, DType dtype, uint32_t seed) {
  SCOPED_TRACE(describe(c, dtype));
  GemmProblem p(c, dtype, seed);
  for_each_gemm_family([&] { p.check(p.run(nullptr)); });
}

void run_both_dtypes(const GemmCase& c, uint32_t& seed) {
  for (DType dtype : {DType::kBF16, DType::kFP16}) run_gemm_case(c, dtype, seed++);
}

// kStore on small integers: bit for bit. E from 1 to 1024; K and N multiples of 8 but not of
// 64 / 128 / 256; every segment layout; rows before and after the segments left alone.
TEST(GpuMoeGemm, StoreIsExactOnIntegerInputs) {
  TESSERA_REQUIRE_GPU();
  const auto I = Fill::kIntegers;
  const auto none = MoeActivation::kNone;
  std::vector<GemmCase> cases = {
      gemm_case(1, 72, 8, Layout::kUniform, 37, none, I),
      gemm_case(8, 200, 136, Layout::kUniform, 64, none, I),
      gemm_case(8, 1032, 264, Layout::kSkewed, 40, none, I),
      gemm_case(64, 72, 1416, Layout::kSomeEmpty, 12, none, I),
      gemm_case(128, 200, 136, Layout::kPermuteAlign1, 4, none, I),
      gemm_case(64, 72, 136, Layout::kPermuteAlign128, 1, none, I),
      gemm_case(256, 1032, 8, Layout::kDecode, 16, none, I),
      gemm_case(256, 200, 264, Layout::kSomeEmpty, 4, none, I),
      gemm_case(1024, 72, 136, Layout::kDecode, 3, none, I),
      gemm_case(1024, 8, 8, Layout::kSomeEmpty, 2, none, I),
  };
  GemmCase gaps = gemm_case(8, 136, 200, Layout::kUniform, 33, none, I);
  gaps.lead = 5;  // offsets[0] > 0: rows before the first segment belong to no expert
  gaps.tail = 11;
  cases.push_back(gaps);
  GemmCase tail = gemm_case(128, 72, 264, Layout::kPermuteAlign1, 2, none, I);
  tail.tail = 300;  // offsets[E] well below rows (a worst-case-sized buffer)
  cases.push_back(tail);
  uint32_t seed = 1000;
  for (const GemmCase& c : cases) run_both_dtypes(c, seed);
}

// Random inputs, both activations, both dtypes, under the tolerance rule. SwiGLU needs I = N / 2
// a multiple of 8: N = 16, 144, 272, 1424.
TEST(GpuMoeGemm, RandomInputsWithinTheToleranceRule) {
  TESSERA_REQUIRE_GPU();
  const auto none = MoeActivation::kNone, swiglu = MoeActivation::kSwiGLU;
  std::vector<GemmCase> cases = {
      gemm_case(8, 72, 8, Layout::kUniform, 50, none),
      gemm_case(8, 72, 16, Layout::kUniform, 50, swiglu),
      gemm_case(64, 200, 144, Layout::kSomeEmpty, 10, swiglu),
      gemm_case(64, 200, 136, Layout::kSomeEmpty, 10, none),
      gemm_case(128, 1032, 144, Layout::kPermuteAlign1, 2, swiglu),
      sampled(gemm_case(256, 72, 136, Layout::kPermuteAlign128, 1, none), 128),  // ~20k padded rows
      gemm_case(1024, 72, 144, Layout::kDecode, 2, swiglu),
      gemm_case(1, 1032, 1416, Layout::kUniform, 40, none),
      gemm_case(1, 264, 1424, Layout::kUniform, 40, swiglu),
      gemm_case(8, 200, 1424, Layout::kSkewed, 16, swiglu),
      gemm_case(256, 264, 144, Layout::kDecode, 16, swiglu),
  };
  GemmCase gaps = gemm_case(8, 136, 272, Layout::kSomeEmpty, 20, swiglu);
  gaps.lead = 3;
  gaps.tail = 7;
  cases.push_back(gaps);
  uint32_t seed = 2000;
  for (const GemmCase& c : cases) run_both_dtypes(c, seed);
}

// Real models' MoE GEMMs, scaled down (hidden and intermediate sizes / 4 to / 16 so the weights
// stay small enough to build on the host quickly; the expert counts kept), up (SwiGLU) and down;
// rows sampled for the reference.
TEST(GpuMoeGemm, ModelShapesScaledDown) {
  TESSERA_REQUIRE_GPU();
  const auto none = MoeActivation::kNone, swiglu = MoeActivation::kSwiGLU;
  struct Model {
    const char* name;
    int experts, hidden, inter, rows_per_expert;
    Layout layout;
    bool fp16_too;
  };
  const Model models[] = {
      {"Mixtral 8x7B / 8 (hidden 4096, inter 14336)", 8, 512, 1792, 64, Layout::kPermuteAlign1, true},
      {"DeepSeek-V3 / 16 (256 experts, hidden 7168, inter 2048)", 256, 448, 128, 4, Layout::kPermuteAlign1, false},
      {"Qwen3-30B-A3B / 8 (128 experts, hidden 2048, inter 768)", 128, 256, 96, 16, Layout::kPermuteAlign128, true},
      {"gpt-oss-120b / 16 (128 experts, hidden = inter 2880)", 128, 184, 184, 2, Layout::kDecode, false},
  };
  uint32_t seed = 3000;
  for (const Model& m : models) {
    SCOPED_TRACE(m.name);
    const GemmCase up = sampled(gemm_case(m.experts, m.hidden, 2 * m.inter, m.layout, m.rows_per_expert, swiglu), 48);
    const GemmCase down = sampled(gemm_case(m.experts, m.inter, m.hidden, m.layout, m.rows_per_expert, none), 48);
    run_gemm_case(up, DType::kBF16, seed++);
    run_gemm_case(down, DType::kBF16, seed++);
    if (m.fp16_too) run_gemm_case(up, DType::kFP16, seed++);
  }
}

// `a` a column slice of a wider tensor (row stride > K), `out` the same, weights with padded rows:
// the padding of `a` and the weights holds NaN (never read), out's stays poisoned (never written).
TEST(GpuMoeGemm, StridedViews) {
  TESSERA_REQUIRE_GPU();
  uint32_t seed = 4000;
  const std::pair<MoeActivation, Fill> kinds[] = {{MoeActivation::kNone, Fill::kIntegers},
                                                  {MoeActivation::kNone, Fill::kRandom},
                                                  {MoeActivation::kSwiGLU, Fill::kRandom}};
  for (const auto& [act, fill] : kinds) {
    const bool sw = act == MoeActivation::kSwiGLU;
    GemmCase c = gemm_case(64, 200, sw ? 272 : 264, Layout::kPermuteAlign1, 6, act, fill);
    c.a_offset = 16;  // a = x[:, 16:216] of x [rows, 264]
    c.a_pad = 64;
    c.out_offset = 8;
    c.out_pad = 24;
    c.w_pad = 8;
    c.tail = 9;
    run_both_dtypes(c, seed);
    GemmCase d = gemm_case(8, 72, sw ? 144 : 136, Layout::kSkewed, 30, act, fill);
    d.a_pad = 8;  // row stride K + 8, no column offset
    d.out_pad = 8;
    d.w_pad = 56;
    run_both_dtypes(d, seed);
  }
}

// The layout moe_permute produces on the device (its expert_offsets, its permuted_x with zeroed
// padding rows) fed straight into the GEMM, at align 1 and 128; rows past the last segment keep
// the poison in the output (and NaN in permuted_x: they are never read into a result).
TEST(GpuMoeGemm, OffsetsFromMoePermute) {
  TESSERA_REQUIRE_GPU();
  uint32_t seed = 5000;
  for (int align : {1, 128}) {
    for (MoeActivation act : {MoeActivation::kNone, MoeActivation::kSwiGLU}) {
      const DType dtype = align == 1 ? DType::kBF16 : DType::kFP16;
      const int tokens = 200, top_k = 4, experts = 64, k = 200;
      const int n = act == MoeActivation::kSwiGLU ? 144 : 136, n_out = act == MoeActivation::kSwiGLU ? n / 2 : n;
      SCOPED_TRACE("align " + std::to_string(align) + (act == MoeActivation::kSwiGLU ? " swiglu" : " store"));
      std::mt19937 rng(seed++);
      std::vector<int32_t> ids(size_t(tokens) * top_k);
      std::uniform_int_distribution<int> pick(0, experts / 2 - 1);  // the odd experts stay empty
      for (size_t i = 0; i < ids.size(); ++i) ids[i] = i % 13 == 4 ? -1 : 2 * pick(rng);
      const int64_t capacity = moe_permute_capacity(tokens, top_k, experts, align);
      const ref::Permutation perm = ref::permute(ids.data(), tokens, top_k, experts, align, capacity);
      const int64_t used = perm.offsets.back();
      // Integer x (exact kStore), weights likewise for kStore, small random for SwiGLU.
      std::vector<uint16_t> x_bits(size_t(tokens) * k), w_bits(size_t(experts) * n * k);
      std::vector<float> w_vals(w_bits.size());
      for (auto& b : x_bits) b = to_bits(float(int(rng() % 7) - 3), dtype);
      std::uniform_real_distribution<float> small(-0.05f, 0.05f);
      for (size_t i = 0; i < w_bits.size(); ++i) {
        w_bits[i] = to_bits(act == MoeActivation::kNone ? float(int(rng() % 7) - 3) : small(rng), dtype);
        w_vals[i] = from_bits(w_bits[i], dtype);
      }
      DeviceBuffer d_ids(ids.size() * 4), d_x(x_bits.size() * 2), d_px(size_t(capacity) * k * 2);
      DeviceBuffer d_off(size_t(experts + 1) * 4), d_tok(size_t(capacity) * 4), d_inv(ids.size() * 4);
      const size_t ws = moe_permute_workspace_bytes(tokens, top_k, experts);
      DeviceBuffer d_ws(std::max<size_t>(ws, 256)), d_w(w_bits.size() * 2), d_out(size_t(capacity) * n_out * 2);
      d_ids.upload(ids);
      d_x.upload(x_bits);
      d_w.upload(w_bits);
      d_px.poison();
      d_out.poison();
      MoePermuteArgs pa;
      pa.topk_ids = TensorView::contiguous(d_ids.get(), DType::kInt32, {tokens, top_k});
      pa.num_experts = experts;
      pa.align = align;
      pa.x = TensorView::contiguous(d_x.get(), dtype, {tokens, k});
      pa.permuted_x = TensorView::contiguous(d_px.get(), dtype, {capacity, k});
      pa.expert_offsets = TensorView::contiguous(d_off.get(), DType::kInt32, {experts + 1});
      pa.permuted_token = TensorView::contiguous(d_tok.get(), DType::kInt32, {capacity});
      pa.inverse = TensorView::contiguous(d_inv.get(), DType::kInt32, {tokens, top_k});
      pa.workspace = d_ws.get();
      pa.workspace_size = ws;
      MoeGroupedGemmArgs ga;
      ga.a = pa.permuted_x;
      ga.weights = TensorView::contiguous(d_w.get(), dtype, {experts, n, k});
      ga.expert_offsets = pa.expert_offsets;
      ga.activation = act;
      ga.out = TensorView::contiguous(d_out.get(), dtype, {capacity, n_out});
      Stream stream;
      moe_permute(pa, stream);
      moe_grouped_gemm(ga, stream);
      sync(stream, "moe_permute + moe_grouped_gemm");
      ASSERT_EQ(d_off.download<int32_t>(size_t(experts) + 1), perm.offsets);
      const auto got = d_out.download<uint16_t>(size_t(capacity) * n_out);

      std::vector<float> a(size_t(used) * k, 0.f);  // padding rows zero, as moe_permute writes them
      for (int64_t r = 0; r < used; ++r) {
        const int32_t t = perm.permuted_token[size_t(r)];
        for (int i = 0; t >= 0 && i < k; ++i) a[size_t(r) * k + i] = from_bits(x_bits[size_t(t) * k + i], dtype);
      }
      std::vector<double> want, naive;
      const bool sw = act == MoeActivation::kSwiGLU;
      ref::grouped_gemm(a.data(), used, k, w_vals.data(), experts, n, perm.offsets.data(), sw, want);
      int64_t past_written = 0;
      for (int64_t i = used * n_out; i < capacity * n_out; ++i) past_written += got[size_t(i)] != kNaN16;
      EXPECT_EQ(past_written, 0) << "rows past expert_offsets[E] written";
      if (!sw) {
        int64_t wrong = 0;
        for (int64_t i = 0; i < used * n_out; ++i) wrong += got[size_t(i)] != to_bits(float(want[size_t(i)]), dtype);
        EXPECT_EQ(wrong, 0) << "of " << used * n_out << " elements differ from the exact sums rounded";
      } else {
        ref::grouped_gemm_naive_lowp(a.data(), used, k, w_vals.data(), experts, n, perm.offsets.data(), true,
                                     mantissa_bits(dtype), naive);
        std::vector<float> g(want.size());
        double naive_err = 0, scale = 0;
        for (size_t i = 0; i < want.size(); ++i) {
          g[i] = output_value(got[i], dtype);
          naive_err = std::max(naive_err, std::fabs(naive[i] - want[i]));
          scale = std::max(scale, std::fabs(want[i]));
        }
        expect_within_rule(g, want, naive_err, 0x1p-16 * scale + 1e-7, "out");
      }
    }
  }
}

// Every tile shape of the Hopper kernel (token rows 16 / 32 / 64 swapped, 128; its rule picks
// one by the mean rows per expert, so a forced shape sees segments far from the one it is chosen
// for): integer kStore bit for bit and SwiGLU under the rule, segments of 0 to ~300 rows, so the
// 128-row shape's last row tiles of <= 64 rows (one consumer idle) and > 64 rows both occur.
TEST(GpuMoeGemm, EveryHopperTileShape) {
  TESSERA_REQUIRE_GPU();
  const auto families = dispatch::moe_gemm_families_on_this_gpu();
  if (std::find(families.begin(), families.end(), dispatch::MoeGemmFamily::kHopper) == families.end()) {
    GTEST_SKIP() << "the Hopper grouped GEMM does not run on this GPU";
  }
  const std::vector<GemmCase> cases = {
      gemm_case(16, 136, 264, Layout::kSomeEmpty, 150, MoeActivation::kNone, Fill::kIntegers),
      gemm_case(8, 72, 136, Layout::kDecode, 200, MoeActivation::kNone, Fill::kIntegers),
      gemm_case(12, 200, 272, Layout::kSomeEmpty, 100, MoeActivation::kSwiGLU),
      gemm_case(4, 1032, 144, Layout::kUniform, 65, MoeActivation::kSwiGLU),
  };
  uint32_t seed = 1500;
  for (int token_rows : {16, 32, 64, 128}) {
    SCOPED_TRACE("token rows " + std::to_string(token_rows));
    dispatch::force_moe_gemm_token_rows(token_rows);
    const dispatch::MoeGemmFamily hopper = dispatch::MoeGemmFamily::kHopper;
    dispatch::force_moe_gemm_family(&hopper);
    for (const GemmCase& c : cases) {
      SCOPED_TRACE(describe(c, DType::kBF16));
      GemmProblem problem(c, DType::kBF16, seed++);
      problem.check(problem.run(nullptr));
    }
  }
  dispatch::force_moe_gemm_token_rows(0);
  dispatch::force_moe_gemm_family(nullptr);
}

// expert_offsets is device data the host cannot check. Broken arrays (overlapping segments that
// each claim every row, offsets below 0 and past `rows`, decreasing ones) must neither fault nor
// write outside out's rows nor take longer than a valid array of the same rows: the kernels clamp
// the offsets and raise each to the largest before it (include/tessera/moe.h), so the segments
// never overlap. What lands inside out is unspecified; out's rows past `rows` (a guard in the
// same allocation) must keep their poison.
TEST(GpuMoeGemm, BrokenOffsetsStayInBounds) {
  TESSERA_REQUIRE_GPU();
#if TESSERA_DEVICE_CHECKS
  GTEST_SKIP() << "the kernels were built with TESSERA_DEVICE_CHECKS: broken device data traps instead "
                  "(GpuDeviceChecks.BrokenDeviceDataTraps)";
#endif
  const int experts = 256, k = 136, n = 272, rows = 384, guard = 256;
  DeviceBuffer a(size_t(rows + guard) * k * 2), w(size_t(experts) * n * k * 2), off(size_t(experts + 1) * 4),
      out(size_t(rows + guard) * n * 2);
  a.upload(std::vector<uint16_t>(size_t(rows + guard) * k, 0x3F80));  // bf16 1.0
  w.upload(std::vector<uint16_t>(size_t(experts) * n * k, 0x3F80));
  std::vector<std::pair<std::string, std::vector<int32_t>>> arrays;
  {
    std::vector<int32_t> o(size_t(experts) + 1);
    for (int e = 0; e <= experts; ++e) o[size_t(e)] = e % 2 ? rows : 0;
    arrays.push_back({"every segment [0, rows)", o});
    for (int e = 0; e <= experts; ++e) o[size_t(e)] = e % 3 == 0 ? -1000000 : e % 3 == 1 ? INT32_MAX : rows + e;
    arrays.push_back({"below 0 and past rows", o});
    for (int e = 0; e <= experts; ++e) o[size_t(e)] = rows - e * rows / experts;
    arrays.push_back({"decreasing", o});
    std::mt19937 rng(77);
    std::uniform_int_distribution<int32_t> any(INT32_MIN, INT32_MAX);
    for (auto& x : o) x = any(rng);
    arrays.push_back({"random int32", o});
  }
  for (MoeActivation act : {MoeActivation::kNone, MoeActivation::kSwiGLU}) {
    const int n_out = act == MoeActivation::kSwiGLU ? n / 2 : n;
    MoeGroupedGemmArgs g;
    g.a = TensorView::contiguous(a.get(), DType::kBF16, {rows, k});
    g.weights = TensorView::contiguous(w.get(), DType::kBF16, {experts, n, k});
    g.expert_offsets = TensorView::contiguous(off.get(), DType::kInt32, {experts + 1});
    g.activation = act;
    g.out = TensorView::contiguous(out.get(), DType::kBF16, {rows, n_out});
    for (const auto& [name, offsets] : arrays) {
      SCOPED_TRACE(name + (act == MoeActivation::kSwiGLU ? ", SwiGLU" : ""));
      off.upload(offsets);
      for_each_gemm_family([&] {
        out.poison();
        moe_grouped_gemm(g, nullptr);
        sync(nullptr, "moe_grouped_gemm");
        const auto bits = out.download<uint16_t>(size_t(rows + guard) * n_out);
        const int64_t guard_written =
            int64_t(std::count_if(bits.begin() + int64_t(rows) * n_out, bits.end(), [](uint16_t b) { return b != kNaN16; }));
        EXPECT_EQ(guard_written, 0) << "elements written past out's last row";
      });
    }
  }
}

// No rows at all, and rows but every expert empty: nothing is written, nothing fails.
TEST(GpuMoeGemm, NoRowsWritesNothing) {
  TESSERA_REQUIRE_GPU();
  for (MoeActivation act : {MoeActivation::kNone, MoeActivation::kSwiGLU}) {
    const int experts = 8, k = 72, n = 144, n_out = act == MoeActivation::kSwiGLU ? 72 : 144;
    DeviceBuffer a(64 * k * 2), w(size_t(experts) * n * k * 2), off(size_t(experts + 1) * 4), out(64 * n_out * 2);
    a.poison();
    w.upload(std::vector<uint16_t>(size_t(experts) * n * k, 0x3F80));  // bf16 1.0
    MoeGroupedGemmArgs g;
    g.weights = TensorView::contiguous(w.get(), DType::kBF16, {experts, n, k});
    g.expert_offsets = TensorView::contiguous(off.get(), DType::kInt32, {experts + 1});
    g.activation = act;
    for (int64_t rows : {0, 64}) {
      SCOPED_TRACE("rows " + std::to_string(rows));
      off.upload(std::vector<int32_t>(size_t(experts) + 1, rows == 0 ? 0 : 17));  // every segment empty
      out.poison();
      g.a = TensorView::contiguous(a.get(), DType::kBF16, {rows, k});
      g.out = TensorView::contiguous(out.get(), DType::kBF16, {rows, n_out});
      moe_grouped_gemm(g, nullptr);
      sync(nullptr, "moe_grouped_gemm");
      const auto bits = out.download<uint16_t>(size_t(64) * n_out);
      EXPECT_EQ(std::count(bits.begin(), bits.end(), kNaN16), int64_t(bits.size())) << "an empty problem wrote";
    }
  }
}

// 8 experts x 2048 rows x K 4096 x N 1024 (and SwiGLU to I 1024): every element written; integer
// kStore exact on sampled rows (the first and last of every segment and random ones), SwiGLU under
// the rule on sampled rows.
TEST(GpuMoeGemm, LargeProblem) {
  TESSERA_REQUIRE_GPU();
  const GemmCase store =
      sampled(gemm_case(8, 4096, 1024, Layout::kUniform, 2048, MoeActivation::kNone, Fill::kIntegers), 64);
  run_gemm_case(store, DType::kBF16, 6000);
  const GemmCase sw = sampled(gemm_case(8, 2048, 2048, Layout::kSomeEmpty, 1024, MoeActivation::kSwiGLU), 32);
  run_gemm_case(sw, DType::kBF16, 6001);
  run_gemm_case(sw, DType::kFP16, 6002);
}

// Captured in a CUDA graph and replayed after `a` got new contents (same offsets): bitwise what an
// eager call gives on those contents.
TEST(GpuMoeGemm, GraphReplayEqualsEager) {
  TESSERA_REQUIRE_GPU();
  uint32_t seed = 7000;
  const GemmCase cases[] = {gemm_case(64, 200, 272, Layout::kPermuteAlign1, 6, MoeActivation::kSwiGLU),
                            gemm_case(128, 1032, 136, Layout::kDecode, 2, MoeActivation::kNone),
                            sampled(gemm_case(8, 1032, 1416, Layout::kPermuteAlign128, 64, MoeActivation::kNone), 32)};
  for_each_gemm_family([&] {
    for (const GemmCase& c : cases) {
      for (DType dtype : {DType::kBF16, DType::kFP16}) {
        SCOPED_TRACE(describe(c, dtype));
        GemmProblem p(c, dtype, seed++);
        Stream stream;
        const auto eager_first = p.run(stream);
        p.check(eager_first);
        cudaGraph_t graph;
        CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
        moe_grouped_gemm(p.args(), stream);
        CUDA_OK(cudaStreamEndCapture(stream, &graph));
        cudaGraphExec_t exec;
        CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
        p.new_a();
        const auto eager_second = p.run(stream);
        p.poison_out();
        CUDA_OK(cudaGraphLaunch(exec, stream));
        CUDA_OK(cudaStreamSynchronize(stream));
        EXPECT_TRUE(p.download() == eager_second) << "graph replay differs from the eager run on the new a";
        p.poison_out();
        CUDA_OK(cudaGraphLaunch(exec, stream));  // a second replay: the same again
        CUDA_OK(cudaStreamSynchronize(stream));
        EXPECT_TRUE(p.download() == eager_second) << "second graph replay differs";
        cudaGraphExecDestroy(exec);
        cudaGraphDestroy(graph);
      }
    }
  });
}

// The same inputs give bitwise the same outputs, in every regime (decode-sized segments, where a
// kernel might split K, as well as large ones).
TEST(GpuMoeGemm, RepeatRunsAreBitwiseEqual) {
  TESSERA_REQUIRE_GPU();
  uint32_t seed = 8000;
  const GemmCase cases[] = {gemm_case(128, 1032, 144, Layout::kDecode, 4, MoeActivation::kSwiGLU),
                            gemm_case(64, 4096, 72, Layout::kDecode, 1, MoeActivation::kNone),
                            gemm_case(8, 2048, 1416, Layout::kSkewed, 128, MoeActivation::kNone),
                            gemm_case(8, 1032, 2048, Layout::kUniform, 512, MoeActivation::kSwiGLU)};
  for_each_gemm_family([&] {
    for (const GemmCase& c : cases) {
      for (DType dtype : {DType::kBF16, DType::kFP16}) {
        if (dtype == DType::kFP16 && c.experts == 8) continue;  // the large ones once (host time)
        SCOPED_TRACE(describe(c, dtype));
        GemmProblem p(c, dtype, seed++);
        const auto first = p.run(nullptr);
        for (int again = 0; again < 2; ++again) EXPECT_TRUE(p.run(nullptr) == first) << "run " << again + 2 << " differs";
      }
    }
  });
}

// A few rules with real device buffers (the host-side table in tests/cpu/test_bad_input.cpp covers
// the rest where no GPU is visible): nothing launches, the error names the argument.
TEST(GpuMoeGemm, ArgumentsAreValidated) {
  TESSERA_REQUIRE_GPU();
  const int rows = 64, k = 72, n = 136, experts = 8;
  DeviceBuffer a(size_t(rows) * (k + 8) * 2), w(size_t(experts) * n * k * 2), off(size_t(experts + 1) * 4);
  DeviceBuffer out(size_t(rows) * n * 2), big_w(size_t(1025) * 8 * 8 * 2), big_off(size_t(1026) * 4);
  off.upload(std::vector<int32_t>(size_t(experts) + 1, 0));
  auto args = [&] {
    MoeGroupedGemmArgs g;
    g.a = TensorView::contiguous(a.get(), DType::kBF16, {rows, k});
    g.weights = TensorView::contiguous(w.get(), DType::kBF16, {experts, n, k});
    g.expert_offsets = TensorView::contiguous(off.get(), DType::kInt32, {experts + 1});
    g.out = TensorView::contiguous(out.get(), DType::kBF16, {rows, n});
    return g;
  };
  auto call = [](const MoeGroupedGemmArgs& g) { return [g] { moe_grouped_gemm(g, nullptr); }; };
  moe_grouped_gemm(args(), nullptr);  // the valid problem runs (every segment empty)
  CUDA_OK(cudaDeviceSynchronize());
  out.poison();
  MoeGroupedGemmArgs g = args();
  g.out = TensorView::contiguous(out.get(), DType::kBF16, {rows - 1, n});  // out too small
  expect_arg_error("moe_grouped_gemm", call(g), {"out"});
  g = args();
  g.weights = TensorView::contiguous(w.get(), DType::kFP16, {experts, n, k});  // dtype differs from a's
  expect_arg_error("moe_grouped_gemm", call(g), {"weights"});
  g = args();
  g.a = TensorView::contiguous(a.get(), DType::kBF16, {rows, 68});  // K not a multiple of 8
  g.weights = TensorView::contiguous(w.get(), DType::kBF16, {experts, n, 68});
  expect_arg_error("moe_grouped_gemm", call(g), {"a", "weights"});
  g = args();
  g.weights = TensorView::strided(w.get(), DType::kBF16, {experts, n, 32}, {int64_t(n) * k, k, 2});  // K strided
  g.a = TensorView::contiguous(a.get(), DType::kBF16, {rows, 32});
  expect_arg_error("moe_grouped_gemm", call(g), {"weights"});
  g = args();
  g.weights = TensorView::contiguous(big_w.get(), DType::kBF16, {1025, 8, 8});  // 1025 experts
  g.a = TensorView::contiguous(a.get(), DType::kBF16, {rows, 8});
  g.out = TensorView::contiguous(out.get(), DType::kBF16, {rows, 8});
  g.expert_offsets = TensorView::contiguous(big_off.get(), DType::kInt32, {1026});
  expect_arg_error("moe_grouped_gemm", call(g), {"weights", "expert_offsets"});
  g = args();
  g.activation = MoeActivation::kSwiGLU;  // out must then hold N / 2 columns
  g.weights = TensorView::contiguous(w.get(), DType::kBF16, {experts, 128, k});
  g.out = TensorView::contiguous(out.get(), DType::kBF16, {rows, 128});
  expect_arg_error("moe_grouped_gemm", call(g), {"out"});
  g = args();
  g.a = TensorView::strided(a.get(), DType::kBF16, {rows, k}, {k + 4, 1});  // row stride not a multiple of 8
  expect_arg_error("moe_grouped_gemm", call(g), {"a"});
  g = args();
  g.expert_offsets = TensorView::contiguous(off.get(), DType::kInt32, {experts});
  expect_arg_error("moe_grouped_gemm", call(g), {"expert_offsets"});
  const auto bits = out.download<uint16_t>(size_t(rows) * n);
  EXPECT_EQ(std::count(bits.begin(), bits.end(), kNaN16), int64_t(bits.size())) << "a refused call wrote";
}

// ---- Gathered rows (a_rows) ----------------------------------------------------------------------
// With a_rows, product row r reads x[a_rows[r]] (a row of zeros for an entry outside x's rows). The
// same GEMM on the explicitly gathered copy (GemmProblem::args()) computes the same products in the
// same order on the same family, so the two must agree bit for bit; the gathered run is also held
// to the reference on the gathered rows (GemmProblem::check: exact for integer kStore, else the
// tolerance rule; rows outside the segments still poisoned; zero rows exactly 0).

// got == want element for element (16-bit patterns of out, row stride `stride`).
void expect_same_bits(const std::vector<uint16_t>& got, const std::vector<uint16_t>& want, int64_t stride,
                      const char* what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  int64_t differ = 0;
  size_t first = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (got[i] != want[i] && differ++ == 0) first = i;
  }
  EXPECT_EQ(differ, 0) << what << ": " << differ << " of " << got.size() << " elements differ, first at row x col "
                       << dims({int64_t(first) / stride, int64_t(first) % stride}) << " (bits 0x" << std::hex
                       << (differ ? got[first] : 0) << " vs 0x" << (differ ? want[first] : 0) << std::dec << ")";
}

// One gathered run against the reference and bitwise against the explicit copy's run (same family,
// same forced shape, if any).
void check_gathered_run(GemmProblem& p, cudaStream_t stream) {
  const std::vector<uint16_t> copy = p.run(stream);
  const std::vector<uint16_t> gathered = p.run_gathered(stream);
  p.check(gathered);
  const int64_t stride = p.rows() > 0 ? int64_t(gathered.size()) / p.rows() : 1;
  expect_same_bits(gathered, copy, stride, "a_rows against the GEMM on the explicitly gathered copy");
}

// Runs `body` with the Hopper kernel forced to each of its tile shapes (token rows 16, 32, 64
// swapped, 128) when this GPU runs it; lifts the forcing afterwards.
template <typename Body>
void for_each_hopper_tile_shape(Body&& body) {
  const auto families = dispatch::moe_gemm_families_on_this_gpu();
  if (std::find(families.begin(), families.end(), dispatch::MoeGemmFamily::kHopper) == families.end()) return;
  const dispatch::MoeGemmFamily hopper = dispatch::MoeGemmFamily::kHopper;
  dispatch::force_moe_gemm_family(&hopper);
  for (int token_rows : {16, 32, 64, 128}) {
    SCOPED_TRACE("hopper, forced token rows " + std::to_string(token_rows));
    dispatch::force_moe_gemm_token_rows(token_rows);
    body();
  }
  dispatch::force_moe_gemm_token_rows(0);
  dispatch::force_moe_gemm_family(nullptr);
}

// E 8 and 64; K 200 and 4104 (not multiples of 64); N 136 / 264 (not multiples of the 64- / 128-
// / 256-column tiles), SwiGLU to I 72 / 136; mean rows per expert ~5, ~18, 40, 56, 300 and ~4.5
// (decode), so the Hopper rule picks each of its tile shapes on its own (16, 32, 64, 128), and every
// case runs under every forced shape too. x has fewer rows than the products in most cases and
// more in one; the token counts are chosen so that x's rows per expert land in the same tile shape
// as the products' (whichever the tile rule is fed, both calls get the same shape). Rows before
// and after the segments (a_rows pointing anywhere) are never written; one case has strided x
// and out.
TEST(GpuMoeGemm, GatheredRowsEqualThePermutedCopy) {
  TESSERA_REQUIRE_GPU();
  const auto none = MoeActivation::kNone, swiglu = MoeActivation::kSwiGLU;
  std::vector<GemmCase> cases;
  {
    GemmCase c = gemm_case(8, 200, 136, Layout::kUniform, 4, none, Fill::kIntegers);  // 40 rows, 24 tokens
    c.lead = 3;
    c.tail = 5;
    c.gather_tokens = 24;
    cases.push_back(c);
  }
  {
    GemmCase c = gemm_case(64, 200, 144, Layout::kSomeEmpty, 27, swiglu);  // ~1130 rows, 1000 tokens
    c.tail = 7;
    c.gather_tokens = 1000;
    cases.push_back(c);
  }
  {
    GemmCase c = gemm_case(8, 4104, 136, Layout::kUniform, 40, none);  // 320 rows, 250 tokens
    c.a_offset = 8;  // x = columns [8, 4112) of rows of 4120, out columns [8, 144) of rows of 144
    c.a_pad = 16;
    c.out_offset = 8;
    c.out_pad = 8;
    c.gather_tokens = 250;
    cases.push_back(c);
  }
  {
    GemmCase c = gemm_case(64, 200, 272, Layout::kUniform, 56, swiglu);  // 3584 rows, 4000 tokens
    c.gather_tokens = 4000;
    cases.push_back(c);
  }
  {
    GemmCase c = gemm_case(8, 200, 264, Layout::kSkewed, 300, none, Fill::kIntegers);  // 2400 rows to one expert
    c.gather_tokens = 1000;
    cases.push_back(c);
  }
  {
    GemmCase c = gemm_case(64, 4104, 144, Layout::kDecode, 8, swiglu);  // ~290 rows, 100 tokens
    c.gather_tokens = 100;
    cases.push_back(c);
  }
  uint32_t seed = 16000;
  for (const GemmCase& c : cases) {
    for (DType dtype : {DType::kBF16, DType::kFP16}) {
      SCOPED_TRACE(describe(c, dtype));
      GemmProblem p(c, dtype, seed++);
      for_each_gemm_family([&] { check_gathered_run(p, nullptr); });
      for_each_hopper_tile_shape([&] { check_gathered_run(p, nullptr); });
    }
  }
}

// moe_permute's own output as a_rows: permuted_token (the token of each row; -1 on the padding of
// the align-16 / align-128 segments and past the last row) over x itself, against the GEMM on
// moe_permute's permuted_x (bit for bit, same family) and the reference; the padding rows are 0,
// the rows past expert_offsets[E] keep the poison.
TEST(GpuMoeGemm, GatheredRowsFromMoePermute) {
  TESSERA_REQUIRE_GPU();
  uint32_t seed = 17000;
  for (int align : {16, 128}) {
    for (MoeActivation act : {MoeActivation::kNone, MoeActivation::kSwiGLU}) {
      const bool sw = act == MoeActivation::kSwiGLU;
      const DType dtype = (align == 16) == sw ? DType::kFP16 : DType::kBF16;
      const int tokens = 300, top_k = 4, experts = 64, k = 200;
      const int n = sw ? 144 : 136, n_out = sw ? n / 2 : n;
      SCOPED_TRACE("align " + std::to_string(align) + (sw ? " swiglu " : " store ") + dtype_name(dtype));
      std::mt19937 rng(seed++);
      std::vector<int32_t> ids(size_t(tokens) * top_k);
      std::uniform_int_distribution<int> pick(0, experts / 2 - 1);  // the odd experts stay empty
      for (size_t i = 0; i < ids.size(); ++i) ids[i] = i % 13 == 4 ? -1 : 2 * pick(rng);
      const int64_t capacity = moe_permute_capacity(tokens, top_k, experts, align);
      const ref::Permutation perm = ref::permute(ids.data(), tokens, top_k, experts, align, capacity);
      const int64_t used = perm.offsets.back();
      int64_t padding = 0;
      for (int64_t r = 0; r < used; ++r) padding += perm.permuted_token[size_t(r)] < 0;
      ASSERT_GT(padding, 0) << "no padding rows: the case does not test -1 entries inside the segments";
      // Integer x (exact kStore), weights likewise for kStore, small random for SwiGLU.
      std::vector<uint16_t> x_bits(size_t(tokens) * k), w_bits(size_t(experts) * n * k);
      std::vector<float> w_vals(w_bits.size());
      for (auto& b : x_bits) b = to_bits(float(int(rng() % 7) - 3), dtype);
      std::uniform_real_distribution<float> small(-0.05f, 0.05f);
      for (size_t i = 0; i < w_bits.size(); ++i) {
        w_bits[i] = to_bits(sw ? small(rng) : float(int(rng() % 7) - 3), dtype);
        w_vals[i] = from_bits(w_bits[i], dtype);
      }
      DeviceBuffer d_ids(ids.size() * 4), d_x(x_bits.size() * 2), d_px(size_t(capacity) * k * 2);
      DeviceBuffer d_off(size_t(experts + 1) * 4), d_tok(size_t(capacity) * 4), d_inv(ids.size() * 4);
      const size_t ws = moe_permute_workspace_bytes(tokens, top_k, experts);
      DeviceBuffer d_ws(std::max<size_t>(ws, 256)), d_w(w_bits.size() * 2);
      DeviceBuffer d_out(size_t(capacity) * n_out * 2), d_copy_out(size_t(capacity) * n_out * 2);
      d_ids.upload(ids);
      d_x.upload(x_bits);
      d_w.upload(w_bits);
      d_px.poison();  // rows past the last segment stay NaN: never read
      MoePermuteArgs pa;
      pa.topk_ids = TensorView::contiguous(d_ids.get(), DType::kInt32, {tokens, top_k});
      pa.num_experts = experts;
      pa.align = align;
      pa.x = TensorView::contiguous(d_x.get(), dtype, {tokens, k});
      pa.permuted_x = TensorView::contiguous(d_px.get(), dtype, {capacity, k});
      pa.expert_offsets = TensorView::contiguous(d_off.get(), DType::kInt32, {experts + 1});
      pa.permuted_token = TensorView::contiguous(d_tok.get(), DType::kInt32, {capacity});
      pa.inverse = TensorView::contiguous(d_inv.get(), DType::kInt32, {tokens, top_k});
      pa.workspace = d_ws.get();
      pa.workspace_size = ws;
      Stream stream;
      moe_permute(pa, stream);
      sync(stream, "moe_permute");
      ASSERT_EQ(d_off.download<int32_t>(size_t(experts) + 1), perm.offsets);
      ASSERT_EQ(d_tok.download<int32_t>(size_t(capacity)), perm.permuted_token);

      MoeGroupedGemmArgs copy;  // on the permuted copy
      copy.a = pa.permuted_x;
      copy.weights = TensorView::contiguous(d_w.get(), dtype, {experts, n, k});
      copy.expert_offsets = pa.expert_offsets;
      copy.activation = act;
      copy.out = TensorView::contiguous(d_copy_out.get(), dtype, {capacity, n_out});
      MoeGroupedGemmArgs gathered = copy;  // on x through permuted_token
      gathered.a = pa.x;
      gathered.a_rows = pa.permuted_token;
      gathered.out = TensorView::contiguous(d_out.get(), dtype, {capacity, n_out});

      std::vector<float> a(size_t(used) * k, 0.f);  // padding rows zero
      for (int64_t r = 0; r < used; ++r) {
        const int32_t t = perm.permuted_token[size_t(r)];
        for (int i = 0; t >= 0 && i < k; ++i) a[size_t(r) * k + i] = from_bits(x_bits[size_t(t) * k + i], dtype);
      }
      std::vector<double> want, naive;
      ref::grouped_gemm(a.data(), used, k, w_vals.data(), experts, n, perm.offsets.data(), sw, want);
      double naive_err = 0, scale = 0;
      if (sw) {
        ref::grouped_gemm_naive_lowp(a.data(), used, k, w_vals.data(), experts, n, perm.offsets.data(), true,
                                     mantissa_bits(dtype), naive);
        for (size_t i = 0; i < want.size(); ++i) {
          naive_err = std::max(naive_err, std::fabs(naive[i] - want[i]));
          scale = std::max(scale, std::fabs(want[i]));
        }
      }
      for_each_gemm_family([&] {
        d_out.poison();
        d_copy_out.poison();
        moe_grouped_gemm(copy, stream);
        moe_grouped_gemm(gathered, stream);
        sync(stream, "moe_grouped_gemm on permuted_x and with a_rows = permuted_token");
        const auto got = d_out.download<uint16_t>(size_t(capacity) * n_out);
        expect_same_bits(got, d_copy_out.download<uint16_t>(size_t(capacity) * n_out), n_out,
                         "a_rows = permuted_token against the GEMM on permuted_x");
        int64_t past_written = 0, padding_nonzero = 0;
        for (int64_t i = used * n_out; i < capacity * n_out; ++i) past_written += got[size_t(i)] != kNaN16;
        EXPECT_EQ(past_written, 0) << "rows past expert_offsets[E] written";
        for (int64_t r = 0; r < used; ++r) {
          if (perm.permuted_token[size_t(r)] >= 0) continue;
          for (int j = 0; j < n_out; ++j) padding_nonzero += from_bits(got[size_t(r * n_out + j)], dtype) != 0.f;
        }
        EXPECT_EQ(padding_nonzero, 0) << "elements of the " << padding << " padding rows (permuted_token -1) not 0";
        if (!sw) {
          int64_t wrong = 0;
          for (int64_t i = 0; i < used * n_out; ++i) wrong += got[size_t(i)] != to_bits(float(want[size_t(i)]), dtype);
          EXPECT_EQ(wrong, 0) << "of " << used * n_out << " elements differ from the exact sums rounded";
        } else {
          std::vector<float> g(want.size());
          for (size_t i = 0; i < want.size(); ++i) g[i] = output_value(got[i], dtype);
          expect_within_rule(g, want, naive_err, 0x1p-16 * scale + 1e-7, "out");
        }
      });
    }
  }
}

// The gathered call captured in a CUDA graph and replayed after x and a_rows got new contents
// (same offsets): bitwise what an eager call gives on those contents (a_rows is read when the
// graph runs, not when it is captured).
TEST(GpuMoeGemm, GatheredGraphReplayEqualsEager) {
  TESSERA_REQUIRE_GPU();
  uint32_t seed = 18000;
  std::vector<GemmCase> cases = {gemm_case(64, 200, 272, Layout::kPermuteAlign1, 6, MoeActivation::kSwiGLU),
                                 gemm_case(128, 1032, 136, Layout::kDecode, 2, MoeActivation::kNone)};
  cases[0].gather_tokens = 300;
  cases[0].tail = 9;
  cases[1].gather_tokens = 100;
  for_each_gemm_family([&] {
    for (const GemmCase& c : cases) {
      for (DType dtype : {DType::kBF16, DType::kFP16}) {
        SCOPED_TRACE(describe(c, dtype));
        GemmProblem p(c, dtype, seed++);
        Stream stream;
        p.check(p.run_gathered(stream));
        cudaGraph_t graph;
        CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
        moe_grouped_gemm(p.gathered_args(), stream);
        CUDA_OK(cudaStreamEndCapture(stream, &graph));
        cudaGraphExec_t exec;
        CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
        p.new_a();  // new x, new a_rows
        const auto eager = p.run_gathered(stream);
        p.check(eager);
        p.poison_out();
        CUDA_OK(cudaGraphLaunch(exec, stream));
        CUDA_OK(cudaStreamSynchronize(stream));
        EXPECT_TRUE(p.download() == eager) << "graph replay differs from the eager run on the new x and a_rows";
        cudaGraphExecDestroy(exec);
        cudaGraphDestroy(graph);
      }
    }
  });
}

// a_rows' rules with real device buffers (tests/cpu/test_bad_input.cpp has the full table): a
// valid gathered call whose x has fewer rows than out runs; refused calls name the argument and
// write nothing.
TEST(GpuMoeGemm, GatheredArgumentsAreValidated) {
  TESSERA_REQUIRE_GPU();
  const int rows = 64, tokens = 24, k = 72, n = 136, experts = 8;
  DeviceBuffer x(size_t(tokens) * k * 2), w(size_t(experts) * n * k * 2), off(size_t(experts + 1) * 4);
  DeviceBuffer out(size_t(rows) * n * 2), idx(size_t(rows) * 2 * 4);
  off.upload(std::vector<int32_t>(size_t(experts) + 1, 0));
  idx.upload(std::vector<int32_t>(size_t(rows) * 2, 0));
  std::vector<int32_t> host_rows(size_t(rows), 0);
  auto args = [&] {
    MoeGroupedGemmArgs g;
    g.a = TensorView::contiguous(x.get(), DType::kBF16, {tokens, k});
    g.weights = TensorView::contiguous(w.get(), DType::kBF16, {experts, n, k});
    g.expert_offsets = TensorView::contiguous(off.get(), DType::kInt32, {experts + 1});
    g.out = TensorView::contiguous(out.get(), DType::kBF16, {rows, n});
    g.a_rows = TensorView::contiguous(idx.get(), DType::kInt32, {rows});
    return g;
  };
  auto call = [](const MoeGroupedGemmArgs& g) { return [g] { moe_grouped_gemm(g, nullptr); }; };
  moe_grouped_gemm(args(), nullptr);  // the valid problem runs (every segment empty)
  CUDA_OK(cudaDeviceSynchronize());
  out.poison();
  MoeGroupedGemmArgs g = args();
  g.a_rows = TensorView::contiguous(idx.get(), DType::kFP32, {rows});
  expect_arg_error("moe_grouped_gemm", call(g), {"a_rows"});
  g = args();
  g.a_rows = TensorView::contiguous(idx.get(), DType::kInt32, {rows, 1});
  expect_arg_error("moe_grouped_gemm", call(g), {"a_rows"});
  g = args();
  g.a_rows = TensorView::strided(idx.get(), DType::kInt32, {rows}, {2});
  expect_arg_error("moe_grouped_gemm", call(g), {"a_rows"});
  g = args();
  g.a_rows = TensorView::contiguous(host_rows.data(), DType::kInt32, {rows}, Device::kCPU);  // read on the device
  expect_arg_error("moe_grouped_gemm", call(g), {"a_rows"});
  g = args();
  g.a_rows = TensorView::contiguous(idx.get(), DType::kInt32, {rows - 1});  // not out's rows
  expect_arg_error("moe_grouped_gemm", call(g), {"out"});
  g = args();
  g.a_rows = TensorView::contiguous(out.get(), DType::kInt32, {rows});  // over out
  expect_arg_error("moe_grouped_gemm", call(g), {"out"});
  const auto bits = out.download<uint16_t>(size_t(rows) * n);
  EXPECT_EQ(std::count(bits.begin(), bits.end(), kNaN16), int64_t(bits.size())) << "a refused call wrote";
}

// ---- Combine -----------------------------------------------------------------------------------
struct CombineCase {
  DType dtype = DType::kBF16;
  int tokens = 1, top_k = 1, hidden = 64, experts = 8, align = 1;
  bool shared = false, dropped = false;
  int y_pad = 0, out_pad = 0;  // extra elements per row of expert_out / out (strided views)
};

std::string describe(const CombineCase& c) {
  return "T " + std::to_string(c.tokens) + " k " + std::to_string(c.top_k) + " hidden " + std::to_string(c.hidden) +
         " E " + std::to_string(c.experts) + " align " + std::to_string(c.align) + " " + dtype_name(c.dtype) +
         (c.shared ? " shared" : "") + (c.dropped ? " dropped" : "") +
         (c.y_pad || c.out_pad ? " strided +" + std::to_string(c.y_pad) + "/+" + std::to_string(c.out_pad) : "");
}

void run_combine(const CombineCase& c, uint32_t seed) {
  SCOPED_TRACE(describe(c));
  std::mt19937 rng(seed);
  const int64_t entries = int64_t(c.tokens) * c.top_k;
  std::vector<int32_t> ids(size_t(std::max<int64_t>(entries, 1)));
  std::uniform_int_distribution<int> pick(0, c.experts - 1);
  for (int64_t i = 0; i < entries; ++i) {
    ids[size_t(i)] = pick(rng);
    if (c.dropped && (i % 5 == 2 || i / c.top_k == c.tokens / 2)) ids[size_t(i)] = -1;  // one token loses every copy
  }
  const int64_t capacity = moe_permute_capacity(c.tokens, c.top_k, c.experts, c.align);
  const ref::Permutation perm = ref::permute(ids.data(), c.tokens, c.top_k, c.experts, c.align, capacity);
  const int64_t rows = std::max<int64_t>(capacity, 1), y_stride = c.hidden + c.y_pad, out_stride = c.hidden + c.out_pad;
  // expert_out: values on the rows some copy refers to, NaN on the others (padding, past the end)
  // and in the row padding: none of them may reach a result.
  std::vector<uint16_t> y_bits(size_t(rows * y_stride), kNaN16);
  std::vector<float> y(size_t(rows) * c.hidden, 0.f);
  std::uniform_real_distribution<float> val(-2.f, 2.f);
  for (int64_t r = 0; r < rows; ++r) {
    if (r >= int64_t(perm.permuted_token.size()) || perm.permuted_token[size_t(r)] < 0) continue;
    for (int j = 0; j < c.hidden; ++j) {
      y_bits[size_t(r * y_stride + j)] = to_bits(val(rng), c.dtype);
      y[size_t(r) * c.hidden + j] = from_bits(y_bits[size_t(r * y_stride + j)], c.dtype);
    }
  }
  std::vector<uint16_t> s_bits;
  const std::vector<float> shared = random_16bit(size_t(c.tokens) * c.hidden, c.dtype, rng, s_bits, -2.f, 2.f);
  std::vector<float> weights = random_floats(size_t(std::max<int64_t>(entries, 1)), rng, 0.f, 1.f);
  if (entries > 3) weights[3] = 0.f;  // a zero weight on a real copy

  std::vector<double> want, naive;
  const float* shared_ptr = c.shared ? shared.data() : nullptr;
  ref::combine(y.data(), rows, c.hidden, perm.inverse.data(), weights.data(), c.tokens, c.top_k, shared_ptr, want);
  ref::combine_naive_lowp(y.data(), rows, c.hidden, perm.inverse.data(), weights.data(), c.tokens, c.top_k, shared_ptr,
                          mantissa_bits(c.dtype), naive);

  DeviceBuffer d_y(y_bits.size() * 2), d_inv(ids.size() * 4), d_w(weights.size() * 4);
  DeviceBuffer d_s(std::max<size_t>(s_bits.size() * 2, 16)), d_out(std::max<size_t>(size_t(c.tokens * out_stride) * 2, 16));
  d_y.upload(y_bits);
  d_inv.upload(perm.inverse);
  d_w.upload(weights);
  d_s.upload(s_bits);
  MoeCombineArgs a;
  a.expert_out = TensorView::strided(d_y.get(), c.dtype, {rows, c.hidden}, {y_stride, 1});
  a.inverse = TensorView::contiguous(d_inv.get(), DType::kInt32, {c.tokens, c.top_k});
  a.topk_weights = TensorView::contiguous(d_w.get(), DType::kFP32, {c.tokens, c.top_k});
  if (c.shared) a.shared_out = TensorView::contiguous(d_s.get(), c.dtype, {c.tokens, c.hidden});
  a.out = TensorView::strided(d_out.get(), c.dtype, {c.tokens, c.hidden}, {out_stride, 1});
  auto run = [&](cudaStream_t stream) {
    d_out.poison();
    moe_combine(a, stream);
    sync(stream, "moe_combine");
    return d_out.download<uint16_t>(size_t(c.tokens * out_stride));
  };
  const auto bits = run(nullptr);
  std::vector<float> got(want.size());
  int64_t padding_written = 0;
  double naive_err = 0, scale = 0;
  for (int64_t t = 0; t < c.tokens; ++t) {
    for (int64_t j = 0; j < out_stride; ++j) {
      const uint16_t b = bits[size_t(t * out_stride + j)];
      if (j >= c.hidden) {
        padding_written += b != kNaN16;
        continue;
      }
      const size_t e = size_t(t * c.hidden + j);
      got[e] = output_value(b, c.dtype);
      naive_err = std::max(naive_err, std::fabs(naive[e] - want[e]));
      scale = std::max(scale, std::fabs(want[e]));
    }
  }
  EXPECT_EQ(padding_written, 0) << "out's row padding written";
  expect_within_rule(got, want, naive_err, 0x1p-20 * scale + 1e-6, "out");
  // Deterministic, and the same replayed from a CUDA graph.
  EXPECT_TRUE(run(nullptr) == bits) << "a second run differs";
  Stream stream;
  cudaGraph_t graph;
  CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  moe_combine(a, stream);
  CUDA_OK(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec;
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  d_out.poison();
  CUDA_OK(cudaGraphLaunch(exec, stream));
  CUDA_OK(cudaStreamSynchronize(stream));
  EXPECT_TRUE(d_out.download<uint16_t>(size_t(c.tokens * out_stride)) == bits) << "graph replay differs";
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
}

TEST(GpuMoeCombine, AgainstTheReference) {
  TESSERA_REQUIRE_GPU();
  uint32_t seed = 9000;
  int r = 0;
  for (int top_k : {1, 2, 8}) {
    for (int tokens : {1, 3, 127, 1024}) {
      for (bool shared : {false, true}) {
        CombineCase c;
        c.dtype = r % 2 ? DType::kFP16 : DType::kBF16;
        c.tokens = tokens;
        c.top_k = top_k;
        c.experts = top_k == 8 ? 64 : 8;
        c.hidden = r % 3 == 0 ? 136 : r % 3 == 1 ? 1032 : 8;
        c.align = r % 4 == 3 ? 128 : r % 4 == 1 ? 16 : 1;
        c.shared = shared;
        c.dropped = r % 3 != 2;
        if (r % 5 == 4) {
          c.y_pad = 16;
          c.out_pad = 8;
        }
        run_combine(c, seed++);
        ++r;
      }
    }
  }
}

// inverse is device data the host cannot check: entries outside [0, rows of expert_out) (past
// the end, INT32_MAX, any negative) are skipped like a dropped copy (-1), never read. Small
// integers and power-of-two weights: the sums are exact.
TEST(GpuMoeCombine, InverseOutsideExpertOutIsSkipped) {
  TESSERA_REQUIRE_GPU();
#if TESSERA_DEVICE_CHECKS
  GTEST_SKIP() << "the kernels were built with TESSERA_DEVICE_CHECKS: broken device data traps instead "
                  "(GpuDeviceChecks.BrokenDeviceDataTraps)";
#endif
  const int tokens = 4, top_k = 4, hidden = 64, rows = 8;
  const std::vector<int32_t> inverse = {0, 8, 1, -1,            //
                                        INT32_MAX, 2, -7, 3,    //
                                        1000000, 8, INT32_MIN, 9,  //
                                        7, 6, 5, 4};
  std::vector<float> weights(size_t(tokens) * top_k);
  for (size_t i = 0; i < weights.size(); ++i) weights[i] = 0.25f * float(1 + i % 4);
  std::vector<uint16_t> y_bits(size_t(rows) * hidden);
  for (int r = 0; r < rows; ++r)
    for (int j = 0; j < hidden; ++j) y_bits[size_t(r * hidden + j)] = to_bits(float((r * 7 + j) % 9 - 4), DType::kBF16);
  DeviceBuffer d_y(y_bits.size() * 2), d_inv(inverse.size() * 4), d_w(weights.size() * 4), d_out(size_t(tokens) * hidden * 2);
  d_y.upload(y_bits);
  d_inv.upload(inverse);
  d_w.upload(weights);
  d_out.poison();
  MoeCombineArgs a;
  a.expert_out = TensorView::contiguous(d_y.get(), DType::kBF16, {rows, hidden});
  a.inverse = TensorView::contiguous(d_inv.get(), DType::kInt32, {tokens, top_k});
  a.topk_weights = TensorView::contiguous(d_w.get(), DType::kFP32, {tokens, top_k});
  a.out = TensorView::contiguous(d_out.get(), DType::kBF16, {tokens, hidden});
  moe_combine(a, nullptr);
  sync(nullptr, "moe_combine");
  const auto bits = d_out.download<uint16_t>(size_t(tokens) * hidden);
  int64_t wrong = 0;
  for (int t = 0; t < tokens; ++t) {
    for (int j = 0; j < hidden; ++j) {
      double want = 0;
      for (int q = 0; q < top_k; ++q) {
        const int32_t r = inverse[size_t(t * top_k + q)];
        if (r >= 0 && r < rows) want += double(weights[size_t(t * top_k + q)]) * from_bits(y_bits[size_t(r * hidden + j)], DType::kBF16);
      }
      wrong += double(output_value(bits[size_t(t * hidden + j)], DType::kBF16)) != want;
    }
  }
  EXPECT_EQ(wrong, 0) << "elements differing from the sum over the in-range copies";
}

// With the device checks compiled in (TESSERA_DEVICE_CHECKS, a Debug build), a broken device
// array is reported instead of made safe: the kernel traps. Each case runs in a child process (a
// trap ends the CUDA context); the child prints the CUDA error to stderr and exits 3.
TEST(GpuDeviceChecks, BrokenDeviceDataTraps) {
  TESSERA_REQUIRE_GPU();
#if !TESSERA_DEVICE_CHECKS
  GTEST_SKIP() << "the kernels were built without TESSERA_DEVICE_CHECKS (release build)";
#else
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  auto expect_trap = [](auto&& launch) {
    EXPECT_EXIT(
        {
          launch();
          const cudaError_t err = cudaDeviceSynchronize();
          std::fprintf(stderr, "cuda: %s\n", cudaGetErrorName(err));
          std::exit(err == cudaSuccess ? 0 : 3);
        },
        ::testing::ExitedWithCode(3), "cuda: cudaError");
  };
  // moe_combine: an inverse entry past expert_out's rows.
  expect_trap([] {
    const int tokens = 2, top_k = 2, hidden = 64, rows = 4;
    DeviceBuffer y(size_t(rows) * hidden * 2), inv(size_t(tokens) * top_k * 4), w(size_t(tokens) * top_k * 4),
        out(size_t(tokens) * hidden * 2);
    y.upload(std::vector<uint16_t>(size_t(rows) * hidden, 0x3F80));
    inv.upload(std::vector<int32_t>{0, 1, 2, 7});
    w.upload(std::vector<float>(size_t(tokens) * top_k, 1.f));
    MoeCombineArgs a;
    a.expert_out = TensorView::contiguous(y.get(), DType::kBF16, {rows, hidden});
    a.inverse = TensorView::contiguous(inv.get(), DType::kInt32, {tokens, top_k});
    a.topk_weights = TensorView::contiguous(w.get(), DType::kFP32, {tokens, top_k});
    a.out = TensorView::contiguous(out.get(), DType::kBF16, {tokens, hidden});
    moe_combine(a, nullptr);
    cudaDeviceSynchronize();  // inside the child: the buffers outlive the kernel
  });
  // moe_grouped_gemm: expert offsets that go down.
  expect_trap([] {
    const int experts = 4, k = 64, n = 64, rows = 64;
    DeviceBuffer a(size_t(rows) * k * 2), w(size_t(experts) * n * k * 2), off(size_t(experts + 1) * 4),
        out(size_t(rows) * n * 2);
    off.upload(std::vector<int32_t>{0, 32, 16, 48, 64});
    MoeGroupedGemmArgs g;
    g.a = TensorView::contiguous(a.get(), DType::kBF16, {rows, k});
    g.weights = TensorView::contiguous(w.get(), DType::kBF16, {experts, n, k});
    g.expert_offsets = TensorView::contiguous(off.get(), DType::kInt32, {experts + 1});
    g.out = TensorView::contiguous(out.get(), DType::kBF16, {rows, n});
    moe_grouped_gemm(g, nullptr);
    cudaDeviceSynchronize();
  });
#endif
}

TEST(GpuMoeCombine, ArgumentsAreValidated) {
  TESSERA_REQUIRE_GPU();
  const int tokens = 16, top_k = 2, rows = 40, hidden = 64;
  DeviceBuffer y(size_t(rows) * hidden * 2), inv(size_t(tokens) * top_k * 4), w(size_t(tokens) * top_k * 4);
  DeviceBuffer s(size_t(tokens) * hidden * 2), out(size_t(tokens) * hidden * 2);
  auto args = [&] {
    MoeCombineArgs a;
    a.expert_out = TensorView::contiguous(y.get(), DType::kBF16, {rows, hidden});
    a.inverse = TensorView::contiguous(inv.get(), DType::kInt32, {tokens, top_k});
    a.topk_weights = TensorView::contiguous(w.get(), DType::kFP32, {tokens, top_k});
    a.shared_out = TensorView::contiguous(s.get(), DType::kBF16, {tokens, hidden});
    a.out = TensorView::contiguous(out.get(), DType::kBF16, {tokens, hidden});
    return a;
  };
  auto call = [](const MoeCombineArgs& a) { return [a] { moe_combine(a, nullptr); }; };
  out.poison();
  MoeCombineArgs a = args();
  a.out = TensorView::contiguous(out.get(), DType::kBF16, {tokens - 1, hidden});
  expect_arg_error("moe_combine", call(a), {"out"});
  a = args();
  a.out = TensorView::contiguous(out.get(), DType::kFP16, {tokens, hidden});
  expect_arg_error("moe_combine", call(a), {"out"});
  a = args();
  a.inverse = TensorView::contiguous(inv.get(), DType::kFP32, {tokens, top_k});
  expect_arg_error("moe_combine", call(a), {"inverse"});
  a = args();
  a.topk_weights = TensorView::contiguous(w.get(), DType::kFP32, {tokens, top_k + 1});
  expect_arg_error("moe_combine", call(a), {"topk_weights", "inverse"});
  a = args();
  a.shared_out = TensorView::contiguous(s.get(), DType::kBF16, {tokens, hidden - 8});
  expect_arg_error("moe_combine", call(a), {"shared_out"});
  a = args();
  a.out = TensorView::contiguous(y.get(), DType::kBF16, {tokens, hidden});  // over expert_out
  expect_arg_error("moe_combine", call(a), {"out", "expert_out"});
  const auto bits = out.download<uint16_t>(size_t(tokens) * hidden);
  EXPECT_EQ(std::count(bits.begin(), bits.end(), kNaN16), int64_t(bits.size())) << "a refused call wrote";
}

// ---- fused_moe ---------------------------------------------------------------------------------
struct FusedCase {
  DType dtype = DType::kBF16;
  int tokens = 1, hidden = 64, inter = 32, experts = 8, top_k = 2;
  bool logits = true;            // route from router_logits; else the caller's topk_ids / topk_weights
  bool receive_routing = false;  // with logits: pass topk_ids / topk_weights to receive the routing
  MoeScore score = MoeScore::kSoftmax;
  bool renormalize = false, bias = false;
  int num_groups = 1, topk_groups = 1;
  float routed_scaling = 1.f;
  int shared_inter = 0;
  bool dropped = false;  // given routing with some copies -1 (an expert-parallel rank)
};

std::string describe(const FusedCase& c) {
  return "T " + std::to_string(c.tokens) + " hidden " + std::to_string(c.hidden) + " inter " +
         std::to_string(c.inter) + " E " + std::to_string(c.experts) + " k " + std::to_string(c.top_k) + " " +
         dtype_name(c.dtype) +
         (c.logits ? std::string(c.score == MoeScore::kSigmoid ? " sigmoid" : " softmax") +
                         (c.renormalize ? " renorm" : "") + (c.bias ? " bias" : "") + " groups " +
                         std::to_string(c.num_groups) + "/" + std::to_string(c.topk_groups)
                   : std::string(" given routing")) +
         (c.shared_inter ? " shared " + std::to_string(c.shared_inter) : "") + (c.dropped ? " dropped" : "");
}

// Host copies in the kernels' layouts, the fp64 reference and the naive 16-bit layer, device buffers.
class FusedProblem {
 public:
  FusedProblem(const FusedCase& c, uint32_t seed) : c_(c), rng_(seed) {
    const int T = c.tokens, H = c.hidden, I = c.inter, E = c.experts, K = c.top_k;
    x_ = random_16bit(size_t(T) * H, c.dtype, rng_, x_bits_);
    const float s1 = 2.f / std::sqrt(float(H)), s2 = 2.f / std::sqrt(float(I));
    w1_ = random_16bit(size_t(E) * 2 * I * H, c.dtype, rng_, w1_bits_, -s1, s1);
    w2_ = random_16bit(size_t(E) * H * I, c.dtype, rng_, w2_bits_, -s2, s2);
    if (c.shared_inter) {
      const float s3 = 2.f / std::sqrt(float(c.shared_inter));
      sw1_ = random_16bit(size_t(2) * c.shared_inter * H, c.dtype, rng_, sw1_bits_, -s1, s1);
      sw2_ = random_16bit(size_t(H) * c.shared_inter, c.dtype, rng_, sw2_bits_, -s3, s3);
    }
    // Routing: logits on a shuffled grid (distinct, far enough apart that fp32 and fp64 rank them
    // alike: the ids must match exactly), or the caller's distinct ids with random weights.
    std::vector<int> order(static_cast<size_t>(E));
    logits_.resize(size_t(T) * E);
    for (int t = 0; t < T; ++t) {
      std::iota(order.begin(), order.end(), 0);
      std::shuffle(order.begin(), order.end(), rng_);
      for (int e = 0; e < E; ++e) logits_[size_t(t) * E + e] = -3.f + 6.f * (float(order[size_t(e)]) + 1.f / 3.f) / float(E);
      if (!c.logits) {
        for (int k = 0; k < K; ++k) {
          const bool drop = c.dropped && ((t * K + k) % 5 == 1 || t == T / 2);
          given_ids_.push_back(drop ? -1 : order[size_t(k)]);
          given_weights_.push_back(std::uniform_real_distribution<float>(0.05f, 1.f)(rng_));
        }
      }
    }
    bias_.assign(size_t(E), 0.f);
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), rng_);
    if (c.bias) {
      for (int e = 0; e < E; ++e) bias_[size_t(e)] = 0.25f * float(order[size_t(e)] % 4);
    }
    if (c.logits) {
      ref::RouterParams rp;
      rp.num_experts = E;
      rp.top_k = K;
      rp.score = c.score == MoeScore::kSigmoid ? ref::RouterScore::kSigmoid : ref::RouterScore::kSoftmax;
      rp.renormalize = c.renormalize;
      rp.num_groups = c.num_groups;
      rp.topk_groups = c.topk_groups;
      if (c.bias) rp.selection_bias.assign(bias_.begin(), bias_.end());
      rp.routed_scaling = c.routed_scaling;
      routing_ = ref::route(logits_.data(), T, rp);
    } else {
      routing_.expert = given_ids_;
      routing_.weight.assign(given_weights_.begin(), given_weights_.end());
    }

    d_x_ = device_buffer(x_bits_.size() * 2);
    d_w1_ = device_buffer(w1_bits_.size() * 2);
    d_w2_ = device_buffer(w2_bits_.size() * 2);
    d_logits_ = device_buffer(logits_.size() * 4);
    d_bias_ = device_buffer(bias_.size() * 4);
    d_ids_ = device_buffer(size_t(T) * K * 4);
    d_weights_ = device_buffer(size_t(T) * K * 4);
    d_sw1_ = device_buffer(sw1_bits_.size() * 2);
    d_sw2_ = device_buffer(sw2_bits_.size() * 2);
    d_out_ = device_buffer(size_t(T) * H * 2);
    ws_bytes_ = fused_moe_workspace_bytes(T, H, I, E, K, c.shared_inter);
    d_ws_ = device_buffer(ws_bytes_);
    d_x_->upload(x_bits_);
    d_w1_->upload(w1_bits_);
    d_w2_->upload(w2_bits_);
    d_logits_->upload(logits_);
    d_bias_->upload(bias_);
    d_sw1_->upload(sw1_bits_);
    d_sw2_->upload(sw2_bits_);
    if (!c.logits) {
      d_ids_->upload(given_ids_);
      d_weights_->upload(given_weights_);
    }
  }

  FusedMoeArgs args() const {
    const int64_t T = c_.tokens, H = c_.hidden, I = c_.inter, E = c_.experts, K = c_.top_k;
    FusedMoeArgs a;
    a.x = TensorView::contiguous(d_x_->get(), c_.dtype, {T, H});
    a.w1 = TensorView::contiguous(d_w1_->get(), c_.dtype, {E, 2 * I, H});
    a.w2 = TensorView::contiguous(d_w2_->get(), c_.dtype, {E, H, I});
    a.top_k = c_.top_k;
    if (c_.logits) {
      a.router_logits = TensorView::contiguous(d_logits_->get(), DType::kFP32, {T, E});
      a.score = c_.score;
      a.renormalize = c_.renormalize;
      a.num_groups = c_.num_groups;
      a.topk_groups = c_.topk_groups;
      a.routed_scaling = c_.routed_scaling;
      if (c_.bias) a.selection_bias = TensorView::contiguous(d_bias_->get(), DType::kFP32, {E});
    }
    if (!c_.logits || c_.receive_routing) {
      a.topk_ids = TensorView::contiguous(d_ids_->get(), DType::kInt32, {T, K});
      a.topk_weights = TensorView::contiguous(d_weights_->get(), DType::kFP32, {T, K});
    }
    if (c_.shared_inter) {
      a.shared_w1 = TensorView::contiguous(d_sw1_->get(), c_.dtype, {2 * int64_t(c_.shared_inter), H});
      a.shared_w2 = TensorView::contiguous(d_sw2_->get(), c_.dtype, {H, int64_t(c_.shared_inter)});
    }
    a.out = TensorView::contiguous(d_out_->get(), c_.dtype, {T, H});
    a.workspace = d_ws_->get();
    a.workspace_size = ws_bytes_;
    return a;
  }

  // Poisons out and the workspace (nothing may rely on zeroed scratch), and the routing outputs.
  void poison() {
    d_out_->poison();
    d_ws_->poison();
    if (c_.logits && c_.receive_routing) {
      d_ids_->poison();
      d_weights_->poison();
    }
  }
  std::vector<uint16_t> run(cudaStream_t stream) {
    poison();
    fused_moe(args(), stream);
    sync(stream, "fused_moe");
    return download();
  }
  std::vector<uint16_t> download() const { return d_out_->download<uint16_t>(size_t(c_.tokens) * c_.hidden); }

  void new_x() {
    x_ = random_16bit(x_.size(), c_.dtype, rng_, x_bits_);
    d_x_->upload(x_bits_);
  }

  void check(const std::vector<uint16_t>& bits) const {
    const int T = c_.tokens, H = c_.hidden, I = c_.inter, E = c_.experts, K = c_.top_k, S = c_.shared_inter;
    // ref::moe_layer's layouts: w_gate_up [E, H, 2I] (w1 transposed), w_down [E, I, H] (w2 transposed).
    std::vector<float> gate_up(w1_.size()), down(w2_.size()), s_gate_up(sw1_.size()), s_down(sw2_.size());
    for (int e = 0; e < E; ++e) {
      for (int j = 0; j < 2 * I; ++j) {
        for (int i = 0; i < H; ++i) {
          gate_up[(size_t(e) * H + i) * 2 * I + j] = w1_[(size_t(e) * 2 * I + j) * H + i];
        }
      }
      for (int c = 0; c < H; ++c) {
        for (int j = 0; j < I; ++j) down[(size_t(e) * I + j) * H + c] = w2_[(size_t(e) * H + c) * I + j];
      }
    }
    for (int j = 0; j < 2 * S; ++j) {
      for (int i = 0; i < H; ++i) s_gate_up[size_t(i) * 2 * S + j] = sw1_[size_t(j) * H + i];
    }
    for (int c = 0; c < H; ++c) {
      for (int j = 0; j < S; ++j) s_down[size_t(j) * H + c] = sw2_[size_t(c) * S + j];
    }
    // fp64: dropped copies become weight 0 on expert 0 (moe_layer wants real ids); the shared
    // expert added with weight 1.
    ref::Routing exact = routing_;
    for (size_t i = 0; i < exact.expert.size(); ++i) {
      if (exact.expert[i] < 0) exact.expert[i] = 0, exact.weight[i] = 0.0;
    }
    std::vector<double> want, naive;
    ref::moe_layer(x_.data(), T, H, I, gate_up.data(), down.data(), exact, K, want);
    if (S > 0) {
      std::vector<double> s(static_cast<size_t>(H));
      for (int t = 0; t < T; ++t) {
        ref::swiglu_expert(x_.data() + size_t(t) * H, s_gate_up.data(), s_down.data(), H, S, s.data());
        for (int c = 0; c < H; ++c) want[size_t(t) * H + c] += s[size_t(c)];
      }
    }
    const ref::SharedExpert shared{S ? s_gate_up.data() : nullptr, S ? s_down.data() : nullptr, S};
    ref::moe_layer_naive_lowp(x_.data(), T, H, I, gate_up.data(), down.data(), routing_, K, shared,
                              mantissa_bits(c_.dtype), naive);
    std::vector<float> got(want.size());
    double naive_err = 0, scale = 0;
    for (size_t i = 0; i < want.size(); ++i) {
      got[i] = output_value(bits[i], c_.dtype);
      naive_err = std::max(naive_err, std::fabs(naive[i] - want[i]));
      scale = std::max(scale, std::fabs(want[i]));
    }
    int64_t unwritten = 0;
    for (uint16_t b : bits) unwritten += b == kNaN16;
    EXPECT_EQ(unwritten, 0) << "out elements never written (still poisoned)";
    expect_within_rule(got, want, naive_err, std::ldexp(scale, -(mantissa_bits(c_.dtype) + 2)) + 1e-6, "out");

    if (c_.logits && c_.receive_routing) {  // the routing handed back equals the reference's
      const auto ids = d_ids_->download<int32_t>(size_t(T) * K);
      const auto w = d_weights_->download<float>(size_t(T) * K);
      int bad = 0;
      for (size_t i = 0; i < ids.size() && bad < 5; ++i) {
        if (ids[i] != routing_.expert[i] ||
            !(std::fabs(double(w[i]) - routing_.weight[i]) <= 2e-6 + 1e-5 * std::fabs(routing_.weight[i]))) {
          ADD_FAILURE() << "token " << i / size_t(K) << " choice " << i % size_t(K) << ": expert " << ids[i] << " weight "
                        << w[i] << ", want " << routing_.expert[i] << " " << routing_.weight[i];
          ++bad;
        }
      }
    }
  }

 private:
  FusedCase c_;
  std::mt19937 rng_;
  std::vector<uint16_t> x_bits_, w1_bits_, w2_bits_, sw1_bits_, sw2_bits_;
  std::vector<float> x_, w1_, w2_, sw1_, sw2_, logits_, bias_, given_weights_;
  std::vector<int32_t> given_ids_;
  ref::Routing routing_;
  std::size_t ws_bytes_ = 0;
  std::unique_ptr<DeviceBuffer> d_x_, d_w1_, d_w2_, d_logits_, d_bias_, d_ids_, d_weights_, d_sw1_, d_sw2_, d_out_, d_ws_;
};

// Both ways of feeding x's rows to the first GEMM (gathered in its loads, or copied by the
// permutation: dispatch::fused_moe_rows picks by the layer's inter size), forced in turn; the
// workspace is sized under each.
void run_fused(const FusedCase& c, uint32_t seed) {
  SCOPED_TRACE(describe(c));
  struct Lift {
    ~Lift() { dispatch::force_fused_moe_rows(nullptr); }
  } lift;
  for (const dispatch::FusedMoeRows rows : {dispatch::FusedMoeRows::kGather, dispatch::FusedMoeRows::kCopy}) {
    SCOPED_TRACE(rows == dispatch::FusedMoeRows::kGather ? "x's rows gathered" : "x's rows copied");
    dispatch::force_fused_moe_rows(&rows);
    FusedProblem p(c, seed);
    for_each_gemm_family([&] { p.check(p.run(nullptr)); });
  }
}

// Mixtral-style: softmax top-2 of 8 experts from router_logits, renormalised.
TEST(GpuFusedMoe, RouterLogitsSoftmaxTop2) {
  TESSERA_REQUIRE_GPU();
  uint32_t seed = 10000;
  int r = 0;
  for (int tokens : {1, 3, 127, 1024}) {
    FusedCase c;
    c.dtype = r == 1 || r == 2 ? DType::kFP16 : DType::kBF16;
    c.tokens = tokens;
    c.hidden = 264;
    c.inter = 136;
    c.experts = 8;
    c.top_k = 2;
    c.renormalize = true;
    c.receive_routing = r % 2 == 0;
    run_fused(c, seed++);
    ++r;
  }
}

// The caller's routing (no logits: grouped routing does not apply), 64 experts, top-8.
TEST(GpuFusedMoe, GivenRoutingE64Top8) {
  TESSERA_REQUIRE_GPU();
  uint32_t seed = 11000;
  int r = 0;
  for (int tokens : {1, 3, 127, 1024}) {
    FusedCase c;
    c.dtype = r == 1 || r == 3 ? DType::kFP16 : DType::kBF16;
    c.tokens = tokens;
    c.hidden = 136;
    c.inter = 72;
    c.experts = 64;
    c.top_k = 8;
    c.logits = false;
    run_fused(c, seed++);
    ++r;
  }
}

// The remaining grid corners: top-1 over 128 experts at 32768 tokens (long segments and
// the many-rows tile shape), top-8 over 256 experts (decode-sized segments, the swapped shape).
TEST(GpuFusedMoe, Top1ManyTokensAndTop8ManyExperts) {
  TESSERA_REQUIRE_GPU();
  uint32_t seed = 11500;
  for (int variant = 0; variant < 2; ++variant) {
    FusedCase c;
    c.tokens = variant == 0 ? 32768 : 1024;
    c.hidden = 64;
    c.inter = 32;
    c.experts = variant == 0 ? 128 : 256;
    c.top_k = variant == 0 ? 1 : 8;
    c.logits = variant == 0;
    c.renormalize = variant == 0;
    run_fused(c, seed++);
  }
}

// DeepSeek-V3-style routing inside the layer: sigmoid scores, a selection bias, 8 groups keep 4,
// renormalised and scaled 2.5, with a shared expert.
TEST(GpuFusedMoe, GroupedSigmoidRoutingWithSharedExpert) {
  TESSERA_REQUIRE_GPU();
  FusedCase c;
  c.tokens = 127;
  c.hidden = 136;
  c.inter = 72;
  c.experts = 64;
  c.top_k = 8;
  c.score = MoeScore::kSigmoid;
  c.bias = true;
  c.num_groups = 8;
  c.topk_groups = 4;
  c.renormalize = true;
  c.routed_scaling = 2.5f;
  c.shared_inter = 144;
  c.receive_routing = true;
  run_fused(c, 12000);
  c.dtype = DType::kFP16;
  c.tokens = 3;
  run_fused(c, 12001);
}

TEST(GpuFusedMoe, SharedExpert) {
  TESSERA_REQUIRE_GPU();
  uint32_t seed = 13000;
  for (int tokens : {1, 127}) {
    FusedCase c;
    c.dtype = tokens == 1 ? DType::kFP16 : DType::kBF16;
    c.tokens = tokens;
    c.hidden = 264;
    c.inter = 136;
    c.shared_inter = 264;
    c.renormalize = true;
    run_fused(c, seed++);
  }
  FusedCase g;  // with the caller's routing
  g.tokens = 3;
  g.hidden = 136;
  g.inter = 72;
  g.experts = 64;
  g.top_k = 8;
  g.logits = false;
  g.shared_inter = 72;
  run_fused(g, seed++);
}

// An expert-parallel rank passes -1 for the experts it does not hold: those copies add nothing; a
// token with every copy dropped gets 0 (or just the shared expert). Assumes fused_moe drops ids
// outside [0, num_experts) the way moe_permute does.
TEST(GpuFusedMoe, DroppedCopiesContributeNothing) {
  TESSERA_REQUIRE_GPU();
  uint32_t seed = 14000;
  for (int shared : {0, 72}) {
    FusedCase c;
    c.tokens = 127;
    c.hidden = 136;
    c.inter = 72;
    c.experts = 64;
    c.top_k = 8;
    c.logits = false;
    c.dropped = true;
    c.shared_inter = shared;
    run_fused(c, seed++);
  }
}

// Repeat runs bitwise equal; a CUDA graph captured once and replayed after x got new contents
// equals the eager run on them.
TEST(GpuFusedMoe, DeterministicAndGraphReplay) {
  TESSERA_REQUIRE_GPU();
  uint32_t seed = 15000;
  for_each_gemm_family([&] {
    for (bool logits : {true, false}) {
      FusedCase c;
      c.tokens = 127;
      c.hidden = 136;
      c.inter = 72;
      c.experts = logits ? 8 : 64;
      c.top_k = logits ? 2 : 8;
      c.logits = logits;
      c.receive_routing = logits;
      c.shared_inter = logits ? 72 : 0;
      SCOPED_TRACE(describe(c));
      FusedProblem p(c, seed++);
      Stream stream;
      const auto first = p.run(stream);
      p.check(first);
      EXPECT_TRUE(p.run(stream) == first) << "a second run differs";
      cudaGraph_t graph;
      CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
      fused_moe(p.args(), stream);
      CUDA_OK(cudaStreamEndCapture(stream, &graph));
      cudaGraphExec_t exec;
      CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
      p.new_x();
      const auto eager = p.run(stream);
      p.poison();
      CUDA_OK(cudaGraphLaunch(exec, stream));
      CUDA_OK(cudaStreamSynchronize(stream));
      EXPECT_TRUE(p.download() == eager) << "graph replay differs from the eager run on the new x";
      cudaGraphExecDestroy(exec);
      cudaGraphDestroy(graph);
    }
  });
}

TEST(GpuFusedMoe, ArgumentsAreValidated) {
  TESSERA_REQUIRE_GPU();
  const int T = 16, H = 64, I = 32, E = 8, K = 2;
  DeviceBuffer x(size_t(T) * H * 2), w1(size_t(E) * 2 * I * H * 2), w2(size_t(E) * H * I * 2);
  DeviceBuffer logits(size_t(T) * E * 4), out(size_t(T) * H * 2);
  const size_t ws = fused_moe_workspace_bytes(T, H, I, E, K);
  DeviceBuffer work(std::max<size_t>(ws, 256));
  auto args = [&] {
    FusedMoeArgs a;
    a.x = TensorView::contiguous(x.get(), DType::kBF16, {T, H});
    a.w1 = TensorView::contiguous(w1.get(), DType::kBF16, {E, 2 * I, H});
    a.w2 = TensorView::contiguous(w2.get(), DType::kBF16, {E, H, I});
    a.router_logits = TensorView::contiguous(logits.get(), DType::kFP32, {T, E});
    a.top_k = K;
    a.out = TensorView::contiguous(out.get(), DType::kBF16, {T, H});
    a.workspace = work.get();
    a.workspace_size = ws;
    return a;
  };
  auto call = [](const FusedMoeArgs& a) { return [a] { fused_moe(a, nullptr); }; };
  out.poison();
  FusedMoeArgs a = args();
  a.workspace_size = ws - 1;
  expect_arg_error("fused_moe", call(a), {"workspace_size"});
  a = args();
  a.w2 = TensorView::contiguous(w2.get(), DType::kBF16, {E, H + 8, I / 2});
  expect_arg_error("fused_moe", call(a), {"w2"});
  a = args();
  a.x = TensorView::contiguous(x.get(), DType::kFP32, {T, H / 2});
  expect_arg_error("fused_moe", call(a), {"x"});
  a = args();
  a.router_logits = TensorView();  // no routing at all
  expect_arg_error("fused_moe", call(a), {"topk_ids", "router_logits"});
  a = args();
  a.shared_w1 = TensorView::contiguous(w1.get(), DType::kBF16, {2 * I, H});  // without shared_w2
  expect_arg_error("fused_moe", call(a), {"shared_w2", "shared_w1"});
  const auto bits = out.download<uint16_t>(size_t(T) * H);
  EXPECT_EQ(std::count(bits.begin(), bits.end(), kNaN16), int64_t(bits.size())) << "a refused call wrote";
}

}  // namespace
}  // namespace tessera::testing
