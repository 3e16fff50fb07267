// The wgmma forward with warp specialisation, the default at head dim 128 (Mainloop::kWgmmaWs). Warpgroup 2
// holds a single producer thread that loads Q once and the run list's K/V tiles with TMA into a
// four-stage ring (mbarriers with transaction counts); warpgroups 0 and 1 (240 registers through
// setmaxnreg) only compute, each on its 64 rows, with no block barrier: a warpgroup waits for its
// stage to be full and releases it once its P V has retired. Same tile lists, masks, online softmax
// and epilogue as attention_fwd_wgmma.cuh (its fwd_* helpers); by default (FwdWsConfig::kDefault) O leaves through
// shared memory and TMA stores. Needs head dim 128, G dividing 128 (Q's TMA box is 64 columns x G heads x 128 / G
// tokens), 16-byte aligned rows.
//
// One kernel, attention_fwd_ws_kernel<C, E>, for any FwdWsConfig C (launch.hpp), made of parts: shared memory
// layout, producer, tile scheduler (one block per item or persistent: C.persistent), softmax and epilogue; and
// launch_fwd_ws<C>. attention_fwd_ws.cu instantiates the library's two configs; bench/cuda/bench_attention.cu
// includes this header to time the others beside them. The kernel lives in an unnamed namespace: each translation
// unit that includes this header gets its own instantiations.
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

__device__ __forceinline__ unsigned long long globaltimer() {  // kTrace: nanoseconds
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Volatile 16-byte global accesses (the persistent scheduler's scratch, rewritten while the kernel runs).
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

// A consumer thread's two packed rows of its warpgroup's accumulators (row[h]: warp * 16 + lane / 4 + 8 h) and their
// tokens, first + row[h] / G.
__device__ __forceinline__ void fwd_ws_rows(int warp, int lane, int G, int first, int (&row)[2], int (&tok)[2]) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    row[h] = warp * 16 + lane / 4 + 8 * h;
    tok[h] = first + row[h] / G;
  }
}

// This warp's 16 rows of Q (the Q buffer at sQ) into registers (ldmatrix), one A fragment of S = Q K^T per k16 step.
__device__ __forceinline__ void fwd_ws_load_q_regs(uint32_t sQ, int warp, int lane, uint32_t (&qf)[kWsD / 16][4]) {
  const int wg = warp / 4, mi = lane / 8, rr = wg * 64 + (warp % 4) * 16 + (mi % 2) * 8 + lane % 8;
#pragma unroll
  for (int kk = 0; kk < kWsD / 16; ++kk) {
    const int chunk = (kk % 4) * 2 + mi / 2;  // 16-byte chunk inside the 64-column panel kk / 4
    ldmatrix_x4(qf[kk], sQ + (kk / 4) * kWsRows * 128 + rr * 128 + ((chunk ^ (rr % 8)) << 4));
  }
}

// ---- Shared memory ------------------------------------------------------------------------------------------------

// Q (BM packed rows as two 64-column panels); kPersistent: sO, the epilogue's staging panels (one block per item
// stages O in Q's buffer instead); the K/V ring ([stage][BN x D panels] each); then the mbarriers qfull, kPersistent:
// qempty, full[kWsStages], empty[kWsStages], kPersistent: itemfull[2]. 1 KiB aligned (kBytes counts the bytes).
template <bool kPersistent>
struct FwdWsSmem {
  static constexpr int D = kWsD, BM = kWsRows, BN = kWsKeys;
  static constexpr int kQBars = kPersistent ? 2 : 1;  // qfull, qempty
  static constexpr uint32_t kO = kPersistent ? BM * D * 2 : 0, kK = kO + BM * D * 2, kV = kK + kWsStages * BN * D * 2,
                            kBars = kV + kWsStages * BN * D * 2;
  static constexpr int kBytes = kBars + 8 * (kQBars + 2 * kWsStages + (kPersistent ? 2 : 0)) + 1024;
  uint32_t sQ;  // the 1 KiB aligned base; the rest lie at fixed offsets from it

