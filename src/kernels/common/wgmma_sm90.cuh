// Warpgroup matrix products of sm_90a (wgmma) and what they read:
//   - Sw128Tile: a tile of 16-bit elements in shared memory as the copy engine writes it with
//     128-byte swizzling (a TMA box 64 elements wide per call): kCols / 64 column blocks, each
//     kRows rows of 128 bytes, the 16-byte chunks of row r XOR-ed with r % 8. It is the canonical
//     128B-swizzled layout of wgmma operands, read through matrix descriptors:
//       K-major (rows are M or N, the 64 contiguous elements are K): S = Q K^T's Q and K;
//       MN-major (rows are K, the contiguous elements are N): O += P V's V, read transposed.
//   - Wgmma<T, N>: D[64 x N] (+)= A[64 x 16] B[16 x N] over one warpgroup, fp32 accumulators in an
//     AccTile<N> per warp (register_tile.cuh), A from shared memory (ss) or registers (rs). The
//     instructions are CuTe's atoms from the pinned CUTLASS package (cute/arch/mma_sm90_gmma*.hpp:
//     one asm statement per shape with its 32-128 accumulator operands); the layouts, descriptors
//     and the kernel's use of them are written here, without CuTe's layout algebra (which costs
//     minutes of compile time per kernel on the build machines this project targets).
//   - register reallocation between warpgroups (setmaxnreg) and the wgmma fences.
// Device code for sm_90a only (the sm_90a target of the Hopper family).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <utility>

#include <cute/arch/mma_sm90_gmma.hpp>
#include <cute/arch/mma_sm90_gmma_ext.hpp>  // the N that are not multiples of 32 (80, 112, 144, 176)

#include "kernels/attention/common/register_tile.cuh"
#include "kernels/common/tma_sm90.cuh"

namespace tessera::kernels::sm90 {

// ---- Shared-memory tiles and their descriptors -------------------------------------------------

template <typename T, int kRowsT, int kColsT>
struct Sw128Tile {
  static_assert(sizeof(T) == 2, "16-bit elements");
  static constexpr int kRows = kRowsT, kCols = kColsT;
  static constexpr int kBlockCols = 64;  // 128 bytes: one swizzle row
  static constexpr int kColBlocks = kCols / kBlockCols;
  static constexpr int kBlockBytes = kRows * 128;
  static constexpr int kBytes = kColBlocks * kBlockBytes;
  static_assert(kCols % kBlockCols == 0 && kRows % 8 == 0, "whole 8-row x 128-byte swizzle atoms");
  unsigned char* base;  // 1024-byte aligned: the swizzle pattern is one of address bits

  __device__ unsigned char* block(int c) const { return base + c * kBlockBytes; }

  // wgmma descriptor fields: start address, leading and stride byte offsets (16-byte units), and
  // the 128-byte swizzle mode.
  __device__ static uint64_t descriptor(uint32_t addr, uint32_t leading_bytes, uint32_t stride_bytes) {
    return descriptor_plus(addr, leading_bytes, stride_bytes, 0);
  }
  // K-major operand: rows [row0, row0 + M or N) and K columns [16 k, 16 k + 16). Within a 128-byte
  // row the k-step is a 32-byte offset of the start address (the hardware applies the swizzle to
  // the address it computes); 8-row groups are 1024 bytes apart; the leading offset is unused.
  __device__ uint64_t k_major(int row0, int k) const {
    return descriptor_plus(smem_u32(base), 16, 1024, (k / 4) * kBlockBytes + row0 * 128 + (k % 4) * 32);
  }
  // MN-major operand (read transposed): K rows [16 k, 16 k + 16) (two groups of 8 rows, 1024 bytes
  // apart) and all kCols N columns (64-column blocks kBlockBytes apart).
  __device__ uint64_t mn_major(int k) const { return descriptor_plus(smem_u32(base), kBlockBytes, 1024, k * 16 * 128); }
  // The descriptor of base + offset as the base's low word plus offset / 16: one 32-bit add a
  // product once the base's word is formed (shared::cta addresses are below 2^18, so the 14-bit
  // address field never carries into the leading offset). Masking and shifting each address took
  // 3-4 uniform instructions a product: the hd128 192-key loop ran 712 instructions a warp per KV
  // tile against FA3's 659, now 659; same run, H100, +0.4 to +1.7% from 4K, even below
  // (notes/prefill_hopper.md v13).
  __device__ static uint64_t descriptor_plus(uint32_t base_addr, uint32_t leading_bytes, uint32_t stride_bytes,
                                             uint32_t offset) {
    const uint32_t lo = ((base_addr & 0x3FFFF) >> 4 | (leading_bytes >> 4) << 16) + (offset >> 4);
    const uint32_t hi = stride_bytes >> 4 | uint32_t(1) << 30;
    return uint64_t(hi) << 32 | lo;
  }
  // Zeroes rows [from_row, kRows) of every column block, `lanes` threads from `lane`. A row of a
  // block is 128 contiguous bytes whatever the swizzle.
  __device__ void zero_rows(int from_row, int lane, int lanes) const {
    const int chunks = (kRows - from_row) * 8;  // 16-byte chunks per column block
    for (int c = 0; c < kColBlocks; ++c) {
      uint4* dst = reinterpret_cast<uint4*>(block(c) + from_row * 128);
      for (int i = lane; i < chunks; i += lanes) dst[i] = make_uint4(0, 0, 0, 0);
    }
  }
  // The whole tile by TMA from a 3-D tensor map over [rows, heads, kCols] (box 64 x 1 x kRows):
  // one copy per column block, all completing on `bar`.
  __device__ void load(const CUtensorMap* map, Mbarrier* bar, int head, int row0) const {
#pragma unroll
    for (int c = 0; c < kColBlocks; ++c) tma_load_3d(map, bar, block(c), c * kBlockCols, head, row0);
  }
  // The boxes load() would copy, into the L2 only.
  __device__ static void prefetch_l2(const CUtensorMap* map, int head, int row0) {
#pragma unroll
    for (int c = 0; c < kColBlocks; ++c) tma_prefetch_l2_3d(map, c * kBlockCols, head, row0);
  }
};

// The same operands with the column blocks interleaved per 8-row group: group g (rows 8g .. 8g + 7)
// holds its kColBlocks 1024-byte swizzle atoms side by side, so one TMA box of 8 x 64 elements x
// kColBlocks x (rows / 8) lands all columns of a run of rows (a page's rows: one copy per page
// instead of one per column block; kv_source_sm90.cuh). The descriptors' 8-row stride is then
// kGroupBytes and the column blocks are 1024 bytes apart.
template <typename T, int kRowsT, int kColsT>
struct Sw128GroupedTile {
  static_assert(sizeof(T) == 2, "16-bit elements");
  static constexpr int kRows = kRowsT, kCols = kColsT;
  static constexpr int kBlockCols = 64;
  static constexpr int kColBlocks = kCols / kBlockCols;
  static constexpr int kGroupBytes = kColBlocks * 1024;
  static constexpr int kBytes = (kRows / 8) * kGroupBytes;
  static_assert(kCols % kBlockCols == 0 && kRows % 8 == 0, "whole 8-row x 128-byte swizzle atoms");
  unsigned char* base;  // 1024-byte aligned

