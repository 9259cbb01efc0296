// The overlap rule of the argument checks (detail::views_overlap, docs in core/arg_check.h): exact
// for views with one nested lattice (the K and V halves of a combined cache among them), refusing
// (kUnknown) where it does not decide. Runs without a GPU: only addresses are compared. The
// entry points' use of it: BadInputAppend.CombinedCache in test_bad_input.cpp.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <vector>

#include "core/arg_check.h"
#include "tessera/tessera.h"

namespace tessera {
namespace {

using detail::Overlap;
using detail::views_overlap;
using ::testing::HasSubstr;
using ::testing::Not;

void* at(uintptr_t byte_offset) { return reinterpret_cast<void*>(0x1000000 + byte_offset); }

// The K and V halves of a combined bf16 cache [pages, 2, a, b, head_dim] (NHD: a = page_size,
// b = heads; HND: a = heads, b = page_size), as the Python bindings split it: same shape and
// strides, V one dim-1 step after K.
struct Combined {
  TensorView k, v;
  Combined(int64_t pages, int64_t a, int64_t b, int64_t d, int64_t v_offset_elems = -1) {
    const int64_t half = a * b * d;
    k = TensorView::strided(at(0), DType::kBF16, {pages, a, b, d}, {2 * half, b * d, d, 1});
    v = k;
    v.data = at(2 * (v_offset_elems < 0 ? half : v_offset_elems));
  }
};

TEST(Overlap, CombinedCacheHalvesAreDisjoint) {
  for (const auto& c : {Combined(8, 16, 4, 128), Combined(8, 4, 16, 128), Combined(1, 16, 4, 128),
                        Combined(3, 1, 2, 64), Combined(100, 4, 2, 128)}) {
    EXPECT_EQ(views_overlap(c.k, c.v), Overlap::kNone) << c.k.describe();
    EXPECT_EQ(views_overlap(c.v, c.k), Overlap::kNone) << c.k.describe();
  }
}

TEST(Overlap, RealOverlapsOfOneLatticeAreFound) {
  const int64_t half = 16 * 4 * 128;
  // V on K (same data), V one page later (V's page i is K's page i + 1), V one token, one head
  // or one element into K's first page, V's page 0 from page 1's V half into K's page 2.
  for (int64_t offset : {int64_t(0), 2 * half, int64_t(4 * 128), int64_t(128), int64_t(1), 3 * half + 5}) {
    const Combined c(8, 16, 4, 128, offset);
    EXPECT_EQ(views_overlap(c.k, c.v), Overlap::kShared) << "V at element " << offset;
  }
  // V in page 1's V half (V's page i is the V half of page i + 1): disjoint again.
  const Combined next(8, 16, 4, 128, 3 * half);
  EXPECT_EQ(views_overlap(next.k, next.v), Overlap::kNone);
  // V half an element late: its last element of page 0 straddles K's first element of page 1.
  Combined late(8, 16, 4, 128);
  late.v.data = at(2 * half + 1);
  EXPECT_EQ(views_overlap(late.k, late.v), Overlap::kShared);
  // V half an element early: its first element straddles K's last element of page 0.
  Combined early(2, 16, 4, 128);
  early.v.data = at(2 * half - 1);
  EXPECT_EQ(views_overlap(early.k, early.v), Overlap::kShared);
}

TEST(Overlap, RowMajorSlicesAndPermutations) {
  const TensorView rows = TensorView::contiguous(at(0), DType::kFP32, {16, 4, 128});
  TensorView shifted = rows;
  shifted.data = at(4 * 64);  // 64 elements in: inside row 0
  EXPECT_EQ(views_overlap(rows, shifted), Overlap::kShared);
  // Even and odd heads of one buffer: disjoint element sets.
  TensorView even = TensorView::strided(at(0), DType::kFP32, {16, 2, 128}, {512, 256, 1});
  TensorView odd = even;
  odd.data = at(4 * 128);
  EXPECT_EQ(views_overlap(even, odd), Overlap::kNone);
  // The same elements through a transposed view.
  const TensorView a = TensorView::strided(at(0), DType::kFP32, {4, 8}, {8, 1});
  const TensorView t = TensorView::strided(at(0), DType::kFP32, {8, 4}, {1, 8});
  EXPECT_EQ(views_overlap(a, t), Overlap::kShared);
  // Negative strides: {6, 4, 2, 0} against {1, 3, 5, 7}.
  const TensorView down = TensorView::strided(at(4 * 6), DType::kFP32, {4}, {-2});
  const TensorView up = TensorView::strided(at(4 * 1), DType::kFP32, {4}, {2});
  EXPECT_EQ(views_overlap(down, up), Overlap::kNone);
  EXPECT_EQ(views_overlap(down, TensorView::strided(at(0), DType::kFP32, {4}, {2})), Overlap::kShared);
  // Single elements, empty views, disjoint byte ranges.
  const TensorView one = TensorView::contiguous(at(8), DType::kFP32, {1});
  EXPECT_EQ(views_overlap(one, TensorView::contiguous(at(8), DType::kFP32, {1, 1})), Overlap::kShared);
  EXPECT_EQ(views_overlap(one, TensorView::contiguous(at(12), DType::kFP32, {1})), Overlap::kNone);
  EXPECT_EQ(views_overlap(rows, TensorView::contiguous(at(0), DType::kFP32, {0, 4, 128})), Overlap::kNone);
  EXPECT_EQ(views_overlap(rows, TensorView::contiguous(at(4 * 16 * 4 * 128), DType::kFP32, {3, 3})),
            Overlap::kNone);
}

// Against brute force: random sub-views of row-major buffers (nested lattices, dims permuted and
// flipped at random) and random byte offsets between two copies of one; every answer is decided and
// agrees with comparing the byte ranges of all element pairs.
TEST(Overlap, AgreesWithBruteForceOnNestedLattices) {
  std::mt19937 rng(17);
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  int shared = 0, none = 0;
  for (int trial = 0; trial < 3000; ++trial) {
    const int rank = pick(1, 3);
    const int64_t elem = pick(0, 1) ? 2 : 4;
    int64_t parent = 1, sizes[3], strides[3];
    for (int i = rank - 1; i >= 0; --i) {  // a sub-view of a row-major parent: sizes <= parent dims
      const int64_t parent_dim = pick(1, 5);
      sizes[i] = pick(1, static_cast<int>(parent_dim));
      strides[i] = parent;
      parent *= parent_dim;
    }
    TensorView a;
    a.dtype = elem == 2 ? DType::kBF16 : DType::kFP32;
    a.rank = rank;
    int64_t base = 4 * parent * elem;  // room for flipped dims below the data pointer
    for (int i = 0; i < rank; ++i) {
      a.shape[i] = sizes[i];
      a.stride[i] = strides[i];
      if (pick(0, 3) == 0) {  // flip: start at the last element of the dim, walk back
        base += (sizes[i] - 1) * strides[i] * elem;
        a.stride[i] = -strides[i];
      }
    }
    if (rank > 1 && pick(0, 1)) {  // permute two dims (the element set is unchanged)
      std::swap(a.shape[0], a.shape[rank - 1]);
      std::swap(a.stride[0], a.stride[rank - 1]);
    }
    a.data = at(static_cast<uintptr_t>(base));
    TensorView b = a;
    const int64_t d = pick(-static_cast<int>(2 * parent * elem), static_cast<int>(2 * parent * elem));
    b.data = at(static_cast<uintptr_t>(base + d));

    std::vector<int64_t> starts;  // byte offsets of a's elements from a.data
    for (int64_t i0 = 0; i0 < (rank > 0 ? a.shape[0] : 1); ++i0)
      for (int64_t i1 = 0; i1 < (rank > 1 ? a.shape[1] : 1); ++i1)
        for (int64_t i2 = 0; i2 < (rank > 2 ? a.shape[2] : 1); ++i2)
          starts.push_back(elem * (i0 * a.stride[0] + (rank > 1 ? i1 * a.stride[1] : 0) +
                                   (rank > 2 ? i2 * a.stride[2] : 0)));
    bool truth = false;
    for (int64_t x : starts)
      for (int64_t y : starts) truth = truth || (x < y + d + elem && y + d < x + elem);
    const Overlap got = views_overlap(a, b);
    ASSERT_NE(got, Overlap::kUnknown) << a.describe() << " d=" << d;
    ASSERT_EQ(got == Overlap::kShared, truth) << a.describe() << " d=" << d;
    (truth ? shared : none) += 1;
  }
  EXPECT_GT(shared, 300);  // both answers well exercised
  EXPECT_GT(none, 300);
}

// Where the rule does not decide, it says so and the checks refuse, even when the views are in
// fact disjoint (documented in core/arg_check.h).
TEST(Overlap, UndecidedLayoutsAreRefused) {
  // A lattice that is not nested: sizes [3, 2], strides [4, 6] hold {0, 4, 8, 6, 10, 14}; shifted
  // by one element, {1, 5, 9, 7, 11, 15}: disjoint, but the stride 6 lies inside the reach 8 of
  // the stride-4 dim, so the rule does not decide it.
  const TensorView a = TensorView::strided(at(0), DType::kFP32, {3, 2}, {4, 6});
  TensorView b = a;
  b.data = at(4);
  EXPECT_EQ(views_overlap(a, b), Overlap::kUnknown);
  // Different shapes or element sizes over intersecting byte ranges.
  const TensorView q = TensorView::contiguous(at(0), DType::kBF16, {16, 4, 128});
  const TensorView k = TensorView::contiguous(at(0), DType::kBF16, {16, 2, 128});
  EXPECT_EQ(views_overlap(q, k), Overlap::kUnknown);
  EXPECT_EQ(views_overlap(q, TensorView::contiguous(at(0), DType::kFP32, {16, 4, 64})), Overlap::kUnknown);
  // Offsets past int64.
  const TensorView huge = TensorView::strided(at(0), DType::kBF16, {4, 8}, {int64_t(1) << 62, 1});
  EXPECT_EQ(views_overlap(huge, huge), Overlap::kUnknown);

  try {
    detail::ArgCheck("x").disjoint(b, "out", a, "in");
    ADD_FAILURE() << "expected tessera::Error";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("argument 'out': must not overlap 'in'"));
    EXPECT_THAT(e.what(), HasSubstr("cannot be proved disjoint"));
  }
  try {
    detail::ArgCheck("x").disjoint(q, "out", q, "in");
    ADD_FAILURE() << "expected tessera::Error";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("must not overlap 'in' (an output may not alias an input)"));
    EXPECT_THAT(e.what(), Not(HasSubstr("cannot be proved")));
  }
}

}  // namespace
}  // namespace tessera
