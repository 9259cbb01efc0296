// Paged decode attention (sm_80+), driven by the decode planner's work list.
//
// One CTA takes one work item: one request's query rows for one KV head over a KV token range
// [kv_begin, kv_end). The rows are the request's qo_len x group query heads of that KV head, packed
// into one m16 tile (r = query_token * group + head_in_group), so every K/V byte is read once per
// group. More than 16 rows (GQA groups x verification tokens) run as several passes over the KV
// range. The kernel is a composition of parts:
//   decode_config_sm80.cuh    the CTA shape (keys per stage, warps, copy layout, shared memory)
//   decode_mainloop_sm80.cuh  the page gather into a ring of stages, and each warp's step over its
//                             own 16 keys of a stage (S = Q K^T, mask, online softmax, O += P V)
//   decode_epilogue_sm80.cuh  the warps' states combined into O / LSE, or a split chunk's partial
//   decode_merge_sm80.cuh     the split merge, by the CTA that finishes a merge row's last chunk
// Decode is bandwidth-bound: the tensor cores only keep the per-key math off the critical path.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <string>

#include "core/cuda_check.h"
#include "core/once_per_device.h"
#include "kernels/attention/common/logits.cuh"
#include "kernels/attention/common/mask.cuh"
#include "kernels/attention/decode_params.h"
#include "kernels/attention/portable/decode_config_sm80.cuh"
#include "kernels/attention/portable/decode_epilogue_sm80.cuh"
#include "kernels/attention/portable/decode_mainloop_sm80.cuh"
#include "kernels/attention/portable/decode_merge_sm80.cuh"
#include "kernels/attention/portable/row_softmax_sm80.cuh"
#include "kernels/common/dependent_launch.cuh"
#include "kernels/common/mma_sm80.cuh"
#include "tessera/error.h"
#include "tessera_instantiations.h"

