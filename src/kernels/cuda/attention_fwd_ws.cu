// The wgmma forward with warp specialisation, the default at head dim 128 (Mainloop::kWgmmaWs). Warpgroup 2
// holds a single producer thread that loads Q once and the run list's K/V tiles with TMA into a
// four-stage ring (mbarriers with transaction counts); warpgroups 0 and 1 (240 registers through
// setmaxnreg) only compute, each on its 64 rows, with no block barrier: a warpgroup waits for its
// stage to be full and releases it once its P V has retired. Same tile lists, masks, online softmax
// and epilogue as attention_fwd_wgmma.cuh (its fwd_* helpers); by default (launch variant 3) O leaves through shared
// memory and TMA stores. Needs head dim 128, G dividing 128 (Q's TMA box is 64 columns x G heads x 128 / G tokens),
// 16-byte aligned rows.
#include <cfloat>

#include "kernels/cuda/attention_fwd_wgmma.cuh"  // the per-tile steps both forward kernels share
#include "kernels/cuda/launch.hpp"
#include "kernels/cuda/mma.cuh"
#include "kernels/cuda/tma.cuh"
#include "kernels/cuda/wgmma.cuh"

namespace treecp::cuda::detail {
namespace {

struct FwdWsArgs {
  CUtensorMap tq, tk, tv;  // 64-byte aligned by their type
  CUtensorMap to;          // kTmaO: O, boxes of 64 columns x G heads x 64 / G tokens (one warpgroup's rows)
  FwdArgs a;
};

constexpr int kWsD = 128, kWsRows = 128, kWsKeys = 64, kWsStages = 4;
constexpr int kWsThreads = 384;  // two consumer warpgroups, then the producer's
constexpr int kWsSmem = (kWsRows + 2 * kWsStages * kWsKeys) * kWsD * 2 + 8 * (1 + 2 * kWsStages) + 1024;

// kQReg: Q in registers (ldmatrix once per block) as the A operand of S = Q K^T, so that GEMM reads only K
// from shared memory (half its operand traffic); costs 32 of the consumers' 240 registers.
// kOverlap: FA3's intra-warpgroup overlap. Tile n issues S(n) and then P V of tile n - 1; it waits only
// for S(n), and its mask and softmax run while P V(n - 1) is still on the tensor cores. O is rescaled
// once that P V has retired, and tile n's P goes to a second set of A registers.
// kTmaO: the epilogue writes each warpgroup's normalised O rows into its own rows of the Q buffer (free once Q is
// in registers or the last S GEMM has retired) and one thread stores them with two TMA boxes, instead of 32
// four-byte global stores per thread (8 rows x 16 bytes per warp instruction).
template <bool kQReg, bool kOverlap, bool kTmaO = false>
__global__ void __launch_bounds__(kWsThreads, 1) attention_fwd_ws_kernel(const __grid_constant__ FwdWsArgs w) {
  constexpr int D = kWsD, BM = kWsRows, BN = kWsKeys;
  const FwdArgs& args = w.a;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  const uint32_t raw_addr = smem_addr(smem_raw);
  unsigned char* base = smem_raw + (((raw_addr + 1023) & ~1023u) - raw_addr);
  const uint32_t sQ = smem_addr(base);
  const uint32_t sK = sQ + BM * D * 2;                  // [stage][BN x D panels]
  const uint32_t sV = sK + kWsStages * BN * D * 2;      // [stage][BN x D panels]
  const uint32_t bars = sV + kWsStages * BN * D * 2;    // qfull, full[kWsStages], empty[kWsStages]
  const uint32_t qfull = bars;
  auto full = [&](int s) { return bars + 8 + 8 * s; };
  auto empty = [&](int s) { return bars + 8 + 8 * kWsStages + 8 * s; };

  const AttentionForwardParams& p = args.p;
  const auto& L = args.lists;
  const int tile = L.order[blockIdx.x / p.hkv];
  const int kvh = blockIdx.x % p.hkv;
  const int G = args.group;
  const int t0 = tile * L.major_tile_rows;
  const int e_end = L.offsets[tile + 1];

  if (threadIdx.x == 0) {
    mbar_init(qfull, 1);
    for (int s = 0; s < kWsStages; ++s) {
      mbar_init(full(s), 1);
      mbar_init(empty(s), 8);  // lane 0 of each consumer warp
    }
    mbar_init_fence();
  }
  __syncthreads();

  if (threadIdx.x >= 256) {
    setmaxnreg_dec<24>();
    if (threadIdx.x != 256) return;
    // Q: two 64-column panels of packed rows (token t0 + r / G, head kvh G + r % G)
    mbar_expect_tx(qfull, BM * D * 2);
    for (int pnl = 0; pnl < D / 64; ++pnl) tma_load_3d(sQ + pnl * BM * 128, &w.tq, pnl * 64, kvh * G, t0, qfull);
    RunCursor cur = RunCursor::first(L.entries, L.offsets[tile], e_end);
    for (int n = 0; cur.entry < e_end; ++n, cur = cur.next(L.entries, e_end)) {
      const int s = n % kWsStages;
      if (n >= kWsStages) mbar_wait(empty(s), ((n / kWsStages) - 1) & 1);
      mbar_expect_tx(full(s), 2 * BN * D * 2);
      const int k0 = L.minor_start[cur.tile];  // BN rows from the tile's start, whatever its length
      for (int pnl = 0; pnl < D / 64; ++pnl) {
        tma_load_3d(sK + s * BN * D * 2 + pnl * BN * 128, &w.tk, pnl * 64, kvh, k0, full(s));
        tma_load_3d(sV + s * BN * D * 2 + pnl * BN * 128, &w.tv, pnl * 64, kvh, k0, full(s));
      }
    }
    return;
  }
  setmaxnreg_inc<240>();

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int wg = warp / 4;
  int row[2], tok[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    row[h] = warp * 16 + lane / 4 + 8 * h;
    tok[h] = t0 + row[h] / G;
  }
  float o[D / 2];
#pragma unroll
  for (int i = 0; i < D / 2; ++i) o[i] = 0.f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  const float sl2 = p.scale * kLog2e;
  const uint32_t q16 = (sQ + wg * 64 * 128) >> 4, k16 = sK >> 4, v16 = sV >> 4;
  constexpr uint32_t kStage16 = BN * D * 2 / 16;
  mbar_wait(qfull, 0);
  uint32_t qf[D / 16][4];  // kQReg: this warp's 16 rows of Q, one A fragment per k16 step
  if constexpr (kQReg) {
    const int mi = lane / 8, rr = wg * 64 + (warp % 4) * 16 + (mi % 2) * 8 + lane % 8;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      const int chunk = (kk % 4) * 2 + mi / 2;  // 16-byte chunk inside the 64-column panel kk / 4
      ldmatrix_x4(qf[kk], sQ + (kk / 4) * BM * 128 + rr * 128 + ((chunk ^ (rr % 8)) << 4));
    }
  }