  __device__ __forceinline__ explicit FwdWsSmem(unsigned char* base) : sQ(smem_addr(base)) {}
  __device__ __forceinline__ uint32_t sO() const { return sQ + kO; }
  __device__ __forceinline__ uint32_t sK() const { return sQ + kK; }
  __device__ __forceinline__ uint32_t sV() const { return sQ + kV; }
  __device__ __forceinline__ uint32_t qfull() const { return sQ + kBars; }
  __device__ __forceinline__ uint32_t qempty() const { return sQ + kBars + 8; }  // kPersistent
  __device__ __forceinline__ uint32_t full(int s) const { return sQ + kBars + 8 * kQBars + 8 * s; }
  __device__ __forceinline__ uint32_t empty(int s) const { return sQ + kBars + 8 * kQBars + 8 * kWsStages + 8 * s; }
  // kPersistent with items published ahead: item i's slot, phase (i / 2) & 1
  __device__ __forceinline__ uint32_t itemfull(int i) const { return sQ + kBars + 16 + 16 * kWsStages + 8 * (i & 1); }
  // thread 0, before the block barrier
  template <bool kItemBars>
  __device__ __forceinline__ void init_barriers() const {
    mbar_init(qfull(), 1);
    if constexpr (kPersistent) mbar_init(qempty(), 8);  // lane 0 of each consumer warp, once it holds Q and the item
    for (int s = 0; s < kWsStages; ++s) {
      mbar_init(full(s), 1);
      mbar_init(empty(s), 8);  // lane 0 of each consumer warp
    }
    if constexpr (kItemBars) {
      mbar_init(itemfull(0), 1);
      mbar_init(itemfull(1), 1);
    }
    mbar_init_fence();
  }
};

// ---- Trace (bench only) -------------------------------------------------------------------------------------------

// kTrace: kFwdTraceWords clock64 stamps per block (FwdWsConfig::trace names them); else nothing.
template <bool kTrace>
struct FwdWsTrace {
  unsigned long long* words;
  __device__ __forceinline__ explicit FwdWsTrace(const FwdWsArgs& w)
      : words(kTrace ? w.trace + static_cast<size_t>(blockIdx.x) * kFwdTraceWords : nullptr) {}
  __device__ __forceinline__ void stamp(int slot) const {
    if constexpr (kTrace) words[slot] = clock64();
  }
  __device__ __forceinline__ void set(int slot, unsigned long long v) const {
    if constexpr (kTrace) words[slot] = v;
  }
  __device__ __forceinline__ void time(int slot) const {  // %globaltimer (ns)
    if constexpr (kTrace) words[slot] = globaltimer();
  }
  __device__ __forceinline__ void start() const {  // thread 0: the start, its %globaltimer and the SM
    if constexpr (kTrace) {
      stamp(1);
      words[11] = globaltimer();
      unsigned sm;
      asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
      words[0] = sm;
    }
  }
};

// ---- Producer -----------------------------------------------------------------------------------------------------

// Warpgroup 2's one thread: an item's Q, then its runs' K/V tiles into the ring.
template <bool kPersistent>
struct FwdWsProducer {
  static constexpr int D = kWsD, BM = kWsRows, BN = kWsKeys;
  const FwdWsArgs& w;
  const FwdWsSmem<kPersistent>& sm;

  // Q of KV head kvh (G query heads each) from token t0: its bytes announced on qfull (expect_q), then two 64-column
  // panels of packed rows (token t0 + r / G, head kvh G + r % G) from head0 = kvh G (issue_q). load_q does both; the
  // persistent producer computes head0 and t0 between them.
  __device__ __forceinline__ void expect_q() const { mbar_expect_tx(sm.qfull(), BM * D * 2); }
  __device__ __forceinline__ void issue_q(int head0, int t0) const {
    for (int pnl = 0; pnl < D / 64; ++pnl) tma_load_3d(sm.sQ + pnl * BM * 128, &w.tq, pnl * 64, head0, t0, sm.qfull());
  }
  __device__ __forceinline__ void load_q(int kvh, int G, int t0) const {
    expect_q();
    issue_q(kvh * G, t0);
  }
  // The K/V tiles of the runs [e_begin, e_end) (the first run from tile `first`), KV head kvh: tile n (counted across
  // the block's items: the ring runs on from one item to the next) goes to stage n % kWsStages once the consumers have
  // released that stage's previous tile. on_tile(n) runs before each tile.
  template <class OnTile>
  __device__ __forceinline__ void load_runs(int e_begin, int first, int e_end, int kvh, int& n, OnTile on_tile) const {
    const auto& L = w.a.lists;
    for (RunCursor cur{e_begin, first}; cur.entry < e_end; ++n, cur = cur.next(L.entries, e_end)) {
      const int s = n % kWsStages;
      on_tile(n);
      if (n >= kWsStages) mbar_wait(sm.empty(s), ((n / kWsStages) - 1) & 1);
      mbar_expect_tx(sm.full(s), 2 * BN * D * 2);
      const int k0 = L.minor_start[cur.tile];  // BN rows from the tile's start, whatever its length
      for (int pnl = 0; pnl < D / 64; ++pnl) {
        tma_load_3d(sm.sK() + s * BN * D * 2 + pnl * BN * 128, &w.tk, pnl * 64, kvh, k0, sm.full(s));
        tma_load_3d(sm.sV() + s * BN * D * 2 + pnl * BN * 128, &w.tv, pnl * 64, kvh, k0, sm.full(s));
      }
    }
  }
};