namespace tessera::kernels::sm80 {

template <typename T, int kHeadDim, typename Logits, int kStagesT, int kCtasPerSmT>
__global__ void __launch_bounds__(DecodeTileConfig<kHeadDim, kStagesT, kCtasPerSmT>::kThreads,
                                  DecodeTileConfig<kHeadDim, kStagesT, kCtasPerSmT>::kMinBlocksPerSM)
    decode_sm80_kernel(const DecodeParams p) {
  using Cfg = DecodeTileConfig<kHeadDim, kStagesT, kCtasPerSmT>;
  constexpr int kBlockN = Cfg::kBlockN, kRows = Cfg::kRows, kStages = Cfg::kStages;
  using KVTile = SwizzledTile<T, kBlockN, kHeadDim>;

  extern __shared__ __align__(128) unsigned char smem[];
  const SwizzledTile<T, kRows, kHeadDim> q_tile{reinterpret_cast<T*>(smem)};
  auto k_tile = [&](int stage) { return KVTile{reinterpret_cast<T*>(smem + Cfg::kQBytes + stage * Cfg::kStageBytes)}; };
  auto v_tile = [&](int stage) { return KVTile{k_tile(stage).base + kBlockN * kHeadDim}; };
  float* scratch = reinterpret_cast<float*>(smem + Cfg::kQBytes);  // after the KV loop only
  float* stat_max = reinterpret_cast<float*>(smem + Cfg::kQBytes + kStages * Cfg::kStageBytes);
  const WarpStates<Cfg> states{stat_max, stat_max + Cfg::kWarps * kRows, scratch};

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int copy_col = (threadIdx.x % Cfg::kChunksPerRow) * 8;
  const int group = p.num_qo_heads / p.num_kv_heads;
  const Logits logits(p.scale, p.soft_cap);
  const auto q_lane = LdmatrixLane<T, kRows, kHeadDim>::a_operand(q_tile, lane);

  // K/V are read once per step: evict-first in L2 (b1 x 32K: 3.09 vs 3.02 TB/s, same run).
  const uint64_t kv_policy = l2_evict_first_policy();
  // Task t runs work item t / num_kv_heads for KV head t % num_kv_heads (plan::task_of). The item
  // is loaded together with the task count (the grid never exceeds the tasks' capacity, which
  // bounds the items too, so the first load is in bounds): one round trip before the page ids.
  // The plan is read before waiting for the previous kernel: only plan()'s copy writes it, and a
  // copy is never overlapped by a programmatic launch, so under a stream of steps this round trip
  // runs while the previous kernel finishes.
  const int num_tasks = p.header->num_work;
  const int heads = p.num_kv_heads;
  plan::WorkItem next = p.work[blockIdx.x / heads];
  // Launched early behind the previous kernel (programmatic launch): everything below reads or
  // writes memory that kernel may still use (Q, the page table, the pages, the outputs, the
  // merge counters).
  wait_for_preceding_grid();
  for (int task = blockIdx.x; task < num_tasks; task += gridDim.x) {
    const plan::Task w = plan::task_of(next, task % heads);
    const plan::RequestInfo req = next.req;
    if (task + gridDim.x < num_tasks) next = p.work[(task + gridDim.x) / heads];
    // A split task's merge row, loaded now so that the end of the task does not wait for it.
    const plan::MergeRow merge = w.partial_slot >= 0 ? p.merges[w.merge] : plan::MergeRow{};
    const int rows = req.qo_len * group;
    // The band of this chunk's keys: a query row sees keys [0, kv_end) within its causal band and
    // window (bottom-right alignment).
    const MaskBand band{req.qo_len, w.kv_end, req.kv_len - req.qo_len, p.causal, p.window_left};

    for (int r0 = 0; r0 < rows; r0 += kRows) {
      // The keys any row of this pass sees, within the item's range.
      const int qi_first = r0 / group, qi_last = (min(r0 + kRows, rows) - 1) / group;
      const DecodePageGather<T, Cfg, kHeadDim> gather{
          p.kv_indices + req.page_begin,
          static_cast<const T*>(p.k_pages) + int64_t(w.kv_head) * p.k_stride_head + copy_col,
          static_cast<const T*>(p.v_pages) + int64_t(w.kv_head) * p.v_stride_head + copy_col,
          max(w.kv_begin, band.key_begin(qi_first)), band.key_end(qi_last), int(threadIdx.x) / Cfg::kChunksPerRow};
      const int num_tiles = gather.end > gather.begin ? (gather.end - gather.begin + kBlockN - 1) / kBlockN : 0;

      // Q rows r0 .. r0 + 15 (zeros past the request's rows); they join the first stage's group.
      load_q_rows<T, Cfg>(p, q_tile, req.q_start, w.kv_head, group, r0, rows);
      // Prologue: tiles 0 .. kStages - 2 in flight (one commit group each, Q in the first), and
      // the page ids of the next tile to issue in registers.
      static_assert(kStages == 2 || kStages == 3, "the prologue below fills one or two stages");
      int page_ids[Cfg::kRowsPerThread];
      if constexpr (kStages == 3) {
        // The page ids of the first three tiles are requested together (one round trip).
        int first_ids[Cfg::kRowsPerThread];
        if (num_tiles > 0) gather.fetch(p, 0, first_ids);
        if (num_tiles > 1) gather.fetch(p, 1, page_ids);
        if (num_tiles > 0) gather.issue(p, 0, first_ids, k_tile(0), v_tile(0), copy_col, kv_policy);
        cp_async_commit();
        if (num_tiles > 1) gather.issue(p, 1, page_ids, k_tile(1), v_tile(1), copy_col, kv_policy);
        cp_async_commit();
      } else {
        if (num_tiles > 0) gather.fetch(p, 0, page_ids);
        if (num_tiles > 0) gather.issue(p, 0, page_ids, k_tile(0), v_tile(0), copy_col, kv_policy);
        cp_async_commit();
      }
      if (kStages - 1 < num_tiles) gather.fetch(p, kStages - 1, page_ids);
      // The query rows of this lane's two tile rows (g and g + 8), for the mask.
      const int lane_rows[2] = {min(r0 + lane / 4, rows - 1) / group, min(r0 + lane / 4 + 8, rows - 1) / group};
      RowSoftmax<1, /*kTreeMax=*/true, /*kTreeSum=*/false> softmax;
      AccTile<kHeadDim> o;
      fill(o, 0.f);
      uint32_t q_frag[Cfg::kQInRegisters ? kHeadDim / 16 : 1][4];

      for (int tile = 0; tile < num_tiles; ++tile) {
        cp_async_wait<kStages - 2>();
        __syncthreads();  // tile (and Q) landed; every warp is done with tile - 1's stage
        const int refill = tile + kStages - 1;
        if (refill < num_tiles) gather.issue(p, refill, page_ids, k_tile(refill % kStages), v_tile(refill % kStages), copy_col, kv_policy);
        cp_async_commit();
        if (refill + 1 < num_tiles) gather.fetch(p, refill + 1, page_ids);  // lands while this tile computes
        if constexpr (Cfg::kQInRegisters) {
          if (tile == 0) {
#pragma unroll
            for (int ks = 0; ks < kHeadDim / 16; ++ks) ldmatrix_x4(q_frag[ks], q_lane.at(0, ks));
          }
        }
        const int n0 = gather.begin + tile * kBlockN;
        const KVTile kt = k_tile(tile % kStages), vt = v_tile(tile % kStages);
        // Per-key masking only on tiles that cross the range's end or a row's band edge.
        decode_warp_step<T, Cfg>(logits, band, band.tile_crosses_edge(n0, kBlockN, qi_first, qi_last), lane_rows, n0,
                                 q_lane, q_frag, LdmatrixLane<T, kBlockN, kHeadDim>::b_operands(kt, lane),
                                 LdmatrixLane<T, kBlockN, kHeadDim>::a_operand(vt, lane), warp, lane, softmax, o);
      }
      cp_async_wait<0>();
      // The next kernel may start launching once every CTA has streamed its keys (its last pass):
      // it then overlaps this kernel's combines, partial writes and merges. Allowed at the start
      // instead, a stream of steps whose grid leaves SMs or CTA slots free ran 16-17% slower than
      // plain launches (b12 x 8K 3.47 vs 4.15 TB/s, b24 3.63 vs 4.34; here 4.19 and 4.38).
      if (r0 + kRows >= rows) allow_dependent_launch();
      __syncthreads();  // every warp is done with the stages: the combine scratch reuses them
      states.store(softmax, o, logits.log2_scale, warp, lane, r0, rows);
      __syncthreads();
      states.template combine_and_write<T>(p, req, w.kv_head, w.partial_slot, group, r0, rows);
      __syncthreads();  // the scratch and the Q tile are refilled by the next pass
    }

    if (w.partial_slot >= 0) {
      __shared__ int merges_here;
      count_and_merge<T, kHeadDim, Cfg::kThreads>(p, w.merge, merge, req, group, scratch,
                                                  kStages * Cfg::kStageBytes / 4, merges_here);
    }
  }
}

template <typename T, int kHeadDim, typename Logits, int kStages, int kCtasPerSm>
auto decode_kernel_ready() {
  using Cfg = DecodeTileConfig<kHeadDim, kStages, kCtasPerSm>;
  auto kernel = decode_sm80_kernel<T, kHeadDim, Logits, kStages, kCtasPerSm>;
  static detail::OncePerDevice smem_limit_raised;
  smem_limit_raised([&] {
    TESSERA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            Cfg::kSmemBytes));
  });
  return kernel;
}

