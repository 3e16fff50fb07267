// The wgmma forward with warp specialisation, the default at head dim 128 (Mainloop::kWgmmaWs). Warpgroup 2
// holds a single producer thread that loads Q once and the run list's K/V tiles with TMA into a
// four-stage ring (mbarriers with transaction counts); warpgroups 0 and 1 (240 registers through
// setmaxnreg) only compute, each on its 64 rows, with no block barrier: a warpgroup waits for its
// stage to be full and releases it once its P V has retired. Same tile lists, masks, online softmax
// and epilogue as attention_fwd_wgmma.cuh (its fwd_* helpers); by default (FwdWsConfig::kDefault) O leaves through
// shared memory and TMA stores. Needs head dim 128, G dividing 128 (Q's TMA box is 64 columns x G heads x 128 / G
// tokens), 16-byte aligned rows.
//
// The kernels and launch_fwd_ws<C> for any FwdWsConfig (launch.hpp). attention_fwd_ws.cu instantiates the library's
// two configs; bench/cuda/bench_attention.cu includes this header to time the others beside them. The kernels live in
// an unnamed namespace: each translation unit that includes this header gets its own instantiations.
#pragma once

#include <algorithm>
#include <cfloat>
#include <type_traits>

#include "core/error.hpp"
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
  unsigned long long* trace;  // kTrace: kFwdTraceWords clock64 stamps per block (launch.hpp), else null
  int* counter;               // the persistent kernel's workspace: its next item (zeroed by the launch), then scratch
};

constexpr int kWsD = 128, kWsRows = 128, kWsKeys = 64, kWsStages = 4;
constexpr int kWsThreads = 384;  // two consumer warpgroups, then the producer's
constexpr int kWsSmem = (kWsRows + 2 * kWsStages * kWsKeys) * kWsD * 2 + 8 * (1 + 2 * kWsStages) + 1024;

__device__ __forceinline__ unsigned long long globaltimer() {  // kTrace: nanoseconds
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// The producer's K/V loads for the runs [e_begin, e_end) of an item (the first run from tile `first`), KV head kvh:
// tile n (counted across the block's items: the ring runs on) goes to stage n % kWsStages once the consumers have
// released that stage's previous tile; full / empty are the stages' mbarriers. on_tile(n) runs before each tile.
template <class Full, class Empty, class OnTile>
__device__ __forceinline__ void fwd_ws_load_runs(const FwdWsArgs& w, uint32_t sK, uint32_t sV, Full full, Empty empty,
                                                 int e_begin, int first, int e_end, int kvh, int& n, OnTile on_tile) {
  constexpr int D = kWsD, BN = kWsKeys;
  const auto& L = w.a.lists;
  for (RunCursor cur{e_begin, first}; cur.entry < e_end; ++n, cur = cur.next(L.entries, e_end)) {
    const int s = n % kWsStages;
    on_tile(n);
    if (n >= kWsStages) mbar_wait(empty(s), ((n / kWsStages) - 1) & 1);
    mbar_expect_tx(full(s), 2 * BN * D * 2);
    const int k0 = L.minor_start[cur.tile];  // BN rows from the tile's start, whatever its length
    for (int pnl = 0; pnl < D / 64; ++pnl) {
      tma_load_3d(sK + s * BN * D * 2 + pnl * BN * 128, &w.tk, pnl * 64, kvh, k0, full(s));
      tma_load_3d(sV + s * BN * D * 2 + pnl * BN * 128, &w.tv, pnl * 64, kvh, k0, full(s));
    }
  }
}

// A consumer thread's two packed rows of its warpgroup's accumulators (row[h]: warp * 16 + lane / 4 + 8 h) and their
// tokens, first + row[h] / G.
__device__ __forceinline__ void fwd_ws_rows(int warp, int lane, int G, int first, int (&row)[2], int (&tok)[2]) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    row[h] = warp * 16 + lane / 4 + 8 * h;
    tok[h] = first + row[h] / G;
  }
}

