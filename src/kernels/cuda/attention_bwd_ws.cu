// The wgmma backward with warp specialisation (Mainloop::kWgmmaWs). Same work decomposition, GEMMs, masks and
// softmax gradient as attention_bwd_wgmma.cuh (one block per (KV tile of 128 keys, KV head), key-major walk
// over the query tiles that see it, dK / dV in registers), with the loads and the dQ reductions moved out of
// the MMA warps:
//   warpgroup 2 (24 registers) is the producer. One thread loads K and V once, then each listed query tile's
//   Q and dO with TMA into a two-stage ring (mbarriers with transaction counts); one warp copies the tile's
//   LSE (times log2 e) and Dsum into the same stage and arrives on its `full` barrier lane by lane; one
//   thread adds each step's dQ, staged in shared memory by the consumers, to global dQ with TMA bulk
//   reductions (kDqBufs > 0; otherwise the consumers issue red.global.add.v2.f32 themselves).
//   warpgroups 0 and 1 (240 registers) compute. The only barrier between them is a named barrier over their
//   256 threads per step (dS^T complete before the dQ GEMM reads it); every consumer thread arrives on a
//   stage's `empty` barrier once the step's GEMMs that read it (S^T, dP^T, dV, dK) have retired.
// K held in registers as the A operand of S^T = K Q^T (half that GEMM's shared-memory reads) was tried: at
// 240 registers ptxas spills the 32 K registers and serialises the wgmmas (docs/benchmarks-gpu.md, change Q).
// Blocks take their (KV tile, head) in the default order or, where the plan says it shares more through L2, in
// the segment order (a segment's tiles for one head together, every walk reversed: BwdWsConfig::kSegmentOrder).
// Warpgroup 1 sits out the steps its 64 keys see no query of (TileLists::upper_live; BwdWsConfig::skip_idle).
// dK and dV leave through shared memory and TMA bulk reductions (BwdWsConfig::dkdv_by_tma, the default) or are read
// back, added and written by the consumer threads.
// Needs head dim 128, G dividing 64 (Q's TMA box is 64 columns x G heads x 64 / G tokens), 16-byte rows.
#include <atomic>
#include <cfloat>
#include <cstdint>

#include "kernels/cuda/attention_bwd_tile.cuh"
#include "kernels/cuda/attention_bwd_wgmma.cuh"  // the step's GEMM issues and dS^T store
#include "kernels/cuda/launch.hpp"
#include "kernels/cuda/mma.cuh"
#include "kernels/cuda/tma.cuh"
#include "kernels/cuda/wgmma.cuh"

namespace treecp::cuda::detail {
namespace {

struct BwdWsArgs {
  CUtensorMap tq, tdo, tk, tv;  // 64-byte aligned by their type
  CUtensorMap tdq;              // kDqTma: fp32 dQ, boxes of 32 columns x G heads x 64 / G tokens
  CUtensorMap tdk, tdv;         // dkdv_tma: fp32 dK and dV, boxes of 32 columns x 1 head x 64 keys
  BwdArgs a;
  int32_t first_wave;           // blocks [0, first_wave) walk their query tiles in reverse
  int32_t by_segment;           // blocks take (tile, head) in the segment order (BwdWsConfig::segment_order)
  int32_t skip_idle;            // kDqTma: warpgroup 1 skips the steps its keys see no query of (BwdWsConfig)
  int32_t dkdv_tma;             // kDqTma: dK and dV added by TMA bulk reductions (BwdWsConfig::dkdv_by_tma)
};

constexpr int kBwsD = 128, kBwsRows = kBwdBlockRows, kBwsKeys = kBwdBlockKeys;
constexpr int kBwsThreads = 384;  // two consumer warpgroups, then the producer's
static_assert(kBwsRows == 64 && kBwsKeys == 128, "ws backward: 128 keys x 64 rows");

// kDqBufs (0: dQ by red.global.add, no buffer) fp32 dQ buffers of BM x D
template <int kStages, int kDqBufs>
constexpr int bwd_ws_smem() {
  // K, V; per stage Q, dO (16-bit) and LSE, Dsum (fp32); two dS^T buffers; the dQ buffers; per stage the step
  // (query tile, list entry); the barriers; 1 KiB alignment
  return (2 * kBwsKeys * kBwsD + 2 * kStages * kBwsRows * kBwsD + 2 * kBwsKeys * kBwsRows) * 2 +
         kDqBufs * kBwsRows * kBwsD * 4 + 2 * kStages * kBwsRows * 4 + 16 * kStages + 8 * (1 + 2 * kStages + 4) + 1024;
}

// ---- Tile scheduler -----------------------------------------------------------------------------------------------

// Which (KV tile, head) block blockIdx.x takes and the direction of its walk over the query tiles that see it.
// Longest tiles first, the heads of one tile adjacent. The first wave (one block per SM, all starting together) walks
// its lists in reverse, from their common end and in step; every later block walks forward: blocks of one KV segment
// then start about one diagonal apart in time and in place, so they also walk in step. Either way the L2 cache serves
// the Q, dO and dQ lines of a step to all but the first of them (change X in docs/benchmarks-gpu.md: -1 to -7% against
// every walk forward).
// by_segment: the blocks of a segment group [first, end) of segment_order are its tiles for head 0, then for head 1,
// ...; block b lies in the group holding position b / hkv.
struct BwdWsTileScheduler {
  int tile, kvh;
  bool reverse;

