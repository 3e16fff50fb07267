// Backward slice attention on Hopper warpgroup MMA (sm_90a), key-major like attention_bwd.cuh: one
// block per (KV tile of 128 keys, KV head) walks every query tile (64 packed rows) that sees its keys;
// dK and dV stay in registers across the walk (no dK/dV atomics), dQ is added with fp32 reductions.
// Two warpgroups, each owning 64 keys of the tile. Per query tile:
//   S^T  = K Q^T     m64n64k16, K and Q from shared memory (K-major)
//   dP^T = V dO^T    m64n64k16, V and dO from shared memory
//   P^T = exp(S^T scale - LSE), dS^T = P^T (dP^T - Dsum)      (registers; dS^T also to shared memory)
//   dV  += P^T dO    m64nDk16, P^T from registers, dO MN-major from shared memory
//   dK  += dS^T Q    m64nDk16, dS^T from registers, Q MN-major from shared memory
//   dQ   = dS K      m64n64k16 per warpgroup (half of D each), dS^T and K both MN-major in shared memory,
//                    added to fp32 dQ with red.global.add.v2.f32 (staging dQ in shared memory for the copy
//                    engine's bulk reductions, as FA3 does, measured 1-2% slower here: docs/benchmarks-gpu.md);
//                    by default those adds are issued under the next step's S^T / dP^T (BwdOverlap below)
// The accumulator layouts equal attention_bwd.cuh's per-warp fragments (warp w of the block holds keys
// 16 w .. 16 w + 15), so visibility and the softmax gradient are the same code. Head dims 128 (the dQ split
// gives each warpgroup one 64-column panel) and 64: there dQ has one panel, so each warpgroup computes dQ over
// its own 64 keys for all 64 columns (bwd_issue_dq_own_keys) and both add theirs: twice the dQ reductions per
// element of dQ that head dim 128 issues, the same number per step.
#pragma once

#include "kernels/cuda/attention_bwd_tile.cuh"
#include "kernels/cuda/launch.hpp"
#include "kernels/cuda/mma.cuh"
#include "kernels/cuda/wgmma.cuh"

