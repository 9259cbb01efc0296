// Hopper (sm_90a) prefill attention: TMA loads, wgmma products, warp specialisation.
// A CTA is one producer warpgroup (one warp issues every TMA copy; the others exit at once) and
// Config::kConsumers consumer warpgroups of 64 query rows each; Q, K and V tiles come into shared
// memory through a ring of mbarrier-guarded stages; setmaxnreg moves the registers the producer
// does not need to the consumers. The scheduler says which tiles a CTA computes (one, or a
// persistent walk over the list); the KV source where K and V come from (a ragged tensor or
// pages). The parts: prefill_producer_sm90.cuh (loads), kv_source_sm90.cuh (K / V copies),
// prefill_consumer_sm90.cuh (mainloop, softmax, epilogue), tile_scheduler_sm90.cuh (the order),
// tile_handover_sm90.cuh (the producer's decoded tiles, for the consumers of the ragged 128 x 128
// kernels), prefill_config_sm90.cuh (shapes, shared memory).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "core/cuda_check.h"
#include "core/once_per_device.h"
#include "tessera/error.h"
#include "kernels/attention/common/logits.cuh"
#include "kernels/attention/sm90/prefill_config_sm90.cuh"
#include "kernels/attention/sm90/prefill_consumer_sm90.cuh"
#include "kernels/attention/sm90/prefill_producer_sm90.cuh"
#include "kernels/attention/sm90/tile_scheduler_sm90.cuh"
#include "kernels/attention/sm90/tensor_map_sm90.h"
#include "kernels/attention/sm90/tile_handover_sm90.cuh"

