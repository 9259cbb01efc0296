// What the grouped GEMM and combine kernels read (host-visible, no CUDA types but the stream).
#pragma once

#include <cstdint>

#include "tessera/dtype.h"
#include "tessera/stream.h"

namespace tessera::kernels::moe {

enum class GemmEpilogue : int {
  kStore = 0,   // out[r, n] = acc[r, n]
  kSwiGLU = 1,  // out[r, j] = silu(acc[r, j]) * acc[r, n / 2 + j], j < n / 2
};

// For every expert e and row r in [offsets[e], offsets[e + 1]): acc[r, :] = a[r, :] w[e]^T.
// a [rows, k], w [num_experts, n, k], out [rows, n or n / 2]; one 16-bit dtype; k contiguous in
// a and w, columns contiguous in out. offsets is device memory (non-decreasing within [0, rows]).
struct GroupedGemmParams {
  DType dtype = DType::kBF16;
  const void* a = nullptr;
  int64_t a_stride = 0;  // elements between rows
  const void* w = nullptr;
  int64_t w_stride_expert = 0, w_stride_row = 0;
  void* out = nullptr;
  int64_t out_stride = 0;
  const int32_t* offsets = nullptr;  // [num_experts + 1]; nullptr: one expert owning rows [0, rows)
  int64_t rows = 0;                  // rows of the product and out (offsets[num_experts] <= rows)
  // Gathered rows: product row r reads a's row a_row_index[r] ([rows], device; an entry outside
  // [0, a_rows) reads zeros), a being [a_rows, k]; nullptr: row r reads a's row r (a_rows = rows).
  const int32_t* a_row_index = nullptr;
  int64_t a_rows = 0;
  int num_experts = 0;
  int n = 0, k = 0;                  // w's rows and the reduction length
  GemmEpilogue epilogue = GemmEpilogue::kStore;
  // Host-side hint for the tile shape: the expected rows per expert (entries / experts); the
  // kernel reads the real segment sizes on the device.
  int64_t expected_rows_per_expert = 0;
  // The Hopper kernel's token rows per tile (16, 32, 64: swapped; 128), or 0 for its rule from
  // expected_rows_per_expert; set only to measure the shapes against each other (a benchmark or
  // test forcing one through dispatch::force_moe_gemm_token_rows). The portable kernel has one.
  int token_rows = 0;
};
constexpr int kMaxGemmExperts = 1024;

// Hopper (sm_90a, TMA + wgmma): grouped_gemm_sm90.cu, in the build when TESSERA_HOPPER is on.
// Needs k % 8 == 0, the row strides and the expert stride multiples of 8 elements, 16-byte
// aligned bases. Gathered rows: a's tile by the producer warpgroup's cp.async copies, w by TMA.
void launch_grouped_gemm_sm90(const GroupedGemmParams& p, int num_sms, cudaStream_t stream);
// Portable (sm_80+, mma.sync): grouped_gemm_sm80.cu. Same layout rules.
void launch_grouped_gemm_sm80(const GroupedGemmParams& p, int num_sms, cudaStream_t stream);

// out[t, :] = sum_j weights[t, j] y[inverse[t, j], :] (+ shared[t, :]); fp32 sums in j order.
struct CombineParams {
  DType dtype = DType::kBF16;
  const void* y = nullptr;  // [y_rows, hidden]
  int64_t y_stride = 0;
  int64_t y_rows = 0;
  // [tokens, top_k], -1 = dropped; device data the host cannot check, so a row outside
  // [0, y_rows) is skipped like a dropped copy (never read out of bounds)
  const int32_t* inverse = nullptr;
  const float* weights = nullptr;    // [tokens, top_k]
  const void* shared = nullptr;      // optional [tokens, hidden]
  int64_t shared_stride = 0;
  void* out = nullptr;  // [tokens, hidden]
  int64_t out_stride = 0;
  int64_t tokens = 0, hidden = 0;
  int top_k = 0;
};
void launch_combine(const CombineParams& p, cudaStream_t stream);

}  // namespace tessera::kernels::moe