// kQReg: Q in registers (ldmatrix once per block) as the A operand of S = Q K^T, so that GEMM reads only K
// from shared memory (half its operand traffic); costs 32 of the consumers' 240 registers.
// kOverlap: FA3's intra-warpgroup overlap. Tile n issues S(n) and then P V of tile n - 1; it waits only
// for S(n), and its mask and softmax run while P V(n - 1) is still on the tensor cores. O is rescaled
// once that P V has retired, and tile n's P goes to a second set of A registers.
// kTmaO: the epilogue writes each warpgroup's normalised O rows into its own rows of the Q buffer (free once Q is
// in registers or the last S GEMM has retired) and one thread stores them with two TMA boxes, instead of 32
// four-byte global stores per thread (8 rows x 16 bytes per warp instruction).
// kTrace (bench only): stamps of the block's phases (FwdWsConfig::trace names them).
template <bool kQReg, bool kOverlap, bool kTmaO = false, bool kTrace = false, DType E = DType::kBf16>
__global__ void __launch_bounds__(kWsThreads, 1) attention_fwd_ws_kernel(const __grid_constant__ FwdWsArgs w) {
  constexpr int D = kWsD, BM = kWsRows, BN = kWsKeys;
  unsigned long long* trace = kTrace ? w.trace + static_cast<size_t>(blockIdx.x) * kFwdTraceWords : nullptr;
  auto stamp = [&](int slot) {
    if constexpr (kTrace) trace[slot] = clock64();
  };
  if constexpr (kTrace) {
    if (threadIdx.x == 0) {
      stamp(1);
      trace[11] = globaltimer();
      unsigned sm;
      asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
      trace[0] = sm;
    }
  }
  const FwdArgs& args = w.a;
  unsigned char* base = dynamic_smem_1024();
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
    stamp(8);
    const RunCursor first = RunCursor::first(L.entries, L.offsets[tile], e_end);
    int n = 0;
    fwd_ws_load_runs(w, sK, sV, full, empty, first.entry, first.tile, e_end, kvh, n, [&](int t) {
      if (t == 1) stamp(9);  // the first K/V tile's loads are issued
    });
    return;
  }
  setmaxnreg_inc<240>();

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int wg = warp / 4;
  int row[2], tok[2];
  fwd_ws_rows(warp, lane, G, t0, row, tok);
  float o[D / 2];
#pragma unroll
  for (int i = 0; i < D / 2; ++i) o[i] = 0.f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  const float sl2 = p.scale * kLog2e;
  const uint32_t q16 = (sQ + wg * 64 * 128) >> 4, k16 = sK >> 4, v16 = sV >> 4;
  constexpr uint32_t kStage16 = BN * D * 2 / 16;
  mbar_wait(qfull, 0);
  if (threadIdx.x == 0) stamp(2);
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
    if (n == 0 && threadIdx.x == 0) stamp(10);
    const uint32_t ks16 = k16 + s * kStage16, vs16 = v16 + s * kStage16;
    float sc[BN / 2];
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      const uint32_t off = (kk % 4) * 32;
      if constexpr (kQReg)
        wgmma_rs_m64n64k16_kmajor<E>(sc, qf[kk], wgmma_desc16<16, 1024>(ks16 + ((kk / 4) * BN * 128 + off) / 16), kk > 0);
      else
        wgmma_ss_m64n64k16<false, false, E>(sc, wgmma_desc16<16, 1024>(q16 + ((kk / 4) * BM * 128 + off) / 16),
                                         wgmma_desc16<16, 1024>(ks16 + ((kk / 4) * BN * 128 + off) / 16), kk > 0);
    }
    wgmma_commit();
    if constexpr (kOverlap) {
      if (n > 0) fwd_issue_pv<D, BN, E>(o, pa, prev_vs16);
      wgmma_commit();
      wgmma_wait<1>();  // S(n) only: P V(n - 1) stays in flight under the softmax
    } else {
      wgmma_wait<0>();
    }
    wgmma_fence_operands(sc);
    if (n == 0 && threadIdx.x == 0) stamp(3);

    float corrs[2];
    const bool rescale = fwd_tile_softmax<BN>(sc, args, cur, lane, tok, m, l, sl2, corrs);
    uint32_t pn[BN / 16][4];  // this tile's P
    fwd_pack_p<BN, E>(sc, pn);
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
    fwd_pv_waited<D, BN, E>(o, pa, vs16);
    __syncwarp();
    if (lane == 0) mbar_arrive(empty(s));  // this warp's reads of stage s are done
    cur = cur.next(L.entries, e_end);
  }
  if constexpr (kOverlap) {
    if (n > 0) fwd_pv_waited<D, BN, E>(o, pa, prev_vs16);  // the last tile's P V
  }
  if (threadIdx.x == 0) {
    stamp(4);
    if constexpr (kTrace) trace[6] = n;
  }

  if constexpr (kTmaO) {
    fwd_stage_o_lse<D, E>(args, o, m, l, row, tok, kvh, lane, sQ, BM);
    fence_proxy_async_shared();                    // the staged rows -> the TMA store (async proxy)
    named_barrier_sync(1 + wg, 128);               // this warpgroup's 64 rows are staged
    if (threadIdx.x % 128 == 0) {
#pragma unroll
      for (int pnl = 0; pnl < D / 64; ++pnl)
        tma_store_3d(&w.to, pnl * 64, kvh * G, t0 + wg * (64 / G), sQ + pnl * BM * 128 + wg * 64 * 128);
      bulk_commit_group();
      bulk_wait_group_read0();  // shared memory stays until the stores have read it
      stamp(threadIdx.x == 0 ? 5 : 7);
      if constexpr (kTrace)
        if (threadIdx.x == 0) trace[12] = globaltimer();
    }
  } else {
    fwd_store_o_lse<D, E>(args, o, m, l, row, tok, kvh, lane);
  }
}


