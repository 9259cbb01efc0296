// The decode kernel's split merge: a split request's chunks each leave a partial state (fp32 O and
// LSE per row); the CTA that finishes the last chunk of a merge row merges them (the classic
// fence-then-count pattern), so no second kernel and no launch gap follow the decode. A row of
// many chunks merges in two levels (decode_plan.h): each group's merge writes a partial of its
// parent row and counts there in turn. The merge itself is attention_state.cuh's closed form.
#pragma once

#include <cuda_runtime.h>

#include <cmath>

#include "kernels/attention/common/attention_state.cuh"
#include "kernels/attention/decode_params.h"
#include "kernels/common/bulk_copy_sm90.cuh"
#include "kernels/common/mma_sm80.cuh"
#include "kernels/common/vec8.cuh"

namespace tessera::kernels::sm80 {

// The closed-form statistics of one row over `num_slots` chunk partials (their LSEs `stride`
// floats apart), by one warp: each lane accumulates its slots' LSEs (MergeAccumulator), then the
// lanes' accumulators are combined against the largest maximum.
__device__ inline MergeStats row_merge_stats(const float* lse, int64_t stride, int num_slots) {
  const int lane = threadIdx.x % 32;
  MergeAccumulator<0> lses;
  for (int s = lane; s < num_slots; s += 32) lses.add(__ldcg(lse + s * stride));  // other CTAs wrote them: from L2
  float max_lse = lses.max_s;
#pragma unroll
  for (int d = 16; d > 0; d /= 2) max_lse = fmaxf(max_lse, __shfl_xor_sync(0xffffffffu, max_lse, d));
  float sum = lses.sum_against(max_lse);
#pragma unroll
  for (int d = 16; d > 0; d /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, d);
  return MergeStats::of(max_lse, sum, __any_sync(0xffffffffu, lses.nan));
}

// Merges the chunk partials of one merge row into O / LSE (or, for a group of a two-level merge,
// into its parent's partial slot). At batch 1 x 32K (33 slots per head) the merge takes ~3.4 us
// after the last chunk's count (timeline in notes/decode.md).
// Per round of rows: the partial rows are staged into shared memory (bulk copies on sm_90,
// 16-byte cp.async before), while one warp per row computes its statistics from global memory;
// the slots' weights replace their staged LSEs; then each (row, 4-element vector) is accumulated
// by `lanes` threads over interleaved slots, whose sums are added in a fixed order: the result
// does not depend on which CTA merges.
template <typename T, int kHeadDim, int kThreads>
__device__ void merge_chunk_partials(const DecodeParams& p, const plan::MergeRow& m,
                                     const plan::RequestInfo& req, int group, float* scratch,
                                     int scratch_floats) {
  constexpr int kVecs = kHeadDim / 4;  // a thread owns 4 consecutive elements of a row
  constexpr int kWarps = kThreads / 32;
  constexpr int kRoundRows = kThreads / kVecs;  // rows of a round when one thread owns a vector
  static_assert(kThreads % kVecs == 0, "a round of pairs covers whole rows");
  __shared__ MergeStats row_stats[kRoundRows];
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
          const MergeStats st = row_merge_stats(p.partial_lse + first_row + row0 + r, rows, m.num_slots);
          if (threadIdx.x % 32 == 0) row_stats[r] = st;
        }
      }
      cp_async_wait<0>();
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
      bulk.wait();
#endif
      __syncthreads();
      // The slots' weights in place of their LSEs (a slot at -inf weighs 0: its o was written as
      // zeros, no visible key).
      for (int c = threadIdx.x; c < n * nrows; c += kThreads) staged_lse[c] = row_stats[c % nrows].weight(staged_lse[c]);
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
      const MergeStats st = row_stats[rr - row0];
      float out[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) out[e] = st.normalise(acc[e]);
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

// A split task's partial is written: count it at its merge row and, in the CTA that counts a
// row's last chunk, merge the row, then go up the tree while this CTA completes the parent too.
// One thread counts for the CTA with an acquire-release atomic: the barrier before it orders every
// thread's partial writes before the count (release), the barrier after it orders the count before
// the merge's reads (acquire). (A full __threadfence() on each side compiles to a sequentially
// consistent MEMBAR.SC.GPU.) `merges_here` is the CTA's shared flag.
template <typename T, int kHeadDim, int kThreads>
__device__ __forceinline__ void count_and_merge(const DecodeParams& p, int merge_index, plan::MergeRow m,
                                                const plan::RequestInfo& req, int group, float* scratch,
                                                int scratch_floats, int& merges_here) {
  for (;;) {
    __syncthreads();
    if (threadIdx.x == 0) {
      int before;
      asm volatile("atom.add.acq_rel.gpu.global.s32 %0, [%1], 1;\n"
                   : "=r"(before)
                   : "l"(p.merge_counters + merge_index)
                   : "memory");
      merges_here = before == m.num_slots - 1;
    }
    __syncthreads();
    if (!merges_here) break;
    merge_chunk_partials<T, kHeadDim, kThreads>(p, m, req, group, scratch, scratch_floats);
    // Ready for the next layer's run(): subtract this run's count rather than storing 0, so a
    // stray extra count (misuse: two runs sharing the workspace concurrently) cannot stick.
    if (threadIdx.x == 0) atomicSub(p.merge_counters + merge_index, m.num_slots);
    if (m.parent < 0) break;
    merge_index = m.parent;
    m = p.merges[merge_index];
  }
  __syncthreads();  // the scratch is refilled by the next item
}

}  // namespace tessera::kernels::sm80