  // Row `row` (a multiple of 8) of column block c.
  __device__ unsigned char* atom(int row, int c) const { return base + (row / 8) * kGroupBytes + c * 1024; }
  __device__ uint64_t k_major(int row0, int k) const {
    const uint32_t addr = smem_u32(atom(row0, k / 4)) + (k % 4) * 32;
    return Sw128Tile<T, 8, 64>::descriptor(addr, 16, kGroupBytes);
  }
  __device__ uint64_t mn_major(int k) const {
    return Sw128Tile<T, 8, 64>::descriptor(smem_u32(base) + 2 * k * kGroupBytes, 1024, kGroupBytes);
  }
  __device__ void zero_rows(int from_row, int lane, int lanes) const {
    constexpr int kChunksPerRow = kColBlocks * 8;  // 16-byte chunks
    const int chunks = (kRows - from_row) * kChunksPerRow;
    for (int i = lane; i < chunks; i += lanes) {
      const int row = from_row + i / kChunksPerRow, rest = i % kChunksPerRow;
      uint4* dst = reinterpret_cast<uint4*>(atom(row & ~7, rest / 8) + (row % 8) * 128 + (rest % 8) * 16);
      *dst = make_uint4(0, 0, 0, 0);
    }
  }
  // Rows [row, row + box_rows) in one copy from a 5-D map whose box is 64 x 8 x kColBlocks x
  // (box_rows / 8) x 1 (tensor_map_sm90.cpp, grouped maps), at coordinates (0, 0, c2, c3, c4).
  __device__ void load_grouped_rows(const CUtensorMap* map, Mbarrier* bar, int row, int c2, int c3, int c4) const {
    tma_load_5d(map, bar, atom(row, 0), 0, 0, c2, c3, c4);
  }
  // The same rows from a 4-D map over the pages (innermost first: head_dim, the page's token and
  // head dims in stride order, pages), at (column, c1, c2, page); the token coordinate is c1 or c2
  // as token_first says. With one column block the layout is Sw128Tile's and the map's boxes are
  // box_rows x 64: one copy; else 8 x 64 boxes, one copy per 8-row group and column block.
  __device__ void load_page_rows(const CUtensorMap* map, Mbarrier* bar, int row, int box_rows, bool token_first,
                                 int c1, int c2, int page) const {
    if constexpr (kColBlocks == 1) {
      tma_load_4d(map, bar, atom(row, 0), 0, c1, c2, page);
      return;
    }
    for (int g = 0; g < box_rows; g += 8) {
#pragma unroll
      for (int c = 0; c < kColBlocks; ++c)
        tma_load_4d(map, bar, atom(row + g, c), c * kBlockCols, token_first ? c1 + g : c1, token_first ? c2 : c2 + g, page);
    }
  }
};

// ---- Warpgroup synchronisation and registers -----------------------------------------------------

// Registers per thread of the calling warpgroup (the kernel must be compiled with a register cap:
// __launch_bounds__(threads, 1)).
template <int kRegisters>
__device__ __forceinline__ void warpgroup_registers_increase() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
}
template <int kRegisters>
__device__ __forceinline__ void warpgroup_registers_decrease() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
}