// The persistent form: one block per SM takes items (query tile, KV head) in the order of the one-block-per-item
// grid, blockIdx.x first, then one at a time from a global counter, so an SM that finishes early takes the next.
// The producer walks the items back to back: it publishes each item in the block's global scratch (below) with its Q
// load (one Q buffer, refilled once the consumers hold Q in registers) and the K/V ring runs on across items, so the next
// item's Q and first tiles are loaded under the current one's last steps. The consumers carry the overlap
// across the item boundary: a new item's first S GEMM is issued with the previous item's last P V, and the
// previous item's epilogue runs once that P V has retired, its O staged in a buffer of its own and stored by TMA
// without waiting (the next epilogue first waits for that store to have read the buffer).
// Volatile 16-byte global accesses (the persistent forward's scratch, rewritten while the kernel runs).
__device__ __forceinline__ void st_volatile(int4* p, int4 v) {
  asm volatile("st.volatile.global.v4.s32 [%0], {%1, %2, %3, %4};\n" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}
__device__ __forceinline__ int4 ld_volatile(const int4* p) {
  int4 v;
  asm volatile("ld.volatile.global.v4.s32 {%0, %1, %2, %3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p)
               : "memory");
  return v;
}

// O = 0 and LSE = -inf for this thread's rows of an item with no visible key (their part of fwd_store_o_lse).
__device__ __forceinline__ void fwd_store_empty(const FwdArgs& args, const int (&row)[2], const int (&tok)[2], int kvh,
                                                int lane) {
  const AttentionForwardParams& p = args.p;
  const int G = args.group;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    if (row[h] >= args.lists.major_tile_rows * G || tok[h] >= args.q_rows) continue;
    const int head = kvh * G + row[h] % G;
    auto* dst = static_cast<uint16_t*>(p.o) + tok[h] * p.o_row_stride + head * p.o_head_stride + 2 * (lane % 4);
#pragma unroll
    for (int j = 0; j < kWsD / 8; ++j) *reinterpret_cast<uint32_t*>(dst + j * 8) = 0u;
    if (lane % 4 == 0) p.lse[tok[h] * p.lse_row_stride + head * p.lse_head_stride] = -INFINITY;
  }
}

constexpr int kWspSmem = (2 * kWsRows + 2 * kWsStages * kWsKeys) * kWsD * 2 + 8 * (4 + 2 * kWsStages) + 1024;