  __device__ __forceinline__ explicit BwdWsTileScheduler(const BwdWsArgs& w) {
    const AttentionBackwardParams& p = w.a.p;
    const auto& L = w.a.lists;
    if (w.by_segment) {
      const int i = blockIdx.x / p.hkv;
      const int first = L.segment_first[i], size = L.segment_end[i] - first;
      const int local = blockIdx.x - first * p.hkv;
      kvh = local / size;
      tile = L.segment_order[first + local % size];
    } else {
      tile = L.order[blockIdx.x / p.hkv];
      kvh = blockIdx.x % p.hkv;
    }
    reverse = static_cast<int>(blockIdx.x) < w.first_wave;
  }
  // the block's walk over the entries [e_begin, e_end) of its tile
  __device__ __forceinline__ TileWalk walk(const TileEntry* entries, int e_begin, int e_end) const {
    return TileWalk::first(entries, e_begin, e_end, reverse);
  }
};

// ---- Shared memory ------------------------------------------------------------------------------------------------

// K, V (panels of BN rows); per stage Q, dO ([stage][BM x D panels]); two dS^T buffers ([2][BN keys x BM rows, one
// panel]); kDqBufs fp32 dQ buffers ([b][4 panels of BM rows x 32 fp32]); per stage LSE (times log2 e) and Dsum, and
// the step (query tile, its list entry, idle); the mbarriers kvfull, full[kStages], empty[kStages], dqfull[2],
// dqempty[2]. 1 KiB aligned (bwd_ws_smem counts the bytes).
template <int kStages, int kDqBufs>
struct BwdWsSmem {
  static constexpr int D = kBwsD, BM = kBwsRows, BN = kBwsKeys;
  unsigned char* base;
  uint32_t sK, sV, sQ, sdO, sdS, sdQ;
  float* sLse;
  float* sDsum;
  int4* sStep;
  uint32_t bars;

  __device__ __forceinline__ explicit BwdWsSmem(unsigned char* smem_raw) {
    const uint32_t raw_addr = smem_addr(smem_raw);
    base = smem_raw + (((raw_addr + 1023) & ~1023u) - raw_addr);
    sK = smem_addr(base);
    sV = sK + BN * D * 2;
    sQ = sV + BN * D * 2;
    sdO = sQ + kStages * BM * D * 2;
    sdS = sdO + kStages * BM * D * 2;
    sdQ = sdS + 2 * BN * BM * 2;
    unsigned char* stats = base + (sdQ + kDqBufs * BM * D * 4 - sK);
    sLse = reinterpret_cast<float*>(stats);
    sDsum = sLse + kStages * BM;
    sStep = reinterpret_cast<int4*>(sDsum + kStages * BM);
    bars = smem_addr(sStep + kStages);
  }
  __device__ __forceinline__ uint32_t kvfull() const { return bars; }
  __device__ __forceinline__ uint32_t full(int s) const { return bars + 8 + 8 * s; }
  __device__ __forceinline__ uint32_t empty(int s) const { return bars + 8 + 8 * kStages + 8 * s; }
  __device__ __forceinline__ uint32_t dqfull(int b) const { return bars + 8 + 16 * kStages + 8 * b; }   // kDqBufs > 0
  __device__ __forceinline__ uint32_t dqempty(int b) const { return bars + 24 + 16 * kStages + 8 * b; }  // kDqBufs > 0
  // thread 0, before the block barrier
  __device__ __forceinline__ void init_barriers() const {
    mbar_init(kvfull(), 1);
    for (int s = 0; s < kStages; ++s) {
      mbar_init(full(s), 1 + 32);  // the TMA thread's expect_tx, then every lane of the stats warp
      mbar_init(empty(s), 256);    // every consumer thread (its own LSE / Dsum reads: generic proxy)
    }
    for (int b = 0; b < kDqBufs; ++b) {
      mbar_init(dqfull(b), 8);   // lane 0 of each consumer warp
      mbar_init(dqempty(b), 1);  // the dQ warp
    }
    mbar_init_fence();
  }
};

// ---- Producer -----------------------------------------------------------------------------------------------------

// Warpgroup 2's three roles; each walks the block's steps in the scheduler's order.
template <int kStages, int kDqBufs>
struct BwdWsProducer {
  static constexpr int D = kBwsD, BM = kBwsRows, BN = kBwsKeys;
  using Smem = BwdWsSmem<kStages, kDqBufs>;