// ---- Tile schedulers ----------------------------------------------------------------------------------------------

// An item as the consumers take it: query tile (tile < 0: no more), KV head, its runs [e_begin, e_end) and the first
// run's first tile (the walk's start: the scheduler's cursor()).
struct FwdWsItem {
  int tile, kvh, e_begin, e_end, first, t0;  // t0: the tile's first token
};

// Each scheduler is the kernel's parameter for one form: produce() is the producer thread's walk over the block's
// items. The consumers call start() before the first item; next_item(j) gives them item j once its Q has landed
// (false: no more) and cursor() its walk's start; release_q(j) says they hold item j's Q in registers and have read
// the item; read_ahead(j) runs under item j's first GEMMs (or at once where the item is empty).

// One block per item (query tile, KV head): block b takes query tile L.order[b / hkv] (longest first) and KV head
// b % hkv.
struct FwdWsSingleTileScheduler {
  static constexpr bool kPersistent = false, kItemBars = false;
  using Smem = FwdWsSmem<false>;
  // the item: its query tile, KV head (with G query heads each), first token and the end of its runs
  int tile, kvh, G, t0, e_end;

  __device__ __forceinline__ explicit FwdWsSingleTileScheduler(const FwdWsArgs& w)
      : tile(w.a.lists.order[blockIdx.x / w.a.p.hkv]),
        kvh(blockIdx.x % w.a.p.hkv),
        G(w.a.group),
        t0(tile * w.a.lists.major_tile_rows),
        e_end(w.a.lists.offsets[tile + 1]) {}
  __device__ __forceinline__ RunCursor first(const FwdWsArgs& w) const {
    return RunCursor::first(w.a.lists.entries, w.a.lists.offsets[tile], e_end);
  }
  // The producer's walk: the item's Q, then its K/V.
  template <class Trace>
  __device__ __forceinline__ void produce(const FwdWsArgs& w, const FwdWsProducer<false>& producer, const Trace& trace) const {
    producer.load_q(kvh, G, t0);
    trace.stamp(8);
    const RunCursor c = first(w);
    int n = 0;
    producer.load_runs(c.entry, c.tile, e_end, kvh, n, [&](int t) {
      if (t == 1) trace.stamp(9);  // the first K/V tile's loads are issued
    });
  }
  // The consumers' one item (the kernel takes no second); its runs' start is read by cursor().
  __device__ __forceinline__ bool next_item(const FwdWsArgs&, const Smem& sm, int, FwdWsItem& it) const {
    mbar_wait(sm.qfull(), 0);
    it = FwdWsItem{tile, kvh, 0, e_end, 0, t0};
    return true;
  }
  __device__ __forceinline__ RunCursor cursor(const FwdWsArgs& w, const FwdWsItem&) const { return first(w); }
  __device__ __forceinline__ int token_base() const { return t0; }  // the consumers' rows hold the item's tokens
  __device__ __forceinline__ void start(const Smem&) const {}
  __device__ __forceinline__ void release_q(const Smem&, int, int) const {}  // Q's buffer is not refilled
  __device__ __forceinline__ void read_ahead(const Smem&, int) {}
};

// The persistent form: one block per SM takes items (query tile, KV head) in the order of the one-block-per-item
// grid, blockIdx.x first, then one at a time from a global counter, so an SM that finishes early takes the next.
// The producer walks the items back to back: it publishes each item in the block's global scratch (below) with its
// Q load (one Q buffer, refilled once the consumers hold Q in registers) and the K/V ring runs on across items, so
// the next item's Q and first tiles are loaded under the current one's last steps.
// Without kPrefetch the item reaches the consumers through this block's first 32 bytes of global scratch: the
// producer writes it, then arrives on qfull (with Q's bytes, or alone for the end mark: tile -1); a consumer reads it
// once that phase has completed (the mbarrier's release and acquire order the global accesses as well), and arrives
// on qempty once it holds Q in registers and has read the scratch, before the producer rewrites either. (Shared
// memory here would be ordered by the same mbarriers, which compute-sanitizer's racecheck does not follow.)
// kPrefetch (FwdWsConfig::prefetch): the producer publishes each item one item ahead, into two alternating slots of
// the block's scratch with an mbarrier each (itemfull), and the consumers read item j + 1 during item j's first
// step, so that the read's L2 round trip is off the item boundary. Without it the item is read at the boundary.
template <bool kPrefetch>
struct FwdWsPersistentScheduler {
  static constexpr bool kPersistent = true, kItemBars = kPrefetch;
  using Smem = FwdWsSmem<true>;
  static constexpr int D = kWsD, BM = kWsRows;
  int4* scratch;  // kPrefetch: item i in scratch + 2 (i % 2)
  int4 ahead = make_int4(0, 0, 0, 0), ahead2 = ahead;  // kPrefetch, the consumers: the next item's words

