// Paged decode attention (sm_80+), driven by the decode planner's work list.
//
// One CTA takes one work item: one request's query rows for one KV head over a KV token range
// [kv_begin, kv_end). The rows are the request's qo_len x group query heads of that KV head, packed
// into one m16 tile (r = query_token * group + head_in_group), so every K/V byte is read once per
// group. K and V stream through a ring of kStages shared-memory stages (cp.async, 32 KB per stage
// with two CTAs per SM, 64 KB with one: DecodeTileConfig)
// gathered from pages: each 16-byte chunk finds its page through the page table, whose ids for the
// next stage are loaded into registers one stage ahead so their latency stays off the copy issue.
// Each warp owns 16 keys of every stage (S = Q K^T, online softmax and O += P V with mma.sync on its
// own keys); at the end the warps' partial states are combined through shared memory and written
// as O / LSE, or as fp32 partial states of a split request, which the CTA that finishes the
// request's last chunk merges.
// Decode is bandwidth-bound: the tensor cores only keep the per-key math off the critical path.
// More than 16 rows (GQA groups x verification tokens) run as several passes over the KV range.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <string>

#include "core/cuda_check.h"
#include "core/once_per_device.h"
#include "kernels/attention/decode_params.h"
#include "kernels/attention/common/logits.cuh"
#include "kernels/common/bulk_copy_sm90.cuh"
#include "kernels/common/dependent_launch.cuh"
#include "kernels/common/device_check.cuh"
#include "kernels/common/mma_sm80.cuh"
#include "kernels/common/vec8.cuh"
#include "tessera/error.h"
#include "tessera_instantiations.h"