  // Warp 0, one thread: K and V of the tile (rows past kv_rows arrive as zeros) on kvfull, then Q and dO of each
  // listed query tile (tq tokens from cur.tile tq) into stage n % kStages once its previous step has released it.
  __device__ __forceinline__ static void load(const BwdWsArgs& w, const Smem& sm, const BwdWsTileScheduler& sched,
                                              int k0, int tq, int G, int e_begin, int e_end) {
    const auto& L = w.a.lists;
    const int kvh = sched.kvh;
    mbar_expect_tx(sm.kvfull(), 2 * BN * D * 2);
    for (int pnl = 0; pnl < D / 64; ++pnl) {
      tma_load_3d(sm.sK + pnl * BN * 128, &w.tk, pnl * 64, kvh, k0, sm.kvfull());
      tma_load_3d(sm.sV + pnl * BN * 128, &w.tv, pnl * 64, kvh, k0, sm.kvfull());
    }
    TileWalk cur = sched.walk(L.entries, e_begin, e_end);
    for (int n = 0; cur.more(); ++n, cur.advance(L.entries)) {
      const int s = n % kStages;
      if (n >= kStages) mbar_wait(sm.empty(s), ((n / kStages) - 1) & 1);
      mbar_expect_tx(sm.full(s), 2 * BM * D * 2);
      const int t0 = cur.tile * tq;
      for (int pnl = 0; pnl < D / 64; ++pnl) {
        tma_load_3d(sm.sQ + s * BM * D * 2 + pnl * BM * 128, &w.tq, pnl * 64, kvh * G, t0, sm.full(s));
        tma_load_3d(sm.sdO + s * BM * D * 2 + pnl * BM * 128, &w.tdo, pnl * 64, kvh * G, t0, sm.full(s));
      }
    }
  }

  // Warp 1: each step's LSE (times log2 e) and Dsum into its stage, and the step itself (query tile, list entry, and
  // whether warpgroup 1 sits it out) for the consumers, which hold no cursor; every lane arrives on full(s). Packed
  // row r of query tile qt = (token qt tq + r / G, q head kvh G + r % G); rows past q_rows get 0 (the consumers'
  // visibility bits exclude them). Lane l copies rows l and l + 32 (few registers: the per-row token offset and head
  // are computed once).
  __device__ __forceinline__ static void copy_stats(const BwdWsArgs& w, const Smem& sm, const BwdWsTileScheduler& sched,
                                                    int tq, int G, int e_begin, int e_end, int lane) {
    const BwdArgs& args = w.a;
    const AttentionBackwardParams& p = args.p;
    const auto& L = args.lists;
    const int kvh = sched.kvh;
    const int dt0 = lane / G, dt1 = (lane + 32) / G;
    const int h0 = kvh * G + lane % G, h1 = kvh * G + (lane + 32) % G;
    TileWalk cur = sched.walk(L.entries, e_begin, e_end);
#pragma unroll 1
    for (int n = 0; cur.more(); ++n, cur.advance(L.entries)) {
      const int s = n % kStages;
      if (n >= kStages) mbar_wait(sm.empty(s), ((n / kStages) - 1) & 1);
      const int t0 = cur.tile * tq;
      if (lane == 0) {  // the step, for the consumers (no cursor there), and whether warpgroup 1 sits it out
        const int2 live = L.upper_live[cur.entry];
        const bool idle = kDqBufs > 0 && w.skip_idle && (cur.tile < live.x || cur.tile >= live.y);
        sm.sStep[s] = make_int4(cur.tile, cur.entry, idle, 0);
      }
      float* lse_dst = sm.sLse + s * BM + lane;
      float* dsum_dst = sm.sDsum + s * BM + lane;
      const int ta = t0 + dt0, tb = t0 + dt1;
      lse_dst[0] = ta < args.q_rows ? p.lse[ta * p.lse_row_stride + h0 * p.lse_head_stride] * kLog2e : 0.f;
      lse_dst[32] = tb < args.q_rows ? p.lse[tb * p.lse_row_stride + h1 * p.lse_head_stride] * kLog2e : 0.f;
      dsum_dst[0] = ta < args.q_rows ? p.dsum[static_cast<int64_t>(ta) * p.hq + h0] : 0.f;
      dsum_dst[32] = tb < args.q_rows ? p.dsum[static_cast<int64_t>(tb) * p.hq + h1] : 0.f;
      mbar_arrive(sm.full(s));
    }
  }
};

// ---- Mainloop -----------------------------------------------------------------------------------------------------

// A consumer warpgroup's step over the shared steps of attention_bwd_wgmma.cuh: issue_scores, then (in the kernel
// body) the softmax gradient, dV and dK, the dQ GEMM; or, for warpgroup 1 on a step its keys see no query of,
// idle_step. The caller owns every register array. The softmax gradient and the GEMMs after it stay in the body:
// wrapped in a function of this part, even one that only forwards to bwd_softmax_grad, the kernels' machine code
// changes (nvcc optimises a forceinline callee before inlining it; docs/benchmarks-gpu.md, "One kernel body per
// direction").
template <int kStages, int kDqBufs, DType E>
struct BwdWsMainloop {
  static constexpr int D = kBwsD, BM = kBwsRows, BN = kBwsKeys;

