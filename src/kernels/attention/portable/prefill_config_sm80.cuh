// The tile shapes and measured per-head-dim choices of the portable prefill kernel
// (prefill_sm80.cuh and its parts).
#pragma once

namespace tessera::kernels::sm80 {

// Tile shapes and load order by head dim, chosen by measurement on H200 (bf16, 16K tokens, hidden
// 2048, TFLOP/s; see notes/prefill_portable.md):
// - 32 rows per warp beat 16 at hd64 (304 vs 273) and at hd128 (316 vs 285); 32-key tiles lose at
//   hd128 (323 vs 326 at 32 rows per warp); capping registers for 3 CTAs/SM lost 5-10%.
// - hd256: 8 warps, 64-key tiles, one CTA per SM. FA2's shape (8 warps of 16 rows) waited on
//   shared memory: every warp read the whole K and V tile for its 16 rows (297 at best). Warp
//   pairs on 32 rows (each K / V fragment then serves two m16 tiles: 100 ldmatrix.x4 per 256
//   mma instead of 144) reach 322 (+7.5%, prefill_portable.md v11). K(j+1) is requested after the
//   row maxima (below); right after S(j) lost with pairs (316.7 vs 322.7), where FA2's shape had
//   preferred it (297 vs 292).
// - At hd64 the softmax's row max and sum are reduced as trees: the chain of 16 dependent adds
//   per row was exposed with two warps per scheduler (+1.1% at hd64; hd128 lost 1.3%, hd256 even).
// - Whole tiles of ragged K/V are copied with one address per thread (hd128 +10% with the
//   conditional O rescale; hd64 loses 3% with it, so it keeps the general copy). Paged tiles read
//   all their rows' offsets before issuing the copies (kv_source_sm80.cuh).
// kCompact: the shape for GPUs whose shared memory per block is too small for the default one
// (99 KB on sm_86 / sm_89; the wide hd256 tile needs 145 KB): hd256 keeps 4 warps and 32-key tiles
// (66 KB). Identical to the default at hd64 / hd128.
template <int kHeadDimT, bool kCompact = false>
struct PrefillConfig {
  static constexpr int kHeadDim = kHeadDimT;
  static constexpr bool kWide = kHeadDim == 256 && !kCompact;  // 128 x 64 hd256 tile, 8 warps
  static constexpr int kWarps = kWide ? 8 : 4;
  static constexpr int kThreads = kWarps * 32;
  // Warp pairs (kWide): two warps share 32 rows; S = Q K^T is split between them by keys, O += P V
  // by head dims, and each reads the other's half of P from shared memory. Each K and V fragment
  // read then serves two m16 tiles: 100 ldmatrix.x4 per warp and 256 mma instead of 144.
  static constexpr bool kWarpPairs = kWide;
  static constexpr int kKeyHalves = kWarpPairs ? 2 : 1;
  static constexpr int kRowGroups = kWarps / kKeyHalves;   // warps (or pairs) with their own rows
  static constexpr int kMTiles = kHeadDim <= 128 || kWarpPairs ? 2 : 1;  // m16 row tiles per warp
  static constexpr int kBlockM = 16 * kMTiles * kRowGroups;  // query rows per CTA
  static constexpr int kBlockN = kHeadDim == 256 && !kWide ? 32 : 64;  // keys per K/V tile
  static constexpr int kTileBytes = (kBlockM + 2 * kBlockN) * kHeadDim * 2;  // Q, K, V
  // Warp pairs: P (kBlockM x kBlockN) and one float per (key half, row) for the row max / sum.
  static constexpr int kExchangeBytes = kWarpPairs ? kBlockM * kBlockN * 2 + kKeyHalves * kBlockM * 4 : 0;
  static constexpr int kSmemBytes = kTileBytes + kExchangeBytes;
  // CTAs per SM the register budget is sized for (65536 / (kThreads x CTAs) registers per thread).
  static constexpr int kMinBlocksPerSM = kWide ? 1 : 2;
  static constexpr bool kRaggedFullTileCopy = kHeadDim != 64;
  // The softmax's row max and row sum as trees rather than chains (prefill_portable.md v10).
  static constexpr bool kTreeRowReductions = kHeadDim == 64;
  // K(j+1) requested between the row maxima and the exponentials rather than after the softmax,
  // so that the exponentials and O += P V form one basic block: hd64 310.5 vs 303.6, hd256 324.0
  // vs 320.1 (paged +3%); hd128 lost 1.5% (355.6 vs 360.9; prefill_portable.md v12). The compact
  // hd256 shape, timed on the H200 under a 99 KB limit: 288.0 vs 275.5 (16K causal 292.0 vs 281.7).
  static constexpr bool kExponentialsAfterKeyRequest = kHeadDim == 64 || kHeadDim == 256;
  // O rescaled on every tile, so that no branch separates the maxima from the exponentials
  // (prefill_portable.md v13): hd64 8K 317.7 vs 308.2 TFLOP/s, wide hd256 8K 330.5 vs 323.9 and
  // 16K causal 336.1 vs 329.9. hd128 (v12 order) lost 3-4% to spills with it; the compact hd256
  // shape is even with it (285.6 vs 288.0 at 8K, 292.3 vs 292.0 at 16K causal), so it keeps the branch.
  static constexpr bool kRescaleEveryTile = kHeadDim == 64 || kWide;

  // Per warp: the keys of S and the head dims of O (a pair's two warps split S by keys and O by
  // head dims), and the k-steps of Q K^T.
  static constexpr int kSKeys = kBlockN / kKeyHalves, kSNTiles = kSKeys / 8;
  static constexpr int kODims = kHeadDim / kKeyHalves, kODTiles = kODims / 8;
  static constexpr int kKSteps = kHeadDim / 16;
  static_assert(kRowGroups < 16, "a pair's named barrier ids are 1..15");
};

}  // namespace tessera::kernels::sm80
