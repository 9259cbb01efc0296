// merge_state / merge_state_in_place / merge_states on the GPU against the fp64 reference, with
// the tolerance rule: at most 2x the error of the same merge done naively in fp32 and rounded to
// the output dtype, plus a floor.
#include <limits>

#include "gpu/gpu_test_util.h"
#include "reference/merge_ref.h"

namespace tessera::testing {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// n states of shape [rows, heads, head_dim] in `in` precision, stored stacked as
// [rows, n, heads, head_dim] with optional row padding.
struct States {
  int rows, n, heads, head_dim;
  DType in;
  std::vector<float> o;      // exact values, stacked layout without padding
  std::vector<float> s;      // [rows, n, heads]
  float& o_at(int r, int i, int h, int d) { return o[((size_t(r) * n + i) * heads + h) * head_dim + d]; }
  float& s_at(int r, int i, int h) { return s[(size_t(r) * n + i) * heads + h]; }
};

States make_states(int rows, int n, int heads, int head_dim, DType in, std::mt19937& rng) {
  States st{rows, n, heads, head_dim, in, {}, {}};
  st.o = random_floats(size_t(rows) * n * heads * head_dim, rng, -2.f, 2.f);
  for (auto& x : st.o) x = round_to(x, in);
  st.s = random_floats(size_t(rows) * n * heads, rng, -6.f, 6.f);
  // Special rows: some states at -inf, a whole row at -inf, one NaN LSE, one NaN in an o.
  if (rows >= 4) {
    for (int h = 0; h < heads; ++h) st.s_at(1, 0, h) = -INFINITY;
    for (int i = 0; i < n; ++i)
      for (int h = 0; h < heads; ++h) st.s_at(2, i, h) = -INFINITY;
    st.s_at(3, n - 1, 0) = NAN;
    st.o_at(0, 0, heads - 1, head_dim - 1) = NAN;
  }
  return st;
}

// fp64 reference, and the naive fp32 merge rounded to `out` (for the tolerance rule).
void reference(States& st, DType out, std::vector<double>& o_ref, std::vector<double>& s_ref,
               double& naive_o_err) {
  const int D = st.head_dim;
  o_ref.assign(size_t(st.rows) * st.heads * D, 0);
  s_ref.assign(size_t(st.rows) * st.heads, 0);
  naive_o_err = 0;
  std::vector<double> parts(size_t(st.n) * D), lse(st.n);
  for (int r = 0; r < st.rows; ++r) {
    for (int h = 0; h < st.heads; ++h) {
      for (int i = 0; i < st.n; ++i) {
        lse[i] = st.s_at(r, i, h);
        for (int d = 0; d < D; ++d) parts[size_t(i) * D + d] = st.o_at(r, i, h, d);
      }
      double* o = &o_ref[(size_t(r) * st.heads + h) * D];
      ref::merge_n(parts.data(), lse.data(), st.n, D, o, &s_ref[size_t(r) * st.heads + h]);
      // Naive fp32: max, weights, sum, divide, round to the output dtype.
      float m = -INFINITY;
      for (int i = 0; i < st.n; ++i) m = std::fmax(m, float(lse[i]));
      if (m == -INFINITY) continue;
      float sum = 0;
      std::vector<float> acc(D, 0.f);
      for (int i = 0; i < st.n; ++i) {
        if (lse[i] == -kInf) continue;
        const float w = std::exp(float(lse[i]) - m);
        sum += w;
        for (int d = 0; d < D; ++d) acc[d] += w * float(parts[size_t(i) * D + d]);
      }
      for (int d = 0; d < D; ++d) {
        const double e = std::fabs(double(round_to(acc[d] / sum, out)) - o[d]);
        if (std::isfinite(e)) naive_o_err = std::max(naive_o_err, e);
      }
    }
  }
}

std::vector<uint8_t> encode(const std::vector<float>& v, DType dtype) {
  std::vector<uint8_t> bytes(v.size() * dtype_size(dtype));
  for (size_t i = 0; i < v.size(); ++i) {
    if (dtype == DType::kFP32) {
      std::memcpy(&bytes[i * 4], &v[i], 4);
    } else {
      const uint16_t b = to_bits(v[i], dtype);
      std::memcpy(&bytes[i * 2], &b, 2);
    }
  }
  return bytes;
}

std::vector<float> decode(const std::vector<uint8_t>& bytes, DType dtype) {
  const size_t n = bytes.size() / dtype_size(dtype);
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) {
    if (dtype == DType::kFP32) {
      std::memcpy(&v[i], &bytes[i * 4], 4);
    } else {
      uint16_t b;
      std::memcpy(&b, &bytes[i * 2], 2);
      v[i] = b == kPoison16 ? std::numeric_limits<float>::quiet_NaN() : from_bits(b, dtype);
      if (b == kPoison16) std::memcpy(&v[i], "\xff\xff\xff\xff", 4);  // keep "unwritten" visible
    }
  }
  return v;
}