  // S^T = K Q^T and dP^T = V dO^T for this warpgroup's 64 keys x BM rows, issued (element 4 nb + c is (key
  // key_lo + 8 (c / 2), row nb * 8 + 2 (lane % 4) + c % 2); the first k step overwrites).
  __device__ __forceinline__ static void issue_scores(float (&st)[BM / 2], float (&dpt)[BM / 2], uint32_t k16,
                                                      uint32_t v16, uint32_t qs16, uint32_t dos16, int wg) {
    bwd_issue_st_dpt<D, BM, BN, false, E>(st, dpt, k16, v16, qs16, dos16, wg);
  }

  // Warpgroup 1 where its keys (from k0 + 64) see no query of the step (the first half of a diagonal, a tile of at
  // most 64 keys: outside the entry's TileLists::upper_live range): S^T, dP^T, dV and dK skipped, its half of dS^T
  // (rows 64 .. 127 of buffer dsb) zeroed for the dQ GEMM, which it runs with warpgroup 0.
  __device__ __forceinline__ static void idle_step(float (&acc)[32], uint32_t dsb, uint32_t ds16n, uint32_t k16,
                                                   int wg) {
    const uint32_t z = dsb + 64 * 128 + (threadIdx.x - 128) * 64;
#pragma unroll
    for (int i = 0; i < 4; ++i)
      asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(z + 16 * i), "r"(0) : "memory");
    fence_proxy_async_shared();  // the zeros -> the dQ wgmma
    named_barrier_sync(1, 256);  // dS^T complete (both consumer warpgroups)
    bwd_issue_dq<BN, false, E>(acc, ds16n, k16, wg);
    wgmma_wait<0>();
    wgmma_fence_operands(acc);
  }
};

// ---- dQ reduction -------------------------------------------------------------------------------------------------

// kDqBufs > 0: the consumers store each step's dQ (fp32, scaled) into one of kDqBufs shared buffers laid out as four
// 32-column panels with the 128-byte swizzle, and a producer warp adds it to global dQ with four TMA bulk
// reductions, instead of 16 red.global.add.v2.f32 per consumer thread (the profile of run 32 put 28% of the
// consumer warps' stall samples on those reductions and on the registers they still read). Three Q/dO stages
// with one dQ buffer (the shared-memory limit) measured slower than two and two (run 35).
// kDqBufs == 0: each consumer thread adds its part of the previous step's dQ with red.global.add under this step's
// GEMMs (bwd_red_add_dq).
template <int kStages, int kDqBufs>
struct BwdWsDqReduction {
  static constexpr int D = kBwsD, BM = kBwsRows;
  using Smem = BwdWsSmem<kStages, kDqBufs>;

