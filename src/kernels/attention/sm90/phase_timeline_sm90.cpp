// Host side of the Hopper prefill's phase timeline (phase_timeline_sm90.cuh): where an experiment
// build's launches write their records.
#include <string>

#include "kernels/attention/sm90/prefill_sm90_launch.h"
#include "tessera/error.h"

namespace tessera::kernels::sm90 {
namespace {
PrefillSm90Timeline g_timeline;  // (an instrument of single-threaded benchmarks: no locking)
}  // namespace

bool prefill_sm90_timeline_built() { return TESSERA_SM90_TIMELINE != 0; }

void set_prefill_sm90_timeline(unsigned* buffer, int tiles_per_consumer) {
  if (!prefill_sm90_timeline_built()) {
    throw Error("tessera: set_prefill_sm90_timeline: this build has no phase timeline (configure with "
                "-DTESSERA_SM90_TIMELINE=ON)");
  }
  if (buffer != nullptr && tiles_per_consumer <= 0) {
    throw Error("tessera: set_prefill_sm90_timeline: tiles_per_consumer must be > 0, got " +
                std::to_string(tiles_per_consumer));
  }
  g_timeline = {buffer, buffer == nullptr ? 0 : tiles_per_consumer};
}

PrefillSm90Timeline prefill_sm90_timeline() { return g_timeline; }

}  // namespace tessera::kernels::sm90