// launch.programmatic: the kernel may start launching while the previous kernel in the stream
// finishes (sm_90+; the kernel waits for it before touching anything but its own plan).
template <typename Kernel>
void launch_decode_kernel(Kernel kernel, int threads, int smem_bytes, const DecodeParams& p,
                          const DecodeLaunch& launch, cudaStream_t stream) {
  cudaLaunchAttribute attribute[1] = {};
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(launch.decode_ctas);
  config.blockDim = dim3(threads);
  config.dynamicSmemBytes = smem_bytes;
  config.stream = stream;
  config.attrs = attribute;
  config.numAttrs = launch.programmatic ? 1 : 0;
  const cudaError_t status = cudaLaunchKernelEx(&config, kernel, p);
  if (status != cudaSuccess) (void)cudaGetLastError();  // reported here, not again by a later check
  TESSERA_CUDA_CHECK(status);
}

template <typename T, int kHeadDim, int kStages, int kCtasPerSm>
void launch_decode_shape(const DecodeParams& p, const DecodeLaunch& launch, cudaStream_t stream) {
  using Cfg = DecodeTileConfig<kHeadDim, kStages, kCtasPerSm>;
  if (p.soft_cap > 0.f) {
    launch_decode_kernel(decode_kernel_ready<T, kHeadDim, SoftCappedLogits, kStages, kCtasPerSm>(),
                         Cfg::kThreads, Cfg::kSmemBytes, p, launch, stream);
  } else {
    launch_decode_kernel(decode_kernel_ready<T, kHeadDim, PlainLogits, kStages, kCtasPerSm>(),
                         Cfg::kThreads, Cfg::kSmemBytes, p, launch, stream);
  }
}