  // Consumers: scale dS K of this step (acc) into dQ buffer b (element (row r, column c) of the 64 x 128 tile is in
  // panel c / 32, line r, 16-byte chunk (c % 32) / 4 XOR r % 8).
  __device__ __forceinline__ static void stage(const Smem& sm, const float (&acc)[32], float scale, int b, int warp,
                                               int wg, int lane) {
    const uint32_t qb = sm.sdQ + b * BM * D * 4;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = (warp % 4) * 16 + lane / 4 + 8 * h;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int c = 64 * wg + 8 * j + 2 * (lane % 4);
        const uint32_t addr = qb + (c / 32) * (BM * 128) + r * 128 + ((((c % 32) / 4) ^ (r % 8)) << 4) + (c % 4) * 4;
        asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(addr), "f"(acc[4 * j + 2 * h] * scale),
                     "f"(acc[4 * j + 2 * h + 1] * scale)
                     : "memory");
      }
    }
  }

  // Producer warp 2, one thread: each step's buffer into global dQ (rows past q_rows are skipped), then the buffer
  // back to the consumers once the reductions have read it.
  __device__ __forceinline__ static void drain(const BwdWsArgs& w, const Smem& sm, const BwdWsTileScheduler& sched,
                                               int tq, int G, int e_begin, int e_end) {
    const auto& L = w.a.lists;
    TileWalk cur = sched.walk(L.entries, e_begin, e_end);
    for (int n = 0; cur.more(); ++n, cur.advance(L.entries)) {
      const int b = n % kDqBufs;
      mbar_wait(sm.dqfull(b), (n / kDqBufs) & 1);
      const int t0 = cur.tile * tq;
#pragma unroll
      for (int pnl = 0; pnl < D / 32; ++pnl)
        tma_reduce_add_3d(&w.tdq, pnl * 32, sched.kvh * G, t0, sm.sdQ + b * BM * D * 4 + pnl * BM * 128);
      bulk_commit_group();
      bulk_wait_group_read0();  // the buffer has been read: the consumers may refill it
      mbar_arrive(sm.dqempty(b));
    }
    bulk_wait_group0();
  }
};

// ---- dK / dV epilogue ---------------------------------------------------------------------------------------------

template <int kStages, int kDqBufs>
struct BwdWsEpilogue {
  static constexpr int D = kBwsD;
  using Smem = BwdWsSmem<kStages, kDqBufs>;

  // dkdv_tma: each warpgroup stages its 64 keys of dK (scaled) and dV, fp32, as four 32-column panels each with the
  // 128-byte swizzle, over K, V (warpgroup 0) and the Q / dO stages (warpgroup 1), and one thread adds them with eight
  // TMA bulk reductions: no read of dK / dV back into registers. Keys from k_end on (the next tile's) add zeros.
  __device__ __forceinline__ static void reduce_by_tma(const BwdWsArgs& w, const Smem& sm, const float (&dk)[D / 2],
                                                       const float (&dv)[D / 2], int k0, int k_end, int key_lo, int kvh,
                                                       int warp, int wg, int lane) {
    const AttentionBackwardParams& p = w.a.p;
    named_barrier_sync(1, 256);  // both warpgroups' last GEMMs have retired: K, V, Q and dO are free
    const uint32_t region = sm.sK + wg * (2 * 64 * D * 4);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = (warp % 4) * 16 + lane / 4 + 8 * h;
      const float ok = key_lo + 8 * h < k_end ? 1.f : 0.f;
#pragma unroll
      for (int j = 0; j < D / 8; ++j) {
        const int c = 8 * j + 2 * (lane % 4);
        const uint32_t addr = region + (c / 32) * (64 * 128) + r * 128 + ((((c % 32) / 4) ^ (r % 8)) << 4) + (c % 4) * 4;
        asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(addr), "f"(dk[4 * j + 2 * h] * p.scale * ok),
                     "f"(dk[4 * j + 2 * h + 1] * p.scale * ok)
                     : "memory");
        asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(addr + 4 * 64 * 128), "f"(dv[4 * j + 2 * h] * ok),
                     "f"(dv[4 * j + 2 * h + 1] * ok)
                     : "memory");
      }
    }
    fence_proxy_async_shared();       // the staged rows -> the bulk reductions (async proxy)
    named_barrier_sync(2 + wg, 128);  // this warpgroup's rows are staged
    if (threadIdx.x % 128 == 0 && k0 + 64 * wg < k_end) {
#pragma unroll
      for (int pnl = 0; pnl < D / 32; ++pnl) {
        tma_reduce_add_3d(&w.tdk, pnl * 32, kvh, k0 + 64 * wg, region + pnl * 64 * 128);
        tma_reduce_add_3d(&w.tdv, pnl * 32, kvh, k0 + 64 * wg, region + 4 * 64 * 128 + pnl * 64 * 128);
      }
      bulk_commit_group();
      bulk_wait_group_read0();  // shared memory stays until the reductions have read it
    }
  }
};

