// Portable grouped GEMM (sm_80+, mma.sync m16n8k16, fp32 accumulation): for every expert e and row
// r of its segment [offsets[e], offsets[e + 1]), acc[r, :] = a[r, :] w[e]^T, stored (kStore) or
// reduced to silu(gate) * up (kSwiGLU). The path for GPUs without wgmma; Hopper runs
// grouped_gemm_sm90.cu.
//
// Tile 128 rows x 128 w rows (output columns) x 32 k; 8 warps as 4 (rows) x 2 (columns), a warp
// 32 rows x 64 columns (64 fp32 accumulators a thread); a 3-stage cp.async pipeline (48 KB, so the
// kernel also fits the 99 KB of sm_86 / sm_89); A and B fragments by ldmatrix, both operands being
// K-major like Q and K in attention's S = Q K^T.
// Scheduling happens on the device, so there is no host synchronisation and the launch can be
// captured in a graph (segment sizes may change between replays): every CTA scans the experts'
// m-tile counts from offsets (none: one expert owning every row) into shared memory, then walks
// tile ids with a grid stride and finds a tile's expert by binary search. Segments may start at
// any row: an m tile covers rows [offsets[e] + 128 i, +128) of its expert, and rows past the
// segment's end load zeros and are not stored. Gathered rows (a_row_index) are looked up once
// per tile by the thread copying them.
// SwiGLU: a tile's B rows are 64 gate rows and the 64 up rows of the same columns, and every warp
// holds matching gate and up columns, so silu(gate) * up is formed in registers.
// Not run on a GPU nor measured yet; its index math was checked by a lane-level host emulation.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "core/cuda_check.h"
#include "core/once_per_device.h"
#include "kernels/attention/common/register_tile.cuh"
#include "kernels/common/mma_sm80.cuh"
#include "kernels/moe/grouped_gemm_params.h"
#include "kernels/moe/grouped_tiles.cuh"
#include "kernels/moe/swiglu.cuh"
#include "tessera/error.h"

namespace tessera::kernels::moe {
namespace {

using sm80::cp_async_16;
using sm80::cp_async_commit;
using sm80::cp_async_wait;
using sm80::ldmatrix_x4;
using sm80::LdmatrixX4;
using sm80::mma_16816;
using sm80::pack2;

constexpr int kBlockM = 128;  // rows of a (one expert's) per tile
constexpr int kBlockN = 128;  // rows of w per tile: output columns, or 64 gate + 64 up rows
constexpr int kBlockK = 32;
constexpr int kStages = 3;
constexpr int kWarpsM = 4, kWarpsN = 2;
constexpr int kThreads = 32 * kWarpsM * kWarpsN;
// 48 KB of stages: with 128 registers a thread, two CTAs fit an SM from sm_80 on (one on sm_86 /
// sm_89), so the grid is two per SM; where only one fits, the grid-stride loop balances the same.
constexpr int kCtasPerSm = 2;

constexpr int kWarpRows = kBlockM / kWarpsM;  // 32
constexpr int kWarpMTiles = kWarpRows / 16;   // m16 tiles a warp
// A warp's columns come from both halves of the B tile, 32 from each (8 n8 blocks): under SwiGLU
// block j (gate) and block j + 4 (up) then hold the same output column in the same lane.
constexpr int kHalfN = kBlockN / 2;
constexpr int kWarpHalfCols = kHalfN / kWarpsN;       // 32
constexpr int kWarpNBlocks = 2 * kWarpHalfCols / 8;   // 8
constexpr int kKSteps = kBlockK / 16;
using WarpAcc = AccTile<8 * kWarpNBlocks>;  // one m16 tile of the warp: 16 rows x 64 columns

// One k slice (kBlockK = 32 elements, 64 bytes a row) of kRows rows in shared memory. Two rows
// share a 128-byte bank line, so the 4 chunks of a row are XOR-swizzled by (row / 2) % 4: the 8
// rows an ldmatrix phase reads at one logical chunk, and the 2 x 4 chunks a cp.async phase writes,
// land in 8 distinct 16-byte bank groups. (mma_sm80.cuh's SwizzledTile needs rows of 8 chunks; a
// 64-wide k slice would take 96 KB for 3 stages, more than sm_86 / sm_89 give a block.)
__host__ __device__ constexpr int k_slice_offset(int row, int chunk) {
  return row * kBlockK + (chunk ^ ((row / 2) % (kBlockK / 8))) * 8;
}
template <typename T, int kRows>
struct KSliceTile {
  static constexpr int kElems = kRows * kBlockK;
  T* base;