  __device__ __forceinline__ explicit FwdWsPersistentScheduler(const FwdWsArgs& w)
      : scratch(reinterpret_cast<int4*>(w.counter) + 2 + 4 * blockIdx.x) {}

  // The producer's walk over the block's items: each item's Q, then its K/V.
  template <class Trace>
  __device__ __forceinline__ void produce(const FwdWsArgs& w, const FwdWsProducer<true>& producer, const Trace&) const {
    const AttentionForwardParams& p = w.a.p;
    const auto& L = w.a.lists;
    const int G = w.a.group;
    const Smem& sm = producer.sm;
    int4* const scratch = this->scratch;
    const int items = L.num_major * p.hkv;
    int n = 0;  // K/V tiles loaded so far, all items: the ring runs across them
    auto load_runs = [&](int e_begin, int first, int e_end, int kvh) {
      producer.load_runs(e_begin, first, e_end, kvh, n, [](int) {});
    };
    if constexpr (kPrefetch) {
      // item i's words into its slot, then its itemfull phase (the release orders the stores before it)
      auto publish = [&](int i, int index) {
        int4* slot = scratch + 2 * (i & 1);
        if (index >= items) {
          st_volatile(slot, make_int4(-1, 0, 0, 0));
        } else {
          const int tile = L.order[index / p.hkv];
          const int e_begin = L.offsets[tile], e_end = L.offsets[tile + 1];
          st_volatile(slot, make_int4(tile, index % p.hkv, e_begin, e_end));
          st_volatile(slot + 1, make_int4(e_begin < e_end ? L.entries[e_begin].tile_begin : 0, index, 0, 0));
        }
        mbar_arrive(sm.itemfull(i));
      };
      publish(0, blockIdx.x);
      for (int j = 0;; ++j) {
        if (j > 0) mbar_wait(sm.qempty(), (j - 1) & 1);  // the consumers hold Q(j - 1) and have read item j + 1's slot's last
        const int4 q = ld_volatile(scratch + 2 * (j & 1));  // this thread's own words for item j
        if (q.x < 0) break;
        producer.expect_q();
        producer.issue_q(q.y * G, q.x * L.major_tile_rows);
        publish(j + 1, atomicAdd(w.counter, 1) + static_cast<int>(gridDim.x));
        const int4 it = ld_volatile(scratch + 2 * (j & 1));  // again: fewer live registers across publish (24 here)
        const int first = ld_volatile(scratch + 2 * (j & 1) + 1).x;
        const int kvh = it.y, e_begin = it.z, e_end = it.w;
        load_runs(e_begin, first, e_end, kvh);
      }
      return;
    }
    int index = blockIdx.x;
    for (int j = 0;; ++j) {
      if (j > 0) mbar_wait(sm.qempty(), (j - 1) & 1);
      if (index >= items) {
        st_volatile(scratch, make_int4(-1, 0, 0, 0));
        mbar_arrive(sm.qfull());
        break;
      }
      const int tile = L.order[index / p.hkv], kvh = index % p.hkv;
      const int e_begin = L.offsets[tile], e_end = L.offsets[tile + 1];
      const int first = e_begin < e_end ? L.entries[e_begin].tile_begin : 0;
      const int next = atomicAdd(w.counter, 1) + static_cast<int>(gridDim.x);  // used after this item's loads
      st_volatile(scratch, make_int4(tile, kvh, e_begin, e_end));
      st_volatile(scratch + 1, make_int4(first, index, 0, 0));
      producer.expect_q();
      producer.issue_q(kvh * G, tile * L.major_tile_rows);
      load_runs(e_begin, first, e_end, kvh);
      index = next;
    }
  }

