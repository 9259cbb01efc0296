// Where the Hopper prefill kernel's K and V come from: a request's extent (WorkTile::kv_start and
// kv_len) and the producer's copy of one KV tile into the ring.
//   RaggedKVSm90: a ragged [total_kv, heads, head_dim] tensor (k_map / v_map 3-D); kv_start is the
//     request's first row; a tile is one TMA box of kBlockN rows per 64-column block.
//   PagedKVSm90: pages [num_pages, page_size, heads, head_dim] (NHD) or [num_pages, heads,
//     page_size, head_dim] (HND), page_size a multiple of 8, behind 5-D grouped maps, or 4-D ones
//     for padded heads (tensor_map_sm90.h; the layout is only the maps' dim order and strides),
//     into tiles whose column blocks are interleaved per 8 rows (Sw128GroupedTile); kv_start is
//     the request's first entry of kv_indices. A tile of kBlockN keys is kBlockN / box_rows runs
//     of box_rows = gcd(page_size, kBlockN) rows (a multiple of 8: each run lies inside one page
//     and starts on a whole 8-row group); lane j of the producer warp looks up run j's page and
//     copies it: one box with a grouped map (all column blocks: the copy engine serves about one
//     box per 50 ns per SM, so page-16 tiles of one box per column block and page were
//     request-bound), else one per 8 rows and column block. A tile costs one index load per lane.
//   GatheredKVSm90: the same pages of any other size (1, 7, 100, ...), gathered by the producer
//     warpgroup's four warps with 16-byte cp.async copies (below).
// Keys past kv_len: ragged, the next request's rows; paged, the rest of the last page, and boxes
// wholly past kv_len are not copied (their shared memory keeps an older tile). The consumers mask
// those logits and the producer zeroes those V rows (prefill_producer_sm90.cuh), so neither
// reaches O. The gathered source's copies write zeros there themselves (kZeroesPastEnd).
#pragma once

#include <cuda_runtime.h>

#include "kernels/attention/sm90/prefill_sm90_params.h"
#include "kernels/common/cp_async.cuh"
#include "kernels/common/tma_sm90.cuh"
#include "kernels/common/device_check.cuh"
#include "kernels/common/warp_uniform.cuh"

