// The per-step pieces the three key-major backward kernels share (attention_bwd.cuh, attention_bwd_wgmma.cuh,
// attention_bwd_ws.cu). Their accumulators have one layout per warp: warp w holds keys 16 w .. 16 w + 15 of
// the KV tile, and a thread's register 4 nb + c of a 16 x BM tile (S^T, dP^T) is (key key_lo + 8 (c / 2),
// packed query row nb * 8 + 2 (lane % 4) + c % 2), key_lo = k0 + 16 w + lane / 4. A packed row r of a query
// tile starting at token t0 is (token t0 + r / G, q head kvh G + r % G).
#pragma once

#include <cfloat>

#include "kernels/cuda/launch.hpp"
#include "kernels/cuda/mma.cuh"

namespace treecp::cuda::detail {

// The visibility bits (below) of this thread's keys key_lo and key_lo + 8 inside the KV tile: keys from
// k_end on belong to the next tile (a block loads BN rows from its start whatever its length) and are never
// visible here. Constant per block.
__device__ __forceinline__ uint32_t bwd_keys_ok(int key_lo, int k_end) {
  return (key_lo < k_end ? 0x33333333u : 0u) | (key_lo + 8 < k_end ? 0xCCCCCCCCu : 0u);
}

// Bit 4 nb + c: the thread's element 4 nb + c is a visible pair. Full tiles: every real row (padding rows,
// r >= valid_rows, are in no slice); partial ones: inside any listed slice (slices are disjoint). Both only
// on the keys of keys_ok (bwd_keys_ok). A slice shows key k the tokens [max(q0, k + dmin), min(q1, k + dmax)),
// i.e. the packed rows [G (lo - t0), G (hi - t0)) of the tile: one run of this thread's 16 columns (run_bits16), so
// a key costs a few integer operations per slice, not a test (and a division by G) per element.
template <int BM>
__device__ __forceinline__ uint32_t bwd_visibility(const BwdArgs& args, const TileEntry& e, int t0, int G,
                                                   int valid_rows, int key_lo, uint32_t keys_ok, int lane) {
  static_assert(BM == 64, "one bit per element of a 16 x 64 tile");
  const int rbase = 2 * (lane % 4);  // this thread's columns: packed rows rbase + 8 nb + c
  if (e.mask_count == 0) {
    const uint32_t row = spread_bit_pairs(run_bits16(rbase, 0, valid_rows));
    return (row | (row << 2)) & keys_ok;
  }
  uint32_t vis = 0;
  for (int j = 0; j < e.mask_count; ++j) {
    const DeviceSlice sl = load_slice(args.slices + args.lists.mask_index[e.mask_begin + j]);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int key = key_lo + 8 * h;
      if (!in_range(key, sl.k0, sl.k1)) continue;
      const ColumnRun r = slice_row_run(sl, key, t0, G, valid_rows, BM);
      vis |= spread_bit_pairs(run_bits16(rbase, r.lo, r.hi)) << (2 * h);
    }
  }
  return vis & keys_ok;
}

// P^T = exp(S^T scale - LSE) on visible pairs, 0 elsewhere, in place; lse holds the step's BM row LSEs
// (natural log; kLse2: already times log2 e).
template <int BM, bool kLse2>
__device__ __forceinline__ void bwd_p_tile(float (&st)[BM / 2], uint32_t vis, const float* lse, float sl2, int lane) {
#pragma unroll
  for (int nb = 0; nb < BM / 8; ++nb)
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const float lse2 = kLse2 ? lse[nb * 8 + 2 * (lane % 4) + (c & 1)] : lse[nb * 8 + 2 * (lane % 4) + (c & 1)] * kLog2e;
      st[4 * nb + c] = (vis >> (nb * 4 + c) & 1u) && lse2 != -INFINITY ? exp2_fast(fmaf(st[4 * nb + c], sl2, -lse2)) : 0.f;
    }
}