namespace tessera::kernels::sm80 {

// kStagesT: 3 wherever the shared memory allows (every sm_80/sm_90 part), 2 on GPUs with 99 KB
// per block (sm_86, sm_89), where three stages at hd128/hd256 (103/107 KB) cannot launch.
// kCtasPerSmT: the CTA shape. 2: two CTAs share an SM, each with 32 KB stages (the default). 1: one
// CTA per SM with twice the warps and 64 KB stages, the same registers and shared memory per SM
// (sm_90's 227 KB; hd128 and hd256). The planner picks it where it pays (decode_plan.h): mostly a
// batch whose (request, KV head) items about fill the SMs, which it then runs unsplit (no
// partials, no merge). Measured gains and losses: notes/decode.md, v12.
template <int kHeadDim, int kStagesT = 3, int kCtasPerSmT = 2>
struct DecodeTileConfig {
  static_assert(kCtasPerSmT == 1 || kCtasPerSmT == 2, "one or two CTAs per SM");
  static constexpr int kCtasPerSm = kCtasPerSmT;
  static constexpr int kBlockN = 16384 / (kHeadDim * kCtasPerSm);  // keys per stage: K + V are 64 KB per SM
  static constexpr int kWarps = kBlockN / 16;      // each warp owns 16 keys of every stage
  static constexpr int kThreads = kWarps * 32;
  // Measured on H200 (hd128, NHD page 16, see notes/decode.md): 3 stages x 2 CTAs per SM beat
  // 2 stages x 3 CTAs (b64 x 4K: 4.32 vs 3.86 TB/s, a wave-quantisation tail) and 4 or 6 stages
  // x 1 CTA of 4 warps (2.5 and 2.3 TB/s: one 4-warp CTA per SM cannot issue the copies fast
  // enough; the one-CTA-per-SM shape has 8).
  static constexpr int kStages = kStagesT;
  static constexpr int kMinBlocksPerSM = kCtasPerSm;
  static constexpr int kRows = 16;                 // query rows per pass: one m16 tile
  static constexpr int kChunksPerRow = kHeadDim / 8;  // 16-byte chunks of one K/V/Q row
  // A thread copies one chunk column of kRowsPerThread rows, kRowStep apart, of each stage.
  static constexpr int kRowStep = kThreads / kChunksPerRow;
  static constexpr int kRowsPerThread = kBlockN / kRowStep;
  static constexpr int kScratchStride = kHeadDim + 8;  // fp32 combine rows, padded against bank conflicts
  static constexpr int kQBytes = kRows * kHeadDim * 2;
  static constexpr int kStageBytes = 2 * kBlockN * kHeadDim * 2;
  static constexpr int kStatBytes = 2 * kWarps * kRows * 4;
  static constexpr int kSmemBytes = kQBytes + kStages * kStageBytes + kStatBytes;
  // Q fragments live in registers across the KV loop up to hd128 (32 registers); at hd256 the O
  // accumulators alone take 128, so Q is re-read from shared memory.
  static constexpr bool kQInRegisters = kHeadDim <= 128;
  static_assert(kThreads % kChunksPerRow == 0 && kBlockN % kRowStep == 0, "copy layout");
  static_assert(kWarps * kRows * kScratchStride * 4 <= kStages * kStageBytes &&
                    (kThreads * 4 + kThreads / (kHeadDim / 4) * (kHeadDim + 1)) * 4 <=
                        kStages * kStageBytes,
                "the combine and merge scratch reuse the stages");
};

// token / page_size without a division: (umulhi(token, magic) + token) >> shift, exact for any
// page size 1..2^31 and token < 2^31 (Granlund-Montgomery; magic and shift come from the host).
// Branch-free, 3 instructions: the copy loop computes it for every row of every stage.
__device__ inline int page_index(const DecodeParams& p, int token) {
  const unsigned t = static_cast<unsigned>(token);
  return static_cast<int>((__umulhi(t, p.page_magic) + t) >> p.page_shift);
}


// Per-row statistics of a split merge: the largest chunk LSE, the reciprocal of the sum of the
// chunks' weights e^(lse - max), the merged LSE, and whether a NaN LSE poisons the row.
struct MergeRowStats {
  float max_lse, inv_sum, lse;
  bool nan;
};

// Reduces the LSEs of one row over `num_slots` chunk partials (`stride` floats apart) with one
// warp: each lane keeps a running (max, sum) of its slots, then the lanes are combined. States at
// -inf contribute nothing; no contributor gives inv_sum 0 and LSE -inf.
__device__ inline MergeRowStats reduce_row_lses(const float* lse, int64_t stride, int num_slots) {
  constexpr float kLog2e = 1.4426950408889634f;
  const int lane = threadIdx.x % 32;
  float max_lse = -INFINITY, sum = 0.f;
  bool nan = false;
  for (int s = lane; s < num_slots; s += 32) {
    const float v = __ldcg(lse + s * stride);  // written by other CTAs of this launch: read from L2
    nan = nan || isnan(v);
    if (!(v > -INFINITY)) continue;
    if (v > max_lse) {
      sum = fmaf(sum, exp2f((max_lse - v) * kLog2e), 1.f);
      max_lse = v;
    } else {
      sum += exp2f((v - max_lse) * kLog2e);
    }
  }
  float row_max = max_lse;
#pragma unroll
  for (int d = 16; d > 0; d /= 2) row_max = fmaxf(row_max, __shfl_xor_sync(0xffffffffu, row_max, d));
  float row_sum = sum > 0.f ? sum * exp2f((max_lse - row_max) * kLog2e) : 0.f;
#pragma unroll
  for (int d = 16; d > 0; d /= 2) row_sum += __shfl_xor_sync(0xffffffffu, row_sum, d);
  nan = __any_sync(0xffffffffu, nan);
  MergeRowStats st;
  st.max_lse = row_max;
  st.inv_sum = row_sum > 0.f ? 1.f / row_sum : 0.f;
  st.lse = nan ? NAN : (row_sum > 0.f ? row_max + logf(row_sum) : -INFINITY);
  st.nan = nan;
  return st;
}

// Merges the chunk partials of one split (request, KV head) into O / LSE: run by the CTA that
// finished the request's last chunk. Closed form: per row, O = sum_s w_s o_s with
// w_s = e^(lse_s - max) / sum_t e^(lse_t - max), so the slots' multiply-adds are independent (an
// online max/rescale per slot chained them). At batch 1 x 32K (33 slots per head) the merge takes
// ~3.4 us after the last chunk's count (timeline in notes/decode.md).
// Per round of rows: the partial rows are staged into shared memory (bulk copies on sm_90,
// 16-byte cp.async before), while one warp per row reduces its LSEs from global memory; the
// slots' weights replace their staged LSEs; then each (row, 4-element vector) is accumulated by
// `lanes` threads over interleaved slots, whose sums are added in a fixed order: the result does
// not depend on which CTA merges.
template <typename T, int kHeadDim, int kThreads>
__device__ void merge_chunk_partials(const DecodeParams& p, const plan::MergeRow& m,
                                     const plan::RequestInfo& req, int group, float* scratch,
                                     int scratch_floats) {
  constexpr float kLog2e = 1.4426950408889634f;
  constexpr int kVecs = kHeadDim / 4;  // a thread owns 4 consecutive elements of a row
  constexpr int kWarps = kThreads / 32;
  constexpr int kRoundRows = kThreads / kVecs;  // rows of a round when one thread owns a vector
  static_assert(kThreads % kVecs == 0, "a round of pairs covers whole rows");
  __shared__ MergeRowStats row_stats[kRoundRows];
  const int rows = req.qo_len * group;
  const int pairs = rows * kVecs;
  const int lanes = pairs >= kThreads ? 1 : kThreads / pairs;
  const int per_round = kThreads / lanes;
  const int64_t first_row = p.slot_rows[m.first_slot];
  float* stash = scratch + scratch_floats - kThreads * 4;
  float* staged = scratch;  // [slot][row of this base][kHeadDim], then the LSEs [slot][row]
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  __shared__ __align__(8) uint64_t bulk_barrier;
  BulkStaging bulk(&bulk_barrier);
  // The partials were written by other CTAs through the generic proxy; the bulk copies read them
  // through the async proxy.
  asm volatile("fence.proxy.async.global;\n" ::: "memory");
#endif
  for (int base = 0; base < pairs; base += per_round) {
    const int row0 = base / kVecs;
    const int nrows = min(rows - row0, per_round / kVecs);
    const int u = base + threadIdx.x % per_round;
    const int lane = threadIdx.x / per_round;
    const bool active = u < pairs && lane < lanes;
    const int rr = u / kVecs, col = (u % kVecs) * 4;
    const int slot_floats = nrows * (kHeadDim + 1);
    const int max_slots = (scratch_floats - kThreads * 4) / slot_floats;
    float acc[4] = {};
    for (int s0 = 0; s0 < m.num_slots; s0 += max_slots) {
      const int n = min(max_slots, m.num_slots - s0);
      float* staged_lse = staged + n * nrows * kHeadDim;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
      // Bulk copies: 16-byte cp.async copies of 33 slots took 3.6 us at batch 1 x 32K, one SM's
      // fetch rate. When the round holds all the rows, its slots are one contiguous block and take
      // one copy (one per slot took 1.4 us to issue at 33 slots: the issue is serial).
      const float* first = p.partial_o + (first_row + int64_t(s0) * rows + row0) * kHeadDim;
      if (nrows == rows) bulk.stage(first, 0, staged, n * rows * kHeadDim, 1);
      else bulk.stage(first, int64_t(rows) * kHeadDim, staged, nrows * kHeadDim, n);
#else
      const int chunks_per_slot = nrows * kHeadDim / 4;
      for (int c = threadIdx.x; c < n * chunks_per_slot; c += kThreads) {
        const int s = c / chunks_per_slot, within = c - s * chunks_per_slot;
        const float* src = p.partial_o + (first_row + int64_t(s0 + s) * rows + row0) * kHeadDim + within * 4;
        cp_async_16(staged + s * nrows * kHeadDim + within * 4, src, true);
      }
#endif
      for (int c = threadIdx.x; c < n * nrows; c += kThreads) {
        const int s = c / nrows, r = c - s * nrows;
        asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(smem_addr(staged_lse + c)),
                     "l"(p.partial_lse + first_row + int64_t(s0 + s) * rows + row0 + r));
      }
      cp_async_commit();
      if (s0 == 0) {  // the rows' statistics over every slot, while the first slots are staged
        for (int r = threadIdx.x / 32; r < nrows; r += kWarps) {
          const MergeRowStats st = reduce_row_lses(p.partial_lse + first_row + row0 + r, rows, m.num_slots);
          if (threadIdx.x % 32 == 0) row_stats[r] = st;
        }
      }
      cp_async_wait<0>();
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
      bulk.wait();
#endif
      __syncthreads();
      // The slots' weights e^(lse - max), in place of their LSEs. A slot at -inf weighs 0 (its o
      // was written as zeros: no visible key).
      for (int c = threadIdx.x; c < n * nrows; c += kThreads) {
        const float lse = staged_lse[c];
        staged_lse[c] = lse > -INFINITY ? exp2f((lse - row_stats[c % nrows].max_lse) * kLog2e) : 0.f;
      }
      __syncthreads();
      if (active) {
#pragma unroll 4
        for (int s = lane; s < n; s += lanes) {
          const float w = staged_lse[s * nrows + rr - row0];
          // Consecutive threads read consecutive 16 bytes: no bank conflicts (8-element vectors
          // read as two float4 32 bytes apart were 2-way conflicted; the fold took 1.2 us at 33
          // slots).
          const float4 o = *reinterpret_cast<const float4*>(staged + (s * nrows + rr - row0) * kHeadDim + col);
          acc[0] = fmaf(w, o.x, acc[0]);
          acc[1] = fmaf(w, o.y, acc[1]);
          acc[2] = fmaf(w, o.z, acc[2]);
          acc[3] = fmaf(w, o.w, acc[3]);
        }
      }
      __syncthreads();  // the staging area is refilled by the next round
    }
    if (lanes > 1) {  // uniform over the CTA: the lanes' sums, added in lane order
#pragma unroll
      for (int e = 0; e < 4; ++e) stash[threadIdx.x * 4 + e] = acc[e];
      __syncthreads();
      if (active && lane == 0) {
        for (int i = 1; i < lanes; ++i) {
          const float* theirs = stash + (i * per_round + threadIdx.x % per_round) * 4;
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[e] += theirs[e];
        }
      }
      __syncthreads();
    }
    if (active && lane == 0) {
      const MergeRowStats st = row_stats[rr - row0];
      float out[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) out[e] = st.nan ? NAN : acc[e] * st.inv_sum;
      if (m.target_slot < 0) {
        const int64_t q_row = req.q_start + rr / group;
        const int head = m.kv_head * group + rr % group;
        *reinterpret_cast<uint2*>(static_cast<T*>(p.o) + q_row * p.o_stride_row + head * p.o_stride_head + col) =
            make_uint2(pack2<T>(out[0], out[1]), pack2<T>(out[2], out[3]));
        if (p.lse != nullptr && col == 0) p.lse[q_row * p.lse_stride_row + head * p.lse_stride_head] = st.lse;
      } else {  // a group of a two-level merge: its state is a partial of the top merge
        const int64_t prow = p.slot_rows[m.target_slot] + rr;
        *reinterpret_cast<float4*>(p.partial_o + prow * kHeadDim + col) = make_float4(out[0], out[1], out[2], out[3]);
        if (col == 0) p.partial_lse[prow] = st.lse;
      }
    }
    __syncthreads();  // row_stats is rewritten by the next round
  }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  bulk.release();
#endif
}