// Orders this warpgroup's register writes (accumulators, register A) before its next wgmma.
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// Waits until at most kPending committed groups of this warpgroup are in flight.
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}
// Keeps the compiler from moving accesses of the tile's registers across a wgmma boundary (the
// hardware reads and writes them asynchronously between issue and wait).
template <int kCols>
__device__ __forceinline__ void fence_registers(AccTile<kCols>& tile) {
#pragma unroll
  for (int j = 0; j < AccTile<kCols>::kBlocks; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(tile.v[j][e])::"memory");
}
template <typename T, int kCols>
__device__ __forceinline__ void fence_registers(AFragments<T, kCols>& f) {
#pragma unroll
  for (int k = 0; k < kCols / 16; ++k)
#pragma unroll
    for (int i = 0; i < 4; ++i) asm volatile("" : "+r"(f.a[k][i])::"memory");
}

// ---- The products ------------------------------------------------------------------------------

namespace gmma = cute::SM90::GMMA;

template <typename T, int N>
struct GmmaAtoms;  // the CuTe atoms of shape 64 x N x 16 with fp32 accumulators

#define TESSERA_GMMA_ATOMS(N)                                                                        \
  template <>                                                                                        \
  struct GmmaAtoms<__nv_bfloat16, N> {                                                               \
    template <gmma::Major kB>                                                                        \
    using SS = gmma::MMA_64x##N##x16_F32BF16BF16_SS<gmma::Major::K, kB>;                             \
    template <gmma::Major kB>                                                                        \
    using RS = gmma::MMA_64x##N##x16_F32BF16BF16_RS<gmma::Major::K, kB>;                             \
  };                                                                                                 \
  template <>                                                                                        \
  struct GmmaAtoms<__half, N> {                                                                      \
    template <gmma::Major kB>                                                                        \
    using SS = gmma::MMA_64x##N##x16_F32F16F16_SS<gmma::Major::K, kB>;                               \
    template <gmma::Major kB>                                                                        \
    using RS = gmma::MMA_64x##N##x16_F32F16F16_RS<gmma::Major::K, kB>;                               \
  };
// The N of the tile shapes in use (keys of S = Q K^T, head dims of O += P V; the grouped GEMM's
// token tiles of 16 / 32 rows in its few-tokens shape).
TESSERA_GMMA_ATOMS(16)
TESSERA_GMMA_ATOMS(32)
TESSERA_GMMA_ATOMS(64)
TESSERA_GMMA_ATOMS(80)
TESSERA_GMMA_ATOMS(96)
TESSERA_GMMA_ATOMS(112)
TESSERA_GMMA_ATOMS(128)
TESSERA_GMMA_ATOMS(144)
TESSERA_GMMA_ATOMS(160)
TESSERA_GMMA_ATOMS(176)
TESSERA_GMMA_ATOMS(192)
TESSERA_GMMA_ATOMS(256)
#undef TESSERA_GMMA_ATOMS

namespace detail {
template <typename Atom, int kCols, size_t... I>
__device__ __forceinline__ void gmma_ss(uint64_t a, uint64_t b, AccTile<kCols>& d, bool accumulate,
                                        std::index_sequence<I...>) {
  Atom::fma(a, b, d.v[I / 4][I % 4]..., accumulate ? gmma::ScaleOut::One : gmma::ScaleOut::Zero);
}
template <typename Atom, int kCols, size_t... I>
__device__ __forceinline__ void gmma_rs(const uint32_t (&a)[4], uint64_t b, AccTile<kCols>& d,
                                        std::index_sequence<I...>) {
  Atom::fma(a[0], a[1], a[2], a[3], b, d.v[I / 4][I % 4]..., gmma::ScaleOut::One);
}
}  // namespace detail

// One k16 step, issued by the whole warpgroup (call between wgmma_fence and wgmma_commit).
// d: this warp's 16 rows of the 64 x N accumulator; accumulate = false overwrites d.
template <typename T, int N, gmma::Major kMajorB>
__device__ __forceinline__ void wgmma_ss(uint64_t a_desc, uint64_t b_desc, AccTile<N>& d, bool accumulate) {
  detail::gmma_ss<typename GmmaAtoms<T, N>::template SS<kMajorB>>(a_desc, b_desc, d, accumulate,
                                                                   std::make_index_sequence<N / 2>{});
}
template <typename T, int N, gmma::Major kMajorB>
__device__ __forceinline__ void wgmma_rs(const uint32_t (&a)[4], uint64_t b_desc, AccTile<N>& d) {
  detail::gmma_rs<typename GmmaAtoms<T, N>::template RS<kMajorB>>(a, b_desc, d, std::make_index_sequence<N / 2>{});
}

}  // namespace tessera::kernels::sm90
