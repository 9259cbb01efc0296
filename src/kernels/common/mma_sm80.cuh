// Warp-level tile primitives of the portable (sm_80+) kernels, as raw PTX: cp.async for
// global->shared copies, ldmatrix for shared->register fragments, mma.sync m16n8k16 with fp32
// accumulation. Raw PTX rather than CuTe atoms because the fragment layouts are the algorithm here
// (P is re-used as an A operand straight from the S accumulators) and are clearer spelled out.
//
// Fragment layouts of mma.m16n8k16 (g = lane / 4, t = lane % 4):
//   A 16x16 (4 x b32): a0 (g, 2t..2t+1)  a1 (g+8, 2t..)  a2 (g, 2t+8..)  a3 (g+8, 2t+8..)
//   B 16x8  (2 x b32): b0 (k 2t..2t+1, n g)  b1 (k 2t+8.., n g)
//   C 16x8  (4 x f32): c0,c1 (g, 2t..2t+1)  c2,c3 (g+8, 2t..2t+1)
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "kernels/common/cp_async.cuh"
#include "kernels/common/pack_half2.cuh"

namespace tessera::kernels::sm80 {

__device__ inline uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte global -> shared copy; `valid == false` writes zeros and reads nothing.
__device__ inline void cp_async_16(void* smem, const void* gmem, bool valid) {
  kernels::cp_async_16(smem_addr(smem), gmem, valid);
}
// An L2 policy that evicts first the lines it tags: for data read exactly once (decode's K/V
// stream), so that it does not push out what is reused (the kernel's partial states, the page table).
__device__ inline uint64_t l2_evict_first_policy() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
  return policy;
}
// cp_async_16 with an L2 cache policy (l2_evict_first_policy).
__device__ inline void cp_async_16(void* smem, const void* gmem, bool valid, uint64_t l2_policy) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;\n" ::"r"(smem_addr(smem)),
               "l"(gmem), "r"(src_bytes), "l"(l2_policy));
}
__device__ inline void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int kPending>
__device__ inline void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

__device__ inline void ldmatrix_x4(uint32_t (&r)[4], const void* smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(smem)));
}
__device__ inline void ldmatrix_x4_trans(uint32_t (&r)[4], const void* smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(smem)));
}

// c += a * b for one m16n8k16 tile; T is __nv_bfloat16 or __half.
template <typename T>
__device__ inline void mma_16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same<T, __nv_bfloat16>::value) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// Two fp32 values packed into one b32 of T (the low half holds `lo`).
template <typename T>
__device__ inline uint32_t pack2(float lo, float hi) {
  return pack_half2<T>(lo, hi);
}

// A tile of kRows x kCols 16-bit elements in shared memory, rows of kCols contiguous elements,
// with the 16-byte chunks of each row XOR-swizzled by (row % 8): the 8 rows an ldmatrix reads
// at one logical chunk land in 8 different bank groups, and so do the 16-byte cp.async writes.
template <typename T, int kRows, int kCols>
struct SwizzledTile {
  static_assert(kCols % 64 == 0, "rows must hold at least 8 chunks of 16 bytes");
  static constexpr int kChunksPerRow = kCols / 8;
  static constexpr int kBytes = kRows * kCols * 2;
  T* base;

  __device__ T* at(int row, int col) const {  // col: a multiple of 8
    const int chunk = (col / 8) ^ (row % 8);
    return base + row * kCols + chunk * 8;
  }
};

// Which row and which 16-byte chunk (of the 16 x 16 block read) lane l addresses in ldmatrix.x4,
// for the two operand layouts of mma.m16n8k16 (the four 8 x 8 matrices land in registers 0..3):
//   a: the A operand, 16 rows x k16 (matrices: rows 0-7 and 8-15 of chunk 0, then of chunk 1);
//      read with .trans from a k-major tile (V: keys x head dims) the same lanes give the B
//      operands of two n8 blocks;
//   b: the B operands of two n8 blocks from an n-major tile (K: keys x head dims; matrices: rows
//      0-7 of chunks 0 and 1, then rows 8-15).
// The lane is unsigned so that % and / are bit operations inside these helpers too: with an int
// lane the compiler simplified them differently once inlined, and the kernels' machine code
// changed.
struct LdmatrixX4 {
  __device__ __forceinline__ static int a_row(unsigned lane) { return (lane % 8) + ((lane / 8) % 2) * 8; }
  __device__ __forceinline__ static int a_chunk(unsigned lane) { return lane / 16; }
  __device__ __forceinline__ static int b_row(unsigned lane) { return (lane % 8) + (lane / 16) * 8; }
  __device__ __forceinline__ static int b_chunk(unsigned lane) { return (lane / 8) % 2; }
};

// Per-lane ldmatrix addressing into a SwizzledTile, for the x4 pattern where lane l reads row
// `row0 + lane_row` and logical chunk `2 * step + lane_chunk` (lane_chunk in {0, 1}), with
// lane_row % 8 == l % 8. Because (2 * step + lane_chunk) ^ (l % 8) only touches the low three
// bits, the swizzled chunk is 8 * (step / 4) + xor_chunk[step % 4]: four per-lane values, and
// every other term is a compile-time offset. Keeps the address registers of a fully unrolled
// tile loop at 4 + 1 instead of one per (row block, step).
template <typename T, int kRows, int kCols>
struct LdmatrixLane {
  const T* row_base;     // tile row `lane_row`, chunk 0
  int xor_chunk[4];

  __device__ LdmatrixLane(const SwizzledTile<T, kRows, kCols>& tile, int lane_row, int lane_chunk) {
    row_base = tile.base + lane_row * kCols;
#pragma unroll
    for (int m = 0; m < 4; ++m) xor_chunk[m] = ((2 * m + lane_chunk) ^ (lane_row % 8)) * 8;
  }
  // The lanes of the two operand layouts of mma.m16n8k16 (LdmatrixX4 above).
  __device__ __forceinline__ static LdmatrixLane a_operand(const SwizzledTile<T, kRows, kCols>& tile, unsigned lane) {
    return LdmatrixLane(tile, LdmatrixX4::a_row(lane), LdmatrixX4::a_chunk(lane));
  }
  __device__ __forceinline__ static LdmatrixLane b_operands(const SwizzledTile<T, kRows, kCols>& tile, unsigned lane) {
    return LdmatrixLane(tile, LdmatrixX4::b_row(lane), LdmatrixX4::b_chunk(lane));
  }
  // Address for row block offset `row0` (a multiple of 8) and k-step `step` (16 columns each).
  __device__ const T* at(int row0, int step) const {
    return row_base + row0 * kCols + (step / 4) * 64 + xor_chunk[step % 4];
  }
  // The same lane addressing `cols` columns to the right (a multiple of 64: whole groups of 8
  // chunks, which the swizzle maps onto themselves), so k-steps count from there.
  __device__ LdmatrixLane shifted(int cols) const {
    LdmatrixLane moved = *this;
    moved.row_base += cols;
    return moved;
  }
};

// Synchronises the `threads` threads (whole warps) that call it with barrier `id` (1..15; 0 is
// __syncthreads'), and orders their shared-memory accesses across it.
__device__ inline void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

}  // namespace tessera::kernels::sm80
