// A paged prefill step for the planners' CPU tests (plan/prefill_split.h, plan/prefill_schedule.h):
// host copies of qo_indptr and a page table of `page`-token pages, one request at a time.
#pragma once

#include <cstdint>
#include <vector>

namespace tessera::testing {

struct PrefillBatch {
  std::vector<int32_t> qo_indptr{0}, kv_indptr{0}, last;
  void add(int32_t qo, int32_t kv, int32_t page = 16) {
    qo_indptr.push_back(qo_indptr.back() + qo);
    const int32_t pages = (kv + page - 1) / page;
    kv_indptr.push_back(kv_indptr.back() + pages);
    last.push_back(pages ? kv - (pages - 1) * page : 0);
  }
  int64_t size() const { return static_cast<int64_t>(last.size()); }
};

}  // namespace tessera::testing