void check_outputs(const std::string& what, DeviceBuffer& o_out, DeviceBuffer& s_out, DType out,
                   const std::vector<double>& o_ref, const std::vector<double>& s_ref,
                   double naive_err) {
  const auto o_got = decode(o_out.download<uint8_t>(o_ref.size() * dtype_size(out)), out);
  const auto s_got = s_out.download<float>(s_ref.size());
  expect_within_rule(o_got, o_ref, naive_err, out == DType::kFP32 ? 1e-6 : 1e-7, what + " o");
  expect_within_rule(s_got, s_ref, 1e-6, 2e-6, what + " lse");
}

struct Shape { int rows, heads, head_dim; };

TEST(GpuMergeStates, TwoStatesOutOfPlace) {
  TESSERA_REQUIRE_GPU();
  std::mt19937 rng(11);
  for (auto [in, out] : {std::pair{DType::kBF16, DType::kBF16}, {DType::kFP16, DType::kFP16},
                         {DType::kFP32, DType::kFP32}, {DType::kFP32, DType::kBF16},
                         {DType::kFP32, DType::kFP16}}) {
    for (Shape sh : {Shape{1, 1, 64}, Shape{7, 3, 128}, Shape{97, 32, 128}, Shape{577, 4, 256},
                     Shape{54, 2, 8}}) {
      States st = make_states(sh.rows, 2, sh.heads, sh.head_dim, in, rng);
      std::vector<double> o_ref, s_ref;
      double naive = 0;
      reference(st, out, o_ref, s_ref, naive);
      // Separate tensors a and b, each with a padded row stride.
      const int64_t H = sh.heads, D = sh.head_dim, row = H * D + 8;
      std::vector<float> a(size_t(sh.rows) * row, 0.f), b = a, sa(size_t(sh.rows) * H),
          sb = sa;
      for (int r = 0; r < sh.rows; ++r)
        for (int h = 0; h < H; ++h) {
          sa[r * H + h] = st.s_at(r, 0, h);
          sb[r * H + h] = st.s_at(r, 1, h);
          for (int d = 0; d < D; ++d) {
            a[r * row + h * D + d] = st.o_at(r, 0, h, d);
            b[r * row + h * D + d] = st.o_at(r, 1, h, d);
          }
        }
      DeviceBuffer da(a.size() * dtype_size(in)), db(b.size() * dtype_size(in)),
          dsa(sa.size() * 4), dsb(sb.size() * 4), dout(o_ref.size() * dtype_size(out)),
          dsout(s_ref.size() * 4);
      da.upload(encode(a, in));
      db.upload(encode(b, in));
      dsa.upload(sa);
      dsb.upload(sb);
      dout.poison();
      dsout.poison();
      merge_state(TensorView::strided(da.get(), in, {sh.rows, H, D}, {row, D, 1}),
                  TensorView::contiguous(dsa.get(), DType::kFP32, {sh.rows, H}),
                  TensorView::strided(db.get(), in, {sh.rows, H, D}, {row, D, 1}),
                  TensorView::contiguous(dsb.get(), DType::kFP32, {sh.rows, H}),
                  TensorView::contiguous(dout.get(), out, {sh.rows, H, D}),
                  TensorView::contiguous(dsout.get(), DType::kFP32, {sh.rows, H}), nullptr);
      CUDA_OK(cudaDeviceSynchronize());
      check_outputs(std::string("merge_state ") + dtype_name(in) + "->" + dtype_name(out) +
                        " rows " + std::to_string(sh.rows) + " heads " + std::to_string(H) +
                        " hd " + std::to_string(D),
                    dout, dsout, out, o_ref, s_ref, naive);
    }
  }
}