template <typename T, int kHeadDim, typename Logits, int kStagesT, int kCtasPerSmT>
__global__ void __launch_bounds__(DecodeTileConfig<kHeadDim, kStagesT, kCtasPerSmT>::kThreads,
                                  DecodeTileConfig<kHeadDim, kStagesT, kCtasPerSmT>::kMinBlocksPerSM)
    decode_sm80_kernel(const DecodeParams p) {
  using Cfg = DecodeTileConfig<kHeadDim, kStagesT, kCtasPerSmT>;
  constexpr int kBlockN = Cfg::kBlockN, kThreads = Cfg::kThreads, kStages = Cfg::kStages;
  constexpr int kRows = Cfg::kRows, kChunksPerRow = Cfg::kChunksPerRow;
  constexpr int kDTiles = kHeadDim / 8;   // O accumulator tiles of 8 dims
  constexpr int kKSteps = kHeadDim / 16;  // k-steps of Q K^T
  using KVTile = SwizzledTile<T, kBlockN, kHeadDim>;

  extern __shared__ __align__(128) unsigned char smem[];
  const SwizzledTile<T, kRows, kHeadDim> q_tile{reinterpret_cast<T*>(smem)};
  auto k_tile = [&](int stage) {
    return KVTile{reinterpret_cast<T*>(smem + Cfg::kQBytes + stage * Cfg::kStageBytes)};
  };
  auto v_tile = [&](int stage) { return KVTile{k_tile(stage).base + kBlockN * kHeadDim}; };
  float* scratch = reinterpret_cast<float*>(smem + Cfg::kQBytes);  // after the KV loop only
  float* stat_max = reinterpret_cast<float*>(smem + Cfg::kQBytes + kStages * Cfg::kStageBytes);
  float* stat_sum = stat_max + Cfg::kWarps * kRows;

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const int copy_col = (threadIdx.x % kChunksPerRow) * 8;
  const int copy_row = threadIdx.x / kChunksPerRow;
  const int group = p.num_qo_heads / p.num_kv_heads;
  const Logits logits(p.scale, p.soft_cap);
  const LdmatrixLane<T, kRows, kHeadDim> q_lane(q_tile, (lane % 8) + ((lane / 8) % 2) * 8, lane / 16);

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
    const int offset = req.kv_len - req.qo_len;  // bottom-right alignment
    const int32_t* pages = p.kv_indices + req.page_begin;
    const T* k_head = static_cast<const T*>(p.k_pages) + int64_t(w.kv_head) * p.k_stride_head + copy_col;
    const T* v_head = static_cast<const T*>(p.v_pages) + int64_t(w.kv_head) * p.v_stride_head + copy_col;

    for (int r0 = 0; r0 < rows; r0 += kRows) {
      // The keys any row of this pass sees, within the item's range.
      const int qi_first = r0 / group, qi_last = (min(r0 + kRows, rows) - 1) / group;
      int begin = w.kv_begin, end = w.kv_end;
      if (p.window_left >= 0) begin = max(begin, qi_first + offset - p.window_left);
      if (p.causal) end = min(end, qi_last + offset + 1);
      const int num_tiles = end > begin ? (end - begin + kBlockN - 1) / kBlockN : 0;

      // Q rows r0 .. r0 + 15 (zeros past the request's rows); they join the first stage's group.
#pragma unroll
      for (int c = threadIdx.x; c < kRows * kChunksPerRow; c += kThreads) {
        const int row = c / kChunksPerRow, col = (c % kChunksPerRow) * 8;
        const int rr = r0 + row;
        const bool valid = rr < rows;
        const T* src = static_cast<const T*>(p.q) +
                       (valid ? int64_t(req.q_start + rr / group) * p.q_stride_row +
                                    int64_t(w.kv_head * group + rr % group) * p.q_stride_head
                              : 0) +
                       col;
        cp_async_16(q_tile.at(row, col), src, valid);
      }

      // The page ids of this thread's rows of a tile, and the copies of a tile into its stage.
      // Branch-free: rows past `end` read the last valid row's address and copy zeros (cp.async
      // with 0 source bytes), so the per-row address math stays a handful of integer ops: the
      // copy loop is most of the kernel's instructions (measured: integer ops were 600 of 950
      // instructions per tile before it was made branch-free with 32-bit strides).
      int page_ids[Cfg::kRowsPerThread];
      auto fetch_pages = [&](int tile, int (&ids)[Cfg::kRowsPerThread]) {
        const int n0 = begin + tile * kBlockN;
#pragma unroll
        for (int i = 0; i < Cfg::kRowsPerThread; ++i) {
          const int token = min(n0 + copy_row + i * Cfg::kRowStep, end - 1);
          ids[i] = __ldg(pages + page_index(p, token));
          TESSERA_DEVICE_CHECK(ids[i] >= 0 && ids[i] < p.num_pages, "a kv_indices page id (device copy) outside the cache");
        }
      };
      auto issue = [&](int tile, const int (&ids)[Cfg::kRowsPerThread]) {
        const int n0 = begin + tile * kBlockN;
        const KVTile kt = k_tile(tile % kStages), vt = v_tile(tile % kStages);
#pragma unroll
        for (int i = 0; i < Cfg::kRowsPerThread; ++i) {
          const int row = copy_row + i * Cfg::kRowStep;
          const bool valid = n0 + row < end;
          const int token = min(n0 + row, end - 1);
          const int slot = token - page_index(p, token) * p.page_size;
          const T* k_src = k_head + int64_t(ids[i]) * p.k_stride_page +
                             int64_t(slot) * p.k_stride_token;
          const T* v_src = v_head + int64_t(ids[i]) * p.v_stride_page +
                             int64_t(slot) * p.v_stride_token;
          cp_async_16(kt.at(row, copy_col), k_src, valid, kv_policy);
          cp_async_16(vt.at(row, copy_col), v_src, valid, kv_policy);
        }
      };

      // Prologue: tiles 0 .. kStages - 2 in flight (one commit group each, Q in the first), and
      // the page ids of the next tile to issue in registers.
      static_assert(kStages == 2 || kStages == 3, "the prologue below fills one or two stages");
      if constexpr (kStages == 3) {
        // The page ids of the first three tiles are requested together (one round trip).
        int first_ids[Cfg::kRowsPerThread];
        if (num_tiles > 0) fetch_pages(0, first_ids);
        if (num_tiles > 1) fetch_pages(1, page_ids);
        if (num_tiles > 0) issue(0, first_ids);
        cp_async_commit();
        if (num_tiles > 1) issue(1, page_ids);
        cp_async_commit();
      } else {
        if (num_tiles > 0) fetch_pages(0, page_ids);
        if (num_tiles > 0) issue(0, page_ids);
        cp_async_commit();
      }
      if (kStages - 1 < num_tiles) fetch_pages(kStages - 1, page_ids);
      // The query token of this lane's two rows (g and g + 8), for the per-key mask.
      const int lane_qi[2] = {min(r0 + g, rows - 1) / group, min(r0 + g + 8, rows - 1) / group};
      float o_acc[kDTiles][4] = {};
      float row_max[2] = {-INFINITY, -INFINITY};  // raw logits; scaled into log2 units when used
      float row_sum[2] = {0.f, 0.f};              // this lane's partial sums
      uint32_t q_frag[Cfg::kQInRegisters ? kKSteps : 1][4];

      for (int tile = 0; tile < num_tiles; ++tile) {
        cp_async_wait<kStages - 2>();
        __syncthreads();  // tile (and Q) landed; every warp is done with tile - 1's stage
        const int refill = tile + kStages - 1;
        if (refill < num_tiles) issue(refill, page_ids);  // into tile - 1's stage
        cp_async_commit();
        if (refill + 1 < num_tiles) fetch_pages(refill + 1, page_ids);  // lands while this tile computes
        if constexpr (Cfg::kQInRegisters) {
          if (tile == 0) {
#pragma unroll
            for (int ks = 0; ks < kKSteps; ++ks) ldmatrix_x4(q_frag[ks], q_lane.at(0, ks));
          }
        }

        const int n0 = begin + tile * kBlockN;
        const KVTile kt = k_tile(tile % kStages), vt = v_tile(tile % kStages);
        const LdmatrixLane<T, kBlockN, kHeadDim> k_lane(kt, (lane % 8) + (lane / 16) * 8, (lane / 8) % 2);
        const LdmatrixLane<T, kBlockN, kHeadDim> v_lane(vt, (lane % 8) + ((lane / 8) % 2) * 8, lane / 16);

        // S = Q K^T over this warp's 16 keys: two 8-key accumulator tiles.
        float s[2][4] = {};
#pragma unroll
        for (int ks = 0; ks < kKSteps; ++ks) {
          uint32_t b[4];
          ldmatrix_x4(b, k_lane.at(warp * 16, ks));
          if constexpr (Cfg::kQInRegisters) {
            mma_16816<T>(s[0], q_frag[ks], b[0], b[1]);
            mma_16816<T>(s[1], q_frag[ks], b[2], b[3]);
          } else {
            uint32_t a[4];
            ldmatrix_x4(a, q_lane.at(0, ks));
            mma_16816<T>(s[0], a, b[0], b[1]);
            mma_16816<T>(s[1], a, b[2], b[3]);
          }
        }

        if constexpr (!Logits::kIdentity) {
#pragma unroll
          for (int j = 0; j < 2; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[j][e] = logits(s[j][e]);
        }
        // Per-key masking only on tiles that cross the range's end or a row's band edge.
        const bool needs_mask = n0 + kBlockN > end ||
                                (p.causal && n0 + kBlockN - 1 > qi_first + offset) ||
                                (p.window_left >= 0 && n0 < qi_last + offset - p.window_left);
        if (needs_mask) {
#pragma unroll
          for (int j = 0; j < 2; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int key = n0 + warp * 16 + j * 8 + 2 * t + (e & 1);
              const int qi = lane_qi[e / 2];
              const bool visible = key < end && (!p.causal || key <= qi + offset) &&
                                   (p.window_left < 0 || key >= qi + offset - p.window_left);
              if (!visible) s[j][e] = -INFINITY;
            }
          }
        }

        // Online softmax over this warp's keys (rows g and g + 8; the 4 lanes of a row share them).
        float rescale[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          float m = fmaxf(row_max[r], fmaxf(fmaxf(s[0][2 * r], s[0][2 * r + 1]),
                                            fmaxf(s[1][2 * r], s[1][2 * r + 1])));
          m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
          m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
          const float m_scaled = m == -INFINITY ? 0.f : m * logits.log2_scale;
          rescale[r] = exp2_approx(row_max[r] * logits.log2_scale - m_scaled);
          row_max[r] = m;
          float sum = 0.f;
#pragma unroll
          for (int j = 0; j < 2; ++j) {
#pragma unroll
            for (int e = 2 * r; e < 2 * r + 2; ++e) {
              s[j][e] = exp2_approx(fmaf(s[j][e], logits.log2_scale, -m_scaled));
              sum += s[j][e];
            }
          }
          row_sum[r] = row_sum[r] * rescale[r] + sum;
        }
        // Once the running maxima settle (after the first tiles), no row's max moves and the
        // kHeadDim / 2 multiplies of the O rescale are skipped (warp-uniform test).
        if (__any_sync(0xffffffffu, rescale[0] != 1.f || rescale[1] != 1.f)) {
#pragma unroll
          for (int d = 0; d < kDTiles; ++d) {
#pragma unroll
            for (int e = 0; e < 4; ++e) o_acc[d][e] *= rescale[e / 2];
          }
        }

        // O += P V: P straight from the S accumulators (one k16 A tile of 16 keys).
        uint32_t a[4];
        a[0] = pack2<T>(s[0][0], s[0][1]);
        a[1] = pack2<T>(s[0][2], s[0][3]);
        a[2] = pack2<T>(s[1][0], s[1][1]);
        a[3] = pack2<T>(s[1][2], s[1][3]);
#pragma unroll
        for (int dp = 0; dp < kDTiles / 2; ++dp) {
          uint32_t b[4];
          ldmatrix_x4_trans(b, v_lane.at(warp * 16, dp));
          mma_16816<T>(o_acc[2 * dp], a, b[0], b[1]);
          mma_16816<T>(o_acc[2 * dp + 1], a, b[2], b[3]);
        }
      }
      cp_async_wait<0>();
      // The next kernel may start launching once every CTA has streamed its keys (its last pass):
      // it then overlaps this kernel's combines, partial writes and merges. Allowed at the start
      // instead, a stream of steps whose grid leaves SMs or CTA slots free ran 16-17% slower than
      // plain launches (b12 x 8K 3.47 vs 4.15 TB/s, b24 3.63 vs 4.34; here 4.19 and 4.38).
      if (r0 + kRows >= rows) allow_dependent_launch();
      __syncthreads();  // every warp is done with the stages: the combine scratch reuses them

      // Each warp's state (max in log2 units, sum, unnormalised O) into shared memory.
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float l = row_sum[r];
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        // Only the pass's real rows: a GQA group of 4 fills 4 of the tile's 16 rows, and the
        // padding rows would be three quarters of this shared-memory traffic.
        if (r0 + g + 8 * r >= rows) continue;
        const int row = warp * kRows + g + 8 * r;
        if (t == 0) {
          stat_max[row] = row_max[r] == -INFINITY ? -INFINITY : row_max[r] * logits.log2_scale;
          stat_sum[row] = l;
        }
#pragma unroll
        for (int d = 0; d < kDTiles; ++d) {
          *reinterpret_cast<float2*>(scratch + row * Cfg::kScratchStride + d * 8 + 2 * t) =
              make_float2(o_acc[d][2 * r], o_acc[d][2 * r + 1]);
        }
      }
      __syncthreads();

      // Combine the warps: a warp contributes when its sum is not 0 (a NaN sum contributes and
      // poisons the row); no contributor means no visible key: O = 0, LSE = -inf.
      for (int u = threadIdx.x; u < kRows * kChunksPerRow; u += kThreads) {
        const int row = u / kChunksPerRow, col = (u % kChunksPerRow) * 8;
        const int rr = r0 + row;
        if (rr >= rows) continue;
        float m = -INFINITY;
#pragma unroll
        for (int wi = 0; wi < Cfg::kWarps; ++wi) {
          if (stat_sum[wi * kRows + row] != 0.f) m = fmaxf(m, stat_max[wi * kRows + row]);
        }
        float l = 0.f, acc[8] = {};
#pragma unroll
        for (int wi = 0; wi < Cfg::kWarps; ++wi) {
          const float sw = stat_sum[wi * kRows + row];
          if (sw == 0.f) continue;
          const float weight = exp2_approx(stat_max[wi * kRows + row] - m);
          l = fmaf(weight, sw, l);
          const float* o_w = scratch + (wi * kRows + row) * Cfg::kScratchStride + col;
#pragma unroll
          for (int e = 0; e < 8; ++e) acc[e] = fmaf(weight, o_w[e], acc[e]);
        }
        const bool empty = l == 0.f;
        const float inv = empty ? 0.f : 1.f / l;
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[e] *= inv;
        const float lse = empty ? -INFINITY : (m + log2f(l)) * 0.6931471805599453f;
        if (w.partial_slot < 0) {
          const int64_t q_row = req.q_start + rr / group;
          const int head = w.kv_head * group + rr % group;
          Vec8<T>::from_float(acc).store(static_cast<T*>(p.o) + q_row * p.o_stride_row +
                                         head * p.o_stride_head + col);
          if (p.lse != nullptr && col == 0) {
            p.lse[q_row * p.lse_stride_row + head * p.lse_stride_head] = lse;
          }
        } else {
          const int64_t prow = p.slot_rows[w.partial_slot] + rr;
          Vec8<float>::from_float(acc).store(p.partial_o + prow * kHeadDim + col);
          if (col == 0) p.partial_lse[prow] = lse;
        }
      }
      __syncthreads();  // the scratch and the Q tile are refilled by the next pass
    }

    if (w.partial_slot >= 0) {
      // Split request: the CTA that finishes the last slot of a merge row merges them (the
      // classic fence-then-count pattern), so no second kernel and no launch gap follow the
      // decode. A group of a two-level merge writes a partial of its parent row and counts there
      // in turn. One thread counts for the CTA with an acquire-release atomic: the barrier
      // before it orders every thread's partial writes before the count (release), the barrier
      // after it orders the count before the merge's reads (acquire). (A full __threadfence() on
      // each side compiles to a sequentially consistent MEMBAR.SC.GPU.)
      __shared__ int merges_here;
      int row = w.merge;
      plan::MergeRow m = merge;
      for (;;) {
        __syncthreads();
        if (threadIdx.x == 0) {
          int before;
          asm volatile("atom.add.acq_rel.gpu.global.s32 %0, [%1], 1;\n"
                       : "=r"(before)
                       : "l"(p.merge_counters + row)
                       : "memory");
          merges_here = before == m.num_slots - 1;
        }
        __syncthreads();
        if (!merges_here) break;
        merge_chunk_partials<T, kHeadDim, kThreads>(p, m, req, group, scratch, kStages * Cfg::kStageBytes / 4);
        // Ready for the next layer's run(): subtract this run's count rather than storing 0, so a
        // stray extra count (misuse: two runs sharing the workspace concurrently) cannot stick.
        if (threadIdx.x == 0) atomicSub(p.merge_counters + row, m.num_slots);
        if (m.parent < 0) break;
        row = m.parent;
        m = p.merges[row];
      }
      __syncthreads();  // the scratch is refilled by the next item
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
