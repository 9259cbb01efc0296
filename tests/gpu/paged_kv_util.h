// Helpers shared by the paged-KV GPU tests (decode, paged prefill): a paged K/V cache built on
// the host with shuffled page ids and NaN in every element no request owns, its device copy,
// query rows with NaN padding, and the poisoned o / lse buffers read back with a count of stray
// writes.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <stdexcept>
#include <vector>

#include "gpu/gpu_test_util.h"
#include "reference/attention_ref.h"
#include "tessera/kv_cache.h"

namespace tessera::testing {

inline uint16_t nan_bits(DType dtype) { return dtype == DType::kBF16 ? 0x7FC0 : 0x7E00; }

inline float poison_float() {
  const uint32_t bits = 0xFFFFFFFFu;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline std::vector<int32_t> indptr_of(const std::vector<int>& lengths) {
  std::vector<int32_t> indptr{0};
  for (int n : lengths) indptr.push_back(indptr.back() + n);
  return indptr;
}

// ---- A paged K/V cache on the host ---------------------------------------------------------------
struct KVGeometry {
  KVLayout layout = KVLayout::kNHD;
  DType dtype = DType::kBF16;
  int page_size = 16;
  int num_kv_heads = 2;
  int head_dim = 128;
  int64_t head_pad = 0;    // extra elements after each head_dim row (strides of dims 1 and 2 grow)
  int64_t k_page_pad = 0;  // extra elements after each K page (page stride grows)
  int64_t v_page_pad = 0;  // the same for V, so K and V strides can differ
};

// Element strides of dims 0..2 of a page tensor (head_dim, dim 3, has stride 1).
inline std::array<int64_t, 3> page_strides(const KVGeometry& g, int64_t page_pad) {
  const int64_t row = g.head_dim + g.head_pad;  // dim 2: heads (NHD) or slots (HND)
  const int64_t mid = int64_t(g.layout == KVLayout::kNHD ? g.num_kv_heads : g.page_size) * row;
  return {int64_t(g.page_size) * g.num_kv_heads * row + page_pad, mid, row};
}

struct HostPagedKV {
  KVGeometry g;
  int64_t num_pages = 0;
  std::array<int64_t, 3> k_strides{}, v_strides{};
  std::vector<int32_t> indptr{0}, indices, last_page_len;
  std::vector<uint16_t> k_bits, v_bits;  // whole page tensors, padding included
  std::vector<float> k_vals, v_vals;     // the same as floats (NaN where nothing is owned)

  int batch() const { return static_cast<int>(last_page_len.size()); }
  int64_t offset(const std::array<int64_t, 3>& s, int r, int64_t pos, int h) const {
    const int64_t page = indices[indptr[r] + pos / g.page_size], slot = pos % g.page_size;
    return page * s[0] + (g.layout == KVLayout::kNHD ? slot * s[1] + h * s[2] : h * s[1] + slot * s[2]);
  }
  ref::PagedKV reference() const {
    return ref::PagedKV(k_vals.data(), v_vals.data(),
                        g.layout == KVLayout::kNHD ? ref::PageLayout::kNHD : ref::PageLayout::kHND,
                        g.page_size, g.num_kv_heads, g.head_dim, k_strides.data(), v_strides.data(),
                        indptr, indices, last_page_len);
  }
};

// Requests of the given KV lengths over a cache of num_pages pages (0: just enough plus 3 spare),
// page ids shuffled. Owned (page, slot, head) rows get fresh random values, every other element NaN.
inline HostPagedKV make_paged_kv(const KVGeometry& g, const std::vector<int>& kv_len, int64_t num_pages,
                          std::mt19937& rng) {
  HostPagedKV h;
  h.g = g;
  for (int len : kv_len) {
    const int pages = (len + g.page_size - 1) / g.page_size;
    h.indptr.push_back(h.indptr.back() + pages);
    h.last_page_len.push_back(pages == 0 ? 0 : len - (pages - 1) * g.page_size);
  }
  const int32_t used = h.indptr.back();
  h.num_pages = num_pages > 0 ? num_pages : used + 3;
  if (h.num_pages < used) throw std::runtime_error("make_paged_kv: the cache is too small");
  h.indices.resize(size_t(h.num_pages));
  std::iota(h.indices.begin(), h.indices.end(), 0);
  std::shuffle(h.indices.begin(), h.indices.end(), rng);
  h.indices.resize(size_t(used));

  h.k_strides = page_strides(g, g.k_page_pad);
  h.v_strides = page_strides(g, g.v_page_pad);
  h.k_bits.assign(size_t(h.num_pages * h.k_strides[0]), nan_bits(g.dtype));
  h.v_bits.assign(size_t(h.num_pages * h.v_strides[0]), nan_bits(g.dtype));
  std::vector<uint16_t> row;
  for (int r = 0; r < h.batch(); ++r) {
    for (int64_t pos = 0; pos < kv_len[r]; ++pos) {
      for (int head = 0; head < g.num_kv_heads; ++head) {
        random_16bit(size_t(g.head_dim), g.dtype, rng, row);
        std::copy(row.begin(), row.end(), h.k_bits.begin() + h.offset(h.k_strides, r, pos, head));
        random_16bit(size_t(g.head_dim), g.dtype, rng, row);
        std::copy(row.begin(), row.end(), h.v_bits.begin() + h.offset(h.v_strides, r, pos, head));
      }
    }
  }
  h.k_vals.resize(h.k_bits.size());
  h.v_vals.resize(h.v_bits.size());
  for (size_t i = 0; i < h.k_bits.size(); ++i) h.k_vals[i] = from_bits(h.k_bits[i], g.dtype);
  for (size_t i = 0; i < h.v_bits.size(); ++i) h.v_vals[i] = from_bits(h.v_bits[i], g.dtype);
  return h;
}

// The device copy: page tensors of a HostPagedKV's size, page-table arrays for up to max_batch
// requests over all of the cache's pages (fixed addresses, so a CUDA graph can reuse them).
struct DevicePagedKV {
  DeviceBuffer k, v, indptr, indices, last_page_len;

  DevicePagedKV(const HostPagedKV& h, int max_batch)
      : k(h.k_bits.size() * 2), v(h.v_bits.size() * 2), indptr(size_t(max_batch + 1) * 4),
        indices(size_t(std::max<int64_t>(h.num_pages, 1)) * 4),
        last_page_len(size_t(std::max(max_batch, 1)) * 4) {}

  void upload(const HostPagedKV& h) {
    k.upload(h.k_bits);
    v.upload(h.v_bits);
    indptr.upload(h.indptr);
    indices.upload(h.indices);
    last_page_len.upload(h.last_page_len);
  }
  PagedKVCache cache(const HostPagedKV& h) const {
    const KVGeometry& g = h.g;
    const bool nhd = g.layout == KVLayout::kNHD;
    const int64_t d1 = nhd ? g.page_size : g.num_kv_heads, d2 = nhd ? g.num_kv_heads : g.page_size;
    PagedKVCache c;
    c.layout = g.layout;
    c.k_pages = TensorView::strided(k.get(), g.dtype, {h.num_pages, d1, d2, g.head_dim},
                                    {h.k_strides[0], h.k_strides[1], h.k_strides[2], 1});
    c.v_pages = TensorView::strided(v.get(), g.dtype, {h.num_pages, d1, d2, g.head_dim},
                                    {h.v_strides[0], h.v_strides[1], h.v_strides[2], 1});
    return c;
  }
  // The table of `h` (device arrays here, host copies in `h`, which must outlive the table).
  PageTable table(const HostPagedKV& h) const {
    PageTable t;
    t.indptr = TensorView::contiguous(indptr.get(), DType::kInt32, {h.batch() + 1});
    t.indices = TensorView::contiguous(indices.get(), DType::kInt32, {int64_t(h.indices.size())});
    t.last_page_len = TensorView::contiguous(last_page_len.get(), DType::kInt32, {h.batch()});
    t.host_indptr = h.indptr.data();
    t.host_indices = h.indices.data();
    t.host_last_page_len = h.last_page_len.data();
    return t;
  }
};

// ---- Query rows and outputs ------------------------------------------------------------------------
// A [rows, heads, dim] 16-bit tensor with row stride heads * dim + pad; the padding holds NaN.
struct HostRows {
  int64_t rows = 0, heads = 0, dim = 0, row_stride = 0;
  std::vector<uint16_t> bits;  // rows x row_stride
  std::vector<float> dense;    // [rows, heads, dim], exact values, unpadded
};

inline HostRows random_rows(int64_t rows, int64_t heads, int64_t dim, int64_t pad, DType dtype,
                     std::mt19937& rng, float range) {
  HostRows q;
  q.rows = rows;
  q.heads = heads;
  q.dim = dim;
  q.row_stride = heads * dim + pad;
  std::vector<uint16_t> packed;
  q.dense = random_16bit(size_t(rows * heads * dim), dtype, rng, packed, -range, range);
  q.bits.assign(size_t(rows * q.row_stride), nan_bits(dtype));
  for (int64_t r = 0; r < rows; ++r) {
    std::copy_n(&packed[size_t(r * heads * dim)], heads * dim, &q.bits[size_t(r * q.row_stride)]);
  }
  return q;
}

struct OutputShape {
  int64_t rows, heads, dim, row_stride;  // o: [rows, heads, dim] with this row stride
  DType dtype;
};

// What a run left in the o / lse buffers.
struct Outputs {
  std::vector<uint16_t> o_raw;  // the whole o buffer
  std::vector<float> lse_raw;   // the whole lse buffer
  std::vector<float> o, lse;    // [rows, heads, dim] / [rows, heads]; unwritten ones stay poisoned
  std::size_t stray = 0;        // elements outside the o / lse views that lost their poison
};

inline Outputs fetch(const DeviceBuffer& o, const DeviceBuffer& lse, const OutputShape& s) {
  Outputs out;
  out.o_raw = o.download<uint16_t>(o.bytes() / 2);
  out.lse_raw = lse.download<float>(lse.bytes() / 4);
  std::vector<char> inside(out.o_raw.size(), 0);
  const int64_t width = s.heads * s.dim;
  out.o.resize(size_t(s.rows * width));
  for (int64_t r = 0; r < s.rows; ++r) {
    for (int64_t e = 0; e < width; ++e) {
      const size_t at = size_t(r * s.row_stride + e);
      inside[at] = 1;
      const uint16_t b = out.o_raw[at];
      out.o[size_t(r * width + e)] = b == kPoison16 ? poison_float() : from_bits(b, s.dtype);
    }
  }
  for (size_t i = 0; i < out.o_raw.size(); ++i) out.stray += !inside[i] && out.o_raw[i] != kPoison16;
  const size_t lse_count = size_t(s.rows * s.heads);
  out.lse.assign(out.lse_raw.begin(), out.lse_raw.begin() + lse_count);
  for (size_t i = lse_count; i < out.lse_raw.size(); ++i) out.stray += !is_poison(out.lse_raw[i]);
  return out;
}

inline bool bitwise_equal(const Outputs& a, const Outputs& b) {
  return a.o_raw == b.o_raw && a.lse_raw.size() == b.lse_raw.size() &&
         std::memcmp(a.lse_raw.data(), b.lse_raw.data(), a.lse_raw.size() * 4) == 0;
}

// ---- The reference ---------------------------------------------------------------------------------
struct Expected {
  std::vector<double> o, lse;
  double o_naive_err = 0, lse_naive_err = 0;  // max error of the naive low-precision computation
};

inline double max_finite_diff(const std::vector<double>& a, const std::vector<double>& b) {
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double d = std::fabs(a[i] - b[i]);
    if (std::isfinite(d)) m = std::max(m, d);
  }
  return m;
}

}  // namespace tessera::testing