// ---- The kernel ---------------------------------------------------------------------------------------------------

// One body: the scheduler picks the block's tile and walk, the producer warpgroup loads and (kDqBufs > 0) drains dQ,
// the consumers run the mainloop (per step S^T and dP^T, the softmax gradient dS^T, dV and dK, then dQ = dS K and
// its reduction) and the dK / dV epilogue.
template <int kStages, int kDqBufs, DType E = DType::kBf16>
__global__ void __launch_bounds__(kBwsThreads, 1) attention_bwd_ws_kernel(const __grid_constant__ BwdWsArgs w) {
  constexpr int D = kBwsD, BM = kBwsRows, BN = kBwsKeys;
  using Smem = BwdWsSmem<kStages, kDqBufs>;
  using Producer = BwdWsProducer<kStages, kDqBufs>;
  using DqReduction = BwdWsDqReduction<kStages, kDqBufs>;
  using Mainloop = BwdWsMainloop<kStages, kDqBufs, E>;
  const BwdArgs& args = w.a;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  const Smem sm(smem_raw);
  constexpr bool kDqTma = kDqBufs > 0;

  const AttentionBackwardParams& p = args.p;
  const auto& L = args.lists;
  const BwdWsTileScheduler sched(w);
  const int tile = sched.tile, kvh = sched.kvh;
  const int G = args.group;
  const int k0 = L.major_start[tile];  // the tile: keys [k0, L.major_start[tile + 1]), at most BN
  const int tq = L.minor_tile_rows;  // tokens per query tile (tq G = BM: the launcher checks)
  const int e_begin = L.offsets[tile], e_end = L.offsets[tile + 1];

  if (threadIdx.x == 0) sm.init_barriers();
  __syncthreads();

  if (threadIdx.x >= 256) {
    setmaxnreg_dec<24>();  // (168 - 24) x 128 = (240 - 168) x 256: what the consumers take
    const int pw = threadIdx.x / 32 - 8, lane = threadIdx.x % 32;
    if (pw == 0 && lane == 0 && e_begin < e_end) {
      Producer::load(w, sm, sched, k0, tq, G, e_begin, e_end);
    } else if (pw == 1) {
      Producer::copy_stats(w, sm, sched, tq, G, e_begin, e_end, lane);
    } else if (pw == 2 && lane == 0) {
      if constexpr (kDqTma) DqReduction::drain(w, sm, sched, tq, G, e_begin, e_end);
    }
    return;
  }
  setmaxnreg_inc<240>();

  // ---- consumers: the mainloop
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int wg = warp / 4;
  const int valid_rows = tq * G;
  float dk[D / 2], dv[D / 2];  // register 4 j + c: (key h = c / 2, column 8 j + 2 (lane % 4) + c % 2)
#pragma unroll
  for (int i = 0; i < D / 2; ++i) dk[i] = dv[i] = 0.f;
  const float sl2 = p.scale * kLog2e;
  const int key_lo = k0 + warp * 16 + lane / 4;  // this lane's keys: key_lo and key_lo + 8
  const uint32_t keys_ok = bwd_keys_ok(key_lo, L.major_start[tile + 1]);
  const uint32_t k16 = sm.sK >> 4, v16 = sm.sV >> 4, q16 = sm.sQ >> 4, do16 = sm.sdO >> 4, ds16 = sm.sdS >> 4;
  constexpr uint32_t kQStage16 = BM * D * 2 / 16, kDsStage16 = BN * BM * 2 / 16;
  float* dq = p.dq;
  if (e_begin < e_end) mbar_wait(sm.kvfull(), 0);
  // scale dS K of the previous step, whose reductions are issued under this step's S^T / dP^T GEMMs (a copy
  // made after the wait: ptxas would otherwise wait for the next GEMMs before reading registers a wgmma defined)
  float acc[32], pend[32];
  auto add_dq = [&](int t0) { bwd_red_add_dq(args, dq, pend, t0, G, valid_rows, kvh, warp, wg, lane); };
  int pending_dq_t0 = -1;  // first token of the query tile whose dQ (pend) is still to be added

  int steps = 0;
  for (int i = e_begin; i < e_end; ++i) steps += L.entries[i].tile_end - L.entries[i].tile_begin;
#pragma unroll 1
  for (int n = 0; n < steps; ++n) {
    const int s = n % kStages;
    mbar_wait(sm.full(s), (n / kStages) & 1);
    const uint32_t qs16 = q16 + s * kQStage16, dos16 = do16 + s * kQStage16;
    const float* lse_s = sm.sLse + s * BM;
    const float* dsum_s = sm.sDsum + s * BM;
    const uint32_t dsb = sm.sdS + (n & 1) * BN * BM * 2;  // this step's dS^T buffer
    const int4 step = sm.sStep[s];  // written by the stats warp before its arrival on full(s)
    const TileEntry e = L.entries[step.y];
    const int t0 = step.x * tq;

    // kDqTma: warpgroup 1's keys (from k0 + 64) see no query of some steps (the first half of a diagonal, a
    // tile of at most 64 keys: outside the entry's TileLists::upper_live range, which the stats warp reads). It
    // then skips S^T, dP^T, dV and dK and zeroes its half of dS^T for the dQ GEMM. Decided where no wgmma is in
    // flight; each path waits for its own GEMMs.
    if (kDqTma && wg == 1 && step.z) {
      Mainloop::idle_step(acc, dsb, ds16 + (n & 1) * kDsStage16, k16, wg);
    } else {
      float st[BM / 2], dpt[BM / 2];  // S^T, dP^T
      Mainloop::issue_scores(st, dpt, k16, v16, qs16, dos16, wg);
      if constexpr (!kDqTma) add_dq(pending_dq_t0);  // the previous step's dQ (none when -1), under this step's GEMMs
      uint32_t pa[BM / 16][4], da[BM / 16][4];  // P^T and dS^T as A operands
      bwd_softmax_grad<BM, BN, true, E>(
          args, e, t0, G, valid_rows, key_lo, keys_ok, warp, lane, sl2, lse_s, dsum_s, st, dpt,
          [&] { return reinterpret_cast<elem_t<E>*>(sm.base + (dsb - sm.sK)); }, pa, da);

      bwd_issue_dvdk<D, BM, E>(dv, dk, pa, da, qs16, dos16);
      fence_proxy_async_shared();     // dS^T stores -> the dQ wgmma
      named_barrier_sync(1, 256);     // dS^T complete (both consumer warpgroups)

      // dQ = dS K (scaled below), head-dim columns 64 wg .. +64 of all BM rows
      bwd_issue_dq<BN, false, E>(acc, ds16 + (n & 1) * kDsStage16, k16, wg);
      wgmma_wait<0>();  // dQ, and dV / dK (groups retire in order)
      wgmma_fence_operands(acc);
      wgmma_fence_operands(dv);
      wgmma_fence_operands(dk);
      wgmma_fence_operands(pa);
      wgmma_fence_operands(da);
    }
    mbar_arrive(sm.empty(s));  // this thread's reads of stage s (Q, dO, LSE, Dsum) are done
    // ---- the step's dQ reduction
    if constexpr (kDqTma) {
      const int b = n % kDqBufs;
      // the dQ warp has read step n - kDqBufs's buffer
      if (n >= kDqBufs) mbar_wait(sm.dqempty(b), ((n / kDqBufs) - 1) & 1);
      DqReduction::stage(sm, acc, p.scale, b, warp, wg, lane);
      fence_proxy_async_shared();  // the stores -> the bulk reduction (async proxy)
      __syncwarp();
      if (lane == 0) mbar_arrive(sm.dqfull(b));
    } else {
#pragma unroll
      for (int i = 0; i < 32; ++i) pend[i] = acc[i] * p.scale;
      pending_dq_t0 = t0;
    }
    // The next dS^T goes to the other buffer, whose dQ reads both warpgroups finished before this step's
    // named barrier; the one after reuses this buffer only past the next step's barrier.
  }
  if constexpr (!kDqTma) add_dq(pending_dq_t0);

  // ---- consumers: the dK / dV epilogue
  const int k_end = L.major_start[tile + 1];
  if (kDqTma && w.dkdv_tma) {
    BwdWsEpilogue<kStages, kDqBufs>::reduce_by_tma(w, sm, dk, dv, k0, k_end, key_lo, kvh, warp, wg, lane);
    return;
  }
  bwd_store_dkdv<D>(args, dk, dv, key_lo, k_end, kvh, lane);
}