  __device__ __forceinline__ int token_base() const { return 0; }  // the consumers add each item's first token
  // The consumers, before their first item: kPrefetch, item 0's words.
  __device__ __forceinline__ void start(const Smem& sm) { read_ahead(sm, -1); }
  // The consumers' item j: kPrefetch, as read ahead; else read once its qfull phase has completed.
  __device__ __forceinline__ bool next_item(const FwdWsArgs& w, const Smem& sm, int j, FwdWsItem& it) {
    int4 a, b;
    if constexpr (kPrefetch) {
      a = ahead;
      b = ahead2;
      if (a.x < 0) return false;
      mbar_wait(sm.qfull(), j & 1);
    } else {
      mbar_wait(sm.qfull(), j & 1);
      a = ld_volatile(scratch);      // tile (-1: no more), KV head, runs [begin, end)
      b = ld_volatile(scratch + 1);  // the first run's first tile, the item's index
      if (a.x < 0) return false;
    }
    it = FwdWsItem{a.x, a.y, a.z, a.w, b.x, a.x * w.a.lists.major_tile_rows};
    return true;
  }
  __device__ __forceinline__ RunCursor cursor(const FwdWsArgs&, const FwdWsItem& it) const {
    return RunCursor{it.e_begin, it.first};
  }
  // each consumer warp once it holds Q in registers and has read the item: the producer may refill either
  __device__ __forceinline__ void release_q(const Smem& sm, int, int lane) const {
    __syncwarp();
    if (lane == 0) mbar_arrive(sm.qempty());
  }
  // kPrefetch: item j + 1's words, once published
  __device__ __forceinline__ void read_ahead(const Smem& sm, int j) {
    if constexpr (kPrefetch) {
      mbar_wait(sm.itemfull(j + 1), ((j + 1) >> 1) & 1);
      ahead = ld_volatile(scratch + 2 * ((j + 1) & 1));
      ahead2 = ld_volatile(scratch + 2 * ((j + 1) & 1) + 1);
    }
  }
};

// ---- Softmax ------------------------------------------------------------------------------------------------------

// A tile's scores into P, the A operands of P V, for a thread's two rows of an item: the mask where its run is partial
// or its key tile short, then the online softmax (fwd_tile_softmax) or the held offset (fwd_tile_p_held). m and l are
// the rows' running offset (base-2 units) and sum, `held` (kHeld, kHeldEarlyPack) whether every row of the warp has its
// offset; the caller keeps them (registers across the item's steps). Returns whether O needs its rows rescaled by
// corrs.
template <FwdWsSoftmax S, DType E>
struct FwdWsRowSoftmax {
  static constexpr int BN = kWsKeys;

  __device__ __forceinline__ static bool tile(float (&sc)[BN / 2], const FwdArgs& args, const RunCursor& cur, int lane,
                                              const int (&tok)[2], float (&m)[2], float (&l)[2], bool& held, float sl2,
                                              float (&corrs)[2], uint32_t (&pn)[BN / 16][4]) {
    if constexpr (S != FwdWsSoftmax::kOnline) {
      return fwd_tile_p_held<BN, S == FwdWsSoftmax::kHeldEarlyPack, E>(sc, args, cur, lane, tok, m, l, sl2, corrs, held,
                                                                       pn);
    } else {
      const bool rescale = fwd_tile_softmax<BN>(sc, args, cur, lane, tok, m, l, sl2, corrs);
      fwd_pack_p<BN, E>(sc, pn);
      return rescale;
    }
  }
};

// ---- Epilogue -----------------------------------------------------------------------------------------------------

// O / l and the LSE of a warpgroup's 64 rows. kTmaO: O staged in shared memory and stored with two TMA boxes of 64
// columns x G heads x 64 / G tokens by one thread, instead of 32 four-byte global stores per thread (8 rows x 16 bytes
// per warp instruction). One block per item stages O in its own rows of the Q buffer (free once Q is in registers or
// the last S GEMM has retired) and waits for the store to have read them; the persistent form stages O in a buffer of
// its own (sO), leaves the store running and waits for it before the next item's staging (and at the end: drain).
template <bool kPersistent, bool kTmaO, DType E>
struct FwdWsEpilogue {
  static constexpr int D = kWsD, BM = kWsRows;
  using Smem = FwdWsSmem<kPersistent>;