namespace treecp::cuda::detail {

template <int D>
struct BwdWgmmaShape {
  static constexpr int kRows = kBwdBlockRows;
  static constexpr int kKeys = kBwdBlockKeys;
  static constexpr int kThreads = 256;  // two warpgroups x 64 keys
  // K, V; two stages of Q, dO (16-bit) and of dS^T (16-bit); two of LSE and Dsum (fp32); 1 KiB alignment
  static constexpr int kSmemBytes = (2 * kKeys * D + 4 * kRows * D + 2 * kKeys * kRows) * 2 + 4 * kRows * 4 + 1024;
  static_assert((D == 64 || D == 128) && kRows == 64 && kKeys == 128, "wgmma backward: 128 keys x 64 rows, head dim 64 or 128");
  // dQ columns of warpgroup wg start at wg * kDqCol: a 64-column panel each at D = 128, all 64 at D = 64
  static constexpr int kDqCol = D == 128 ? 64 : 0;
};

// How much of a query step overlaps the next one (each level includes the one before):
//   kNone  every wgmma is waited for before its results' consumer, and dV / dK before the dS^T barrier
//   kDkv   dV += P^T dO and dK += dS^T Q stay in flight across the dS^T barrier and the dQ GEMM's issue;
//          the Q / dO prefetch moves behind the step's first barrier so that it cannot overwrite the stage
//          the other warpgroup's dV / dK still read
//   kDkvDq also the dQ reductions of step n are issued after step n + 1's S^T / dP^T GEMMs
enum class BwdOverlap { kNone, kDkv, kDkvDq };
constexpr BwdOverlap kBwdOverlap = BwdOverlap::kDkvDq;  // the default, by measurement (docs/benchmarks-gpu.md)

// Per-step Q / dO loads (the forward's FwdLoads, attention_fwd_wgmma.cuh):
//   kGeneric    load_panel_async: every 16-byte chunk recomputes its row, token and head (a division and
//               remainder by G), panel swizzle and 64-bit source address
//   kPerThread  thread t always copies chunk t % (D/8) of packed rows t / (D/8) + j * (threads / (D/8));
//               the row step (16) is a multiple of the 8-row swizzle period, so the shared offset is one
//               per-thread constant plus j * step * 64; when G divides the row step, a thread's rows share
//               one head and step by step / G tokens, so the source is one 64-bit multiply per step plus a
//               constant step (no division); other G fall back to load_panel_async (uniform branch)
enum class BwdLoads { kGeneric, kPerThread };
constexpr BwdLoads kBwdLoads = BwdLoads::kPerThread;  // the default, by measurement (docs/benchmarks-gpu.md)

// The GEMM issues and the dS^T store of one step, shared with attention_bwd_ws.cu. Warpgroup wg owns keys
// 64 wg .. +64 of the BN-key tile; K, V are BN-row panels, Q, dO and dS^T BM-row panels (wgmma.cuh);
// addresses are shared-memory byte addresses >> 4. kAccFirst = false: the first k step overwrites the
// accumulators (no zeroing moves), true: they hold zeros already.
// S^T = K Q^T and dP^T = V dO^T (two commit groups, in that order).
template <int D, int BM, int BN, bool kAccFirst, DType E = DType::kBf16>
__device__ __forceinline__ void bwd_issue_st_dpt(float (&st)[BM / 2], float (&dpt)[BM / 2], uint32_t k16, uint32_t v16,
                                                 uint32_t qs16, uint32_t dos16, int wg) {
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    const uint32_t off = (kk % 4) * 32;
    wgmma_ss_m64n64k16<false, false, E>(st, wgmma_desc16<16, 1024>(k16 + wg * 64 * 128 / 16 + ((kk / 4) * BN * 128 + off) / 16),
                                     wgmma_desc16<16, 1024>(qs16 + ((kk / 4) * BM * 128 + off) / 16), kAccFirst || kk > 0);
  }
  wgmma_commit();
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    const uint32_t off = (kk % 4) * 32;
    wgmma_ss_m64n64k16<false, false, E>(dpt, wgmma_desc16<16, 1024>(v16 + wg * 64 * 128 / 16 + ((kk / 4) * BN * 128 + off) / 16),
                                     wgmma_desc16<16, 1024>(dos16 + ((kk / 4) * BM * 128 + off) / 16), kAccFirst || kk > 0);
  }
  wgmma_commit();
}

// dS^T (keys x packed query rows, one BN-row panel) from this warp's 16 keys, packed into da on the way.
template <int BM, int BN, DType E = DType::kBf16>
__device__ __forceinline__ void bwd_store_dst(elem_t<E>* sds, const float (&dst)[BM / 2], uint32_t (&da)[BM / 16][4],
                                              int warp, int lane) {
#pragma unroll
  for (int kk = 0; kk < BM / 16; ++kk) {
    bwd_pack_a<BM, E>(dst, da, kk);
    const int kr = warp * 16 + lane / 4, col = kk * 16 + 2 * (lane % 4);
    *reinterpret_cast<uint32_t*>(sds + swz_panel(kr, col, BN)) = da[kk][0];
    *reinterpret_cast<uint32_t*>(sds + swz_panel(kr + 8, col, BN)) = da[kk][1];
    *reinterpret_cast<uint32_t*>(sds + swz_panel(kr, col + 8, BN)) = da[kk][2];
    *reinterpret_cast<uint32_t*>(sds + swz_panel(kr + 8, col + 8, BN)) = da[kk][3];
  }
}

