#include "kernels/attention/sm90/tensor_map_sm90.h"

#include <algorithm>
#include <string>

#include "kernels/common/tensor_map_encode.h"
#include "tessera/error.h"

namespace tessera::kernels::sm90 {
namespace {

// [rows, heads, head_dim] with element strides row_stride / head_stride (head_dim contiguous).
CUtensorMap ragged_map(const char* what, DType dtype, const void* data, int64_t rows, int64_t heads,
                       int head_dim, int64_t row_stride, int64_t head_stride, int box_rows, int box_heads = 1) {
  const int64_t esize = 2;
  const uint64_t dims[3] = {uint64_t(head_dim), uint64_t(heads), uint64_t(std::max<int64_t>(rows, 1))};
  // A dimension of extent 1 may have any stride; the copy engine still wants a multiple of 16 bytes.
  const int64_t head_bytes = heads == 1 ? int64_t(head_dim) * esize : head_stride * esize;
  const int64_t row_bytes = rows <= 1 ? heads * int64_t(head_dim) * esize : row_stride * esize;
  const uint64_t strides[2] = {uint64_t(head_bytes), uint64_t(row_bytes)};
  const uint32_t box[3] = {64, uint32_t(box_heads), uint32_t(box_rows)};
  return encode_tensor_map_16bit(what,
                                 "row stride " + std::to_string(row_stride) + ", head stride " +
                                     std::to_string(head_stride) + " elements",
                                 dtype, 3, data, dims, strides, box);
}

// One page tensor: dims (innermost first) head_dim, the head / token dims in stride order, pages;
// strides in elements. A dimension of extent 1 takes the dense stride (see ragged_map).
CUtensorMap paged_map(const char* what, DType dtype, const void* data, const PrefillParams& p, int head_dim,
                      int64_t head_stride, int64_t token_stride, int64_t page_stride, bool token_first,
                      int box_rows) {
  const int64_t esize = 2;
  const int64_t heads = p.num_kv_heads, tokens = p.page_size;
  const int64_t pages = std::max<int64_t>(p.num_pages, 1);
  const int64_t extent1 = token_first ? tokens : heads, extent2 = token_first ? heads : tokens;
  int64_t stride1 = (token_first ? token_stride : head_stride) * esize;
  int64_t stride2 = (token_first ? head_stride : token_stride) * esize;
  int64_t stride3 = page_stride * esize;
  if (extent1 == 1) stride1 = int64_t(head_dim) * esize;
  if (extent2 == 1) stride2 = stride1 * extent1;
  if (pages == 1) stride3 = stride2 * extent2;
  const uint64_t dims[4] = {uint64_t(head_dim), uint64_t(extent1), uint64_t(extent2), uint64_t(pages)};
  const uint64_t strides[3] = {uint64_t(stride1), uint64_t(stride2), uint64_t(stride3)};
  const uint32_t box[4] = {64, token_first ? uint32_t(box_rows) : 1u, token_first ? 1u : uint32_t(box_rows), 1};
  return encode_tensor_map_16bit(what,
                                 "page stride " + std::to_string(page_stride) + ", token stride " +
                                     std::to_string(token_stride) + ", head stride " + std::to_string(head_stride) +
                                     " elements",
                                 dtype, 4, data, dims, strides, box);
}

// One page tensor as a grouped map (PagedTensorMaps::grouped), or false (leaving *map alone) when
// its heads are padded.
bool grouped_paged_map(const char* what, DType dtype, const void* data, const PrefillParams& p, int head_dim,
                       int64_t head_stride, int64_t token_stride, int64_t page_stride, bool nhd, int box_rows,
                       CUtensorMap* map) {
  const int64_t esize = 2;
  const int64_t heads = p.num_kv_heads, blocks = head_dim / 64, pages = std::max<int64_t>(p.num_pages, 1);
  if (heads > 1 && head_stride != (nhd ? int64_t(head_dim) : p.page_size * token_stride)) return false;
  const int64_t groups = nhd ? p.page_size / 8 : heads * p.page_size / 8;
  const int64_t page_bytes = pages == 1 ? groups * 8 * token_stride * esize : page_stride * esize;
  const uint64_t dims[5] = {64, 8, uint64_t(nhd ? heads * blocks : blocks), uint64_t(groups), uint64_t(pages)};
  const uint64_t strides[4] = {uint64_t(token_stride * esize), 64 * esize, uint64_t(8 * token_stride * esize),
                               uint64_t(page_bytes)};
  const uint32_t box[5] = {64, 8, uint32_t(blocks), uint32_t(box_rows / 8), 1};
  try {
    *map = encode_tensor_map_16bit(what, "grouped", dtype, 5, data, dims, strides, box);
  } catch (const Error&) {
    return false;  // the 4-D maps then say what the copy engine cannot describe, if anything
  }
  return true;
}

int gcd(int a, int b) { return b == 0 ? a : gcd(b, a % b); }

// q or o: one box is `tile_rows` rows of a query tile; packed GQA (p.gqa_pack) makes them the
// 2^gqa_pack heads of a KV head times tile_rows >> gqa_pack tokens, landing token-major.
CUtensorMap query_rows_map(const char* what, DType dtype, const void* data, const PrefillParams& p, int head_dim,
                           int64_t row_stride, int64_t head_stride, int tile_rows) {
  return ragged_map(what, dtype, data, p.q_rows, p.num_qo_heads, head_dim, row_stride, head_stride,
                    tile_rows >> p.gqa_pack, 1 << p.gqa_pack);
}

}  // namespace

PagedTensorMaps paged_tensor_maps(DType dtype, const PrefillParams& p, int head_dim, int q_box_rows,
                                  int kv_tile_rows) {
  if (p.page_size % 8 != 0) {
    throw Error("tessera: the Hopper prefill family reads pages of a multiple of 8 tokens; page_size is " +
                std::to_string(p.page_size));
  }
  PagedTensorMaps maps;
  maps.q = query_rows_map("q", dtype, p.q, p, head_dim, p.q_stride_row, p.q_stride_head, q_box_rows);
  maps.kv_box_rows = gcd(p.page_size, kv_tile_rows);
  // The token dim goes second when it is the closer one in memory (HND pages, or one head).
  maps.k_token_dim_first = p.num_kv_heads > 1 && int64_t(p.k_stride_token) < p.k_stride_head;
  maps.v_token_dim_first = p.num_kv_heads > 1 && int64_t(p.v_stride_token) < p.v_stride_head;
  // Grouped maps when both tensors allow them (one box per page run instead of one per 8 rows
  // and column block). k and v share the layout (PagedKVCache), so they agree on NHD / HND.
  // head_dim 64 has one column block: the grouped tile is Sw128Tile's layout, and one box_rows x
  // 64 box per page run already covers the row (the 5-D box measured 2.6% slower, H200 a651b46).
  const bool nhd = !maps.k_token_dim_first;
  if (head_dim > 64 && maps.k_token_dim_first == maps.v_token_dim_first) {
    CUtensorMap k_map, v_map;
    if (grouped_paged_map("k_pages", dtype, p.k, p, head_dim, p.k_stride_head, p.k_stride_token, p.k_stride_page,
                          nhd, maps.kv_box_rows, &k_map) &&
        grouped_paged_map("v_pages", dtype, p.v, p, head_dim, p.v_stride_head, p.v_stride_token, p.v_stride_page,
                          nhd, maps.kv_box_rows, &v_map)) {
      maps.k = k_map;
      maps.v = v_map;
      maps.grouped = true;
      maps.head_in_blocks = nhd;
      return maps;
    }
  }
  const int copy_rows = head_dim == 64 ? maps.kv_box_rows : 8;  // Sw128GroupedTile::load_page_rows
  maps.k = paged_map("k_pages", dtype, p.k, p, head_dim, p.k_stride_head, p.k_stride_token, p.k_stride_page,
                     maps.k_token_dim_first, copy_rows);
  maps.v = paged_map("v_pages", dtype, p.v, p, head_dim, p.v_stride_head, p.v_stride_token, p.v_stride_page,
                     maps.v_token_dim_first, copy_rows);
  return maps;
}

RaggedTensorMaps ragged_tensor_maps(DType dtype, const PrefillParams& p, int head_dim, int q_box_rows,
                                    int kv_box_rows) {
  RaggedTensorMaps maps;
  maps.q = query_rows_map("q", dtype, p.q, p, head_dim, p.q_stride_row, p.q_stride_head, q_box_rows);
  // With no K / V rows nothing is ever loaded; the maps still need a valid address.
  const bool no_kv = p.kv_rows == 0;
  maps.k = ragged_map("k", dtype, no_kv ? p.q : p.k, p.kv_rows, p.num_kv_heads, head_dim, p.k_stride_row, p.k_stride_head,
                      kv_box_rows);
  maps.v = ragged_map("v", dtype, no_kv ? p.q : p.v, p.kv_rows, p.num_kv_heads, head_dim, p.v_stride_row, p.v_stride_head,
                      kv_box_rows);
  return maps;
}

CUtensorMap query_tensor_map(DType dtype, const PrefillParams& p, int head_dim, int q_box_rows) {
  return query_rows_map("q", dtype, p.q, p, head_dim, p.q_stride_row, p.q_stride_head, q_box_rows);
}

bool output_tensor_map(DType dtype, const PrefillParams& p, int head_dim, CUtensorMap* map) {
  const int64_t esize = 2;
  auto describable = [](int64_t extent, int64_t stride_bytes) {
    return extent <= 1 || (stride_bytes > 0 && stride_bytes % 16 == 0 && stride_bytes < (int64_t(1) << 40));
  };
  if (reinterpret_cast<uintptr_t>(p.o) % 16 != 0 || !describable(p.num_qo_heads, p.o_stride_head * esize) ||
      !describable(p.q_rows, p.o_stride_row * esize)) {
    return false;
  }
  *map = query_rows_map("o", dtype, p.o, p, head_dim, p.o_stride_row, p.o_stride_head, 64);
  return true;
}

}  // namespace tessera::kernels::sm90