namespace tessera::kernels::sm90 {

// Ablation switch (notes/prefill_hopper.md, "The gathered source against FlashInfer's"), see
// GatheredKVSm90::kWriterFence.
#ifndef TESSERA_SM90_GATHER_WRITER_FENCE
#define TESSERA_SM90_GATHER_WRITER_FENCE 0
#endif
// 1 (the default): the gathered source copies whole 128-byte lines, eight lanes a row
// (GatheredKVSm90, "line copies"); 0 (an ablation switch): the lane pairs of 32-byte sectors it
// was measured with first.
#ifndef TESSERA_SM90_GATHER_ROW_LINES
#define TESSERA_SM90_GATHER_ROW_LINES 1
#endif

// A KV source reads a request's extent from its RequestEntries and is used in two steps per tile,
// so the page-id loads of the next tile can be in flight while the producer waits for ring slots
// (each lookup is a dependent global load); `thread` is the producer thread (0 .. 32
// kProducerWarps - 1):
//   Where where = KV::locate(p, kv_start, kv_len, n0, thread);   // what to copy (this thread's share)
//   KV::load<KVOperand::kKeys>(p, tile, full, kv_head, where, thread);  // K, then V, same `where`
// A request's entries of the index arrays, as loaded (not yet warp-uniform): qo_indptr[r],
// qo_indptr[r + 1], kv_indptr[r], kv_indptr[r + 1] and, paged, kv_last_page_len[r]. Loaded apart
// from their use so the consumers can have the next work tile's in flight while they compute the
// current one (prefill_sm90.cuh).
struct RequestEntries {
  int q_begin, q_end, kv_begin, kv_end, last_page_len;
};
template <bool kPaged>
__device__ __forceinline__ RequestEntries load_request_entries(const PrefillSm90Params& p, int request) {
  RequestEntries e;
  e.q_begin = p.base.qo_indptr[request];
  e.q_end = p.base.qo_indptr[request + 1];
  e.kv_begin = p.base.kv_indptr[request];
  e.kv_end = p.base.kv_indptr[request + 1];
  e.last_page_len = kPaged ? p.base.kv_last_page_len[request] : 0;
  return e;
}

enum class KVOperand { kKeys, kValues };

// Where key `key` of a paged request (its first kv_indices entry kv_start) lies: its page id and
// its token within that page.
struct PageSlot {
  int page, token;
};
__device__ __forceinline__ PageSlot page_slot(const PrefillSm90Params& p, int kv_start, unsigned key) {
  const unsigned page_of_key = (__umulhi(key, p.base.page_magic) + key) >> p.base.page_shift;
  PageSlot slot;
  slot.page = p.base.kv_indices[kv_start + int(page_of_key)];
  TESSERA_DEVICE_CHECK_QUIET(slot.page >= 0 && slot.page < p.base.num_pages, "a kv_indices page id outside the page tensors");
  slot.token = int(key - page_of_key * unsigned(p.base.page_size));
  return slot;
}

struct RaggedKVSm90 {
  static constexpr bool kPaged = false;
  __device__ static void extent(const RequestEntries& e, int /*page_size*/, int& kv_start, int& kv_len) {
    kv_start = warp_uniform(e.kv_begin);
    kv_len = warp_uniform(e.kv_end) - kv_start;
  }
  struct Where {
    int row;  // the tile's first row in the ragged tensor
  };
  __device__ static Where locate(const PrefillSm90Params& /*p*/, int kv_start, int /*kv_len*/, int n0, int /*lane*/) {
    return Where{kv_start + n0};
  }
  static constexpr bool kGroupedTiles = false;  // the smem tile type (PrefillSm90Smem)
  static constexpr int kProducerWarps = 1;       // warps of the producer warpgroup that load
  static constexpr int kFullArrivals = 1;        // per fill of a K / V stage (its expect_tx)
  static constexpr bool kZeroesPastEnd = false;  // rows past kv_len come zeroed (else the producer zeroes V's)
  static constexpr bool kConsumersFence = false;  // fills through the generic proxy (not TMA): the consumers fence
  static constexpr bool kWriterFence = false;     // (GatheredKVSm90)
  // The tile's keys (or values) of kv_head into `tile`, completing on `full`.
  template <KVOperand kOperand, typename Tile>
  __device__ static void load(const PrefillSm90Params& p, const Tile& tile, Mbarrier& full, int kv_head,
                              const Where& where, int lane) {
    const CUtensorMap* map = kOperand == KVOperand::kKeys ? &p.k_map : &p.v_map;
    if (lane == 0) {
      full.arrive_expect_tx(Tile::kBytes);
      tile.load(map, &full, kv_head, where.row);
    }
  }
};

// A paged request's first kv_indices entry and its keys.
__device__ __forceinline__ void paged_extent(const RequestEntries& e, int page_size, int& kv_start, int& kv_len) {
  kv_start = warp_uniform(e.kv_begin);
  const int pages = warp_uniform(e.kv_end) - kv_start;
  kv_len = pages == 0 ? 0 : (pages - 1) * page_size + warp_uniform(e.last_page_len);
}

struct PagedKVSm90 {
  static constexpr bool kPaged = true;
  __device__ static void extent(const RequestEntries& e, int page_size, int& kv_start, int& kv_len) {
    paged_extent(e, page_size, kv_start, kv_len);
  }
  struct Where {
    int boxes;  // boxes of the tile that hold keys (the same for every lane), at most 32
    int row;    // this lane's box (lane < boxes): its first row in the tile, page id and token
    int page, token;
  };
  // Lane j takes box j; kBlockN / gcd(page_size, kBlockN) <= kBlockN / 8 <= 32 boxes.
  __device__ static Where locate(const PrefillSm90Params& p, int kv_start, int kv_len, int n0, int lane) {
    const int box_rows = p.kv_box_rows;
    Where where;
    where.boxes = (min(kv_len - n0, p.kv_tile_rows) + box_rows - 1) / box_rows;  // >= 1: the tile meets a key
    where.row = lane * box_rows;
    where.page = 0;
    where.token = 0;
    if (lane < where.boxes) {
      const PageSlot slot = page_slot(p, kv_start, unsigned(n0 + where.row));
      where.page = slot.page;
      where.token = slot.token;
    }
    return where;
  }
  static constexpr bool kGroupedTiles = true;
  static constexpr int kProducerWarps = 1;
  static constexpr int kFullArrivals = 1;
  static constexpr bool kZeroesPastEnd = false;
  static constexpr bool kConsumersFence = false;
  static constexpr bool kWriterFence = false;
  // token_first: the 4-D map's second dim is the token dim (PrefillSm90Params::k/v_token_dim_first).
  template <KVOperand kOperand, typename Tile>
  __device__ static void load(const PrefillSm90Params& p, const Tile& tile, Mbarrier& full, int kv_head,
                              const Where& where, int lane) {
    const CUtensorMap* map = kOperand == KVOperand::kKeys ? &p.k_map : &p.v_map;
    const bool token_first = kOperand == KVOperand::kKeys ? p.k_token_dim_first : p.v_token_dim_first;
    // The expected bytes are announced before any copy can complete on the barrier.
    if (lane == 0) full.arrive_expect_tx(uint32_t(where.boxes) * p.kv_box_rows * 128 * Tile::kColBlocks);
    __syncwarp();
    if (lane < where.boxes) {
      if (p.kv_grouped) {
        // NHD: the head's column blocks among all heads'; HND: its 8-token groups among all heads'.
        const int block = p.kv_head_in_blocks ? kv_head * Tile::kColBlocks : 0;
        const int group = p.kv_head_in_blocks ? where.token / 8 : (kv_head * p.base.page_size + where.token) / 8;
        tile.load_grouped_rows(map, &full, where.row, block, group, where.page);
      } else if (token_first) {
        tile.load_page_rows(map, &full, where.row, p.kv_box_rows, true, where.token, kv_head, where.page);
      } else {
        tile.load_page_rows(map, &full, where.row, p.kv_box_rows, false, kv_head, where.token, where.page);
      }
    }
  }
};

// Pages of any size (1, 7, 54, ...: TMA boxes must start on whole 8-row swizzle atoms, so those
// are not TMA'd): the producer warpgroup's four warps gather the tile with 16-byte cp.async
// copies into Sw128Tile's layout. Warp w copies rows 32 w + r and 32 w + 16 + r (r = lane / 2),
// the lane pair of a row its even and odd 16-byte chunks, so each copy instruction reads whole
// 32-byte sectors of 16 rows. Each thread looks up its two rows' pages itself, one tile ahead
// (Where; the pair's duplicate lookup hits the cache), and then a copy costs one XOR for its
// swizzled address: in a 1024-byte aligned tile of 128-byte rows, chunk c of row `row` sits at
// (row address + (row % 8) * 16) ^ ((c % 8) * 16), column block c / 8. Rows past kv_len are
// zero-filled by the copies themselves (cp.async with no source bytes), so no V row needs
// zeroing. The copies complete on the stage's barrier through one cp.async.mbarrier.arrive.noinc
// per thread; they write through the generic proxy, so the consumers fence (fence.proxy.async)
// before their wgmma reads.
// The first versions passed each row's page from the lane holding it by shuffle, ~25
// instructions a copy: the consumers waited on K 36% of the time (ncu, hd128 page 1), 82 TFLOP/s
// with one copying warp, 267 with four (the ragged kernel 695).
// Line copies (TESSERA_SM90_GATHER_ROW_LINES=1): ncu of hd128 8K page 1 (H100, 2026-12-07) had
// the L2 at 85% of its throughput against 24% for the same tokens in page-16 TMA boxes, with
// 97% hits: the L2 is busy with requests, not bytes. A lane pair's copy instruction asks 16 lines
// for one 32-byte sector each. With eight lanes a row, one instruction reads 4 rows' whole
// 128-byte lines (four sectors a request, as TMA's boxes), a quarter of the requests. Lane j of
// warp w looks up row 32 w + j's page once a tile; each group of four rows takes its pages from
// their lanes by shuffle (two a group) before its copies: chunk 8 h + lane % 8 of row
// 32 w + 4 g + lane / 8, h over the row's 128-byte halves (blocks).
// Same run (H100, notes/prefill_hopper.md, "Line copies and the producer's 40 registers"), TFLOP/s
// against the lane pairs, with the producer's 40 registers (prefill_sm90.cuh, RegisterSplit):
// hd128 8K page 1 563.1 vs 455.7 (1.24x), causal 521.7 vs 443.5 (1.18x), page 7 563.7 vs 456.3
// (1.24x); line copies alone 1.12-1.18x; hd256 8K page 1 614.8 vs 444.5 (1.38x); hd64 even.
template <int kBlockN, int kHeadDim>
struct GatheredKVSm90 {
  static constexpr bool kPaged = true;
  static constexpr bool kGroupedTiles = false;
  static constexpr int kProducerWarps = 4;
  static constexpr int kFullArrivals = 32 * kProducerWarps;  // every producer thread's noinc arrival
  static constexpr bool kZeroesPastEnd = true;
  // TESSERA_SM90_GATHER_WRITER_FENCE=1 (an ablation switch, off by default): the producer, not the
  // consumers, orders the copies before the wgmma reads: each thread waits for its own copies,
  // fences (fence.proxy.async) and arrives with a plain arrival, only before a wait that would
  // block (prefill_producer_sm90.cuh: acquire, arrive_for_copies); the consumers then do not fence.
  static constexpr bool kWriterFence = TESSERA_SM90_GATHER_WRITER_FENCE != 0;
  static constexpr bool kConsumersFence = !kWriterFence;
  static constexpr int kChunks = kHeadDim / 8;  // 16-byte chunks per row
  static constexpr bool kRowLines = TESSERA_SM90_GATHER_ROW_LINES != 0;
  static_assert(kChunks % 2 == 0 && kChunks <= 32, "lane pairs split a row's chunks");
  static_assert(!kRowLines || kChunks % 8 == 0, "line copies: eight lanes a 128-byte column block");
  static_assert(kBlockN <= 32 * kProducerWarps, "two rows per lane pair and warp half");
  static_assert(kBlockN % 16 == 0, "a warp half's 16 rows lie wholly inside the tile or wholly past it");
  __device__ static void extent(const RequestEntries& e, int page_size, int& kv_start, int& kv_len) {
    paged_extent(e, page_size, kv_start, kv_len);
  }
  // Row i of this thread whose page it looks up: lane pairs, 32 warp + 16 i + lane / 2 (i = 0, 1);
  // line copies, 32 warp + lane (i = 0 only).
  __device__ static int row_of(int thread, int i) {
    return kRowLines ? thread : 32 * (thread / 32) + 16 * i + (thread % 32) / 2;
  }
  struct LanePairWhere {
    int keys;             // the tile's keys inside the request (<= kBlockN), the same for every thread
    int page[2], token[2];  // this thread's rows' page ids and tokens (page -1: past the keys)
  };
  struct RowLinesWhere {
    int keys;
    int64_t k_offset, v_offset;  // row 32 warp + lane's page and token in K's and V's elements
  };
  using Where = std::conditional_t<kRowLines, RowLinesWhere, LanePairWhere>;
  __device__ static Where locate(const PrefillSm90Params& p, int kv_start, int kv_len, int n0, int thread) {
    Where where;
    where.keys = min(kv_len - n0, kBlockN);
    if constexpr (kRowLines) {
      where.k_offset = where.v_offset = 0;
      const int row = row_of(thread, 0);
      if (row < where.keys) {
        const PageSlot slot = page_slot(p, kv_start, unsigned(n0 + row));
        where.k_offset = slot.page * p.base.k_stride_page + slot.token * p.base.k_stride_token;
        where.v_offset = slot.page * p.base.v_stride_page + slot.token * p.base.v_stride_token;
      }
      return where;
    } else {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int row = row_of(thread, i);
        where.page[i] = -1;
        where.token[i] = 0;
        if (row < where.keys) {
          const PageSlot slot = page_slot(p, kv_start, unsigned(n0 + row));
          where.page[i] = slot.page;
          where.token[i] = slot.token;
        }
      }
      return where;
    }
  }
  template <KVOperand kOperand, typename Tile>
  __device__ static void load(const PrefillSm90Params& p, const Tile& tile, Mbarrier& full, int kv_head,
                              const Where& where, int thread) {
    static_assert(Tile::kRows == kBlockN && Tile::kCols == kHeadDim, "the gathered tile");
    constexpr bool kKeys = kOperand == KVOperand::kKeys;
    const unsigned char* base = static_cast<const unsigned char*>(kKeys ? p.base.k : p.base.v);
    const int64_t stride_page = kKeys ? p.base.k_stride_page : p.base.v_stride_page;
    const int64_t stride_token = kKeys ? p.base.k_stride_token : p.base.v_stride_token;
    const int64_t stride_head = kKeys ? p.base.k_stride_head : p.base.v_stride_head;
    if constexpr (kRowLines) {
      const int lane = thread % 32, warp_row0 = 32 * (thread / 32);
      const int64_t offset = kKeys ? where.k_offset : where.v_offset;
      // This lane's chunk of any row, and its swizzled place in the rows of group g (g % 2 says
      // the row's place in its 8-row swizzle atom: rows 4 g + lane / 8).
      const unsigned char* head_base = base + (kv_head * stride_head + 8 * (lane % 8)) * 2;
      uint32_t to[2];
#pragma unroll
      for (int parity = 0; parity < 2; ++parity)
        to[parity] = smem_u32(tile.block(0)) + (warp_row0 + lane / 8) * 128 + (((4 * parity + lane / 8) ^ (lane % 8)) * 16);
#pragma unroll
      for (int g = 0; g < 8; ++g) {
        if (warp_row0 + 4 * g >= kBlockN) break;  // hd256's 80-row tiles: uniform per warp
        const int64_t row_offset = __shfl_sync(0xffffffffu, offset, 4 * g + lane / 8);
        const bool valid = warp_row0 + 4 * g + lane / 8 < where.keys;
        // Past kv_len the row's offset is 0 (locate): src is the head's first row, nothing is read.
        const unsigned char* src = head_base + row_offset * 2;
#pragma unroll
        for (int h = 0; h < kChunks / 8; ++h) cp_async_16(to[g % 2] + g * 512 + h * Tile::kBlockBytes, src + 128 * h, valid);
      }
    } else {
      const int half = thread % 2;  // this lane's chunks: 2 k + half
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int row = row_of(thread, i);
        if (32 * (thread / 32) + 16 * i >= kBlockN) break;  // hd256's 80-row tiles: uniform per warp
        const bool valid = where.page[i] >= 0;
        const unsigned char* src =
            valid ? base + ((where.page[i] * stride_page + where.token[i] * stride_token + kv_head * stride_head) + 8 * half) * 2
                  : base;
        const uint32_t dst = smem_u32(tile.block(0)) + row * 128 + ((row % 8) * 16);
#pragma unroll
        for (int k = 0; k < kChunks / 2; ++k) {
          const int c = 2 * k;  // this lane's chunk is c + half; (c + half) % 8 * 16 == (c % 8) * 16 ^ half * 16
          const uint32_t to = ((dst ^ ((c % 8) * 16) ^ (half * 16))) + (c / 8) * Tile::kBlockBytes;
          // Past kv_len src is the tensor's first row, and src + 32 k stays inside it: nothing is read.
          cp_async_16(to, src + 32 * k, valid);
        }
      }
    }
    // The slot's previous contents were last read by the consumers' wgmma (async proxy) before
    // they released it on the empty barrier this thread waited on: wgmma completion includes a
    // generic-async proxy fence (PTX ISA 9.7.15.4), so these generic writes come after those reads.
    if constexpr (!kWriterFence) full.arrive_after_copies();
  }
};
}  // namespace tessera::kernels::sm90