// The step's softmax gradient, between the S^T / dP^T GEMMs (in flight, two groups) and dV / dK: the visibility
// bits while they run; P^T = exp(S scale - LSE) once S^T is done, packed into pa; dS^T = P^T (dP^T - Dsum) once
// dP^T is done, stored to the buffer sds() returns and packed into da. kLse2: lse holds LSE times log2 e.
template <int BM, int BN, bool kLse2, DType E = DType::kBf16, class Sds>
__device__ __forceinline__ void bwd_softmax_grad(const BwdArgs& args, const TileEntry& e, int t0, int G, int valid_rows,
                                                 int key_lo, uint32_t keys_ok, int warp, int lane, float sl2,
                                                 const float* lse, const float* dsum, float (&st)[BM / 2],
                                                 float (&dpt)[BM / 2], Sds&& sds, uint32_t (&pa)[BM / 16][4],
                                                 uint32_t (&da)[BM / 16][4]) {
  const uint32_t vis = bwd_visibility<BM>(args, e, t0, G, valid_rows, key_lo, keys_ok, lane);
  wgmma_wait<1>();  // S^T done
  wgmma_fence_operands(st);
  bwd_p_tile<BM, kLse2>(st, vis, lse, sl2, lane);  // 0 on pairs that are not visible
#pragma unroll
  for (int kk = 0; kk < BM / 16; ++kk) bwd_pack_a<BM, E>(st, pa, kk);  // k16 step kk: query rows 16 kk .. +16
  wgmma_wait<0>();  // dP^T done
  wgmma_fence_operands(dpt);
  bwd_ds_tile<BM>(st, dpt, dsum, lane);
  bwd_store_dst<BM, BN, E>(sds(), dpt, da, warp, lane);
}

// Adds a step's scaled dQ (pend: this thread's 32 values of the warpgroup's 64 rows x 64 columns 64 wg ..) into
// fp32 dQ with red.global.add.v2.f32 for the query tile at token t0 (none when t0 < 0). Predicated, branch-free:
// it runs while the next step's S^T / dP^T GEMMs are in flight. kAdd = false keeps only the adds of the value
// 1234.5, i.e. none in practice: the timing-only variant without dQ reductions.
// kDqCol: the first column of warpgroup wg's dQ is wg * kDqCol (64: a panel each; 0: both add all columns).
template <bool kAdd = true, int kDqCol = 64>
__device__ __forceinline__ void bwd_red_add_dq(const BwdArgs& args, float* dq, const float (&pend)[32], int t0, int G,
                                               int valid_rows, int kvh, int warp, int wg, int lane) {
  const AttentionBackwardParams& p = args.p;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = (warp % 4) * 16 + lane / 4 + 8 * h;
    const int t = t0 + r / G;
    const bool ok = t0 >= 0 && r < valid_rows && t < args.q_rows;
    float* dst = dq + t * p.dq_row_stride + (kvh * G + r % G) * p.dq_head_stride + wg * kDqCol + 2 * (lane % 4);
#pragma unroll
    for (int j = 0; j < 8; ++j)
      red_add_f32x2_if(ok && (kAdd || pend[4 * j + 2 * h] == 1234.5f), dst + j * 8, pend[4 * j + 2 * h],
                       pend[4 * j + 2 * h + 1]);
  }
}

// dV += P^T dO and dK += dS^T Q: dO and Q are MN-major B operands (k16 step = 16 query rows); one group.
template <int D, int BM, DType E = DType::kBf16>
__device__ __forceinline__ void bwd_issue_dvdk(float (&dv)[D / 2], float (&dk)[D / 2], const uint32_t (&pa)[BM / 16][4],
                                               const uint32_t (&da)[BM / 16][4], uint32_t qs16, uint32_t dos16) {
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < BM / 16; ++kk) {
    wgmma_rs_trans_b<D, E>(dv, pa[kk], wgmma_desc16<BM * 128, 1024>(dos16 + kk * 16 * 128 / 16));
    wgmma_rs_trans_b<D, E>(dk, da[kk], wgmma_desc16<BM * 128, 1024>(qs16 + kk * 16 * 128 / 16));
  }
  wgmma_commit();
}

