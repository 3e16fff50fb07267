// Backward slice attention, key-major: one block per (KV tile, KV head) walks every query tile that
// sees its keys (the key-major tile list). dK and dV of the tile stay in registers across all those
// query tiles and all q heads of the GQA group, so a shared prefix read by hundreds of queries is
// reduced in registers, never through atomics; only dQ (fp32) is added with atomics, as in FA2/FA3.
// Each warp owns 16 keys: S^T = K Q^T and dP^T = V dO^T come out key-major, dV += P^T dO and
// dK += dS^T Q need no exchange; dS^T goes through shared memory once for dQ = dS K.
#pragma once

#include "kernels/cuda/attention_bwd_tile.cuh"
#include "kernels/cuda/launch.hpp"
#include "kernels/cuda/mma.cuh"

namespace treecp::cuda::detail {

// D is Dqk (the columns of Q, K, dQ and dK), DV the columns of V, dO and dV (attention_dims.hpp's kAttentionDims).
template <int D, int DV = D>
struct BwdShape {
  static constexpr int kRows = kBwdBlockRows;
  static constexpr int kKeys = kBwdBlockKeys;
  static constexpr int kWarps = kKeys / 16;
  static constexpr int kThreads = kWarps * 32;
  // K, V, kQStages stages of Q and dO (16-bit), two of dS^T (16-bit), kQStages stages of LSE and Dsum (fp32)
  static constexpr int smem_bytes(int stages) {
    return (kKeys * (D + DV) + stages * kRows * (D + DV) + 2 * kKeys * kRows) * 2 + 2 * stages * kRows * 4;
  }
  // Two Q / dO stages (the next query tile loads under this one) where they fit 227 KiB; one at (256, 256), where
  // the next tile's loads start after the step's dS^T barrier and overlap only its dQ GEMM.
  static constexpr int kQStages = smem_bytes(2) <= 227 * 1024 ? 2 : 1;
  static constexpr int kSmemBytes = smem_bytes(kQStages);
  static_assert(kSmemBytes <= 227 * 1024, "mma.sync backward: K, V and one Q / dO stage must fit 227 KiB");
};

// kAddDq = false drops the dQ reduction (wrong dQ): a timing-only variant the benchmark uses to
// attribute backward time to the dQ atomics. The library launches kAddDq = true only.
template <int D, bool kAddDq = true, DType E = DType::kBf16, int DV = D>
__global__ void __launch_bounds__(BwdShape<D, DV>::kThreads, 1) attention_bwd_kernel(const BwdArgs args) {
  using S = BwdShape<D, DV>;
  using T = elem_t<E>;
  constexpr int BM = S::kRows, BN = S::kKeys, NQ = S::kQStages;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* sK = reinterpret_cast<T*>(smem_raw);
  T* sV = sK + BN * D;        // [BN][DV]
  T* sQ = sV + BN * DV;       // [NQ][BM][D]
  T* sdO = sQ + NQ * BM * D;  // [NQ][BM][DV]
  T* sdS2 = sdO + NQ * BM * DV; // [2][BN][BM], dS^T
  float* sLse = reinterpret_cast<float*>(sdS2 + 2 * BN * BM);  // [NQ][BM]
  float* sDsum = sLse + NQ * BM;                         // [NQ][BM]

  const AttentionBackwardParams& p = args.p;
  const auto& L = args.lists;
  // Longest tiles first across all KV heads (the heads of one tile are adjacent): a head-major order
  // would start the last head's longest tiles late and leave a tail.
  const int tile = L.order[blockIdx.x / p.hkv];
  const int kvh = blockIdx.x % p.hkv;
  const int G = args.group;
  const int k0 = L.major_start[tile];  // the tile: keys [k0, L.major_start[tile + 1]), at most BN
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int tq = L.minor_tile_rows;  // tokens per query tile
  const int valid_rows = tq * G;
  const auto* q = static_cast<const T*>(p.q);
  const auto* k = static_cast<const T*>(p.k);
  const auto* v = static_cast<const T*>(p.v);
  const auto* d_o = static_cast<const T*>(p.d_o);

  load_tile_async<D, S::kThreads>(sK, BN, k, [&](int r) -> const T* {
    return k0 + r < args.kv_rows ? k + (k0 + r) * p.k_row_stride + kvh * p.k_head_stride : nullptr;
  });
  load_tile_async<DV, S::kThreads>(sV, BN, v, [&](int r) -> const T* {
    return k0 + r < args.kv_rows ? v + (k0 + r) * p.v_row_stride + kvh * p.v_head_stride : nullptr;
  });
  const int e_end = L.offsets[tile + 1];
  RunCursor cur = RunCursor::first(L.entries, L.offsets[tile], e_end);
  // packed row r of query tile qt = (token qt * tq + r / G, q head kvh * G + r % G)
  auto load_q = [&](int qt, int stage) {
    const int t0 = qt * tq;
    auto ok = [&](int r) { return r < valid_rows && t0 + r / G < args.q_rows; };
    load_tile_async<D, S::kThreads>(sQ + stage * BM * D, BM, q, [&](int r) -> const T* {
      return ok(r) ? q + (t0 + r / G) * p.q_row_stride + (kvh * G + r % G) * p.q_head_stride : nullptr;
    });
    load_tile_async<DV, S::kThreads>(sdO + stage * BM * DV, BM, d_o, [&](int r) -> const T* {
      return ok(r) ? d_o + (t0 + r / G) * p.o_row_stride + (kvh * G + r % G) * p.o_head_stride : nullptr;
    });
    for (int r = threadIdx.x; r < BM; r += S::kThreads) {
      const int t = t0 + r / G, h = kvh * G + r % G;
      cp_async_4(sLse + stage * BM + r, ok(r) ? p.lse + t * p.lse_row_stride + h * p.lse_head_stride : p.lse, ok(r));
      cp_async_4(sDsum + stage * BM + r, ok(r) ? p.dsum + static_cast<int64_t>(t) * p.hq + h : p.dsum, ok(r));
    }
  };
  if (cur.entry < e_end) load_q(cur.tile, 0);
  cp_async_commit();

  float dk[D / 8][4], dv[DV / 8][4];
  if constexpr (D == DV) {
#pragma unroll
    for (int j = 0; j < D / 8; ++j)
#pragma unroll
      for (int c = 0; c < 4; ++c) dk[j][c] = dv[j][c] = 0.f;
  } else {
#pragma unroll
    for (int j = 0; j < D / 8; ++j)
#pragma unroll
      for (int c = 0; c < 4; ++c) dk[j][c] = 0.f;
#pragma unroll
    for (int j = 0; j < DV / 8; ++j)
#pragma unroll
      for (int c = 0; c < 4; ++c) dv[j][c] = 0.f;
  }
  const float sl2 = p.scale * kLog2e;
  const int key_lo = k0 + warp * 16 + lane / 4;  // this lane's keys: key_lo and key_lo + 8
  const uint32_t keys_ok = bwd_keys_ok(key_lo, L.major_start[tile + 1]);
  float* dq = p.dq;

  for (int stage = 0; cur.entry < e_end; stage ^= 1) {
    const RunCursor next = cur.next(L.entries, e_end);
    if constexpr (NQ == 2) {
      if (next.entry < e_end) load_q(next.tile, stage ^ 1);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();  // one stage: the next tile is loaded after this step's dS^T barrier
    }
    __syncthreads();
    const int qstage = NQ == 2 ? stage : 0;
    const T* q_s = sQ + qstage * BM * D;
    const T* do_s = sdO + qstage * BM * DV;
    const float* lse_s = sLse + qstage * BM;
    const float* dsum_s = sDsum + qstage * BM;
    // Double-buffered with the Q/dO stage: a warp that runs ahead into the next step writes the other
    // buffer, so no barrier is needed after dQ (the next step's top barrier orders the rest).
    T* sdS = sdS2 + stage * BN * BM;
    const TileEntry e = L.entries[cur.entry];
    const int t0 = cur.tile * tq;

    // S^T = K Q^T (16 keys x BM rows per warp); element [nb][c] = (key key_lo + 8 (c / 2), row nb*8 + 2(lane%4) + c%2)
    float st[BM / 8][4];
#pragma unroll
    for (int j = 0; j < BM / 8; ++j) st[j][0] = st[j][1] = st[j][2] = st[j][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t a[4];
      ldmatrix_x4(a, smem_addr(sK + swz<D>(warp * 16 + lane % 16, kk * 16 + (lane / 16) * 8)));
#pragma unroll
      for (int np = 0; np < BM / 16; ++np) {
        uint32_t b[4];
        ldmatrix_x4(b, smem_addr(q_s + swz<D>(np * 16 + lane % 8 + (lane / 16) * 8, kk * 16 + ((lane / 8) % 2) * 8)));
        mma_m16n8k16<E>(st[2 * np], a, b[0], b[1]);
        mma_m16n8k16<E>(st[2 * np + 1], a, b[2], b[3]);
      }
    }

    // visibility bits, then P^T = exp(S scale - LSE) on visible pairs, 0 elsewhere (flat views of the
    // [nb][c] fragments: register 4 nb + c, the layout of attention_bwd_tile.cuh)
    auto& stf = reinterpret_cast<float (&)[BM / 2]>(st);
    const uint32_t vis = bwd_visibility<BM>(args, e, t0, G, valid_rows, key_lo, keys_ok, lane);
    bwd_p_tile<BM, false>(stf, vis, lse_s, sl2, lane);
    uint32_t pa[BM / 16][4];  // P^T as A operands (16 keys x 16 rows per k16 step)
#pragma unroll
    for (int kk = 0; kk < BM / 16; ++kk) bwd_pack_a<BM, E>(stf, pa, kk);

    // dP^T = V dO^T, then dS^T = P^T (dP^T - Dsum)
    float dpt[BM / 8][4];
#pragma unroll
    for (int j = 0; j < BM / 8; ++j) dpt[j][0] = dpt[j][1] = dpt[j][2] = dpt[j][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < DV / 16; ++kk) {
      uint32_t a[4];
      ldmatrix_x4(a, smem_addr(sV + swz<DV>(warp * 16 + lane % 16, kk * 16 + (lane / 16) * 8)));
#pragma unroll
      for (int np = 0; np < BM / 16; ++np) {
        uint32_t b[4];
        ldmatrix_x4(b, smem_addr(do_s + swz<DV>(np * 16 + lane % 8 + (lane / 16) * 8, kk * 16 + ((lane / 8) % 2) * 8)));
        mma_m16n8k16<E>(dpt[2 * np], a, b[0], b[1]);
        mma_m16n8k16<E>(dpt[2 * np + 1], a, b[2], b[3]);
      }
    }
    auto& dptf = reinterpret_cast<float (&)[BM / 2]>(dpt);
    bwd_ds_tile<BM>(stf, dptf, dsum_s, lane);
    uint32_t da[BM / 16][4];
#pragma unroll
    for (int kk = 0; kk < BM / 16; ++kk) {
      bwd_pack_a<BM, E>(dptf, da, kk);
      // dS^T to shared memory for dQ: rows = keys, columns = packed query rows
      const int kr = warp * 16 + lane / 4, col = kk * 16 + 2 * (lane % 4);
      *reinterpret_cast<uint32_t*>(sdS + swz<BM>(kr, col)) = da[kk][0];
      *reinterpret_cast<uint32_t*>(sdS + swz<BM>(kr + 8, col)) = da[kk][1];
      *reinterpret_cast<uint32_t*>(sdS + swz<BM>(kr, col + 8)) = da[kk][2];
      *reinterpret_cast<uint32_t*>(sdS + swz<BM>(kr + 8, col + 8)) = da[kk][3];
    }

    // dV += P^T dO and dK += dS^T Q (B operands: rows of dO / Q are the reduction dimension)
#pragma unroll
    for (int kk = 0; kk < BM / 16; ++kk) {
      if constexpr (D == DV) {
#pragma unroll
        for (int dp = 0; dp < D / 16; ++dp) {
          uint32_t b[4];
          const int r = kk * 16 + lane % 8 + ((lane / 8) % 2) * 8, c = dp * 16 + (lane / 16) * 8;
          ldmatrix_x4_trans(b, smem_addr(do_s + swz<D>(r, c)));
          mma_m16n8k16<E>(dv[2 * dp], pa[kk], b[0], b[1]);
          mma_m16n8k16<E>(dv[2 * dp + 1], pa[kk], b[2], b[3]);
          ldmatrix_x4_trans(b, smem_addr(q_s + swz<D>(r, c)));
          mma_m16n8k16<E>(dk[2 * dp], da[kk], b[0], b[1]);
          mma_m16n8k16<E>(dk[2 * dp + 1], da[kk], b[2], b[3]);
        }
      } else {
        const int r = kk * 16 + lane % 8 + ((lane / 8) % 2) * 8;
#pragma unroll
        for (int dp = 0; dp < DV / 16; ++dp) {
          uint32_t b[4];
          ldmatrix_x4_trans(b, smem_addr(do_s + swz<DV>(r, dp * 16 + (lane / 16) * 8)));
          mma_m16n8k16<E>(dv[2 * dp], pa[kk], b[0], b[1]);
          mma_m16n8k16<E>(dv[2 * dp + 1], pa[kk], b[2], b[3]);
        }
#pragma unroll
        for (int dp = 0; dp < D / 16; ++dp) {
          uint32_t b[4];
          ldmatrix_x4_trans(b, smem_addr(q_s + swz<D>(r, dp * 16 + (lane / 16) * 8)));
          mma_m16n8k16<E>(dk[2 * dp], da[kk], b[0], b[1]);
          mma_m16n8k16<E>(dk[2 * dp + 1], da[kk], b[2], b[3]);
        }
      }
    }
    __syncthreads();  // dS^T complete
    if constexpr (NQ == 1) {
      // every thread finished this step's reads of Q, dO, LSE and Dsum (the dQ GEMM below reads dS^T and K only)
      if (next.entry < e_end) load_q(next.tile, 0);
      cp_async_commit();
    }

    // dQ = scale * dS K, added to fp32 dQ: warp w takes query rows (w % 4) * 16 .. + 16 and half
    // w / 4 of the head dim (a 16 x D/2 accumulator of 32 registers)
    static_assert(S::kWarps == 2 * (BM / 16), "dQ split: 4 row groups x 2 halves of D");
    {
      const int rg = warp % (BM / 16), half = warp / (BM / 16);
      float acc[D / 16][4];
#pragma unroll
      for (int j = 0; j < D / 16; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk) {
        uint32_t a[4];
        ldmatrix_x4_trans(a, smem_addr(sdS + swz<BM>(kk * 16 + lane % 8 + (lane / 16) * 8, rg * 16 + ((lane / 8) % 2) * 8)));
#pragma unroll
        for (int dp = 0; dp < D / 32; ++dp) {
          uint32_t b[4];
          const int dcol = half * (D / 2) + dp * 16 + (lane / 16) * 8;
          ldmatrix_x4_trans(b, smem_addr(sK + swz<D>(kk * 16 + lane % 8 + ((lane / 8) % 2) * 8, dcol)));
          mma_m16n8k16<E>(acc[2 * dp], a, b[0], b[1]);
          mma_m16n8k16<E>(acc[2 * dp + 1], a, b[2], b[3]);
        }
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = rg * 16 + lane / 4 + 8 * h;
        const int t = t0 + r / G;
        if (r >= valid_rows || t >= args.q_rows) continue;
        float* dst = dq + t * p.dq_row_stride + (kvh * G + r % G) * p.dq_head_stride + half * (D / 2) + 2 * (lane % 4);
#pragma unroll
        for (int j = 0; j < D / 16; ++j)
          if constexpr (kAddDq) red_add_f32x2(dst + j * 8, acc[j][2 * h] * p.scale, acc[j][2 * h + 1] * p.scale);
          else if (acc[j][2 * h] == 1234.5f) dst[j * 8] = 0.f;  // keeps the dQ GEMM alive
      }
    }
    // No barrier here: the next prefetch targets the other Q/dO stage (with one stage: it was issued after this
    // step's dS^T barrier), which every warp finished reading before that barrier, and the next dS^T goes to the
    // other buffer.
    cur = next;
  }
  cp_async_wait<0>();

  if constexpr (D == DV)
    bwd_store_dkdv<D>(args, reinterpret_cast<const float (&)[D / 2]>(dk), reinterpret_cast<const float (&)[D / 2]>(dv),
                      key_lo, L.major_start[tile + 1], kvh, lane);
  else
    bwd_store_dkdv<D, DV>(args, reinterpret_cast<const float (&)[D / 2]>(dk),
                          reinterpret_cast<const float (&)[DV / 2]>(dv), key_lo, L.major_start[tile + 1], kvh, lane);
}

template <int D, bool kAddDq = true, DType E = DType::kBf16, int DV = D>
void launch_bwd(const BwdArgs& a, cudaStream_t stream) {
  using S = BwdShape<D, DV>;
  const int64_t blocks = static_cast<int64_t>(a.lists.num_major) * a.p.hkv;
  if (blocks == 0) return;
  check_cuda(cudaFuncSetAttribute(attention_bwd_kernel<D, kAddDq, E, DV>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  S::kSmemBytes),
             "attention_backward: shared memory limit");
  attention_bwd_kernel<D, kAddDq, E, DV><<<static_cast<unsigned>(blocks), S::kThreads, S::kSmemBytes, stream>>>(a);
  check_cuda(cudaGetLastError(), "attention_backward: launch");
}

}  // namespace treecp::cuda::detail
