#include "kernels/attention/sm90/tensor_map_sm90.h"

#include <cudaTypedefs.h>  // PFN_cuTensorMapEncodeTiled
#include <cuda_runtime_api.h>

#include <algorithm>
#include <mutex>
#include <string>

#include "tessera/error.h"

namespace tessera::kernels::sm90 {
namespace {

PFN_cuTensorMapEncodeTiled_v12000 encode_function() {
  static PFN_cuTensorMapEncodeTiled_v12000 encode = nullptr;
  static std::once_flag once;
  std::call_once(once, [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found) ==
            cudaSuccess &&
        found == cudaDriverEntryPointSuccess) {
      encode = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
    }
    cudaGetLastError();
  });
  if (encode == nullptr) throw Error("tessera: the CUDA driver does not provide cuTensorMapEncodeTiled (Hopper prefill)");
  return encode;
}

// [rows, heads, head_dim] with element strides row_stride / head_stride (head_dim contiguous).
CUtensorMap ragged_map(const char* what, DType dtype, const void* data, int64_t rows, int64_t heads,
                       int head_dim, int64_t row_stride, int64_t head_stride, int box_rows) {
  CUtensorMap map;
  const int64_t esize = 2;
  const cuuint64_t dims[3] = {cuuint64_t(head_dim), cuuint64_t(heads), cuuint64_t(std::max<int64_t>(rows, 1))};
  // A dimension of extent 1 may have any stride; the copy engine still wants a multiple of 16 bytes.
  const int64_t head_bytes = heads == 1 ? int64_t(head_dim) * esize : head_stride * esize;
  const int64_t row_bytes = rows <= 1 ? heads * int64_t(head_dim) * esize : row_stride * esize;
  const cuuint64_t strides[2] = {cuuint64_t(head_bytes), cuuint64_t(row_bytes)};
  const cuuint32_t box[3] = {64, 1, cuuint32_t(box_rows)};
  const cuuint32_t element_strides[3] = {1, 1, 1};
  const CUresult r = encode_function()(
      &map, dtype == DType::kBF16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 3,
      const_cast<void*>(data), dims, strides, box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
      CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    throw Error(std::string("tessera: the copy engine cannot describe ") + what + " (cuTensorMapEncodeTiled error " +
                std::to_string(int(r)) + ": row stride " + std::to_string(row_stride) + ", head stride " +
                std::to_string(head_stride) + " elements)");
  }
  return map;
}

// One page tensor: dims (innermost first) head_dim, the head / token dims in stride order, pages;
// strides in elements. A dimension of extent 1 takes the dense stride (see ragged_map).
CUtensorMap paged_map(const char* what, DType dtype, const void* data, const PrefillParams& p, int head_dim,
                      int64_t head_stride, int64_t token_stride, int64_t page_stride, bool token_first,
                      int box_rows) {
  CUtensorMap map;
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
  const cuuint64_t dims[4] = {cuuint64_t(head_dim), cuuint64_t(extent1), cuuint64_t(extent2), cuuint64_t(pages)};
  const cuuint64_t strides[3] = {cuuint64_t(stride1), cuuint64_t(stride2), cuuint64_t(stride3)};
  const cuuint32_t box[4] = {64, token_first ? cuuint32_t(box_rows) : 1u, token_first ? 1u : cuuint32_t(box_rows), 1};
  const cuuint32_t element_strides[4] = {1, 1, 1, 1};
  const CUresult r = encode_function()(
      &map, dtype == DType::kBF16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 4,
      const_cast<void*>(data), dims, strides, box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
      CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    throw Error(std::string("tessera: the copy engine cannot describe ") + what + " (cuTensorMapEncodeTiled error " +
                std::to_string(int(r)) + ": page stride " + std::to_string(page_stride) + ", token stride " +
                std::to_string(token_stride) + ", head stride " + std::to_string(head_stride) + " elements)");
  }
  return map;
}

int gcd(int a, int b) { return b == 0 ? a : gcd(b, a % b); }

}  // namespace

PagedTensorMaps paged_tensor_maps(DType dtype, const PrefillParams& p, int head_dim, int q_box_rows,
                                  int kv_tile_rows) {
  if (p.page_size % 8 != 0) {
    throw Error("tessera: the Hopper prefill family reads pages of a multiple of 8 tokens; page_size is " +
                std::to_string(p.page_size));
  }
  PagedTensorMaps maps;
  maps.q = ragged_map("q", dtype, p.q, p.q_rows, p.num_qo_heads, head_dim, p.q_stride_row, p.q_stride_head,
                      q_box_rows);
  maps.kv_box_rows = gcd(p.page_size, kv_tile_rows);
  // The token dim goes second when it is the closer one in memory (HND pages, or one head).
  maps.k_token_dim_first = p.num_kv_heads > 1 && int64_t(p.k_stride_token) < p.k_stride_head;
  maps.v_token_dim_first = p.num_kv_heads > 1 && int64_t(p.v_stride_token) < p.v_stride_head;
  maps.k = paged_map("k_pages", dtype, p.k, p, head_dim, p.k_stride_head, p.k_stride_token, p.k_stride_page,
                     maps.k_token_dim_first, maps.kv_box_rows);
  maps.v = paged_map("v_pages", dtype, p.v, p, head_dim, p.v_stride_head, p.v_stride_token, p.v_stride_page,
                     maps.v_token_dim_first, maps.kv_box_rows);
  return maps;
}

RaggedTensorMaps ragged_tensor_maps(DType dtype, const PrefillParams& p, int head_dim, int q_box_rows,
                                    int kv_box_rows) {
  RaggedTensorMaps maps;
  maps.q = ragged_map("q", dtype, p.q, p.q_rows, p.num_qo_heads, head_dim, p.q_stride_row, p.q_stride_head,
                      q_box_rows);
  // With no K / V rows nothing is ever loaded; the maps still need a valid address.
  const bool no_kv = p.kv_rows == 0;
  maps.k = ragged_map("k", dtype, no_kv ? p.q : p.k, p.kv_rows, p.num_kv_heads, head_dim, p.k_stride_row, p.k_stride_head,
                      kv_box_rows);
  maps.v = ragged_map("v", dtype, no_kv ? p.q : p.v, p.kv_rows, p.num_kv_heads, head_dim, p.v_stride_row, p.v_stride_head,
                      kv_box_rows);
  return maps;
}

}  // namespace tessera::kernels::sm90