// dQ = dS K for head-dim columns 64 wg .. +64 of all BM rows: A = dS^T (keys x rows, MN-major), B = K (keys x
// D, MN-major); k16 step kk = keys 16 kk .. +16; one group.
template <int BN, bool kAccFirst, DType E = DType::kBf16>
__device__ __forceinline__ void bwd_issue_dq(float (&acc)[32], uint32_t dss16, uint32_t k16, int wg) {
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < BN / 16; ++kk)
    wgmma_ss_m64n64k16<true, true, E>(acc, wgmma_desc16<BN * 128, 1024>(dss16 + kk * 16 * 128 / 16),
                                   wgmma_desc16<BN * 128, 1024>(k16 + wg * BN * 128 / 16 + kk * 16 * 128 / 16),
                                   kAccFirst || kk > 0);
  wgmma_commit();
}

// dQ = dS K at head dim 64 over warpgroup wg's own keys 64 wg .. +64 only, all 64 columns (K has one panel): the
// partial sums of both warpgroups are added into dQ. k16 step kk = keys 64 wg + 16 kk .. +16; one group.
template <int BN, bool kAccFirst, DType E = DType::kBf16>
__device__ __forceinline__ void bwd_issue_dq_own_keys(float (&acc)[32], uint32_t dss16, uint32_t k16, int wg) {
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < BN / 32; ++kk) {
    const uint32_t key16 = (wg * (BN / 2) + kk * 16) * 128 / 16;
    wgmma_ss_m64n64k16<true, true, E>(acc, wgmma_desc16<BN * 128, 1024>(dss16 + key16),
                                   wgmma_desc16<BN * 128, 1024>(k16 + key16), kAccFirst || kk > 0);
  }
  wgmma_commit();
}

// kAddDq = false drops the dQ reduction (wrong dQ): timing-only, as in attention_bwd.cuh.
template <int D, bool kAddDq = true, BwdOverlap kOverlap = kBwdOverlap, BwdLoads kLoads = kBwdLoads,
          DType E = DType::kBf16>