  __device__ T* at(int row, int chunk) const { return base + k_slice_offset(row, chunk); }
};
constexpr int kStageElems = (kBlockM + kBlockN) * kBlockK;
constexpr int kSmemBytes = kStages * kStageElems * 2;

template <typename T>
struct Stage {
  KSliceTile<T, kBlockM> a;
  KSliceTile<T, kBlockN> b;  // w rows
};
template <typename T>
__device__ Stage<T> stage_at(T* smem, int s) {
  T* base = smem + s * kStageElems;
  return {{base}, {base + KSliceTile<T, kBlockM>::kElems}};
}

// This lane's ldmatrix.x4 offsets into a KSliceTile for one operand pattern of LdmatrixX4 (lane l
// reads row row0 + lane_row, logical chunk 2 * step + lane_chunk). row0 is a multiple of 8 in every
// use, so the swizzle depends on lane_row alone and the offsets are computed once per lane.
struct KSliceLane {
  int offset[kKSteps];

  __device__ KSliceLane(int lane_row, int lane_chunk) {
#pragma unroll
    for (int s = 0; s < kKSteps; ++s) offset[s] = k_slice_offset(lane_row, 2 * s + lane_chunk);
  }
  template <typename T, int kRows>
  __device__ const T* at(const KSliceTile<T, kRows>& tile, int row0, int step) const {
    return tile.base + row0 * kBlockK + offset[step];
  }
};

// Which w rows the B tile holds, and which output columns a tile covers, per epilogue.
//   kStore:  B row b is w row n0 + b; output columns [n0, n0 + 128), n0 = 128 n_tile.
//   kSwiGLU: B rows [0, 64) are gate rows n0 + b, rows [64, 128) the up rows n / 2 + n0 + b - 64;
//            output columns [n0, n0 + 64), n0 = 64 n_tile.
// Either way the tile count over n is ceil(output columns / output columns a tile).
template <GemmEpilogue kEpilogue>
struct ColumnMap {
  static constexpr bool kSwiGLU = kEpilogue == GemmEpilogue::kSwiGLU;
  static constexpr int kOutColsPerTile = kSwiGLU ? kHalfN : kBlockN;

  __host__ __device__ static int out_cols(int n) { return kSwiGLU ? n / 2 : n; }
  __host__ __device__ static int n_tiles(int n) { return (out_cols(n) + kOutColsPerTile - 1) / kOutColsPerTile; }
  // The w row of B row b, or -1 past the w rows (or gate / up columns) the tile may read.
  __device__ static int w_row(int n, int n0, int b) {
    if constexpr (kSwiGLU) {
      const int col = n0 + b % kHalfN;
      return col < n / 2 ? (b / kHalfN) * (n / 2) + col : -1;
    } else {
      return n0 + b < n ? n0 + b : -1;
    }
  }
};

// One tile of work: rows [row0, row0 + rows) of expert `expert` (rows <= kBlockM: the rest of the
// m tile lies past the segment's end), n tile n_tile.
struct GemmTile {
  int expert;
  int row0;
  int rows;
  int n_tile;
};

// The tile list (grouped_tiles.cuh, the Hopper kernel's too): built by every CTA from offsets,
// expert by expert with m tiles fastest, so the CTAs that run at the same time mostly read the
// same w tile. Column tiles are counted in units of one n tile.
using Tiles = GroupedTiles<kBlockM, kThreads>;

__device__ GemmTile gemm_tile(const Tiles& tiles, int id) {
  const GroupedTile t = tiles.at(id);
  const int rows_left = t.row_end - t.row0;
  return {t.expert, t.row0, rows_left < kBlockM ? rows_left : kBlockM, t.col0};
}

// This thread's share of a stage's copies: tile rows thread / 4 + 64 i of A and of B, chunk
// thread % 4, their source rows fixed for the whole tile. Rows past the segment, w rows past the
// tile's columns and chunks past k are zero-filled (and read nothing; their address is then the
// operand's base, which always exists).
template <typename T, GemmEpilogue kEpilogue>
struct TileLoader {
  static constexpr int kChunksPerRow = kBlockK / 8;
  static constexpr int kRowsPerPass = kThreads / kChunksPerRow;  // 64
  static constexpr int kPasses = kBlockM / kRowsPerPass;
  static_assert(kBlockM == kBlockN, "A and B rows share the copy passes");