// kPrefetch (FwdWsConfig::prefetch): the producer publishes each item one item ahead, into two alternating slots of the
// block's scratch with an mbarrier per slot (itemfull), and the consumers read item j + 1 during item j's first step,
// so that the read's L2 round trip is off the item boundary. Without it the item is read at the boundary.
// kHeld (FwdWsConfig::softmax): 1, the held-offset softmax (fwd_tile_p_held) after each item's first step; 2 (the
// default, kPersistent): with P packed before the guard's vote.
template <bool kPrefetch, int kHeld = 0, DType E = DType::kBf16>
__global__ void __launch_bounds__(kWsThreads, 1) attention_fwd_ws_persistent_kernel(const __grid_constant__ FwdWsArgs w) {
  constexpr int D = kWsD, BM = kWsRows, BN = kWsKeys;
  const FwdArgs& args = w.a;
  unsigned char* base = dynamic_smem_1024();
  const uint32_t sQ = smem_addr(base);
  const uint32_t sO = sQ + BM * D * 2;                  // the epilogue's staging panels
  const uint32_t sK = sO + BM * D * 2;                  // [stage][BN x D panels]
  const uint32_t sV = sK + kWsStages * BN * D * 2;      // [stage][BN x D panels]
  // qfull, qempty, full[kWsStages], empty[kWsStages], kPrefetch: itemfull[2]
  const uint32_t bars = sV + kWsStages * BN * D * 2;
  const uint32_t qfull = bars, qempty = bars + 8;
  auto full = [&](int s) { return bars + 16 + 8 * s; };
  auto empty = [&](int s) { return bars + 16 + 8 * kWsStages + 8 * s; };
  auto itemfull = [&](int i) { return bars + 16 + 16 * kWsStages + 8 * (i & 1); };  // item i's slot, phase (i / 2) & 1

  const AttentionForwardParams& p = args.p;
  const auto& L = args.lists;
  const int G = args.group;

  if (threadIdx.x == 0) {
    mbar_init(qfull, 1);
    mbar_init(qempty, 8);  // lane 0 of each consumer warp, once it holds Q and has read the item
    for (int s = 0; s < kWsStages; ++s) {
      mbar_init(full(s), 1);
      mbar_init(empty(s), 8);
    }
    if constexpr (kPrefetch) {
      mbar_init(itemfull(0), 1);
      mbar_init(itemfull(1), 1);
    }
    mbar_init_fence();
  }
  __syncthreads();

  // Without kPrefetch the item reaches the consumers through this block's first 32 bytes of global scratch: the producer
  // writes it, then arrives on qfull (with Q's bytes, or alone for the end mark: tile -1); a consumer reads it once
  // that phase has completed (the mbarrier's release and acquire order the global accesses as well), and arrives on
  // qempty once it holds Q in registers and has read the scratch, before the producer rewrites either. (Shared memory
  // here would be ordered by the same mbarriers, which compute-sanitizer's racecheck does not follow.)
  int4* scratch = reinterpret_cast<int4*>(w.counter) + 2 + 4 * blockIdx.x;  // kPrefetch: item i in scratch + 2 (i % 2)
  if (threadIdx.x >= 256) {
    setmaxnreg_dec<24>();
    if (threadIdx.x != 256) return;
    const int items = L.num_major * p.hkv;
    int n = 0;  // K/V tiles loaded so far, all items: the ring runs across them
    auto load_runs = [&](int e_begin, int first, int e_end, int kvh) {
      fwd_ws_load_runs(w, sK, sV, full, empty, e_begin, first, e_end, kvh, n, [](int) {});
    };
    if constexpr (kPrefetch) {
      // item i's words into its slot, then its itemfull phase (the release orders the stores before it)
      auto publish = [&](int i, int item) {
        int4* slot = scratch + 2 * (i & 1);
        if (item >= items) {
          st_volatile(slot, make_int4(-1, 0, 0, 0));
        } else {
          const int tile = L.order[item / p.hkv];
          const int e_begin = L.offsets[tile], e_end = L.offsets[tile + 1];
          st_volatile(slot, make_int4(tile, item % p.hkv, e_begin, e_end));
          st_volatile(slot + 1, make_int4(e_begin < e_end ? L.entries[e_begin].tile_begin : 0, item, 0, 0));
        }
        mbar_arrive(itemfull(i));
      };
      publish(0, blockIdx.x);
      for (int j = 0;; ++j) {
        if (j > 0) mbar_wait(qempty, (j - 1) & 1);  // the consumers hold Q(j - 1) and have read item j + 1's slot's last
        const int4 q = ld_volatile(scratch + 2 * (j & 1));  // this thread's own words for item j
        if (q.x < 0) break;
        mbar_expect_tx(qfull, BM * D * 2);
        for (int pnl = 0; pnl < D / 64; ++pnl)
          tma_load_3d(sQ + pnl * BM * 128, &w.tq, pnl * 64, q.y * G, q.x * L.major_tile_rows, qfull);
        publish(j + 1, atomicAdd(w.counter, 1) + static_cast<int>(gridDim.x));
        const int4 it = ld_volatile(scratch + 2 * (j & 1));  // again: fewer live registers across publish (24 here)
        const int first = ld_volatile(scratch + 2 * (j & 1) + 1).x;
        const int kvh = it.y, e_begin = it.z, e_end = it.w;
        load_runs(e_begin, first, e_end, kvh);
      }
      return;
    }
    int item = blockIdx.x;
    for (int j = 0;; ++j) {
      if (j > 0) mbar_wait(qempty, (j - 1) & 1);
      if (item >= items) {
        st_volatile(scratch, make_int4(-1, 0, 0, 0));
        mbar_arrive(qfull);
        break;
      }
      const int tile = L.order[item / p.hkv], kvh = item % p.hkv;
      const int e_begin = L.offsets[tile], e_end = L.offsets[tile + 1];
      const int first = e_begin < e_end ? L.entries[e_begin].tile_begin : 0;
      const int next = atomicAdd(w.counter, 1) + static_cast<int>(gridDim.x);  // used after this item's loads
      st_volatile(scratch, make_int4(tile, kvh, e_begin, e_end));
      st_volatile(scratch + 1, make_int4(first, item, 0, 0));
      mbar_expect_tx(qfull, BM * D * 2);
      for (int pnl = 0; pnl < D / 64; ++pnl)
        tma_load_3d(sQ + pnl * BM * 128, &w.tq, pnl * 64, kvh * G, tile * L.major_tile_rows, qfull);
      load_runs(e_begin, first, e_end, kvh);
      item = next;
    }
    return;
  }
  setmaxnreg_inc<240>();

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int wg = warp / 4;
  int row[2], rq[2];
  fwd_ws_rows(warp, lane, G, 0, row, rq);
  float o[D / 2];
#pragma unroll
  for (int i = 0; i < D / 2; ++i) o[i] = 0.f;
  const float sl2 = p.scale * kLog2e;
  const uint32_t k16 = sK >> 4, v16 = sV >> 4;
  constexpr uint32_t kStage16 = BN * D * 2 / 16;

  // The previous item's epilogue: O / l into this warpgroup's rows of sO, then two TMA boxes from one thread.
  auto epilogue = [&](const float(&m)[2], const float(&l)[2], const int(&tok)[2], int kvh, int t0) {
    if (threadIdx.x % 128 == 0) bulk_wait_group_read0();  // the last store has read sO
    named_barrier_sync(1 + wg, 128);
    float sum[2];
    fwd_quad_sums(l, sum);
    fwd_stage_o<D, E>(o, sum, row, lane, sO, BM);
    fence_proxy_async_shared();
    named_barrier_sync(1 + wg, 128);
    if (threadIdx.x % 128 == 0) {
#pragma unroll
      for (int pnl = 0; pnl < D / 64; ++pnl)
        tma_store_3d(&w.to, pnl * 64, kvh * G, t0 + wg * (64 / G), sO + pnl * BM * 128 + wg * 64 * 128);
      bulk_commit_group();
    }
    fwd_store_lse(args, m, sum, row, tok, kvh, lane);
  };

  uint32_t qf[D / 16][4], pa[BN / 16][4];
  bool pending = false;  // P V of step n - 1 (pa, stage prev_s) is still to be issued
  bool due = false;      // the previous item's epilogue is due once that P V has retired
  float pm[2], pl[2];    // the previous item's row max and sum, its tokens, head and first token
  int ptok[2], pkvh = 0, pt0 = 0;
  int prev_s = 0, n = 0;
  uint32_t prev_vs16 = 0;
  auto flush = [&] {  // the pending P V, then the previous item's epilogue
    if (pending) {
      fwd_pv_waited<D, BN, E>(o, pa, prev_vs16);
      __syncwarp();
      if (lane == 0) mbar_arrive(empty(prev_s));
      pending = false;
    }
    if (due) {
      epilogue(pm, pl, ptok, pkvh, pt0);
      due = false;
    }
  };
  // kPrefetch: this item's words (read during the previous item's first step) and the next item's
  int4 item = make_int4(0, 0, 0, 0), item2 = item, next_item = item, next_item2 = item;
  auto read_next = [&](int j) {  // item j + 1's words, once published
    mbar_wait(itemfull(j + 1), ((j + 1) >> 1) & 1);
    next_item = ld_volatile(scratch + 2 * ((j + 1) & 1));
    next_item2 = ld_volatile(scratch + 2 * ((j + 1) & 1) + 1);
  };
  if constexpr (kPrefetch) {
    read_next(-1);
    item = next_item;
    item2 = next_item2;
  }
  for (int j = 0;; ++j) {
    if constexpr (kPrefetch) {
      if (item.x < 0) break;
      mbar_wait(qfull, j & 1);
    } else {
      mbar_wait(qfull, j & 1);
      item = ld_volatile(scratch);       // tile (-1: no more), KV head, runs [begin, end)
      item2 = ld_volatile(scratch + 1);  // the first run's first tile, the item's index
      if (item.x < 0) break;
    }
    const int tile = item.x, kvh = item.y, e_begin = item.z, e_end = item.w;
    {
      const int mi = lane / 8, rr = wg * 64 + (warp % 4) * 16 + (mi % 2) * 8 + lane % 8;
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        const int chunk = (kk % 4) * 2 + mi / 2;
        ldmatrix_x4(qf[kk], sQ + (kk / 4) * BM * 128 + rr * 128 + ((chunk ^ (rr % 8)) << 4));
      }
    }
    __syncwarp();
    if (lane == 0) mbar_arrive(qempty);
    const int t0 = tile * L.major_tile_rows;
    const int tok[2] = {t0 + rq[0], t0 + rq[1]};
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
    if (e_begin == e_end) {  // no visible key: O = 0 and LSE = -inf, stored directly; pending work stays pending
      fwd_store_empty(args, row, tok, kvh, lane);
      if constexpr (kPrefetch) {
        read_next(j);
        item = next_item;
        item2 = next_item2;
      }
      continue;
    }
    // One step; the item's first (kFirst) may find no P V pending (the block's first item) and does the previous
    // item's epilogue. The loop over the other steps holds neither, like the one-block-per-item kernel's.
    RunCursor cur{e_begin, item2.x};
    bool held = false;  // kHeld: every row of the warp has its offset
    auto step = [&](auto first) {
      constexpr bool kFirst = decltype(first)::value;
      const int s = n % kWsStages;
      mbar_wait(full(s), (n / kWsStages) & 1);
      const uint32_t ks16 = k16 + s * kStage16, vs16 = v16 + s * kStage16;
      float sc[BN / 2];
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk)
        wgmma_rs_m64n64k16_kmajor<E>(sc, qf[kk],
                                     wgmma_desc16<16, 1024>(ks16 + ((kk / 4) * BN * 128 + (kk % 4) * 32) / 16), kk > 0);
      wgmma_commit();
      if (!kFirst || pending) fwd_issue_pv<D, BN, E>(o, pa, prev_vs16);
      wgmma_commit();
      if constexpr (kPrefetch && kFirst) read_next(j);  // under the GEMMs; used at the next item's start
      wgmma_wait<1>();  // S(n) only: P V(n - 1), maybe the previous item's last, stays in flight under the softmax
      wgmma_fence_operands(sc);
      float corrs[2] = {1.f, 1.f};
      bool rescale;
      uint32_t pn[BN / 16][4];
      if constexpr (kHeld) {
        rescale = fwd_tile_p_held<BN, kHeld == 2, E>(sc, args, cur, lane, tok, m, l, sl2, corrs, held, pn);
      } else {
        rescale = fwd_tile_softmax<BN>(sc, args, cur, lane, tok, m, l, sl2, corrs);
        fwd_pack_p<BN, E>(sc, pn);
      }
      wgmma_wait<0>();
      wgmma_fence_operands(o);
      wgmma_fence_operands(pa);
      if (!kFirst || pending) {
        __syncwarp();
        if (lane == 0) mbar_arrive(empty(prev_s));
      }
      if constexpr (kFirst) {
        if (due) {  // O holds the previous item's result; this step's corrs are 0 (m was -inf)
          epilogue(pm, pl, ptok, pkvh, pt0);
          due = false;
        }
      }
      fwd_rescale_o<D>(o, rescale, corrs);
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk)
#pragma unroll
        for (int c = 0; c < 4; ++c) pa[kk][c] = pn[kk][c];
      pending = true;
      prev_s = s;
      prev_vs16 = vs16;
      cur = cur.next(L.entries, e_end);
      ++n;
    };
    step(std::true_type{});
    while (cur.entry < e_end) step(std::false_type{});
    if constexpr (kPrefetch) {
      item = next_item;
      item2 = next_item2;
    }
    due = true;  // this item's last P V is pending
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      pm[h] = m[h];
      pl[h] = l[h];
      ptok[h] = tok[h];
    }
    pkvh = kvh;
    pt0 = t0;
  }
  flush();
  if (threadIdx.x % 128 == 0) bulk_wait_group_read0();  // shared memory stays until the last store has read it
}