__global__ void __launch_bounds__(BwdWgmmaShape<D>::kThreads, 1) attention_bwd_wgmma_kernel(const BwdArgs args) {
  using S = BwdWgmmaShape<D>;
  using T = elem_t<E>;
  constexpr int BM = S::kRows, BN = S::kKeys;
  constexpr bool kAccZero = kOverlap == BwdOverlap::kNone;  // accumulators zeroed by moves (the kNone form)
  extern __shared__ __align__(128) unsigned char smem_raw[];
  const uint32_t raw_addr = smem_addr(smem_raw);
  T* sK = reinterpret_cast<T*>(smem_raw + (((raw_addr + 1023) & ~1023u) - raw_addr));
  T* sV = sK + BN * D;        // panels of BN rows
  T* sQ = sV + BN * D;        // [2][BM x D panels]
  T* sdO = sQ + 2 * BM * D;   // [2][BM x D panels]
  T* sdS2 = sdO + 2 * BM * D; // [2][BN keys x BM rows, one panel]: dS^T
  float* sLse = reinterpret_cast<float*>(sdS2 + 2 * BN * BM);  // [2][BM]
  float* sDsum = sLse + 2 * BM;                                // [2][BM]

  const AttentionBackwardParams& p = args.p;
  const auto& L = args.lists;
  const int tile = L.order[blockIdx.x / p.hkv];  // longest tiles first, heads of one tile adjacent
  const int kvh = blockIdx.x % p.hkv;
  const int G = args.group;
  const int k0 = L.major_start[tile];  // the tile: keys [k0, L.major_start[tile + 1]), at most BN
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int wg = warp / 4;
  const int tq = L.minor_tile_rows;  // tokens per query tile
  const int valid_rows = tq * G;
  const auto* q = static_cast<const T*>(p.q);
  const auto* k = static_cast<const T*>(p.k);
  const auto* v = static_cast<const T*>(p.v);
  const auto* d_o = static_cast<const T*>(p.d_o);

  load_panel_async<D, S::kThreads>(sK, BN, k, [&](int r) -> const T* {
    return k0 + r < args.kv_rows ? k + (k0 + r) * p.k_row_stride + kvh * p.k_head_stride : nullptr;
  });
  load_panel_async<D, S::kThreads>(sV, BN, v, [&](int r) -> const T* {
    return k0 + r < args.kv_rows ? v + (k0 + r) * p.v_row_stride + kvh * p.v_head_stride : nullptr;
  });
  const int e_end = L.offsets[tile + 1];
  prefetch_entries_l1(L.entries, L.offsets[tile], e_end);
  RunCursor cur = RunCursor::first(L.entries, L.offsets[tile], e_end);
  // kPerThread: this thread's chunk, first packed row and shared offset (element units) in every Q / dO tile
  constexpr int kChunks = D / 8, kRowStep = S::kThreads / kChunks, kLoadIters = BM / kRowStep;
  static_assert(S::kThreads % kChunks == 0 && BM % kRowStep == 0 && kRowStep % 8 == 0,
                "kPerThread loads: whole rows per step, row step a multiple of the 8-row swizzle period");
  const bool ld_linear = kLoads == BwdLoads::kPerThread && kRowStep % G == 0;  // uniform per block
  // packed row r of query tile qt = (token qt * tq + r / G, q head kvh * G + r % G)
  auto load_q = [&](int qt, int stage) {
    const int t0 = qt * tq;
    auto ok = [&](int r) { return r < valid_rows && t0 + r / G < args.q_rows; };
    if (ld_linear) {
      const int ld_row = threadIdx.x / kChunks, ld_chunk = threadIdx.x % kChunks;
      const uint32_t ld_smem = swz_panel(ld_row, ld_chunk * 8, BM);  // + j * kRowStep * 64 for row ld_row + j * kRowStep
      const int tok = t0 + ld_row / G, head = kvh * G + ld_row % G, tok_step = kRowStep / G;
      const T* qs = q + static_cast<int64_t>(tok) * p.q_row_stride + head * p.q_head_stride + ld_chunk * 8;
      const T* ds = d_o + static_cast<int64_t>(tok) * p.o_row_stride + head * p.o_head_stride + ld_chunk * 8;
      T* qd = sQ + stage * BM * D + ld_smem;
      T* dd = sdO + stage * BM * D + ld_smem;
#pragma unroll
      for (int j = 0; j < kLoadIters; ++j) {
        const bool okj = ld_row + j * kRowStep < valid_rows && tok + j * tok_step < args.q_rows;
        cp_async_16(qd + j * kRowStep * 64, okj ? qs + j * tok_step * p.q_row_stride : q, okj);
        cp_async_16(dd + j * kRowStep * 64, okj ? ds + j * tok_step * p.o_row_stride : d_o, okj);
      }
    } else {
      load_panel_async<D, S::kThreads>(sQ + stage * BM * D, BM, q, [&](int r) -> const T* {
        return ok(r) ? q + (t0 + r / G) * p.q_row_stride + (kvh * G + r % G) * p.q_head_stride : nullptr;
      });
      load_panel_async<D, S::kThreads>(sdO + stage * BM * D, BM, d_o, [&](int r) -> const T* {
        return ok(r) ? d_o + (t0 + r / G) * p.o_row_stride + (kvh * G + r % G) * p.o_head_stride : nullptr;
      });
    }
    for (int r = threadIdx.x; r < BM; r += S::kThreads) {
      const int t = t0 + r / G, h = kvh * G + r % G;
      cp_async_4(sLse + stage * BM + r, ok(r) ? p.lse + t * p.lse_row_stride + h * p.lse_head_stride : p.lse, ok(r));
      cp_async_4(sDsum + stage * BM + r, ok(r) ? p.dsum + static_cast<int64_t>(t) * p.hq + h : p.dsum, ok(r));
    }
  };
  if (cur.entry < e_end) load_q(cur.tile, 0);
  cp_async_commit();

  float dk[D / 2], dv[D / 2];  // register 4 j + c: (key h = c / 2, column 8 j + 2 (lane % 4) + c % 2)
#pragma unroll
  for (int i = 0; i < D / 2; ++i) dk[i] = dv[i] = 0.f;
  const float sl2 = p.scale * kLog2e;
  const int key_lo = k0 + warp * 16 + lane / 4;  // this lane's keys: key_lo and key_lo + 8
  const uint32_t keys_ok = bwd_keys_ok(key_lo, L.major_start[tile + 1]);
  // descriptor start addresses (bytes >> 4); a k step, a stage, this warpgroup's keys are constant adds
  const uint32_t k16 = smem_addr(sK) >> 4, v16 = smem_addr(sV) >> 4;
  const uint32_t q16 = smem_addr(sQ) >> 4, do16 = smem_addr(sdO) >> 4, ds16 = smem_addr(sdS2) >> 4;
  constexpr uint32_t kQStage16 = BM * D * 2 / 16, kDsStage16 = BN * BM * 2 / 16;
  float* dq = p.dq;
  // dQ of one step (warpgroup wg: head-dim columns 64 wg .. +64 of all BM rows), added to global dQ
  float acc[32];
  // kDkvDq: scale dS K of the previous step, whose reductions are still to be issued (a copy made after the
  // wait: ptxas would otherwise wait for the next GEMMs before reading registers a wgmma defined)
  float pend[32];
  auto add_dq = [&](int t0) {
    if constexpr (kOverlap == BwdOverlap::kDkvDq) {
      bwd_red_add_dq<kAddDq, S::kDqCol>(args, dq, pend, t0, G, valid_rows, kvh, warp, wg, lane);
    } else {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = (warp % 4) * 16 + lane / 4 + 8 * h;
        const int t = t0 + r / G;
        if (r >= valid_rows || t >= args.q_rows) continue;
        float* dst = dq + t * p.dq_row_stride + (kvh * G + r % G) * p.dq_head_stride + wg * S::kDqCol + 2 * (lane % 4);
#pragma unroll
        for (int j = 0; j < 8; ++j)
          if constexpr (kAddDq) red_add_f32x2(dst + j * 8, acc[4 * j + 2 * h] * p.scale, acc[4 * j + 2 * h + 1] * p.scale);
          else if (acc[4 * j + 2 * h] == 1234.5f) dst[j * 8] = 0.f;  // keeps the dQ GEMM alive
      }
    }
  };
  int pending_dq_t0 = -1;  // kDkvDq: first token of the query tile whose dQ (acc) is still to be added

  for (int stage = 0; cur.entry < e_end; stage ^= 1) {
    const RunCursor next = cur.next(L.entries, e_end);
    if constexpr (kOverlap == BwdOverlap::kNone) {
      if (next.entry < e_end) load_q(next.tile, stage ^ 1);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    fence_proxy_async_shared();
    __syncthreads();
    if constexpr (kOverlap != BwdOverlap::kNone) {
      // every thread finished the previous step (its dV / dK included), so stage ^ 1 is free
      if (next.entry < e_end) load_q(next.tile, stage ^ 1);
      cp_async_commit();
    }
    const uint32_t qs16 = q16 + stage * kQStage16, dos16 = do16 + stage * kQStage16;
    const float* lse_s = sLse + stage * BM;
    const float* dsum_s = sDsum + stage * BM;
    T* sdS = sdS2 + stage * BN * BM;
    const TileEntry e = L.entries[cur.entry];
    const int t0 = cur.tile * tq;

    // S^T = K Q^T and dP^T = V dO^T for this warpgroup's 64 keys x BM rows; element 4 nb + c is
    // (key key_lo + 8 (c / 2), row nb * 8 + 2 (lane % 4) + c % 2)
    // (past kNone the first k step overwrites the accumulators instead of adding to zeros)
    float st[BM / 2], dpt[BM / 2];
    if constexpr (kOverlap == BwdOverlap::kNone) {
#pragma unroll
      for (int i = 0; i < BM / 2; ++i) st[i] = dpt[i] = 0.f;
    }
    bwd_issue_st_dpt<D, BM, BN, kAccZero, E>(st, dpt, k16, v16, qs16, dos16, wg);
    if constexpr (kOverlap == BwdOverlap::kDkvDq) {
      add_dq(pending_dq_t0);  // the previous step's dQ (none when -1), under this step's GEMMs
    }

    uint32_t pa[BM / 16][4], da[BM / 16][4];  // P^T and dS^T as A operands
    bwd_softmax_grad<BM, BN, false, E>(args, e, t0, G, valid_rows, key_lo, keys_ok, warp, lane, sl2, lse_s, dsum_s, st,
                                       dpt, [&] { return sdS; }, pa, da);

    bwd_issue_dvdk<D, BM, E>(dv, dk, pa, da, qs16, dos16);
    if constexpr (kOverlap == BwdOverlap::kNone) {
      // dV / dK complete before the barrier: after it, a warpgroup that runs ahead prefetches the next
      // query tile into the Q / dO stage that the other one's dV / dK reads now hold (two stages)
      wgmma_wait<0>();
      wgmma_fence_operands(dv);
      wgmma_fence_operands(dk);
      wgmma_fence_operands(pa);
      wgmma_fence_operands(da);
    }
    fence_proxy_async_shared();  // dS^T stores -> the dQ wgmma
    __syncthreads();             // dS^T complete

    // dQ = dS K (scaled below), head-dim columns 64 wg .. +64 of all BM rows
    if constexpr (kAccZero) {
#pragma unroll
      for (int i = 0; i < 32; ++i) acc[i] = 0.f;
    }
    if constexpr (D == 128) bwd_issue_dq<BN, kAccZero, E>(acc, ds16 + stage * kDsStage16, k16, wg);
    else bwd_issue_dq_own_keys<BN, kAccZero, E>(acc, ds16 + stage * kDsStage16, k16, wg);
    wgmma_wait<0>();  // dQ (and, past kNone, dV / dK: groups retire in order)
    wgmma_fence_operands(acc);
    if constexpr (kOverlap != BwdOverlap::kNone) {
      wgmma_fence_operands(dv);
      wgmma_fence_operands(dk);
      wgmma_fence_operands(pa);
      wgmma_fence_operands(da);
    }
    if constexpr (kOverlap == BwdOverlap::kDkvDq) {
#pragma unroll
      for (int i = 0; i < 32; ++i) pend[i] = acc[i] * p.scale;
      pending_dq_t0 = t0;
    } else {
      add_dq(t0);
    }
    // No barrier here: the next step's first barrier orders this step's reads of Q / dO (all waited for
    // above) before the prefetch that reuses their stage (past kNone the prefetch sits behind that
    // barrier; in kNone this step's dS^T barrier already orders them), and the next dS^T goes to the
    // other buffer, whose dQ reads every thread finished before the next step's first barrier.
    cur = next;
  }
  if constexpr (kOverlap == BwdOverlap::kDkvDq) add_dq(pending_dq_t0);
  cp_async_wait<0>();

  bwd_store_dkdv<D>(args, dk, dv, key_lo, L.major_start[tile + 1], kvh, lane);
}

template <int D, bool kAddDq = true, BwdOverlap kOverlap = kBwdOverlap, BwdLoads kLoads = kBwdLoads,
          DType E = DType::kBf16>
void launch_bwd_wgmma(const BwdArgs& a, cudaStream_t stream) {
  using S = BwdWgmmaShape<D>;
  const int64_t blocks = static_cast<int64_t>(a.lists.num_major) * a.p.hkv;
  if (blocks == 0) return;
  auto* kernel = attention_bwd_wgmma_kernel<D, kAddDq, kOverlap, kLoads, E>;
  check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, S::kSmemBytes),
             "attention_backward: shared memory limit");
  kernel<<<static_cast<unsigned>(blocks), S::kThreads, S::kSmemBytes, stream>>>(a);
  check_cuda(cudaGetLastError(), "attention_backward: launch");
}

}  // namespace treecp::cuda::detail
