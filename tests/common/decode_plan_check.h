// An independent check of a decode plan, shared by the planner's CPU tests and its fuzzer: every
// (request, KV head) with a query is covered once, in order, from its first visible key to its
// kv_len; a split pair's chunk partials reach exactly one root merge row through at most one level
// of group merges, every slot of a merge row being one chunk's partial or one group's output,
// with the request's rows per slot; the plan stays inside the planner's workspace bounds.
#pragma once

#include <cstdint>
#include <string>

#include "format/bsr.h"
#include "plan/decode_plan.h"

namespace tessera::testing_support {

// The first rule the plan breaks, or "" when it keeps them all. granularity: the planner policy's
// (chunks of a split request start on a multiple of lcm(page size, granularity) from its first key).
std::string check_decode_plan(const plan::Plan& plan, const format::BsrLayout& kv, const int32_t* qo_indptr,
                              const plan::PlanCapacity& cap, const plan::DecodePlanner& planner,
                              int32_t granularity = 16);

}  // namespace tessera::testing_support
