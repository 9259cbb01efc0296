// An experiment build's instrument (-DTESSERA_PLAN_PHASES=ON): the host time of each phase of
// BatchPrefillPaged::plan's last call, which tessera_bench prefill_plan prints as its
// "plan_phases" line (notes/prefill_paged.md, plan time). Off (the default) a stamp compiles to
// nothing and plan() is the same code.
#pragma once

#ifndef TESSERA_PLAN_PHASES
#define TESSERA_PLAN_PHASES 0
#endif

#include <chrono>

namespace tessera::detail {

enum PlanPhase : int {
  kPlanChecks,       // arguments, the page table's BSR view and its checks
  kPlanTileLoop,     // the pass over the requests: query tiles, longest row, the fixed grid's limits
  kPlanSplit,        // the split count (cost model) and the fixed-grid choice
  kPlanEventWait,    // the previous step's copy out of the staging buffer
  kPlanSchedule,     // the static longest-first schedule (plan/prefill_schedule.h)
  kPlanImage,        // the step's header and index arrays into the staging buffer
  kPlanCopyEnqueue,  // cudaMemcpyAsync of the image
  kPlanEventRecord,  // cudaEventRecord after it
  kPlanPhases
};
constexpr const char* kPlanPhaseNames[kPlanPhases] = {"checks", "tile_loop", "split", "event_wait",
                                                      "schedule", "image", "copy_enqueue", "event_record"};

bool plan_phases_built();
// Microseconds of each phase in the last plan() (kPlanPhases entries; phases it did not reach: 0).
const double* last_plan_phase_us();

#if TESSERA_PLAN_PHASES
class PlanPhaseClock {
 public:
  PlanPhaseClock();  // clears the last call's record and starts the first phase
  void end(PlanPhase phase);  // the time since the previous end (or the start) is `phase`'s
 private:
  std::chrono::steady_clock::time_point last_;
};
#else
struct PlanPhaseClock {
  void end(PlanPhase) {}
};
#endif

}  // namespace tessera::detail
