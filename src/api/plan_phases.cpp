// The plan-phase instrument's record (plan_phases.h): one per process, written by the last
// BatchPrefillPaged::plan (an instrument of single-threaded benchmarks: no locking).
#include "api/plan_phases.h"

namespace tessera::detail {
namespace {
double g_phase_us[kPlanPhases] = {};
}  // namespace

bool plan_phases_built() { return TESSERA_PLAN_PHASES != 0; }

const double* last_plan_phase_us() { return g_phase_us; }

#if TESSERA_PLAN_PHASES
PlanPhaseClock::PlanPhaseClock() : last_(std::chrono::steady_clock::now()) {
  for (double& us : g_phase_us) us = 0.0;
}

void PlanPhaseClock::end(PlanPhase phase) {
  const auto now = std::chrono::steady_clock::now();
  g_phase_us[phase] += std::chrono::duration<double, std::micro>(now - last_).count();
  last_ = now;
}
#endif

}  // namespace tessera::detail
