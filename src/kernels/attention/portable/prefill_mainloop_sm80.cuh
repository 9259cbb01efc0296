// The mainloop of the portable prefill kernel: the loads of Q and K/V tiles into shared memory
// (cp.async) and the two products over them, S = Q K^T and O += P V (ldmatrix, mma.sync m16n8k16;
// P taken straight from the S accumulators as the A operand, a pair's other half of P from shared
// memory).
//
// Per KV tile j the CTA waits for K(j), issues V(j) (and the page ids of tile j + 2), computes
// S = Q K^T, and once the softmax has the row maxima requests K(j + 1) (after the softmax, or
// between its maxima and exponentials: PrefillConfig::kExponentialsAfterKeyRequest), so that V(j)
// loads while S(j) is computed and K(j + 1) while O += P V(j) is. The K/V rows come from a KV
// source (kv_source_sm80.cuh), passed to every call like the parameters.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/attention/common/register_tile.cuh"
#include "kernels/attention/portable/kv_source_sm80.cuh"
#include "kernels/attention/portable/prefill_warp_sm80.cuh"
#include "kernels/attention/prefill_params.h"
#include "kernels/common/mma_sm80.cuh"

namespace tessera::kernels::sm80 {

// Copies rows [row0, row0 + kRows) of one head of a ragged [rows, heads, kHeadDim] tensor into a
// swizzled shared tile; rows at or past `valid_rows` are zero-filled.
template <typename T, int kRows, int kHeadDim, int kThreads>
__device__ void load_tile_async(const SwizzledTile<T, kRows, kHeadDim>& tile, const T* head_base,
                                int64_t row_stride, int row0, int valid_rows) {
  const T* base = head_base + int64_t(row0) * row_stride;
  copy_tile_rows<T, kRows, kHeadDim, kThreads>(tile, valid_rows - row0,
                                               [&](int r) { return base + r * row_stride; });
}

// The CTA's Q tile and its K / V tile in shared memory, this lane's ldmatrix addresses into them,
// and the products over them. The CTA visits KV tiles [first_tile, end_tile).
// (load_values and request_next_keys take the tile indices by const reference: as plain
// parameters the compiler ordered their comparisons differently, and the kernel's machine code
// changed; the prologue's are plain for the same reason the other way round.)
template <typename T, typename Config>
struct PrefillMainloop {
  static constexpr int kHeadDim = Config::kHeadDim, kBlockM = Config::kBlockM, kBlockN = Config::kBlockN;
  static constexpr int kMTiles = Config::kMTiles, kSKeys = Config::kSKeys, kODims = Config::kODims;
  using STile = AccTile<kSKeys>;  // this warp's S (and P) of one m16 tile: its rows, its keys
  using OTile = AccTile<kODims>;  // this warp's O of one m16 tile: its rows, its head dims
  using Frag = uint32_t[kMTiles][4];  // A operands (or fragments) of the warp's m16 tiles

  const SwizzledTile<T, kBlockM, kHeadDim> q;
  const SwizzledTile<T, kBlockN, kHeadDim> k;
  const SwizzledTile<T, kBlockN, kHeadDim> v;
  // ldmatrix lanes: Q as the A operand, K as B operands, V as B operands read transposed (this
  // warp's head dims).
  const LdmatrixLane<T, kBlockM, kHeadDim> q_lane;
  const LdmatrixLane<T, kBlockN, kHeadDim> k_lane;
  const LdmatrixLane<T, kBlockN, kHeadDim> v_lane;

  __device__ __forceinline__ PrefillMainloop(unsigned char* smem, int lane, int half)
      : q{reinterpret_cast<T*>(smem)}, k{q.base + kBlockM * kHeadDim}, v{k.base + kBlockN * kHeadDim},
        q_lane(LdmatrixLane<T, kBlockM, kHeadDim>::a_operand(q, lane)),
        k_lane(LdmatrixLane<T, kBlockN, kHeadDim>::b_operands(k, lane)),
        v_lane(LdmatrixLane<T, kBlockN, kHeadDim>::a_operand(v, lane).shifted(half * kODims)) {}

  // Q rows [m0, m0 + kBlockM) (zeros from qo_len on) and K of the first tile, one commit group.
  template <typename KV>
  __device__ __forceinline__ void load_q_and_first_keys(const PrefillParams& p, KV& kv, const T* q_head,
                                                        int m0, int qo_len, int first_tile, int end_tile) const {
    load_tile_async<T, kBlockM, kHeadDim, Config::kThreads>(q, q_head, p.q_stride_row, m0, qo_len);
    if (first_tile < end_tile) {
      if constexpr (KV::kSmemBytes > 0) {  // the first two tiles' page ids, the first's rows located
        kv.fetch_rows(p, first_tile * kBlockN, first_tile & 1);
        if (first_tile + 1 < end_tile) kv.fetch_rows(p, (first_tile + 1) * kBlockN, (first_tile + 1) & 1);
        cp_async_commit();
        cp_async_wait<0>();
        __syncthreads();
        kv.publish_rows(p, first_tile * kBlockN, first_tile & 1);
        __syncthreads();
      }
      kv.load(p, k, first_tile * kBlockN, first_tile & 1, KVPart::kKeys);
    }
    cp_async_commit();
  }

