// Merges n partial attention states per (row, head): s = log(sum_i e^{s_i}), o = sum_i o_i e^{s_i-s}.
// Memory-bound: one thread owns 8 consecutive elements of one (row, head); the n LSE values of its
// row are re-read by every thread of the row from L1. All math in fp32.
#include <cuda_runtime.h>

#include <cmath>

#include "core/cuda_check.h"
#include "kernels/attention/common/attention_state.cuh"
#include "kernels/common/vec8.cuh"
#include "kernels/merge/merge_states.h"

namespace tessera::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kElemsPerVec = 8;

template <bool kStacked>
__device__ const float* lse_ptr(const MergeStatesParams& p, int i, int row, int head) {
  if constexpr (kStacked) {
    return p.s_base[0] + row * p.s_row[0] + i * p.s_part + head * p.s_head[0];
  } else {
    return p.s_base[i] + row * p.s_row[i] + head * p.s_head[i];
  }
}

template <bool kStacked, typename TIn>
__device__ const TIn* o_ptr(const MergeStatesParams& p, int i, int row, int head, int col) {
  if constexpr (kStacked) {
    return static_cast<const TIn*>(p.o_base[0]) + row * p.o_row[0] + i * p.o_part +
           head * p.o_head[0] + col;
  } else {
    return static_cast<const TIn*>(p.o_base[i]) + row * p.o_row[i] + head * p.o_head[i] + col;
  }
}

// kStepCounts: rows and the state count come from a PrefillStep on the device (a fixed-grid
// launch of BatchPrefillPaged; a step that does not split merges nothing) instead of p.rows /
// p.num_states.
template <bool kStacked, typename TIn, typename TOut, bool kStepCounts = false>
// 16-bit inputs: at most 64 registers (4 blocks of 256 per SM), since occupancy is what keeps
// enough bytes in flight (80 registers measured 2.84 TB/s). fp32 inputs move twice the bytes per
// thread already and would spill under that cap; they get 3 blocks per SM (85 registers).
__global__ void __launch_bounds__(kThreads, sizeof(TIn) == 2 ? 4 : 3) merge_states_kernel(MergeStatesParams p) {
  int rows = p.rows, num_states = p.num_states;
  if constexpr (kStepCounts) {
    num_states = __ldg(&p.step->kv_splits);
    rows = num_states > 1 ? __ldg(&p.step->rows) : 0;
  }
  const int vecs_per_row = p.head_dim / kElemsPerVec;
  const int vecs_per_token = p.heads * vecs_per_row;
  const int total = rows * vecs_per_token;  // < 2^31, checked on the host (for the step: its rows <= p.rows)

  // Warp-uniform loop: every lane runs every iteration, so __syncwarp below is legal. A warp
  // takes kItems runs of 32 consecutive vectors; the host requires head_dim / 8 to divide 32, so
  // the threads of one (row, head) always share a warp.
  // Loads first, math second: every o and LSE load of an iteration is issued before any result is
  // needed. Measured on H200 (bf16, two states, 16384 x 32 x 128): loading o only after its LSE
  // was known ran at 2.1 TB/s; all loads of one vector first, 2.5 TB/s; two vectors per thread
  // (kItems = 2, 64 bytes in flight per thread), see notes/merge_states.md.
  constexpr int kItems = kStacked ? 1 : 2;
  const int lane = threadIdx.x % 32;
  const int warp = (blockIdx.x * kThreads + threadIdx.x) / 32;
  const int num_warps = gridDim.x * (kThreads / 32);
  for (int chunk = warp * 32 * kItems; chunk < total; chunk += num_warps * 32 * kItems) {
    int row[kItems], head[kItems], col[kItems];
    bool active[kItems];
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      const int idx = chunk + j * 32 + lane;
      active[j] = idx < total;
      row[j] = (active[j] ? idx : 0) / vecs_per_token;
      const int within = (active[j] ? idx : 0) - row[j] * vecs_per_token;
      head[j] = within / vecs_per_row;
      col[j] = (within - head[j] * vecs_per_row) * kElemsPerVec;
    }

    MergeAccumulator<kElemsPerVec> accum[kItems];
    constexpr int kGroup = kStacked ? 4 : 2;  // states loaded together
    for (int first = 0; first < num_states; first += kGroup) {
      // Held in the input precision until used: 4 registers per bf16 vector instead of 8.
      float s[kItems][kGroup];
      Vec8<TIn> o[kItems][kGroup];
#pragma unroll
      for (int j = 0; j < kItems; ++j) {
#pragma unroll
        for (int k = 0; k < kGroup; ++k) {
          const int i = first + k < num_states ? first + k : first;  // clamp: stays in bounds
          s[j][k] = __ldg(lse_ptr<kStacked>(p, i, row[j], head[j]));
          o[j][k] = Vec8<TIn>::load_stream(o_ptr<kStacked, TIn>(p, i, row[j], head[j], col[j]));
        }
      }
#pragma unroll
      for (int j = 0; j < kItems; ++j) {
#pragma unroll
        for (int k = 0; k < kGroup; ++k) {
          float of[kElemsPerVec];
          o[j][k].to_float(of);
          if (first + k < num_states) accum[j].add(s[j][k], of);
        }
      }
    }

    float s_out[kItems];
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      float acc[kElemsPerVec];
      s_out[j] = accum[j].finish(acc);
      if (active[j]) {
        Vec8<TOut>::from_float(acc).store(static_cast<TOut*>(p.o_out) + row[j] * p.o_out_row +
                                          head[j] * p.o_out_head + col[j]);
      }
    }
    // In place, s_out is one of the inputs: every lane of the warp has read it by now.
    __syncwarp();
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      if (active[j] && p.s_out != nullptr && col[j] == 0) {
        p.s_out[row[j] * p.s_out_row + head[j] * p.s_out_head] = s_out[j];
      }
    }
  }
}