  const T* a_row[kPasses];  // this thread's chunk of its A rows (k0 = 0), or null when masked
  const T* w_row[kPasses];
  int row, chunk;

  __device__ TileLoader(const GroupedGemmParams& p, const GemmTile& tile)
      : row(threadIdx.x / kChunksPerRow), chunk(threadIdx.x % kChunksPerRow) {
    const T* a = static_cast<const T*>(p.a);
    const T* w = static_cast<const T*>(p.w) + tile.expert * p.w_stride_expert;
    const int n0 = tile.n_tile * ColumnMap<kEpilogue>::kOutColsPerTile;
#pragma unroll
    for (int i = 0; i < kPasses; ++i) {
      const int r = row + i * kRowsPerPass;
      // Gathered rows: product row row0 + r reads a's row a_row_index[row0 + r]; one outside
      // [0, a_rows) reads zeros.
      int64_t source = r < tile.rows ? int64_t(tile.row0) + r : -1;
      if (p.a_row_index != nullptr && source >= 0) {
        source = p.a_row_index[source];
        if (source >= p.a_rows) source = -1;
      }
      a_row[i] = source >= 0 ? a + source * p.a_stride + chunk * 8 : nullptr;
      const int wr = ColumnMap<kEpilogue>::w_row(p.n, n0, row + i * kRowsPerPass);
      w_row[i] = wr >= 0 ? w + wr * p.w_stride_row + chunk * 8 : nullptr;
    }
  }

  // k columns [k0, k0 + kBlockK) into stage s.
  __device__ void load(const GroupedGemmParams& p, const Stage<T>& s, int k0) const {
    const bool k_inside = k0 + chunk * 8 < p.k;  // k % 8 == 0: a chunk is wholly inside or outside
#pragma unroll
    for (int i = 0; i < kPasses; ++i) {
      const bool a_valid = k_inside && a_row[i] != nullptr;
      const bool w_valid = k_inside && w_row[i] != nullptr;
      cp_async_16(s.a.at(row + i * kRowsPerPass, chunk), a_valid ? a_row[i] + k0 : p.a, a_valid);
      cp_async_16(s.b.at(row + i * kRowsPerPass, chunk), w_valid ? w_row[i] + k0 : p.w, w_valid);
    }
  }
};

// The warp's place in the tile and its ldmatrix lanes.
struct WarpTile {
  int row0;    // first of its kWarpRows rows
  int warp_n;  // which kWarpHalfCols columns of each B half
  KSliceLane a_lane, b_lane;

  __device__ WarpTile(int warp, unsigned lane)
      : row0((warp / kWarpsN) * kWarpRows), warp_n(warp % kWarpsN),
        a_lane(LdmatrixX4::a_row(lane), LdmatrixX4::a_chunk(lane)),
        b_lane(LdmatrixX4::b_row(lane), LdmatrixX4::b_chunk(lane)) {}

  // The B row (tile column) where n8 block j starts: blocks 0-3 in the first half, 4-7 the second.
  __device__ int block_col(int j) const { return (j / 4) * kHalfN + warp_n * kWarpHalfCols + (j % 4) * 8; }