namespace tessera::kernels::sm90 {

// Ablation switch (notes/prefill_hopper.md v7): 0 loads each tile's index entries at its start.
#ifndef TESSERA_SM90_PREFETCH_ENTRIES
#define TESSERA_SM90_PREFETCH_ENTRIES 1
#endif
constexpr bool kPrefetchEntries = TESSERA_SM90_PREFETCH_ENTRIES != 0;

// 1 (the default) gives the gathered source's producer (four copying warps) 40 registers and
// each of two consumer warpgroups 232 (from 24 and 240): at 24 its copy loop spills (ncu of hd128
// 8K page 1, H100: 7.0 M local-memory requests a launch against 16 K with TMA boxes). With the
// line copies (kv_source_sm90.cuh) the pair is 1.18-1.24x at hd128 page 1 / 7 and 1.38x at hd256
// page 1 (same run, H100); alone it measured 0.99x. 0: the 24 / 240 split (an ablation switch).
#ifndef TESSERA_SM90_GATHER_PRODUCER_REGISTERS
#define TESSERA_SM90_GATHER_PRODUCER_REGISTERS 1
#endif
// setmaxnreg's split of the CTA's registers between the producer and the consumer warpgroups.
// (hd64's three consumers leave no room: its gathered producer at 56 registers, the consumers at
// 152, measured 0.81x, notes/prefill_hopper.md.)
template <typename Config, typename KV>
struct RegisterSplit {
  // (With the tile hand-over the producer holds a whole WorkTile to publish: at 24 registers its
  // copy loop spills, so it takes 40 there too.)
  static constexpr bool kWideProducer =
      (TESSERA_SM90_GATHER_PRODUCER_REGISTERS != 0 && KV::kProducerWarps > 1 && Config::kConsumers == 2) ||
      kTileHandover<Config, KV>;
  static constexpr int kProducer = kWideProducer ? 40 : Config::kProducerRegisters;
  static constexpr int kConsumer = kWideProducer ? 232 : Config::kConsumerRegisters;
  static_assert(kProducer * 128 + kConsumer * 128 * Config::kConsumers <= Config::kLaunchRegisters * Config::kThreads,
                "setmaxnreg budgets beyond the registers the CTA holds from its launch");
};

template <typename T, typename Config, typename Logits, typename Scheduler, typename KV>
__global__ void __launch_bounds__(Config::kThreads, 1) prefill_sm90_kernel(const __grid_constant__ PrefillSm90Params p) {
  extern __shared__ unsigned char raw_smem[];
  const PrefillSm90SmemFor<T, Config, KV> smem(raw_smem);
  constexpr int kConsumerWarps = 4 * Config::kConsumers;
  if (threadIdx.x == 0) {
    auto& bar = smem.barriers();
    for (int s = 0; s < Config::kQStages; ++s) {
      bar.q_full[s].init(1);
      bar.q_empty[s].init(kConsumerWarps);
    }
    for (int s = 0; s < Config::kStages; ++s) {
      bar.k_full[s].init(KV::kFullArrivals);
      bar.v_full[s].init(KV::kFullArrivals);
      bar.k_empty[s].init(kConsumerWarps);
      bar.v_empty[s].init(kConsumerWarps);
      bar.v_zeroed[s].init(1);
    }
    if constexpr (Config::kOSharesV) bar.o_read.init(Config::kConsumers);
    if constexpr (kTileHandover<Config, KV>) bar.handover.init(kConsumerWarps);
    Mbarrier::fence_init();
  }
  __syncthreads();

  // Warp-uniform for the compiler (a shuffle from lane 0): ptxas then sees the consumers' turn
  // barriers and branches on it as uniform and keeps their wgmma asynchronous.
  const int warpgroup = __shfl_sync(0xffffffffu, int(threadIdx.x / 128), 0);
  if (warpgroup == 0) {
    warpgroup_registers_decrease<RegisterSplit<Config, KV>::kProducer>();
    if (threadIdx.x < 32 * KV::kProducerWarps) prefill_producer_warp<T, Config, Scheduler, KV>(p, smem);
  } else {
    warpgroup_registers_increase<RegisterSplit<Config, KV>::kConsumer>();
    PrefillConsumer<T, Config, Logits, KV, Scheduler> consumer(p, smem, warpgroup - 1);
    consumer.start_turns();
    if constexpr (kTileHandover<Config, KV>) {  // the producer's decoded tiles, until its end marker
      RingPosition<TileHandover::kSlots> handed;
      for (;;) {
        consumer.timeline.begin_decode();  // (experiment builds only: phase_timeline_sm90.cuh)
        const WorkTile w = smem.barriers().handover.take(handed);
        if (w.request < 0) break;
        if (w.has_rows()) consumer.compute(w);
      }
    } else {  // each consumer walks the scheduler's sequence and decodes every tile itself
      // The next tile's index entries load while this one computes, not at the tile boundary:
      // +0.3-0.5% at every hd128 case, same run (notes/prefill_hopper.md v7). The producer loads its
      // own when it gets there: it runs ahead of the consumers.
      int position = Scheduler::first(p);
      RequestEntries entries{};
      if (position < Scheduler::tiles(p)) entries = load_request_entries<KV::kPaged>(p, request_at<Scheduler, Config::kBlockM, Config::kBlockN>(p, position));
      while (position < Scheduler::tiles(p)) {
        consumer.timeline.begin_decode();  // (experiment builds only: phase_timeline_sm90.cuh)
        const WorkTile w = make_work_tile<Config::kBlockM, Config::kBlockN, KV, Scheduler>(p, position, entries);
        position = Scheduler::next(p, position);
        if (kPrefetchEntries && position < Scheduler::tiles(p))
          entries = load_request_entries<KV::kPaged>(p, request_at<Scheduler, Config::kBlockM, Config::kBlockN>(p, position));
        if (w.has_rows()) consumer.compute(w);
        if (!kPrefetchEntries && position < Scheduler::tiles(p))
          entries = load_request_entries<KV::kPaged>(p, request_at<Scheduler, Config::kBlockM, Config::kBlockN>(p, position));
      }
    }
    consumer.finish_turns();
    consumer.finish_stores();
  }
}

template <typename T>
constexpr DType dtype_of() {
  return std::is_same<T, __nv_bfloat16>::value ? DType::kBF16 : DType::kFP16;
}

template <typename T, typename Config, typename Logits, typename Scheduler, typename KV>
void launch_prefill_sm90_variant(const PrefillSm90Params& params, int grid, cudaStream_t stream) {
  constexpr int kSmemBytes = PrefillSm90SmemFor<T, Config, KV>::kBytes;
  auto kernel = prefill_sm90_kernel<T, Config, Logits, Scheduler, KV>;
  static tessera::detail::OncePerDevice smem_limit_raised;
  smem_limit_raised([&] {
    TESSERA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
  });
  kernel<<<grid, Config::kThreads, kSmemBytes, stream>>>(params);
}

// The kernel for (logits, scheduler) over the KV source. A fixed-grid launch (params.base.step:
// BatchPrefillPaged with cuda_graph, paged sources only) walks the step's list.
template <typename T, typename Config, typename KV>
void launch_prefill_sm90_source(const PrefillSm90Params& params, bool persistent, int grid, cudaStream_t stream) {
  if constexpr (KV::kPaged) {
    if (params.base.step != nullptr) {
      using Step = StepListScheduler<Config::kBlockM>;
      if (params.base.soft_cap > 0.f) launch_prefill_sm90_variant<T, Config, SoftCappedLogits, Step, KV>(params, grid, stream);
      else launch_prefill_sm90_variant<T, Config, PlainLogits, Step, KV>(params, grid, stream);
      return;
    }
  }
  if (params.base.soft_cap > 0.f) {
    if (persistent) launch_prefill_sm90_variant<T, Config, SoftCappedLogits, StaticPersistentScheduler, KV>(params, grid, stream);
    else launch_prefill_sm90_variant<T, Config, SoftCappedLogits, SingleTileScheduler, KV>(params, grid, stream);
  } else {
    if (persistent) launch_prefill_sm90_variant<T, Config, PlainLogits, StaticPersistentScheduler, KV>(params, grid, stream);
    else launch_prefill_sm90_variant<T, Config, PlainLogits, SingleTileScheduler, KV>(params, grid, stream);
  }
}

template <typename T, typename Config>
void launch_prefill_sm90_typed(const PrefillParams& base, const PrefillSm90Schedule& schedule, int num_sms,
                         cudaStream_t stream) {
  constexpr int kHeadDim = Config::kHeadDim;
  if (base.paged && !Config::kPagedSources) {
    throw Error("tessera: the Hopper prefill's " + std::to_string(Config::kBlockN) +
                "-key K / V tiles take ragged K / V only, not pages (internal error: the dispatcher chose them)");
  }
  // Packed GQA: the group's heads share a tile's rows (2^gqa_pack of them a token), so a tile
  // holds a whole number of tokens and one 64-row O box a whole number too.
  const int pack = base.gqa_pack;
  if (pack < 0 || pack > kMaxGqaPack || (pack > 0 && base.num_qo_heads != base.num_kv_heads << pack) ||
      (int64_t(base.max_qo_len) << pack) >= (int64_t(1) << 31)) {
    throw Error("tessera: packed GQA of 2^" + std::to_string(pack) + " query heads a tile does not fit " +
                std::to_string(base.num_qo_heads) + " query / " + std::to_string(base.num_kv_heads) +
                " KV heads and " + std::to_string(base.max_qo_len) + " query rows (internal error)");
  }
  const int m_tiles = int(((int64_t(base.max_qo_len) << pack) + Config::kBlockM - 1) / Config::kBlockM);
  // (A fixed-grid launch runs whatever later step a graph replays, so it launches even when the
  // step it was made with has no tiles.)
  if (base.step == nullptr && (m_tiles == 0 || base.batch_size == 0 || base.num_qo_heads == 0)) return;
  PrefillSm90Params params;
  params.base = base;
  params.m_tiles = m_tiles;
  // < 2^31: the dispatcher checks the unsplit list, BatchPrefillPaged's plan caps kv_splits to fit.
  const int64_t tiles = int64_t(base.batch_size) * (base.num_qo_heads >> pack) * m_tiles * std::max(1, base.kv_splits);
  if (tiles >= (int64_t(1) << 31)) throw Error("tessera: the Hopper prefill's tile list has 2^31 or more entries");
  params.tiles = static_cast<int>(tiles);
  params.order = schedule.order;
  params.heavy_first = schedule.heavy_first;
  params.run_length = std::max(1, schedule.run_length);
  params.m_tiles_divisor = FastDivisor(m_tiles);
  params.heads_divisor = FastDivisor(base.num_qo_heads >> pack);
  params.pairs_divisor = FastDivisor(static_cast<int32_t>(std::min<int64_t>(
      int64_t(base.batch_size) * (base.num_qo_heads >> pack), (int64_t(1) << 31) - 1)));
  params.splits_divisor = FastDivisor(std::max(1, base.kv_splits));
  params.group_divisor = FastDivisor(base.num_kv_heads > 0 ? base.num_qo_heads / base.num_kv_heads : 1);
#if TESSERA_SM90_TIMELINE
  params.timeline = prefill_sm90_timeline().buffer;
  params.timeline_tiles = prefill_sm90_timeline().tiles_per_consumer;
#endif
  if (base.paged && base.page_size % 8 != 0) {
    // Pages whose runs do not start on whole 8-row swizzle atoms: the producer gathers K / V
    // (kv_source_sm90.cuh, GatheredKVSm90); Q still by TMA.
    params.q_map = query_tensor_map(dtype_of<T>(), base, kHeadDim, Config::kBlockM);
    params.kv_gathered = true;
  } else if (base.paged) {
    const PagedTensorMaps maps = paged_tensor_maps(dtype_of<T>(), base, kHeadDim, Config::kBlockM, Config::kBlockN);
    params.q_map = maps.q;
    params.k_map = maps.k;
    params.v_map = maps.v;
    params.kv_box_rows = maps.kv_box_rows;
    params.kv_tile_rows = Config::kBlockN;
    params.kv_grouped = maps.grouped;
    params.kv_head_in_blocks = maps.head_in_blocks;
    params.k_token_dim_first = maps.k_token_dim_first;
    params.v_token_dim_first = maps.v_token_dim_first;
  } else {
    const RaggedTensorMaps maps = ragged_tensor_maps(dtype_of<T>(), base, kHeadDim, Config::kBlockM, Config::kBlockN);
    params.q_map = maps.q;
    params.k_map = maps.k;
    params.v_map = maps.v;
  }
  if constexpr (Config::kStoreOViaSmem) {
    // A fixed-grid launch has its partials' buffers set for every step; its unsplit steps write O.
    if (base.partial_o == nullptr || base.step != nullptr)
      params.o_via_tma = output_tensor_map(dtype_of<T>(), base, kHeadDim, &params.o_map);
  }
  const bool persistent = schedule.scheduler == SchedulerKind::kStaticPersistent;
  const int runs = (params.tiles + params.run_length - 1) / params.run_length;
  // Fixed-grid launches: one CTA per slot of the plan's schedule, one slot per SM.
  const int grid = base.step != nullptr ? num_sms : persistent ? std::min(runs, num_sms) : params.tiles;
  if constexpr (Config::kPagedSources) {
    if (params.kv_gathered) {
      launch_prefill_sm90_source<T, Config, GatheredKVSm90<Config::kBlockN, kHeadDim>>(params, persistent, grid, stream);
      return;
    }
    if (base.paged) {
      launch_prefill_sm90_source<T, Config, PagedKVSm90>(params, persistent, grid, stream);
      return;
    }
  }
  launch_prefill_sm90_source<T, Config, RaggedKVSm90>(params, persistent, grid, stream);
}

}  // namespace tessera::kernels::sm90