template <int kStages, int kDqBufs, DType E>
void launch(const BwdWsArgs& w, int64_t blocks, cudaStream_t stream) {
  auto* kernel = attention_bwd_ws_kernel<kStages, kDqBufs, E>;
  constexpr int smem = bwd_ws_smem<kStages, kDqBufs>();
  static_assert(smem <= 227 * 1024, "ws backward: shared memory");
  check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem),
             "attention_backward (ws): shared memory limit");
  kernel<<<static_cast<unsigned>(blocks), kBwsThreads, smem, stream>>>(w);
  check_cuda(cudaGetLastError(), "attention_backward (ws): launch");
}

}  // namespace

// SMs of the current device (cached per device: the attribute query is not free at every launch)
int sm_count() {
  static std::atomic<int> cached[64] = {};
  int dev = 0;
  check_cuda(cudaGetDevice(&dev), "attention kernels: device");
  const bool cacheable = dev >= 0 && dev < 64;
  int n = cacheable ? cached[dev].load(std::memory_order_relaxed) : 0;
  if (n == 0) {
    check_cuda(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev), "attention kernels: SM count");
    if (cacheable) cached[dev].store(n, std::memory_order_relaxed);
  }
  return n;
}

bool launch_bwd_ws_d128(const BwdArgs& a, cudaStream_t stream, const BwdWsConfig& config) {
  if (a.p.head_dim != kBwsD || kBwsRows % a.group != 0 || a.lists.minor_tile_rows * a.group != kBwsRows ||
      encode_tiled() == nullptr)
    return false;
  const int64_t blocks = static_cast<int64_t>(a.lists.num_major) * a.p.hkv;
  if (blocks == 0) return true;
  constexpr const char* kWho = "attention_backward (ws)";
  BwdWsArgs w;
  w.a = a;
  const auto box_rows = static_cast<uint32_t>(kBwsRows / a.group);
  w.tq = tensor_map_d128(kWho, a.p.dtype, a.p.q, a.q_rows, a.p.hq, a.p.q_row_stride, a.p.q_head_stride,
                         static_cast<uint32_t>(a.group), box_rows);
  w.tdo = tensor_map_d128(kWho, a.p.dtype, a.p.d_o, a.q_rows, a.p.hq, a.p.o_row_stride, a.p.o_head_stride,
                          static_cast<uint32_t>(a.group), box_rows);
  w.tk = tensor_map_d128(kWho, a.p.dtype, a.p.k, a.kv_rows, a.p.hkv, a.p.k_row_stride, a.p.k_head_stride, 1, kBwsKeys);
  w.tv = tensor_map_d128(kWho, a.p.dtype, a.p.v, a.kv_rows, a.p.hkv, a.p.v_row_stride, a.p.v_head_stride, 1, kBwsKeys);
  w.first_wave = config.walk == BwdWsWalk::kReversed  ? INT32_MAX
                 : config.walk == BwdWsWalk::kForward ? 0
                                                      : sm_count();
  w.by_segment = config.segment_order ? 1 : 0;
  w.skip_idle = config.skip_idle ? 1 : 0;
  w.dkdv_tma = 0;
  if (w.by_segment && a.lists.segment_order == nullptr)
    fail("attention_backward (ws): the segment order was asked for but the key-major lists have none");
  // the TMA reduction needs a 16-byte aligned dQ with strides of whole 16-byte units
  const bool dq_tma = config.dq_by_tma && reinterpret_cast<uintptr_t>(a.p.dq) % 16 == 0 && a.p.dq_row_stride % 4 == 0 &&
                      a.p.dq_head_stride % 4 == 0;
  if (dq_tma) {
    w.tdq = tensor_map_3d(kWho, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, a.p.dq, a.q_rows, a.p.hq, a.p.dq_row_stride,
                          a.p.dq_head_stride, 32, static_cast<uint32_t>(a.group), box_rows);
    // dK and dV by TMA reductions under the same alignment conditions (they share their strides)
    if (config.dkdv_by_tma && reinterpret_cast<uintptr_t>(a.p.dk) % 16 == 0 &&
        reinterpret_cast<uintptr_t>(a.p.dv) % 16 == 0 && a.p.dk_row_stride % 4 == 0 && a.p.dk_head_stride % 4 == 0) {
      w.tdk = tensor_map_3d(kWho, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, a.p.dk, a.kv_rows, a.p.hkv, a.p.dk_row_stride,
                            a.p.dk_head_stride, 32, 1, 64);
      w.tdv = tensor_map_3d(kWho, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, a.p.dv, a.kv_rows, a.p.hkv, a.p.dk_row_stride,
                            a.p.dk_head_stride, 32, 1, 64);
      w.dkdv_tma = 1;
    }
    with_dtype(a.p.dtype, [&](auto e) { launch<2, 2, decltype(e)::value>(w, blocks, stream); });
  } else {
    with_dtype(a.p.dtype, [&](auto e) { launch<2, 0, decltype(e)::value>(w, blocks, stream); });
  }
  return true;
}

}  // namespace treecp::cuda::detail