  template <class Trace>
  __device__ __forceinline__ static void store(const FwdWsArgs& w, const Smem& sm, const float (&o)[D / 2],
                                               const float (&m)[2], const float (&l)[2], const int (&row)[2],
                                               const int (&tok)[2], int kvh, int G, int t0, int wg, int lane,
                                               const Trace& trace) {
    const FwdArgs& args = w.a;
    if constexpr (kPersistent) {
      if (threadIdx.x % 128 == 0) bulk_wait_group_read0();  // the last store has read sO
      named_barrier_sync(1 + wg, 128);
      float sum[2];
      fwd_quad_sums(l, sum);
      fwd_stage_o<D, E>(o, sum, row, lane, sm.sO(), BM);
      fence_proxy_async_shared();
      named_barrier_sync(1 + wg, 128);
      if (threadIdx.x % 128 == 0) {
#pragma unroll
        for (int pnl = 0; pnl < D / 64; ++pnl)
          tma_store_3d(&w.to, pnl * 64, kvh * G, t0 + wg * (64 / G), sm.sO() + pnl * BM * 128 + wg * 64 * 128);
        bulk_commit_group();
      }
      fwd_store_lse(args, m, sum, row, tok, kvh, lane);  // after the fence, which waits for this thread's stores
    } else if constexpr (kTmaO) {
      fwd_stage_o_lse<D, E>(args, o, m, l, row, tok, kvh, lane, sm.sO(), BM);
      fence_proxy_async_shared();       // the staged rows -> the TMA store (async proxy)
      named_barrier_sync(1 + wg, 128);  // this warpgroup's 64 rows are staged
      if (threadIdx.x % 128 == 0) {
        const int head0 = kvh * G;
#pragma unroll
        for (int pnl = 0; pnl < D / 64; ++pnl)
          tma_store_3d(&w.to, pnl * 64, head0, t0 + wg * (64 / G), sm.sO() + pnl * BM * 128 + wg * 64 * 128);
        bulk_commit_group();
        bulk_wait_group_read0();  // shared memory stays until the stores have read it
        trace.stamp(threadIdx.x == 0 ? 5 : 7);
        if (threadIdx.x == 0) trace.time(12);
      }
    } else {
      fwd_store_o_lse<D, E>(args, o, m, l, row, tok, kvh, lane);
    }
  }
  // At the end (kPersistent: shared memory stays until the last store has read it; one block per item has waited).
  __device__ __forceinline__ static void drain() {
    if constexpr (kPersistent)
      if (threadIdx.x % 128 == 0) bulk_wait_group_read0();
  }
  // O = 0 and LSE = -inf for this thread's rows of an item with no visible key (their part of
  // fwd_store_o_lse), stored directly.
  __device__ __forceinline__ static void store_empty(const FwdArgs& args, const int (&row)[2], const int (&tok)[2],
                                                     int kvh, int lane) {
    const AttentionForwardParams& p = args.p;
    const int G = args.group;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if (row[h] >= args.lists.major_tile_rows * G || tok[h] >= args.q_rows) continue;
      const int head = kvh * G + row[h] % G;
      auto* dst = static_cast<uint16_t*>(p.o) + tok[h] * p.o_row_stride + head * p.o_head_stride + 2 * (lane % 4);
#pragma unroll
      for (int j = 0; j < D / 8; ++j) *reinterpret_cast<uint32_t*>(dst + j * 8) = 0u;
      if (lane % 4 == 0) p.lse[tok[h] * p.lse_row_stride + head * p.lse_head_stride] = -INFINITY;
    }
  }
};

// ---- The kernel ---------------------------------------------------------------------------------------------------