// dS^T = P^T (dP^T - Dsum), in place in dpt.
template <int BM>
__device__ __forceinline__ void bwd_ds_tile(const float (&pt)[BM / 2], float (&dpt)[BM / 2], const float* dsum, int lane) {
#pragma unroll
  for (int nb = 0; nb < BM / 8; ++nb)
#pragma unroll
    for (int c = 0; c < 4; ++c) dpt[4 * nb + c] = pt[4 * nb + c] * (dpt[4 * nb + c] - dsum[nb * 8 + 2 * (lane % 4) + (c & 1)]);
}

// A 16 x 16 k-step kk of a 16 x BM tile as bf16 or fp16 A operands (the mma.sync / wgmma register A layout).
template <int BM, DType E = DType::kBf16>
__device__ __forceinline__ void bwd_pack_a(const float (&x)[BM / 2], uint32_t (&a)[BM / 16][4], int kk) {
#pragma unroll
  for (int i = 0; i < 4; ++i) a[kk][i] = pack2<E>(x[8 * kk + 2 * i], x[8 * kk + 2 * i + 1]);
}

// This block is the only writer of its KV tile: plain read-add-write of fp32 dK (times scale) and dV; a
// thread holds register 4 j + c = (key key_lo + 8 (c / 2), column 8 j + 2 (lane % 4) + c % 2).
template <int D>
__device__ __forceinline__ void bwd_store_dkdv(const BwdArgs& args, const float (&dk)[D / 2], const float (&dv)[D / 2],
                                               int key_lo, int k_end, int kvh, int lane) {
  const AttentionBackwardParams& p = args.p;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int key = key_lo + 8 * h;
    if (key >= k_end) continue;  // the next KV tile's row (or past kv_rows): another block owns it
    float* dkp = p.dk + key * p.dk_row_stride + kvh * p.dk_head_stride + 2 * (lane % 4);
    float* dvp = p.dv + key * p.dk_row_stride + kvh * p.dk_head_stride + 2 * (lane % 4);
#pragma unroll
    for (int j = 0; j < D / 8; ++j) {
      float2 a = *reinterpret_cast<float2*>(dkp + j * 8);
      a.x += dk[4 * j + 2 * h] * p.scale;
      a.y += dk[4 * j + 2 * h + 1] * p.scale;
      *reinterpret_cast<float2*>(dkp + j * 8) = a;
      float2 b = *reinterpret_cast<float2*>(dvp + j * 8);
      b.x += dv[4 * j + 2 * h];
      b.y += dv[4 * j + 2 * h + 1];
      *reinterpret_cast<float2*>(dvp + j * 8) = b;
    }
  }
}

// The same for Dqk != Dv: dK's D / 2 registers, then dV's DV / 2 (same layout, DV columns).
template <int D, int DV>
__device__ __forceinline__ void bwd_store_dkdv(const BwdArgs& args, const float (&dk)[D / 2], const float (&dv)[DV / 2],
                                               int key_lo, int k_end, int kvh, int lane) {
  const AttentionBackwardParams& p = args.p;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int key = key_lo + 8 * h;
    if (key >= k_end) continue;  // the next KV tile's row (or past kv_rows): another block owns it
    float* dkp = p.dk + key * p.dk_row_stride + kvh * p.dk_head_stride + 2 * (lane % 4);
    // the dispatch filled dv_row_stride / dv_head_stride in (attention_backward)
    float* dvp = p.dv + static_cast<int64_t>(key) * p.dv_row_stride + static_cast<int64_t>(kvh) * p.dv_head_stride +
                 2 * (lane % 4);
#pragma unroll
    for (int j = 0; j < D / 8; ++j) {
      float2 a = *reinterpret_cast<float2*>(dkp + j * 8);
      a.x += dk[4 * j + 2 * h] * p.scale;
      a.y += dk[4 * j + 2 * h + 1] * p.scale;
      *reinterpret_cast<float2*>(dkp + j * 8) = a;
    }
#pragma unroll
    for (int j = 0; j < DV / 8; ++j) {
      float2 b = *reinterpret_cast<float2*>(dvp + j * 8);
      b.x += dv[4 * j + 2 * h];
      b.y += dv[4 * j + 2 * h + 1];
      *reinterpret_cast<float2*>(dvp + j * 8) = b;
    }
  }
}

}  // namespace treecp::cuda::detail