// Launches config C (FwdWsConfig's fields choose the kernel and its template arguments); false when the kernel does
// not apply (launch_fwd_ws_d128 in launch.hpp says when). `trace`: C.trace's stamps; `counter`: C.persistent's
// workspace. E: the element type (a.p.dtype must be it).
template <FwdWsConfig C, DType E = DType::kBf16>
bool launch_fwd_ws(const FwdArgs& a, cudaStream_t stream, unsigned long long* trace, int* counter) {
  static_assert(!C.persistent || (C.q_in_registers && C.overlap && C.o_by_tma && !C.trace),
                "the persistent forward holds Q in registers, overlaps, stores O by TMA and has no trace");
  static_assert(C.persistent || (C.prefetch && C.softmax == FwdWsSoftmax::kOnline),
                "one block per item: no item to prefetch, the online softmax only");
  if (a.p.head_dim != kWsD || kWsRows % a.group != 0 || encode_tiled() == nullptr) return false;
  const int64_t blocks = static_cast<int64_t>(a.lists.num_major) * a.p.hkv;
  if (blocks == 0) return true;
  constexpr const char* kWho = "attention_forward (ws)";
  FwdWsArgs w;
  w.a = a;
  w.trace = trace;
  w.counter = counter;
  w.tq = tensor_map_d128(kWho, E, a.p.q, a.q_rows, a.p.hq, a.p.q_row_stride, a.p.q_head_stride, static_cast<uint32_t>(a.group),
                    static_cast<uint32_t>(kWsRows / a.group));
  w.tk = tensor_map_d128(kWho, E, a.p.k, a.kv_rows, a.p.hkv, a.p.k_row_stride, a.p.k_head_stride, 1, kWsKeys);
  w.tv = tensor_map_d128(kWho, E, a.p.v, a.kv_rows, a.p.hkv, a.p.v_row_stride, a.p.v_head_stride, 1, kWsKeys);
  if constexpr (C.o_by_tma)
    w.to = tensor_map_d128(kWho, E, a.p.o, a.q_rows, a.p.hq, a.p.o_row_stride, a.p.o_head_stride,
                           static_cast<uint32_t>(a.group), static_cast<uint32_t>(64 / a.group));
  if constexpr (C.persistent) {
    require(counter != nullptr, kWho, ": the persistent forward needs a counter");
    check_cuda(cudaMemsetAsync(counter, 0, sizeof(int), stream), "attention_forward (ws): zero the item counter");
    auto* pk = attention_fwd_ws_persistent_kernel<C.prefetch, static_cast<int>(C.softmax), E>;
    check_cuda(cudaFuncSetAttribute(pk, cudaFuncAttributeMaxDynamicSharedMemorySize, kWspSmem),
               "attention_forward (ws): shared memory limit");
    const unsigned grid = static_cast<unsigned>(std::min<int64_t>(blocks, sm_count()));
    pk<<<grid, kWsThreads, kWspSmem, stream>>>(w);
  } else {
    require(!C.trace || trace != nullptr, kWho, ": the traced forward needs a trace buffer");
    auto* kernel = attention_fwd_ws_kernel<C.q_in_registers, C.overlap, C.o_by_tma, C.trace, E>;
    check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kWsSmem),
               "attention_forward (ws): shared memory limit");
    kernel<<<static_cast<unsigned>(blocks), kWsThreads, kWsSmem, stream>>>(w);
  }
  check_cuda(cudaGetLastError(), "attention_forward (ws): launch");
  return true;
}

}  // namespace
}  // namespace treecp::cuda::detail
