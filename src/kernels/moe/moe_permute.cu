// MoE permutation (include/tessera/moe.h): the (token, k) copies grouped by expert, stable (in
// (token, k) order within an expert), every expert's segment aligned; all on the device.
//   1. fill:    permuted_token = -1 over the capacity
//   2. count:   one warp per chunk of kPermuteChunk entries walks it in order; __match_any_sync
//               gives each entry its rank among the chunk's entries of its expert so far; the
//               chunk's per-expert counts go to chunk_base [chunks, experts]
//   3. offsets: one block: per expert the chunks' counts become exclusive bases (in chunk order),
//               the aligned segment sizes are scanned into expert_offsets
//   4. scatter: entry -> row = offsets[e] + chunk_base[chunk, e] + rank; inverse, permuted_token
//   5. rows:    one warp per permuted row copies x's row (16-byte vectors), or zeroes padding
// Chunks and ranks are fixed by the inputs alone, so the layout is deterministic.
#include <cuda_runtime.h>

#include <algorithm>

#include "core/cuda_check.h"
#include "kernels/moe/moe_params.h"

namespace tessera::kernels::moe {
namespace {

constexpr int kThreads = 256;

__global__ void fill_kernel(int32_t* p, int64_t n, int32_t value) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    p[i] = value;
}

__device__ int valid_expert(const PermuteParams& p, int64_t entry) {
  if (entry >= p.entries) return -1;
  const int e = p.ids[entry];
  return e >= 0 && e < p.num_experts ? e : -1;
}

// One warp per chunk.
__global__ void count_kernel(const PermuteParams p) {
  __shared__ int32_t count[kMaxPermuteExperts];
  const int lane = threadIdx.x;
  const int64_t chunk = blockIdx.x;
  for (int e = lane; e < p.num_experts; e += 32) count[e] = 0;
  __syncwarp();
  const int64_t first = chunk * kPermuteChunk;
  for (int i = 0; i < kPermuteChunk; i += 32) {
    const int64_t entry = first + i + lane;
    const int e = valid_expert(p, entry);
    const unsigned same = __match_any_sync(0xffffffffu, e);
    const unsigned before = same & ((1u << lane) - 1u);
    const int base = e >= 0 ? count[e] : 0;
    __syncwarp();
    if (e >= 0) {
      if (entry < p.entries) p.rank[entry] = base + __popc(before);
      if (before == 0) count[e] = base + __popc(same);  // the run's first lane
    }
    __syncwarp();
  }
  for (int e = lane; e < p.num_experts; e += 32) p.chunk_base[chunk * p.num_experts + e] = count[e];
}

// One block of kMaxPermuteExperts threads: thread e owns expert e.
__global__ void offsets_kernel(const PermuteParams p, int64_t chunks) {
  __shared__ int32_t scan[kMaxPermuteExperts];
  const int e = threadIdx.x;
  int32_t total = 0;
  if (e < p.num_experts) {
    for (int64_t c = 0; c < chunks; ++c) {
      int32_t& slot = p.chunk_base[c * p.num_experts + e];
      const int32_t n = slot;
      slot = total;  // this chunk's first row within the expert's segment
      total += n;
    }
  }
  const int32_t padded = (total + p.align - 1) / p.align * p.align;
  scan[e] = e < p.num_experts ? padded : 0;
  __syncthreads();
  // Inclusive Hillis-Steele scan over the experts.
  for (int o = 1; o < kMaxPermuteExperts; o *= 2) {
    const int32_t add = e >= o ? scan[e - o] : 0;
    __syncthreads();
    scan[e] += add;
    __syncthreads();
  }
  if (e < p.num_experts) p.offsets[e + 1] = scan[e];
  if (e == 0) p.offsets[0] = 0;
}

__global__ void scatter_kernel(const PermuteParams p) {
  const int64_t entry = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (entry >= p.entries) return;
  const int e = valid_expert(p, entry);
  if (e < 0) {
    p.inverse[entry] = -1;
    return;
  }
  const int64_t chunk = entry / kPermuteChunk;
  const int32_t row = p.offsets[e] + p.chunk_base[chunk * p.num_experts + e] + p.rank[entry];
  p.inverse[entry] = row;
  p.permuted_token[row] = static_cast<int32_t>(entry / p.top_k);
}

// One warp per permuted row: x's row in 16-byte vectors, or zeros on a padding row.
__global__ void rows_kernel(const PermuteParams p) {
  const int64_t row = int64_t(blockIdx.x) * (kThreads / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= p.capacity || row >= p.offsets[p.num_experts]) return;
  const int32_t token = p.permuted_token[row];
  uint4* dst = reinterpret_cast<uint4*>(static_cast<uint16_t*>(p.permuted_x) + row * p.permuted_x_stride);
  const int64_t vecs = p.hidden / 8;
  if (token < 0) {
    for (int64_t v = lane; v < vecs; v += 32) dst[v] = make_uint4(0, 0, 0, 0);
    return;
  }
  const uint4* src = reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(p.x) + token * p.x_stride);
  for (int64_t v = lane; v < vecs; v += 32) dst[v] = src[v];
}

unsigned grid_for(int64_t n, int per_block) { return static_cast<unsigned>((n + per_block - 1) / per_block); }

}  // namespace

void launch_permute(const PermuteParams& p, cudaStream_t stream) {
  const int64_t chunks = permute_chunks(p.entries);
  if (p.capacity > 0) {
    fill_kernel<<<static_cast<unsigned>(std::min<int64_t>(grid_for(p.capacity, kThreads), 1024)), kThreads, 0, stream>>>(
        p.permuted_token, p.capacity, -1);
    TESSERA_CHECK_LAUNCH();
  }
  if (chunks > 0) {
    count_kernel<<<static_cast<unsigned>(chunks), 32, 0, stream>>>(p);
    TESSERA_CHECK_LAUNCH();
  }
  offsets_kernel<<<1, kMaxPermuteExperts, 0, stream>>>(p, chunks);
  TESSERA_CHECK_LAUNCH();
  if (p.entries > 0) {
    scatter_kernel<<<grid_for(p.entries, kThreads), kThreads, 0, stream>>>(p);
    TESSERA_CHECK_LAUNCH();
  }
  if (p.x != nullptr && p.capacity > 0) {
    // Rows past the aligned total (entries + experts x (align - 1), which bounds offsets[E]) have
    // nothing to copy: the grid stops there, however large the caller's buffers are.
    const int64_t rows = std::min<int64_t>(p.capacity, p.entries + int64_t(p.num_experts) * (p.align - 1));
    rows_kernel<<<grid_for(rows, kThreads / 32), kThreads, 0, stream>>>(p);
    TESSERA_CHECK_LAUNCH();
  }
}

}  // namespace tessera::kernels::moe