// The one-CTA-per-SM shape is compiled at hd128 and hd256 with 3 stages (unless the build leaves it
// out: TESSERA_DECODE_ONE_CTA_PER_SM). At hd64 it would take 16 warps of at most 128 registers,
// and ptxas spills there.
template <int kHeadDim>
constexpr bool kHasOneCtaPerSmShape = TESSERA_INST_DECODE_ONE_CTA_PER_SM && kHeadDim >= 128;

[[noreturn]] inline void one_cta_per_sm_not_compiled(int head_dim, int stages) {
  throw Error("tessera: the one-CTA-per-SM decode shape is not compiled for head_dim " +
              std::to_string(head_dim) + " with " + std::to_string(stages) +
              " stages (it exists at head_dim 128 and 256 with 3 stages, TESSERA_DECODE_ONE_CTA_PER_SM)");
}

template <typename T, int kHeadDim>
void launch_decode(const DecodeParams& p, const DecodeLaunch& launch, cudaStream_t stream) {
  if (launch.decode_ctas == 0) return;
  if (launch.one_cta_per_sm) {
    if constexpr (kHasOneCtaPerSmShape<kHeadDim>) {
      if (launch.stages == 3) {
        launch_decode_shape<T, kHeadDim, 3, 1>(p, launch, stream);
        return;
      }
    }
    one_cta_per_sm_not_compiled(kHeadDim, launch.stages);
  }
  if (launch.stages == 2) launch_decode_shape<T, kHeadDim, 2, 2>(p, launch, stream);
  else launch_decode_shape<T, kHeadDim, 3, 2>(p, launch, stream);
}

// Shared memory per CTA of a compiled shape (stages 2 or 3; 1 or 2 CTAs per SM); 0 for a shape
// that is not compiled.
template <int kHeadDim>
int decode_smem_bytes(int stages, int ctas_per_sm) {
  if (ctas_per_sm == 1) {
    if constexpr (kHasOneCtaPerSmShape<kHeadDim>) {
      return stages == 3 ? DecodeTileConfig<kHeadDim, 3, 1>::kSmemBytes : 0;
    }
    return 0;
  }
  return stages == 2 ? DecodeTileConfig<kHeadDim, 2>::kSmemBytes
                     : DecodeTileConfig<kHeadDim, 3>::kSmemBytes;
}

// A decode kernel shape on the current GPU: resident CTAs per SM (what the planner balances a wave
// for), and whether the code the GPU runs was compiled for sm_90 or newer, so that it waits for
// the preceding grid (a GPU that runs it from the compute_80 PTX must get plain launches).
template <typename T, int kHeadDim, int kStages, int kCtasPerSm>
DecodeKernelInfo decode_kernel_info_of() {
  using Cfg = DecodeTileConfig<kHeadDim, kStages, kCtasPerSm>;
  const auto kernel = decode_kernel_ready<T, kHeadDim, PlainLogits, kStages, kCtasPerSm>();
  DecodeKernelInfo info;
  TESSERA_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&info.ctas_per_sm, kernel, Cfg::kThreads,
                                                                   Cfg::kSmemBytes));
  cudaFuncAttributes attributes{};
  TESSERA_CUDA_CHECK(cudaFuncGetAttributes(&attributes, kernel));
  info.waits_for_preceding_grid = attributes.ptxVersion >= 90;
  return info;
}

// The shape (stages, ctas_per_sm) must be compiled and fit the GPU's shared memory
// (decode_smem_bytes); the occupancy it reports may still be lower than ctas_per_sm.
template <typename T, int kHeadDim>
DecodeKernelInfo decode_kernel_info(int stages, int ctas_per_sm) {
  if (ctas_per_sm == 1) {
    if constexpr (kHasOneCtaPerSmShape<kHeadDim>) {
      if (stages == 3) return decode_kernel_info_of<T, kHeadDim, 3, 1>();
    }
    one_cta_per_sm_not_compiled(kHeadDim, stages);
  }
  return stages == 2 ? decode_kernel_info_of<T, kHeadDim, 2, 2>() : decode_kernel_info_of<T, kHeadDim, 3, 2>();
}

}  // namespace tessera::kernels::sm80
