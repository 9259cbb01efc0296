// libFuzzer target: the page-table (BSR) checks on arbitrary host arrays. check_bsr must never
// read out of bounds or crash, and a table it accepts must keep its invariants (the planner and
// kernels rely on them): indptr from 0, non-decreasing; last page lengths in 1..page_size for rows
// with pages; page ids in [0, num_pages) when num_pages is given (-1 leaves them unchecked); rows
// within kMaxRowTokens.
#include <cstdio>
#include <algorithm>
#include <cstdlib>
#include <vector>

#include "format/bsr.h"
#include "fuzz/fuzz_input.h"

using namespace tessera;

namespace {

[[noreturn]] void finding(const char* what, int64_t at) {
  std::fprintf(stderr, "fuzz_page_table: accepted a table whose %s breaks the rule (at %lld)\n", what,
               static_cast<long long>(at));
  std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  fuzz::FuzzInput in(data, size);
  const int32_t page = static_cast<int32_t>(in.range(-2, 300));
  const int32_t rows = static_cast<int32_t>(in.range(0, 64));
  const int64_t num_pages = in.flag() ? -1 : in.range(0, 4096);
  // Mostly well-formed arrays with occasional corruption, so that the checks' every branch is met.
  std::vector<int32_t> indptr(rows + 1), last(rows);
  indptr[0] = in.range(0, 15) == 0 ? static_cast<int32_t>(in.range(-3, 3)) : 0;
  for (int32_t r = 0; r < rows; ++r) {
    const int32_t step = in.range(0, 15) == 0 ? static_cast<int32_t>(in.range(-5, 5)) : static_cast<int32_t>(in.range(0, 40));
    indptr[r + 1] = indptr[r] + step;
    last[r] = in.range(0, 7) == 0 ? static_cast<int32_t>(in.range(-1, page + 2)) : static_cast<int32_t>(in.range(1, page > 0 ? page : 1));
  }
  const int32_t entries = std::max<int32_t>(0, indptr[rows]);
  std::vector<int32_t> indices(entries);
  for (int32_t& id : indices) id = static_cast<int32_t>(in.range(0, 15) == 0 ? in.range(-4, 5000) : in.range(0, 4095));
  format::BsrLayout b = format::bsr_from_page_table(page, rows, indptr.data(), indices.data(), last.data());
  // check_bsr reads indices[indptr[r] .. indptr[r+1]) only once indptr has been checked; a table
  // whose indptr end exceeds the entries given is not a valid input (the caller owns that array).
  if (indptr[rows] > entries) return 0;
  // The id range BatchDecoder::run checks against (vectorised) equals a plain scan.
  if (rows > 0 && indptr[rows] >= 0 && std::is_sorted(indptr.begin(), indptr.end())) {
    const format::BlockIdRange range = format::block_id_range(b);
    int32_t lo = 0, hi = -1;
    for (int32_t i = 0; i < indptr[rows]; ++i) {
      lo = i == 0 ? indices[i] : std::min(lo, indices[i]);
      hi = i == 0 ? indices[i] : std::max(hi, indices[i]);
    }
    if (range.min != lo || range.max != hi) finding("block id range", indptr[rows]);
  }
  const std::string bad = format::check_bsr(b, num_pages);
  if (!bad.empty()) {
    (void)format::split_bsr_error(bad);
    return 0;
  }
  if (page < 1) finding("page size", page);
  if (indptr[0] != 0) finding("indptr start", 0);
  for (int32_t r = 0; r < rows; ++r) {
    if (indptr[r + 1] < indptr[r]) finding("indptr order", r);
    if (b.row_blocks(r) > 0 && (last[r] < 1 || last[r] > page)) finding("last page length", r);
    if (b.row_tokens(r) > format::kMaxRowTokens) finding("row length", r);
    for (int32_t i = indptr[r]; i < indptr[r + 1]; ++i) {
      // Page ids are checked only against a known page count (num_pages -1: unchecked, the caller
      // vouches for them).
      if (num_pages >= 0 && (indices[i] < 0 || indices[i] >= num_pages)) finding("page id", i);
    }
  }
  return 0;
}
