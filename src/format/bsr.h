// The block-sparse row (BSR) view of attention's KV side, shared by every KV source the kernels
// read: row r (a request) owns column blocks indices[indptr[r] .. indptr[r+1]) of block_size KV
// tokens each, and its last block holds last_block_len[r] tokens (1..block_size). A paged KV
// cache's page table *is* such a matrix (block_size = page_size, blocks = pages); ragged KV is the
// same with one block per token range; shared prefixes and windows are rows that share or skip
// blocks. Pure C++, host memory only.
#pragma once

#include <climits>
#include <cstdint>
#include <string>

namespace tessera::format {

struct BsrLayout {
  int32_t block_size = 1;
  int32_t num_rows = 0;
  const int32_t* indptr = nullptr;          // [num_rows + 1], host
  const int32_t* indices = nullptr;         // [indptr[num_rows]], host
  const int32_t* last_block_len = nullptr;  // [num_rows], host; null: every last block is full

  int32_t row_blocks(int32_t r) const { return indptr[r + 1] - indptr[r]; }
  // KV tokens of row r: block_size * (blocks - 1) + last_block_len (0 without blocks).
  int64_t row_tokens(int32_t r) const {
    const int32_t blocks = row_blocks(r);
    if (blocks == 0) return 0;
    const int32_t last = last_block_len ? last_block_len[r] : block_size;
    return int64_t(block_size) * (blocks - 1) + last;
  }
};

// The BSR view of a paged KV page table (host copies of kv_indptr, kv_indices, kv_last_page_len).
inline BsrLayout bsr_from_page_table(int32_t page_size, int32_t batch_size,
                                     const int32_t* kv_indptr, const int32_t* kv_indices,
                                     const int32_t* kv_last_page_len) {
  BsrLayout b;
  b.block_size = page_size;
  b.num_rows = batch_size;
  b.indptr = kv_indptr;
  b.indices = kv_indices;
  b.last_block_len = kv_last_page_len;
  return b;
}

// Checks the layout's invariants; returns an empty string when it is valid, else which array broke
// which rule (for tessera::Error messages). num_blocks: the blocks (pages) the cache holds, or -1
// when block ids are not to be range-checked.
std::string check_bsr(const BsrLayout& b, int64_t num_blocks);

// The smallest and largest block id the rows use (indices[0 .. indptr[num_rows])); {0, -1} when
// they use none. One vectorised pass (AVX2 where the CPU has it): 3 us at 32K ids, 24 us at 262K
// on the development CPU (-O3), so a caller can check ids against a cache it only sees later
// (BatchDecoder::run).
struct BlockIdRange {
  int32_t min = 0, max = -1;
};
BlockIdRange block_id_range(const BsrLayout& b);

// A check_bsr() message split for an argument error: the page-table array it names
// ("kv_indices: page id ..." -> "kv_indices") and the rule after it; messages that name no array
// are charged to "kv_indptr" whole.
struct BsrError {
  std::string array;
  std::string rule;
};
BsrError split_bsr_error(const std::string& message);

// The most KV tokens one row (request) may hold: the kernels' int32 token arithmetic (tile ends,
// band edges) keeps this much headroom below 2^31.
constexpr int64_t kMaxRowTokens = INT32_MAX - (int64_t(1) << 16);

}  // namespace tessera::format