  // acc += A B^T over one k slice; each B fragment serves both m16 tiles.
  template <typename T>
  __device__ void mma_slice(const Stage<T>& s, WarpAcc (&acc)[kWarpMTiles]) const {
#pragma unroll
    for (int ks = 0; ks < kKSteps; ++ks) {
      uint32_t a[kWarpMTiles][4];
#pragma unroll
      for (int mt = 0; mt < kWarpMTiles; ++mt) ldmatrix_x4(a[mt], a_lane.at(s.a, row0 + 16 * mt, ks));
#pragma unroll
      for (int pair = 0; pair < kWarpNBlocks / 2; ++pair) {  // n8 blocks 2 pair, 2 pair + 1
        uint32_t b[4];
        ldmatrix_x4(b, b_lane.at(s.b, block_col(2 * pair), ks));
#pragma unroll
        for (int mt = 0; mt < kWarpMTiles; ++mt) {
          mma_16816<T>(acc[mt].v[2 * pair], a[mt], b[0], b[1]);
          mma_16816<T>(acc[mt].v[2 * pair + 1], a[mt], b[2], b[3]);
        }
      }
    }
  }
};

// The k loop of one tile: stage kt % kStages holds k slice kt; slices kt + 1 and kt + 2 load while
// slice kt is multiplied. Every iteration commits one group (empty past the last slice), so the
// wait below always leaves exactly the kStages - 2 newest groups in flight.
template <typename T, GemmEpilogue kEpilogue>
__device__ void mainloop(const GroupedGemmParams& p, const GemmTile& tile, T* smem, const WarpTile& warp,
                         WarpAcc (&acc)[kWarpMTiles]) {
  const TileLoader<T, kEpilogue> loader(p, tile);
  const int k_slices = (p.k + kBlockK - 1) / kBlockK;
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < k_slices) loader.load(p, stage_at(smem, s), s * kBlockK);
    cp_async_commit();
  }
  for (int kt = 0; kt < k_slices; ++kt) {
    cp_async_wait<kStages - 2>();  // this thread's copies of slice kt have landed
    __syncthreads();  // everyone's have; and every warp is done with slice kt - 1, whose stage is refilled next
    const int next = kt + kStages - 1;
    if (next < k_slices) loader.load(p, stage_at(smem, next % kStages), next * kBlockK);
    cp_async_commit();
    warp.mma_slice(stage_at(smem, kt % kStages), acc);
  }
}

// Writes the warp's accumulators: rows past the segment and columns past the output are skipped.
template <typename T, GemmEpilogue kEpilogue>
__device__ void epilogue(const GroupedGemmParams& p, const GemmTile& tile, const WarpTile& warp, unsigned lane,
                         const WarpAcc (&acc)[kWarpMTiles]) {
  using Columns = ColumnMap<kEpilogue>;
  const int g = lane / 4, t = lane % 4;
  const int n0 = tile.n_tile * Columns::kOutColsPerTile;
  const int out_cols = Columns::out_cols(p.n);
  T* out = static_cast<T*>(p.out);
#pragma unroll
  for (int mt = 0; mt < kWarpMTiles; ++mt) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {  // rows g and g + 8: accumulator elements 2 half, 2 half + 1
      const int r = warp.row0 + 16 * mt + 8 * half + g;
      if (r >= tile.rows) continue;
      T* out_row = out + (int64_t(tile.row0) + r) * p.out_stride;
      const float(&v)[kWarpNBlocks][4] = acc[mt].v;
      if constexpr (Columns::kSwiGLU) {
#pragma unroll
        for (int j = 0; j < kWarpNBlocks / 2; ++j) {  // gate block j, up block j + 4
          const int col = n0 + warp.block_col(j) + 2 * t;
          if (col < out_cols) {
            *reinterpret_cast<uint32_t*>(out_row + col) =
                pack2<T>(swiglu(v[j][2 * half], v[j + 4][2 * half]),
                         swiglu(v[j][2 * half + 1], v[j + 4][2 * half + 1]));
          }
        }
      } else {
#pragma unroll
        for (int j = 0; j < kWarpNBlocks; ++j) {
          const int col = n0 + warp.block_col(j) + 2 * t;
          // n % 8 == 0 and col is even: col < n covers col + 1 too.
          if (col < out_cols) {
            *reinterpret_cast<uint32_t*>(out_row + col) = pack2<T>(v[j][2 * half], v[j][2 * half + 1]);
          }
        }
      }
    }
  }
}