  // V(tile), once K(tile) has landed and every warp is done with V(tile - 1).
  template <typename KV>
  __device__ __forceinline__ void load_values(const PrefillParams& p, KV& kv, const int& tile,
                                              const int& end_tile) const {
    const int n0 = tile * kBlockN;
    cp_async_wait<0>();
    __syncthreads();  // K(tile) (and Q) landed; every warp is done with V(tile - 1)
    kv.load(p, v, n0, tile & 1, KVPart::kValues);
    if (tile + 2 < end_tile) kv.fetch_rows(p, n0 + 2 * kBlockN, tile & 1);  // lands with V(tile)
    cp_async_commit();
  }

  // K(tile + 1), once V(tile) has landed and every warp is done with K(tile).
  template <typename KV>
  __device__ __forceinline__ void request_next_keys(const PrefillParams& p, KV& kv, const int& tile,
                                                    const int& end_tile) const {
    const int n1 = (tile + 1) * kBlockN;
    if (tile + 1 < end_tile) kv.publish_rows(p, n1, (tile + 1) & 1);
    cp_async_wait<0>();
    __syncthreads();  // V(tile) landed; every warp is done with K(tile); next rows located
    if (tile + 1 < end_tile) kv.load(p, k, n1, (tile + 1) & 1, KVPart::kKeys);
    cp_async_commit();
  }

  // The registers of one tile's products, declared by the kernel next to S and passed in: as a
  // part's own arrays, the compiler placed them elsewhere among the kernel's registers, and ptxas,
  // whose allocation depends on that order, emitted different machine code. (The same holds for
  // the softmax's, prefill_softmax_sm80.cuh.)
  struct QKFragments {
    Frag& q;           // Q of one k-step
    uint32_t (&k)[4];  // the B operands of two n8 blocks of K
  };
  struct PVFragments {
    Frag& own;      // P of this warp's keys, as A operands
    Frag& partner;  // P of the partner's keys (warp pairs)
  };

  // S = Q K^T over this warp's keys: each K fragment read from shared memory serves all kMTiles
  // row tiles.
  __device__ __forceinline__ void scores(STile (&s)[kMTiles], const PrefillWarp<Config>& w, const QKFragments& f) const {
#pragma unroll
    for (int ks = 0; ks < Config::kKSteps; ++ks) {
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) ldmatrix_x4(f.q[mt], q_lane.at(w.tile_row(mt), ks));
#pragma unroll
      for (int np = 0; np < Config::kSNTiles / 2; ++np) {
        ldmatrix_x4(f.k, k_lane.at(w.half * kSKeys + np * 16, ks));
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
          mma_16816<T>(s[mt].v[2 * np], f.q[mt], f.k[0], f.k[1]);
          mma_16816<T>(s[mt].v[2 * np + 1], f.q[mt], f.k[2], f.k[3]);
        }
      }
    }
  }

  // Warp pairs: this lane's P stores into the pair's P tile in shared memory and its ldmatrix
  // addresses into the partner's key half (computed by the kernel).
  struct PairP {
    T* const (&store)[Config::kSNTiles];
    const T* const (&load)[Config::kSNTiles / 2];
  };

  // O += P V over this warp's head dims, P of its own keys taken straight from the S accumulators
  // (two 8-key tiles make one k16 A tile); a pair's other key half from shared memory.
  __device__ __forceinline__ void accumulate(const STile (&s)[kMTiles], OTile (&o)[kMTiles], const PrefillWarp<Config>& w,
                                             const PairP& pair, const PVFragments& f) const {
    if constexpr (Config::kWarpPairs) {
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int j = 0; j < Config::kSNTiles; ++j)
#pragma unroll
          for (int r = 0; r < 2; ++r)
            *reinterpret_cast<uint32_t*>(pair.store[j] + (w.tile_row(mt) + 8 * r) * kBlockN) =
                pack2<T>(s[mt].v[j][2 * r], s[mt].v[j][2 * r + 1]);
    }
#pragma unroll
    for (int ks = 0; ks < kSKeys / 16; ++ks) {
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) a_fragment<T>(s[mt], ks, f.own[mt]);
      accumulate_pv(f.own, w.half * kSKeys + ks * 16, o);
    }
    if constexpr (Config::kWarpPairs) {
      // The partner's half of P is stored. Waiting here, after this warp's own half of P V, measured
      // 316.7 vs 313.4 TFLOP/s against waiting before it (v11 with K(j+1) requested after S); with
      // K(j+1) after the softmax, a split bar.arrive (after the stores) / bar.sync (here) lost
      // 316.4 vs 322.7 (prefill_portable.md v11).
      w.pair_sync();
#pragma unroll
      for (int ks = 0; ks < kSKeys / 16; ++ks) {
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) ldmatrix_x4(f.partner[mt], pair.load[ks] + w.tile_row(mt) * kBlockN);
        accumulate_pv(f.partner, (1 - w.half) * kSKeys + ks * 16, o);
      }
    }
  }

 private:
  // O += A V for the 16 keys from key0 on, over this warp's head dims.
  __device__ __forceinline__ void accumulate_pv(const Frag& a, int key0, OTile (&o)[kMTiles]) const {
#pragma unroll
    for (int dp = 0; dp < Config::kODTiles / 2; ++dp) {
      uint32_t b[4];
      ldmatrix_x4_trans(b, v_lane.at(key0, dp));
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
        mma_16816<T>(o[mt].v[2 * dp], a[mt], b[0], b[1]);
        mma_16816<T>(o[mt].v[2 * dp + 1], a[mt], b[2], b[3]);
      }
    }
  }
};

}  // namespace tessera::kernels::sm80