// One body for both forms; the scheduler (C.persistent) picks the tile scheduler (and with it the shared memory layout and the
// epilogue's staging). The consumers walk the scheduler's items; with C.overlap they carry FA3's intra-warpgroup
// overlap across the item boundary: a new item's first S GEMM is issued with the previous item's last P V, and the
// previous item's epilogue runs once that P V has retired (one block per item has no previous item: those branches
// compile away with the single-tile scheduler, whose loop runs once).
// kQReg (C.q_in_registers): Q in registers (ldmatrix once per item) as the A operand of S = Q K^T, so that GEMM reads only K
// from shared memory (half its operand traffic); costs 32 of the consumers' 240 registers.
// kOverlap (C.overlap): tile n issues S(n) and then P V of tile n - 1; it waits only for S(n), and its mask and softmax run while
// P V(n - 1) is still on the tensor cores. O is rescaled once that P V has retired, and tile n's P goes to a second
// set of A registers. Without it each tile's P V is issued and waited for after its softmax.
// kTmaO (C.o_by_tma): the epilogue stages O and stores it by TMA (FwdWsEpilogue). kSoftmax: FwdWsRowSoftmax's form.
// kTrace (bench only): stamps of the block's phases (FwdWsConfig::trace names them).
// (nvcc takes no class-typed template argument on a kernel: launch_fwd_ws<C> passes C as the scheduler and scalars.)
template <class Sched, bool kQReg, bool kOverlap, bool kTmaO, bool kTrace, FwdWsSoftmax kSoftmax, DType E>
__global__ void __launch_bounds__(kWsThreads, 1) attention_fwd_ws_kernel(const __grid_constant__ FwdWsArgs w) {
  constexpr bool kP = Sched::kPersistent;
  constexpr int D = kWsD, BM = kWsRows, BN = kWsKeys;
  using Smem = FwdWsSmem<kP>;
  using Epilogue = FwdWsEpilogue<kP, kTmaO, E>;
  using Softmax = FwdWsRowSoftmax<kSoftmax, E>;
  const FwdWsTrace<kTrace> trace(w);
  if (threadIdx.x == 0) trace.start();
  const FwdArgs& args = w.a;
  const Smem sm(dynamic_smem_1024());
  const auto& L = args.lists;
  const int G = args.group;
  Sched sched(w);

  if (threadIdx.x == 0) sm.template init_barriers<Sched::kItemBars>();
  __syncthreads();

  if (threadIdx.x >= 256) {
    setmaxnreg_dec<24>();
    if (threadIdx.x != 256) return;
    const FwdWsProducer<kP> producer{w, sm};
    sched.produce(w, producer, trace);
    return;
  }
  setmaxnreg_inc<240>();

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int wg = warp / 4;
  int row[2], rq[2];  // this thread's two packed rows and their tokens (one block per item: its own; else from the item's first)
  fwd_ws_rows(warp, lane, G, sched.token_base(), row, rq);
  float o[D / 2];
#pragma unroll
  for (int i = 0; i < D / 2; ++i) o[i] = 0.f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};  // the item's rows' running offset (base 2) and sum
  const float sl2 = args.p.scale * kLog2e;
  const uint32_t q16 = (sm.sQ + wg * 64 * 128) >> 4, k16 = sm.sK() >> 4, v16 = sm.sV() >> 4;
  constexpr uint32_t kStage16 = BN * D * 2 / 16;

  uint32_t qf[D / 16][4];  // kQReg: this warp's 16 rows of Q, one A fragment per k16 step
  uint32_t pa[BN / 16][4];  // P of the tile whose P V is issued next (kOverlap: of the previous tile)
  bool pending = false;  // kOverlap: P V of step n - 1 (pa, stage prev_s) is still to be issued
  bool due = false;      // the previous item's epilogue is due once that P V has retired
  float pm[2], pl[2];    // the previous item's row max and sum, its tokens, head and first token
  int ptok[2], pkvh = 0, pt0 = 0;
  int prev_s = 0, n = 0;
  uint32_t prev_vs16 = 0;
  FwdWsItem it;
  sched.start(sm);
  for (int j = 0; sched.next_item(w, sm, j, it); ++j) {
    if (threadIdx.x == 0) trace.stamp(2);
    if constexpr (kQReg) fwd_ws_load_q_regs(sm.sQ, warp, lane, qf);
    sched.release_q(sm, j, lane);
    const int t0 = it.t0;
    const int tok[2] = {kP ? t0 + rq[0] : rq[0], kP ? t0 + rq[1] : rq[1]};
    if constexpr (kP) {  // a new item's rows (one block per item has them from the start)
      m[0] = m[1] = -INFINITY;
      l[0] = l[1] = 0.f;
    }
    // No visible key: O = 0 and LSE = -inf. The persistent form stores them directly and leaves pending work
    // pending (an if-else here instead of `continue` costs the wgmmas their overlap: ptxas C7513); one block per
    // item runs no step and its epilogue divides by l = 0 into the same.
    if constexpr (kP) {
      if (it.e_begin == it.e_end) {
        Epilogue::store_empty(args, row, tok, it.kvh, lane);
        sched.read_ahead(sm, j);
        continue;
      }
    }
    const int e_end = it.e_end;
    RunCursor cur = sched.cursor(w, it);
    bool held = false;  // kSoftmax held: every row of the warp has its offset
    // The item's steps. The persistent form peels its first (pass 0, `first`): it may find a P V pending from the
    // previous item (never the block's first) and does that item's epilogue; pass 1 is the loop over the other
    // steps, which holds neither, and all one block per item runs. (Peeled by unrolling the passes: the persistent
    // form runs 8-10% slower unpeeled, run 142, and a lambda per step changes the one-block form's machine code.)
#pragma unroll
    for (int pass = kP ? 0 : 1; pass < 2; ++pass)
    for (const bool first = pass == 0; cur.entry < e_end;) {
      const int s = n % kWsStages;
      mbar_wait(sm.full(s), (n / kWsStages) & 1);
      if (n == 0 && threadIdx.x == 0) trace.stamp(10);
      const uint32_t ks16 = k16 + s * kStage16, vs16 = v16 + s * kStage16;
      float sc[BN / 2];
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        const uint32_t off = (kk % 4) * 32;
        if constexpr (kQReg)
          wgmma_rs_m64n64k16_kmajor<E>(sc, qf[kk], wgmma_desc16<16, 1024>(ks16 + ((kk / 4) * BN * 128 + off) / 16),
                                       kk > 0);
        else
          wgmma_ss_m64n64k16<false, false, E>(sc, wgmma_desc16<16, 1024>(q16 + ((kk / 4) * BM * 128 + off) / 16),
                                              wgmma_desc16<16, 1024>(ks16 + ((kk / 4) * BN * 128 + off) / 16), kk > 0);
      }
      wgmma_commit();
      if constexpr (kOverlap) {
        // the previous step's P V (tested where used, not held in a register: as the old kernels did)
        if (kP ? !first || pending : n > 0) fwd_issue_pv<D, BN, E>(o, pa, prev_vs16);
        wgmma_commit();
        if (kP && first) sched.read_ahead(sm, j);  // kPrefetch: under the GEMMs; used at the next item's start
        wgmma_wait<1>();  // S(n) only: P V(n - 1), maybe the previous item's last, stays in flight under the softmax
      } else {
        wgmma_wait<0>();
      }
      wgmma_fence_operands(sc);
      if (n == 0 && threadIdx.x == 0) trace.stamp(3);
      float corrs[2] = {1.f, 1.f};
      uint32_t pn[BN / 16][4];  // this tile's P
      const bool rescale = Softmax::tile(sc, args, cur, lane, tok, m, l, held, sl2, corrs, pn);
      if constexpr (kOverlap) {
        wgmma_wait<0>();  // P V(n - 1): O and the old P are free again
        wgmma_fence_operands(o);
        wgmma_fence_operands(pa);
        if (kP ? !first || pending : n > 0) {
          __syncwarp();
          if (lane == 0) mbar_arrive(sm.empty(prev_s));
        }
      }
      if constexpr (kP) {
        if (first && due) {  // O holds the previous item's result; this step's corrs are 0 (m was -inf)
          Epilogue::store(w, sm, o, pm, pl, row, ptok, pkvh, G, pt0, wg, lane, trace);
          due = false;
        }
      }
      fwd_rescale_o<D>(o, rescale, corrs);
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk)
#pragma unroll
        for (int c = 0; c < 4; ++c) pa[kk][c] = pn[kk][c];
      if constexpr (kOverlap) {
        pending = true;
        prev_s = s;
        prev_vs16 = vs16;
      } else {
        fwd_pv_waited<D, BN, E>(o, pa, vs16);
        __syncwarp();
        if (lane == 0) mbar_arrive(sm.empty(s));  // this warp's reads of stage s are done
      }
      cur = cur.next(L.entries, e_end);
      ++n;
      if (first) break;  // pass 0: one step
    }
    if constexpr (!kP) {  // one block per item: the last step's P V, then the epilogue; no second item
      if constexpr (kOverlap) {
        if (n > 0) fwd_pv_waited<D, BN, E>(o, pa, prev_vs16);  // (the producer is done with the ring)
      }
      if (threadIdx.x == 0) {
        trace.stamp(4);
        trace.set(6, n);
      }
      Epilogue::store(w, sm, o, m, l, row, tok, it.kvh, G, t0, wg, lane, trace);
      return;
    }
    due = true;  // this item's epilogue, once its last P V has retired
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      pm[h] = m[h];
      pl[h] = l[h];
      ptok[h] = tok[h];
    }
    pkvh = it.kvh;
    pt0 = t0;
  }
  if (pending) {  // the last item's last P V, then its epilogue
    fwd_pv_waited<D, BN, E>(o, pa, prev_vs16);
    __syncwarp();
    if (lane == 0) mbar_arrive(sm.empty(prev_s));
  }
  if (due) Epilogue::store(w, sm, o, pm, pl, row, ptok, pkvh, G, pt0, wg, lane, trace);
  Epilogue::drain();
}