template <typename T, GemmEpilogue kEpilogue>
__global__ void __launch_bounds__(kThreads, kCtasPerSm) grouped_gemm_sm80_kernel(const GroupedGemmParams p) {
  extern __shared__ __align__(128) unsigned char smem_bytes[];
  __shared__ int tiles_storage[Tiles::kSmemBytes / sizeof(int)];
  __shared__ typename Tiles::Scan::TempStorage scan_storage;
  T* smem = reinterpret_cast<T*>(smem_bytes);
  Tiles tiles(tiles_storage, p.num_experts, ColumnMap<kEpilogue>::n_tiles(p.n), 1);
  tiles.build(p.offsets, p.rows, scan_storage);  // ends with __syncthreads
  const unsigned lane = threadIdx.x % 32;
  if (threadIdx.x < 32) Tiles::check_offsets(p.offsets, p.rows, p.num_experts, int(lane));
  const WarpTile warp(threadIdx.x / 32, lane);
  const int num_tiles = tiles.count();
  for (int id = blockIdx.x; id < num_tiles; id += gridDim.x) {
    const GemmTile tile = gemm_tile(tiles, id);
    WarpAcc acc[kWarpMTiles];
#pragma unroll
    for (int mt = 0; mt < kWarpMTiles; ++mt) fill(acc[mt], 0.f);
    mainloop<T, kEpilogue>(p, tile, smem, warp, acc);
    epilogue<T, kEpilogue>(p, tile, warp, lane, acc);
    __syncthreads();  // every warp is done with the stages before the next tile's first loads
  }
}

template <typename T, GemmEpilogue kEpilogue>
void launch_typed(const GroupedGemmParams& p, int num_sms, cudaStream_t stream) {
  auto kernel = grouped_gemm_sm80_kernel<T, kEpilogue>;
  static detail::OncePerDevice smem_limit_raised;
  smem_limit_raised([&] {
    TESSERA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
  });
  // The real tile count is known on the device only. Bound it: every expert adds at most one
  // partial m tile to ceil(rows / kBlockM), and there are never more m tiles than rows.
  const int64_t max_m_tiles = std::min<int64_t>(p.rows, (p.rows + kBlockM - 1) / kBlockM + p.num_experts);
  const int64_t max_tiles = max_m_tiles * ColumnMap<kEpilogue>::n_tiles(p.n);
  const int64_t ctas = std::min<int64_t>(max_tiles, int64_t(std::max(num_sms, 1)) * kCtasPerSm);
  if (ctas == 0) return;
  kernel<<<static_cast<unsigned>(ctas), kThreads, kSmemBytes, stream>>>(p);
  TESSERA_CHECK_LAUNCH();
}

template <typename T>
void launch_epilogue(const GroupedGemmParams& p, int num_sms, cudaStream_t stream) {
  if (p.epilogue == GemmEpilogue::kSwiGLU) launch_typed<T, GemmEpilogue::kSwiGLU>(p, num_sms, stream);
  else launch_typed<T, GemmEpilogue::kStore>(p, num_sms, stream);
}

}  // namespace

// The instantiations: {bf16, fp16} x {kStore, kSwiGLU}.
void launch_grouped_gemm_sm80(const GroupedGemmParams& p, int num_sms, cudaStream_t stream) {
  if (p.num_experts > kMaxGemmExperts) {
    throw Error("tessera: the portable grouped GEMM takes at most " + std::to_string(kMaxGemmExperts) +
                " experts, got " + std::to_string(p.num_experts));
  }
  if (p.rows <= 0 || p.num_experts <= 0 || p.n <= 0) return;  // nothing to write
  if (p.dtype == DType::kBF16) launch_epilogue<__nv_bfloat16>(p, num_sms, stream);
  else if (p.dtype == DType::kFP16) launch_epilogue<__half>(p, num_sms, stream);
  else throw Error(std::string("tessera: the portable grouped GEMM takes bf16 or fp16, not ") + dtype_name(p.dtype));
}

}  // namespace tessera::kernels::moe
