// The Hopper prefill family as the dispatcher sees it (host code, no CUDA types but the stream).
#pragma once

#include "kernels/attention/prefill_params.h"
#include "tessera/dtype.h"

// 1 in experiment builds with the phase timeline (cmake -DTESSERA_SM90_TIMELINE=ON).
#ifndef TESSERA_SM90_TIMELINE
#define TESSERA_SM90_TIMELINE 0
#endif

namespace tessera::kernels::sm90 {

// How the tile list (request, query head, query tile) is ordered and handed to CTAs
// (tile_scheduler_sm90.cuh). The dispatcher chooses per problem; tests and benchmarks force one.
enum class TileOrder : int {
  kQueryTilesInner = 0,  // (request, head, query tile): a head's tiles together (L2 reuse of its K / V)
  kQueryTilesOuter = 1,  // (query tile, request, head): one query tile of every head, then the next
  kMirroredPairs = 2,    // as kQueryTilesInner, a head's tiles as last, first, second last, second, ...
};
enum class SchedulerKind : int {
  kSingleTile = 0,        // one tile per CTA; the hardware starts CTAs in list order
  kStaticPersistent = 1,  // one CTA per SM walks the list with stride gridDim.x
};
struct PrefillSm90Schedule {
  SchedulerKind scheduler = SchedulerKind::kStaticPersistent;
  TileOrder order = TileOrder::kQueryTilesInner;
  bool heavy_first = false;  // query tiles from the last (causal: the most keys first)
  int run_length = 1;        // persistent: consecutive list positions per CTA turn (2 with kMirroredPairs)
  // Keys per K / V tile: 0 for the head dim's default; hd128 with ragged K / V also 160 and 192
  // (prefill_sm90_block_n_choices). Set by dispatch::choose_prefill_sm90_block_n, also under a
  // forced schedule (tests and benchmarks force the width with force_prefill_sm90_block_n).
  int block_n = 0;
};

// Keys of a K / V tile at head_dim by default (PrefillSm90Config).
constexpr int prefill_sm90_default_block_n(int head_dim) { return head_dim == 256 ? 80 : 128; }

// The K / V tile widths the family has at head_dim for ragged K / V (the first is the default;
// paged sources take the default only).
struct PrefillSm90BlockNChoices {
  int count;
  int keys[3];
};
PrefillSm90BlockNChoices prefill_sm90_block_n_choices(int head_dim);

// Packed GQA (PrefillParams::gqa_pack) of at most 2^6 = 64 query heads a KV head: a consumer's
// 64 rows (one O box) then hold whole tokens.
constexpr int kMaxGqaPack = 6;

// Whether the family was compiled for (dtype, head_dim) (the instantiation list; sm_90a only).
bool prefill_sm90_compiled(DType dtype, int head_dim);
// Shared memory one CTA of the family needs at head_dim with block_n keys a K / V tile (0: the
// default; 0 returned if not compiled).
int prefill_sm90_smem_bytes(int head_dim, int block_n = 0);
// Query rows and keys of one tile at head_dim ({128, 128} if not compiled).
struct PrefillSm90Tile {
  int block_m, block_n;
};
PrefillSm90Tile prefill_sm90_tile(int head_dim);
inline int prefill_sm90_block_m(int head_dim) { return prefill_sm90_tile(head_dim).block_m; }
// The phase timeline of an experiment build (cmake -DTESSERA_SM90_TIMELINE=ON; phase_timeline_sm90.cuh):
// the family's next launches write up to tiles_per_consumer records a consumer warpgroup, of
// kPrefillSm90TimelineWords 32-bit words each, into `buffer` (device memory for grid x consumers x
// tiles_per_consumer records: at most num_sms x 3 consumers with the persistent schedules); nullptr
// stops. Throws tessera::Error in a build without the timeline (prefill_sm90_timeline_built()).
constexpr int kPrefillSm90TimelineWords = 15;
bool prefill_sm90_timeline_built();
void set_prefill_sm90_timeline(unsigned* buffer, int tiles_per_consumer);
struct PrefillSm90Timeline {
  unsigned* buffer = nullptr;
  int tiles_per_consumer = 0;
};
PrefillSm90Timeline prefill_sm90_timeline();  // what the launcher hands the kernel

// Launches the family on an sm_90 GPU with num_sms SMs. Throws tessera::Error for a combination
// that was not compiled or a tensor the copy engine cannot describe.
void launch_prefill_sm90(DType dtype, int head_dim, const PrefillParams& params,
                         const PrefillSm90Schedule& schedule, int num_sms, cudaStream_t stream);

}  // namespace tessera::kernels::sm90