// Two separate 16-bit states in closed form: both LSEs arrive with the o loads and the two weights
// come straight from them, s = m + log(w_a + w_b) with m = max(s_a, s_b), so no running
// accumulator is carried and kTwoStateItems vectors per thread (16 bytes of each state) fit the
// 64-register budget of 4 blocks per SM: more bytes in flight per thread than the general kernel's
// two (see notes/merge_states.md for the measured choice).
#ifndef TESSERA_MERGE_TWO_STATE_ITEMS
#define TESSERA_MERGE_TWO_STATE_ITEMS 3
#endif
constexpr int kTwoStateItems = TESSERA_MERGE_TWO_STATE_ITEMS;

template <typename T>
__global__ void __launch_bounds__(kThreads, 4) merge_two_states_kernel(MergeStatesParams p) {
  constexpr int kItems = kTwoStateItems;
  const int vecs_per_row = p.head_dim / kElemsPerVec;
  const int vecs_per_token = p.heads * vecs_per_row;
  const int total = p.rows * vecs_per_token;  // < 2^31, checked on the host
  const int lane = threadIdx.x % 32;
  const int warp = (blockIdx.x * kThreads + threadIdx.x) / 32;
  const int num_warps = gridDim.x * (kThreads / 32);
  // Warp-uniform loop (see merge_states_kernel): the threads of one (row, head) share a warp.
  for (int chunk = warp * 32 * kItems; chunk < total; chunk += num_warps * 32 * kItems) {
    // Only the loaded values live across the loads; the (row, head, col) of a vector is
    // recomputed at its store, which keeps kItems = 4 within 64 registers.
    auto locate = [&](int j, int& row, int& head, int& col) {
      const int idx = min(chunk + j * 32 + lane, total - 1);  // clamped: loads stay in bounds
      row = idx / vecs_per_token;
      const int within = idx - row * vecs_per_token;
      head = within / vecs_per_row;
      col = (within - head * vecs_per_row) * kElemsPerVec;
    };
    float s_a[kItems], s_b[kItems];
    Vec8<T> o_a[kItems], o_b[kItems];
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      int row, head, col;
      locate(j, row, head, col);
      // L2 loads, not the read-only path: in place, s_out / o_out alias state a.
      s_a[j] = __ldcg(lse_ptr<false>(p, 0, row, head));
      s_b[j] = __ldcg(lse_ptr<false>(p, 1, row, head));
      o_a[j] = Vec8<T>::load_stream(o_ptr<false, T>(p, 0, row, head, col));
      o_b[j] = Vec8<T>::load_stream(o_ptr<false, T>(p, 1, row, head, col));
    }
    float s_out[kItems];
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      const float sa = s_a[j], sb = s_b[j];
      const bool nan = isnan(sa) || isnan(sb);
      const bool has_a = sa > -INFINITY, has_b = sb > -INFINITY;
      const float m = fmaxf(sa, sb);
      const float wa = merge_weight(sa, m), wb = merge_weight(sb, m);
      const float sum = wa + wb;
      const float inv = merge_inv_sum(sum);
      float fa[kElemsPerVec], fb[kElemsPerVec], out[kElemsPerVec];
      o_a[j].to_float(fa);
      o_b[j].to_float(fb);
#pragma unroll
      for (int e = 0; e < kElemsPerVec; ++e) {
        // A state at -inf contributes nothing, not 0 * its o (which may be NaN or garbage).
        const float va = has_a ? wa * fa[e] : 0.f;
        const float vb = has_b ? wb * fb[e] : 0.f;
        out[e] = nan ? NAN : (va + vb) * inv;
      }
      s_out[j] = merged_lse(m, sum, nan);
      if (chunk + j * 32 + lane < total) {
        int row, head, col;
        locate(j, row, head, col);
        Vec8<T>::from_float(out).store(static_cast<T*>(p.o_out) + row * p.o_out_row +
                                       head * p.o_out_head + col);
      }
    }
    // In place, s_out is state a's LSE: every lane of the warp has read it by now.
    __syncwarp();
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      int row, head, col;
      locate(j, row, head, col);
      if (chunk + j * 32 + lane < total && p.s_out != nullptr && col == 0) {
        p.s_out[row * p.s_out_row + head * p.s_out_head] = s_out[j];
      }
    }
  }
}