// Launches config C (FwdWsConfig's fields choose the scheduler and the kernel's other template arguments); false when
// the kernel does not apply (launch_fwd_ws_d128 in launch.hpp says when). `trace`: C.trace's stamps; `counter`:
// C.persistent's workspace. E: the element type (a.p.dtype must be it).
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
  unsigned grid = static_cast<unsigned>(blocks);
  if constexpr (C.persistent) {
    require(counter != nullptr, kWho, ": the persistent forward needs a counter");
    check_cuda(cudaMemsetAsync(counter, 0, sizeof(int), stream), "attention_forward (ws): zero the item counter");
    grid = static_cast<unsigned>(std::min<int64_t>(blocks, sm_count()));
  } else {
    require(!C.trace || trace != nullptr, kWho, ": the traced forward needs a trace buffer");
  }
  constexpr int kSmem = FwdWsSmem<C.persistent>::kBytes;
  using Sched = std::conditional_t<C.persistent, FwdWsPersistentScheduler<C.prefetch>, FwdWsSingleTileScheduler>;
  auto* kernel = attention_fwd_ws_kernel<Sched, C.q_in_registers, C.overlap, C.o_by_tma, C.trace, C.softmax, E>;
  check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem),
             "attention_forward (ws): shared memory limit");
  kernel<<<grid, kWsThreads, kSmem, stream>>>(w);
  check_cuda(cudaGetLastError(), "attention_forward (ws): launch");
  return true;
}

}  // namespace
}  // namespace treecp::cuda::detail
