// MoE combine (include/tessera/moe.h): out[t, :] = sum_j weights[t, j] y[inverse[t, j], :]
// (+ shared[t, :]), summed in fp32 in j order (deterministic), copies with inverse -1 skipped.
// A memory-bound gather: one thread owns one Vec8 (8 consecutive columns) of one token, so a
// token's row is spread over hidden / 8 consecutive threads and a decode batch of a few tokens
// still fills the GPU (a warp per token would give T = 16 sixteen warps). A token's inverse and
// weights are read by all its threads, from L1 after the first; the y rows of up to kGroup copies
// are loaded before any is summed, so a thread has kGroup x 16 bytes in flight.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "core/cuda_check.h"
#include "kernels/common/device_check.cuh"
#include "kernels/common/vec8.cuh"
#include "kernels/moe/grouped_gemm_params.h"
#include "tessera/error.h"

namespace tessera::kernels::moe {
namespace {

constexpr int kThreads = 256;
constexpr int kGroup = 8;  // copies loaded together: top_k = 8 (the common case) in one group
// The grid-stride loop covers what lies past this many blocks (far more threads than any GPU holds).
constexpr int64_t kMaxBlocks = int64_t{1} << 20;

template <typename T>
__global__ void __launch_bounds__(kThreads) combine_kernel(const CombineParams p) {
  const int64_t vecs_per_token = p.hidden / 8;
  const int64_t total = p.tokens * vecs_per_token;
  for (int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x; i < total; i += int64_t(gridDim.x) * kThreads) {
    const int64_t token = i / vecs_per_token;
    const int64_t col = (i - token * vecs_per_token) * 8;
    const int32_t* inverse = p.inverse + token * p.top_k;
    const float* weights = p.weights + token * p.top_k;
    const T* y = static_cast<const T*>(p.y) + col;

    float acc[8] = {};
    for (int first = 0; first < p.top_k; first += kGroup) {
      int32_t row[kGroup];
      float weight[kGroup];
#pragma unroll
      for (int g = 0; g < kGroup; ++g) {
        const bool inside = first + g < p.top_k;
        row[g] = inside ? __ldg(inverse + first + g) : -1;
        TESSERA_DEVICE_CHECK(row[g] >= -1 && row[g] < p.y_rows, "an inverse entry outside [-1, rows of expert_out)");
        if (row[g] >= p.y_rows) row[g] = -1;  // outside y: treated as dropped (see CombineParams)
        weight[g] = inside ? __ldg(weights + first + g) : 0.f;
      }
      Vec8<T> rows[kGroup];
#pragma unroll
      for (int g = 0; g < kGroup; ++g) {
        // Each row of y belongs to one (token, j) copy: read once, so evict-first.
        rows[g] = row[g] >= 0 ? Vec8<T>::load_stream(y + row[g] * p.y_stride) : Vec8<T>{};
      }
#pragma unroll
      for (int g = 0; g < kGroup; ++g) {
        if (row[g] < 0) continue;  // dropped: skipped, not added as weight x 0 (a NaN weight stays out)
        float f[8];
        rows[g].to_float(f);
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[e] += weight[g] * f[e];
      }
    }
    if (p.shared != nullptr) {
      // A plain load (not the read-only path): the kernel itself would allow out == shared (each
      // element is read, then written, by one thread), though moe_combine's validation keeps them
      // apart.
      float f[8];
      Vec8<T>{*reinterpret_cast<const uint4*>(static_cast<const T*>(p.shared) + token * p.shared_stride + col)}
          .to_float(f);
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[e] += f[e];
    }
    Vec8<T>::from_float(acc).store(static_cast<T*>(p.out) + token * p.out_stride + col);
  }
}

template <typename T>
void launch_typed(const CombineParams& p, cudaStream_t stream) {
  const int64_t total = p.tokens * (p.hidden / 8);
  if (total == 0) return;  // nothing to write
  const int64_t blocks = std::min<int64_t>((total + kThreads - 1) / kThreads, kMaxBlocks);
  combine_kernel<T><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(p);
  TESSERA_CHECK_LAUNCH();
}

}  // namespace

void launch_combine(const CombineParams& p, cudaStream_t stream) {
  if (p.tokens <= 0 || p.hidden <= 0) return;
  if (p.dtype == DType::kBF16) launch_typed<__nv_bfloat16>(p, stream);
  else if (p.dtype == DType::kFP16) launch_typed<__half>(p, stream);
  else throw Error(std::string("tessera: the MoE combine takes bf16 or fp16, not ") + dtype_name(p.dtype));
}

}  // namespace tessera::kernels::moe