  uint32_t pa[BN / 16][4];  // P of the tile whose P V is issued next (kOverlap: of the previous tile)
  int prev_s = 0;
  uint32_t prev_vs16 = 0;
  int n = 0;
  RunCursor cur = RunCursor::first(L.entries, L.offsets[tile], e_end);
  for (; cur.entry < e_end; ++n) {
    const int s = n % kWsStages;
    mbar_wait(full(s), (n / kWsStages) & 1);
    const uint32_t ks16 = k16 + s * kStage16, vs16 = v16 + s * kStage16;
    float sc[BN / 2];
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      const uint32_t off = (kk % 4) * 32;
      if constexpr (kQReg)
        wgmma_rs_m64n64k16_kmajor(sc, qf[kk], wgmma_desc16<16, 1024>(ks16 + ((kk / 4) * BN * 128 + off) / 16), kk > 0);
      else
        wgmma_ss_m64n64k16<false, false>(sc, wgmma_desc16<16, 1024>(q16 + ((kk / 4) * BM * 128 + off) / 16),
                                         wgmma_desc16<16, 1024>(ks16 + ((kk / 4) * BN * 128 + off) / 16), kk > 0);
    }
    wgmma_commit();
    if constexpr (kOverlap) {
      if (n > 0) fwd_issue_pv<D, BN>(o, pa, prev_vs16);
      wgmma_commit();
      wgmma_wait<1>();  // S(n) only: P V(n - 1) stays in flight under the softmax
    } else {
      wgmma_wait<0>();
    }
    wgmma_fence_operands(sc);