TEST(GpuMergeStates, TwoStatesInPlace) {
  TESSERA_REQUIRE_GPU();
  std::mt19937 rng(12);
  for (DType dt : {DType::kBF16, DType::kFP32}) {
    // hd 8/16/32: several (row, head) pairs share a warp, so the in-place LSE update must wait
    // for every reader of the warp, not just its own row's.
    for (Shape sh : {Shape{5, 2, 64}, Shape{300, 8, 128}, Shape{33, 1, 256}, Shape{37, 5, 8},
                     Shape{19, 3, 16}, Shape{9, 2, 32}}) {
      States st = make_states(sh.rows, 2, sh.heads, sh.head_dim, dt, rng);
      std::vector<double> o_ref, s_ref;
      double naive = 0;
      reference(st, dt, o_ref, s_ref, naive);
      const int64_t H = sh.heads, D = sh.head_dim;
      std::vector<float> a(size_t(sh.rows) * H * D), b = a, sa(size_t(sh.rows) * H), sb = sa;
      for (int r = 0; r < sh.rows; ++r)
        for (int h = 0; h < H; ++h) {
          sa[r * H + h] = st.s_at(r, 0, h);
          sb[r * H + h] = st.s_at(r, 1, h);
          for (int d = 0; d < D; ++d) {
            a[(r * H + h) * D + d] = st.o_at(r, 0, h, d);
            b[(r * H + h) * D + d] = st.o_at(r, 1, h, d);
          }
        }
      DeviceBuffer da(a.size() * dtype_size(dt)), db(b.size() * dtype_size(dt)),
          dsa(sa.size() * 4), dsb(sb.size() * 4);
      da.upload(encode(a, dt));
      db.upload(encode(b, dt));
      dsa.upload(sa);
      dsb.upload(sb);
      merge_state_in_place(TensorView::contiguous(da.get(), dt, {sh.rows, H, D}),
                           TensorView::contiguous(dsa.get(), DType::kFP32, {sh.rows, H}),
                           TensorView::contiguous(db.get(), dt, {sh.rows, H, D}),
                           TensorView::contiguous(dsb.get(), DType::kFP32, {sh.rows, H}),
                           nullptr);
      CUDA_OK(cudaDeviceSynchronize());
      check_outputs(std::string("merge_state_in_place ") + dtype_name(dt) + " rows " +
                        std::to_string(sh.rows),
                    da, dsa, dt, o_ref, s_ref, naive);
    }
  }
}

TEST(GpuMergeStates, NaryStacked) {
  TESSERA_REQUIRE_GPU();
  std::mt19937 rng(13);
  for (auto [in, out] : {std::pair{DType::kFP32, DType::kBF16}, {DType::kBF16, DType::kBF16},
                         {DType::kFP16, DType::kFP16}, {DType::kFP32, DType::kFP32}}) {
    for (int n : {1, 3, 8, 17}) {
      for (Shape sh : {Shape{7, 4, 128}, Shape{97, 2, 64}, Shape{4, 1, 256}}) {
        States st = make_states(sh.rows, n, sh.heads, sh.head_dim, in, rng);
        std::vector<double> o_ref, s_ref;
        double naive = 0;
        reference(st, out, o_ref, s_ref, naive);
        DeviceBuffer dparts(st.o.size() * dtype_size(in)), ds(st.s.size() * 4),
            dout(o_ref.size() * dtype_size(out)), dsout(s_ref.size() * 4);
        dparts.upload(encode(st.o, in));
        ds.upload(st.s);
        dout.poison();
        dsout.poison();
        merge_states(TensorView::contiguous(dparts.get(), in, {sh.rows, n, sh.heads, sh.head_dim}),
                     TensorView::contiguous(ds.get(), DType::kFP32, {sh.rows, n, sh.heads}),
                     TensorView::contiguous(dout.get(), out, {sh.rows, sh.heads, sh.head_dim}),
                     TensorView::contiguous(dsout.get(), DType::kFP32, {sh.rows, sh.heads}),
                     nullptr);
        CUDA_OK(cudaDeviceSynchronize());
        check_outputs(std::string("merge_states n=") + std::to_string(n) + " " +
                          dtype_name(in) + "->" + dtype_name(out) + " rows " +
                          std::to_string(sh.rows),
                      dout, dsout, out, o_ref, s_ref, naive);
      }
    }
  }
}

TEST(GpuMergeStates, RejectedCallWritesNothing) {
  TESSERA_REQUIRE_GPU();
  DeviceBuffer o(4 * 2 * 64 * 2), s(4 * 2 * 4), out(4 * 2 * 64 * 2);
  out.poison();
  // s has the wrong dtype: the call must throw before launching anything.
  EXPECT_THROW(merge_state(TensorView::contiguous(o.get(), DType::kBF16, {4, 2, 64}),
                           TensorView::contiguous(s.get(), DType::kBF16, {4, 2}),
                           TensorView::contiguous(o.get(), DType::kBF16, {4, 2, 64}),
                           TensorView::contiguous(s.get(), DType::kFP32, {4, 2}),
                           TensorView::contiguous(out.get(), DType::kBF16, {4, 2, 64}),
                           TensorView(), nullptr),
               Error);
  CUDA_OK(cudaDeviceSynchronize());
  for (uint16_t b : out.download<uint16_t>(4 * 2 * 64)) ASSERT_EQ(b, kPoison16);
}

}  // namespace
}  // namespace tessera::testing