// SMs of the current device (the grids are a few blocks per SM).
int multiprocessors() {
  int device = 0, sms = 0;
  TESSERA_CUDA_CHECK(cudaGetDevice(&device));
  TESSERA_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  return sms;
}

template <typename TIn, typename TOut>
void launch_typed(const MergeStatesParams& p, cudaStream_t stream) {
  const int64_t total = int64_t(p.rows) * p.heads * (p.head_dim / kElemsPerVec);
  if (total == 0) return;
  const int sms = multiprocessors();
  const int items_per_thread = p.stacked ? 1 : 2;  // kItems of the kernel
  const int64_t wanted = (total + kThreads * items_per_thread - 1) / (kThreads * items_per_thread);
  const int blocks = static_cast<int>(wanted < int64_t(sms) * 8 ? wanted : int64_t(sms) * 8);
  if constexpr (sizeof(TIn) == 2) {
    if (!p.stacked && p.num_states == 2) {
      const int64_t two = (total + kThreads * kTwoStateItems - 1) / (kThreads * kTwoStateItems);
      const int grid = static_cast<int>(two < int64_t(sms) * 4 ? two : int64_t(sms) * 4);
      merge_two_states_kernel<TIn><<<grid, kThreads, 0, stream>>>(p);
      TESSERA_CHECK_LAUNCH();
      return;
    }
  }
  if (p.stacked) {
    merge_states_kernel<true, TIn, TOut><<<blocks, kThreads, 0, stream>>>(p);
  } else {
    merge_states_kernel<false, TIn, TOut><<<blocks, kThreads, 0, stream>>>(p);
  }
  TESSERA_CHECK_LAUNCH();
}

}  // namespace

void launch_merge_step_states(DType out_dtype, const MergeStatesParams& params, cudaStream_t stream) {
  const int sms = multiprocessors();
  const int blocks = sms * 8;  // the grid launch_typed takes for large merges
  if (out_dtype == DType::kBF16) {
    merge_states_kernel<true, float, __nv_bfloat16, true><<<blocks, kThreads, 0, stream>>>(params);
  } else if (out_dtype == DType::kFP16) {
    merge_states_kernel<true, float, __half, true><<<blocks, kThreads, 0, stream>>>(params);
  } else {
    merge_states_kernel<true, float, float, true><<<blocks, kThreads, 0, stream>>>(params);
  }
  TESSERA_CHECK_LAUNCH();
}

void launch_merge_states(DType in_dtype, DType out_dtype, const MergeStatesParams& params,
                         cudaStream_t stream) {
  if (in_dtype == DType::kBF16) {
    launch_typed<__nv_bfloat16, __nv_bfloat16>(params, stream);
  } else if (in_dtype == DType::kFP16) {
    launch_typed<__half, __half>(params, stream);
  } else if (out_dtype == DType::kBF16) {
    launch_typed<float, __nv_bfloat16>(params, stream);
  } else if (out_dtype == DType::kFP16) {
    launch_typed<float, __half>(params, stream);
  } else {
    launch_typed<float, float>(params, stream);
  }
}

}  // namespace tessera::kernels
