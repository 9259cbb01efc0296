// MoE router: logits [tokens, num_experts] -> top-k expert ids and weights (include/tessera/moe.h).
// One warp per token; lane l holds experts l, l + 32, ... (up to 16 each). Every selection is a
// warp arg-max over (key, expert id) with ties to the lower id, so the result does not depend on
// the order of anything but the inputs.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>

#include "core/cuda_check.h"
#include "kernels/moe/moe_params.h"

namespace tessera::kernels::moe {
namespace {

constexpr int kPerLane = kMaxRouteExperts / 32;
constexpr int kWarpsPerBlock = 4;

__device__ float load_logit(const RouteParams& p, int64_t t, int e) {
  const int64_t i = t * p.logits_stride + e;
  switch (p.logits_dtype) {
    case DType::kBF16: return __bfloat162float(static_cast<const __nv_bfloat16*>(p.logits)[i]);
    case DType::kFP16: return __half2float(static_cast<const __half*>(p.logits)[i]);
    default: return static_cast<const float*>(p.logits)[i];
  }
}

__device__ float warp_max(float x) {
  for (int o = 16; o > 0; o /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}
__device__ float warp_sum(float x) {
  for (int o = 16; o > 0; o /= 2) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// A candidate of a selection: the key it is ranked by, its id, and a value it carries.
struct Pick {
  float key;
  int id;
  float value;
  __device__ bool beats(const Pick& o) const { return key > o.key || (key == o.key && id < o.id); }
};
__device__ Pick warp_best(Pick c) {
  for (int o = 16; o > 0; o /= 2) {
    Pick other{__shfl_xor_sync(0xffffffffu, c.key, o), __shfl_xor_sync(0xffffffffu, c.id, o),
               __shfl_xor_sync(0xffffffffu, c.value, o)};
    if (other.beats(c)) c = other;
  }
  return c;
}
constexpr int kNoId = 0x7fffffff;

__global__ void __launch_bounds__(32 * kWarpsPerBlock) route_kernel(const RouteParams p) {
  const int lane = threadIdx.x % 32;
  const int64_t t = int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  if (t >= p.tokens) return;  // whole warps leave together
  const int E = p.num_experts;

  float score[kPerLane], key[kPerLane];
  unsigned taken = 0;  // bit i: expert lane + 32 i is not selectable (chosen, absent, or outside the groups)
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int e = lane + 32 * i;
    score[i] = e < E ? load_logit(p, t, e) : -INFINITY;
    if (e >= E) taken |= 1u << i;
  }
  if (p.sigmoid) {
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) score[i] = 1.f / (1.f + expf(-score[i]));
  } else {
    float m = -INFINITY;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) m = fmaxf(m, score[i]);
    m = warp_max(m);
    float sum = 0.f;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      score[i] = lane + 32 * i < E ? expf(score[i] - m) : 0.f;
      sum += score[i];
    }
    sum = warp_sum(sum);
    const float inv = 1.f / sum;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) score[i] *= inv;
  }
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int e = lane + 32 * i;
    const float biased = score[i] + (p.bias != nullptr && e < E ? p.bias[e] : 0.f);
    key[i] = isnan(biased) ? -INFINITY : biased;  // NaN is chosen last
  }

  // Grouped top-k: a group's score is the sum of its two best keys; keep the topk_groups best.
  if (p.num_groups > 1) {
    const int group_size = E / p.num_groups;
    float my_group_score = -INFINITY;  // lane g: group g's score
    for (int g = 0; g < p.num_groups; ++g) {
      float a1 = -INFINITY, a2 = -INFINITY;
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) {
        const int e = lane + 32 * i;
        if (e < E && e / group_size == g) {
          if (key[i] > a1) {
            a2 = a1;
            a1 = key[i];
          } else if (key[i] > a2) {
            a2 = key[i];
          }
        }
      }
      for (int o = 16; o > 0; o /= 2) {
        const float b1 = __shfl_xor_sync(0xffffffffu, a1, o), b2 = __shfl_xor_sync(0xffffffffu, a2, o);
        const float hi = fmaxf(a1, b1), lo = fmaxf(fminf(a1, b1), fmaxf(a2, b2));
        a1 = hi;
        a2 = lo;
      }
      const float s = group_size >= 2 ? a1 + a2 : a1;
      if (lane == g) my_group_score = isnan(s) ? -INFINITY : s;
    }
    unsigned kept = 0, picked = lane < p.num_groups ? 0u : 1u;
    for (int r = 0; r < p.topk_groups; ++r) {
      const Pick best = warp_best(picked ? Pick{-INFINITY, kNoId, 0.f} : Pick{my_group_score, lane, 0.f});
      kept |= 1u << best.id;
      if (lane == best.id) picked = 1;
    }
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int e = lane + 32 * i;
      if (e < E && !((kept >> (e / group_size)) & 1u)) taken |= 1u << i;
    }
  }

  // Top-k by key; lane r keeps the r-th choice.
  int my_id = 0;
  float my_weight = 0.f;
  for (int r = 0; r < p.top_k; ++r) {
    Pick mine{-INFINITY, kNoId, 0.f};
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const Pick c{key[i], lane + 32 * i, score[i]};
      if (!((taken >> i) & 1u) && c.beats(mine)) mine = c;
    }
    const Pick best = warp_best(mine);
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      if (lane + 32 * i == best.id) taken |= 1u << i;
    }
    if (lane == r) {
      my_id = best.id;
      my_weight = best.value;
    }
  }
  if (p.renormalize) my_weight /= warp_sum(lane < p.top_k ? my_weight : 0.f);
  my_weight *= p.routed_scaling;
  if (lane < p.top_k) {
    p.ids[t * p.top_k + lane] = my_id;
    p.weights[t * p.top_k + lane] = my_weight;
  }
}

}  // namespace

void launch_route(const RouteParams& p, cudaStream_t stream) {
  if (p.tokens == 0) return;
  const int64_t blocks = (p.tokens + kWarpsPerBlock - 1) / kWarpsPerBlock;
  route_kernel<<<static_cast<unsigned>(blocks), 32 * kWarpsPerBlock, 0, stream>>>(p);
  TESSERA_CHECK_LAUNCH();
}

}  // namespace tessera::kernels::moe