    float corrs[2];
    const bool rescale = fwd_tile_softmax<BN>(sc, args, cur, lane, tok, m, l, sl2, corrs);
    uint32_t pn[BN / 16][4];  // this tile's P
    fwd_pack_p<BN>(sc, pn);
    if constexpr (kOverlap) {
      wgmma_wait<0>();  // P V(n - 1): O and the old P are free again
      wgmma_fence_operands(o);
      wgmma_fence_operands(pa);
      if (n > 0) {
        __syncwarp();
        if (lane == 0) mbar_arrive(empty(prev_s));
      }
    }
    fwd_rescale_o<D>(o, rescale, corrs);
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk)
#pragma unroll
      for (int c = 0; c < 4; ++c) pa[kk][c] = pn[kk][c];
    if constexpr (kOverlap) {
      prev_s = s;
      prev_vs16 = vs16;
      cur = cur.next(L.entries, e_end);
      continue;
    }
    wgmma_fence();
    fwd_issue_pv<D, BN>(o, pa, vs16);
    wgmma_commit();
    wgmma_wait<0>();
    wgmma_fence_operands(o);
    wgmma_fence_operands(pa);
    __syncwarp();
    if (lane == 0) mbar_arrive(empty(s));  // this warp's reads of stage s are done
    cur = cur.next(L.entries, e_end);
  }
  if constexpr (kOverlap) {
    if (n > 0) {  // the last tile's P V
      wgmma_fence();
      fwd_issue_pv<D, BN>(o, pa, prev_vs16);
      wgmma_commit();
      wgmma_wait<0>();
      wgmma_fence_operands(o);
      wgmma_fence_operands(pa);
    }
  }

  if constexpr (kTmaO) {
    fwd_stage_o_lse<D>(args, o, m, l, row, tok, kvh, lane, sQ, BM);
    fence_proxy_async_shared();                    // the staged rows -> the TMA store (async proxy)
    named_barrier_sync(1 + wg, 128);               // this warpgroup's 64 rows are staged
    if (threadIdx.x % 128 == 0) {
#pragma unroll
      for (int pnl = 0; pnl < D / 64; ++pnl)
        tma_store_3d(&w.to, pnl * 64, kvh * G, t0 + wg * (64 / G), sQ + pnl * BM * 128 + wg * 64 * 128);
      bulk_commit_group();
      bulk_wait_group_read0();  // shared memory stays until the stores have read it
    }
  } else {
    fwd_store_o_lse<D>(args, o, m, l, row, tok, kvh, lane);
  }
}

}  // namespace

bool launch_fwd_ws_d128(const FwdArgs& a, cudaStream_t stream, int variant) {
  if (a.p.head_dim != kWsD || kWsRows % a.group != 0 || encode_tiled() == nullptr) return false;
  const int64_t blocks = static_cast<int64_t>(a.lists.num_major) * a.p.hkv;
  if (blocks == 0) return true;
  constexpr const char* kWho = "attention_forward (ws)";
  FwdWsArgs w;
  w.a = a;
  w.tq = tensor_map_d128(kWho, a.p.q, a.q_rows, a.p.hq, a.p.q_row_stride, a.p.q_head_stride, static_cast<uint32_t>(a.group),
                    static_cast<uint32_t>(kWsRows / a.group));
  w.tk = tensor_map_d128(kWho, a.p.k, a.kv_rows, a.p.hkv, a.p.k_row_stride, a.p.k_head_stride, 1, kWsKeys);
  w.tv = tensor_map_d128(kWho, a.p.v, a.kv_rows, a.p.hkv, a.p.v_row_stride, a.p.v_head_stride, 1, kWsKeys);
  if (variant == 3)
    w.to = tensor_map_d128(kWho, a.p.o, a.q_rows, a.p.hq, a.p.o_row_stride, a.p.o_head_stride,
                           static_cast<uint32_t>(a.group), static_cast<uint32_t>(64 / a.group));
  auto* kernel = variant == 0   ? attention_fwd_ws_kernel<false, false>
                 : variant == 1 ? attention_fwd_ws_kernel<true, false>
                 : variant == 3 ? attention_fwd_ws_kernel<true, true, true>
                                : attention_fwd_ws_kernel<true, true>;
  check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kWsSmem),
             "attention_forward (ws): shared memory limit");
  kernel<<<static_cast<unsigned>(blocks), kWsThreads, kWsSmem, stream>>>(w);
  check_cuda(cudaGetLastError(), "attention_forward (ws): launch");
  return true;
}

}  // namespace treecp::cuda::detail
