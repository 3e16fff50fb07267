// Forward slice attention on Hopper warpgroup MMA (sm_90a). Same work decomposition, tile lists and
// results as attention_fwd.cuh (one block per (query tile, KV head), GQA packing, two-stage cp.async
// K/V pipeline, online softmax in registers), but the two GEMMs run on wgmma:
//   S = Q K^T   wgmma m64n64k16, Q and K read from shared memory through descriptors;
//   O += P V    wgmma m64nDk16, P from registers (the accumulator layout packed to bf16 or fp16), V from
//               shared memory as an MN-major operand.
// Two warpgroups x 64 packed rows = the 128-row query tile. Accumulators are spread over the 128
// threads of a warpgroup (S: 32 fp32 per thread, O: D/2), against 32 rows of S and O per warp with
// mma.sync, so the kernel fits 2 blocks (16 warps) per SM instead of 8 warps, and the tensor cores read
// K and V from shared memory without ldmatrix. Shared memory uses the panel layout of wgmma.cuh.
#pragma once

#include <cfloat>

#include "kernels/cuda/attention_fwd_mask.cuh"
#include "kernels/cuda/launch.hpp"
#include "kernels/cuda/mma.cuh"
#include "kernels/cuda/wgmma.cuh"

namespace treecp::cuda::detail {

// D is Dqk (Q, K), DV the columns of V and O (attention_dims.hpp's kAttentionDims).
template <int D, int DV = D>
struct FwdWgmmaShape {
  static constexpr int kRows = kFwdBlockRows;
  static constexpr int kKeys = kFwdBlockKeys;
  static constexpr int kWarpgroups = kRows / 64;
  static constexpr int kThreads = kWarpgroups * 128;
  // 2 x (Q + two K/V stages) = 2 x 96 KiB at D = 128; one block at (192, 128) (129 KiB) and (256, 256) (193 KiB),
  // whose 255 registers a thread then also hold O's DV / 2 fp32
  static constexpr int kBlocksPerSm = D <= 128 && DV <= 128 ? 2 : 1;
  // Q + two stages of K and V, plus 1 KiB to align the panels to 1024 bytes (the swizzle atom)
  static constexpr int kSmemBytes = ((kRows + 2 * kKeys) * D + 2 * kKeys * DV) * 2 + 1024;
  static_assert(kRows % 64 == 0 && kKeys == 64, "wgmma forward: 64-row warpgroups, S of 64 keys (m64n64)");
  static_assert(kSmemBytes * kBlocksPerSm <= 227 * 1024, "wgmma forward: shared memory per SM");
  static_assert(D % 64 == 0 && (DV == 64 || DV == 128 || DV == 256), "wgmma forward: whole panels, O of N = 64 .. 256");
};

// Block barriers per 64-key tile:
//   kTwo  prefetch the next K/V stage, wait for this one, barrier; ...; barrier (the next prefetch
//         overwrites the stage this tile's P V read)
//   kOne  wait for this stage, barrier, then prefetch the next one: the barrier also orders every
//         thread's reads of the previous tile (its P V waited for) before the prefetch into that stage;
//         and the first k step of S = Q K^T overwrites the accumulators instead of adding to zeros
enum class FwdBarriers { kTwo, kOne };
constexpr FwdBarriers kFwdBarriers = FwdBarriers::kOne;  // the default, by measurement (docs/benchmarks-gpu.md)

// K/V tile loads:
//   kGeneric    load_panel_async: every 16-byte chunk recomputes its row, panel swizzle and 64-bit
//               source address
//   kPerThread  thread t always copies chunk t % (D/8) of rows t / (D/8) + j * (threads / (D/8)); that
//               row step is a multiple of 8, so the swizzled shared offset is one per-thread constant
//               plus j * step * 64 and the source one 64-bit multiply per tile plus j * step * stride
enum class FwdLoads { kGeneric, kPerThread };
constexpr FwdLoads kFwdLoads = FwdLoads::kPerThread;  // the default, by measurement (docs/benchmarks-gpu.md)

// The per-tile steps both wgmma forward kernels share (this file's and attention_fwd_ws.cu's). A thread
// holds two rows (h = 0, 1: token tok[h]) of a 64 x BN accumulator tile in the layout of wgmma.cuh;
// element 4 nb + 2 h + c is (row h, key 8 nb + 2 (lane % 4) + c).

// Partial run: keys no listed slice makes visible from the row get -inf (fwd_visible_bits). Also for a full
// run of a tile shorter than BN (key tiles end at segment boundaries): the keys from k_end on, loaded with the
// tile, belong to the next one.
template <int BN>
__device__ __forceinline__ void fwd_mask_tile(float (&s)[BN / 2], const FwdArgs& args, const TileEntry& e, int k0,
                                              int k_end, int lane, const int (&tok)[2]) {
  const int rows[1][2] = {{tok[0], tok[1]}};
  uint32_t vis[1];
  fwd_visible_bits<BN, 1>(args, e, k0, k_end, lane, rows, vis);
#pragma unroll
  for (int i = 0; i < BN / 2; ++i)
    if (!(vis[0] >> i & 1u)) s[i] = -INFINITY;
}

// Online softmax of one tile, in base 2: the row max m and sum l move on, S becomes P, corrs[h] is the
// factor O's row h needs; returns whether this thread has a factor other than 1. Rows are shared by the
// 4 lanes of a quad. The row max and sum are pairwise trees (independent operations, not one dependent
// chain of 16); scale > 0, so the max of the raw scores times sl2 is the max of the scaled ones.
template <int BN>
__device__ __forceinline__ bool fwd_softmax_tile(float (&s)[BN / 2], float (&m)[2], float (&l)[2], float sl2,
                                                 float (&corrs)[2]) {
  bool rescale = false;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float t[BN / 8];
#pragma unroll
    for (int nb = 0; nb < BN / 8; ++nb) t[nb] = fmaxf(s[4 * nb + 2 * h], s[4 * nb + 2 * h + 1]);
#pragma unroll
    for (int w = BN / 16; w >= 1; w /= 2)
#pragma unroll
      for (int i = 0; i < w; ++i) t[i] = fmaxf(t[i], t[i + w]);
    float mx = fmaxf(m[h], t[0] * sl2);
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float base = mx == -INFINITY ? 0.f : mx;  // all masked so far: keep exp2 finite
    const float corr = exp2_fast(m[h] - base);
    m[h] = mx;
#pragma unroll
    for (int nb = 0; nb < BN / 8; ++nb) {
      s[4 * nb + 2 * h] = exp2_fast(fmaf(s[4 * nb + 2 * h], sl2, -base));
      s[4 * nb + 2 * h + 1] = exp2_fast(fmaf(s[4 * nb + 2 * h + 1], sl2, -base));
      t[nb] = s[4 * nb + 2 * h] + s[4 * nb + 2 * h + 1];
    }
#pragma unroll
    for (int w = BN / 16; w >= 1; w /= 2)
#pragma unroll
      for (int i = 0; i < w; ++i) t[i] += t[i + w];
    l[h] = fmaf(l[h], corr, t[0]);
    corrs[h] = corr;
    rescale |= corr != 1.f;
  }
  return rescale;
}

// A listed tile's mask: keys no listed slice makes visible from the row, and where the key tile is shorter than BN
// the keys past its end, get -inf.
template <int BN>
__device__ __forceinline__ void fwd_tile_mask(float (&s)[BN / 2], const FwdArgs& args, const RunCursor& cur, int lane,
                                              const int (&tok)[2]) {
  const auto& L = args.lists;
  const TileEntry e = L.entries[cur.entry];
  const int ka = L.minor_start[cur.tile], kb = L.minor_start[cur.tile + 1];
  if (e.mask_count > 0 || kb - ka < BN) fwd_mask_tile<BN>(s, args, e, ka, kb, lane, tok);
}

// A listed tile's scores to probabilities: the mask where its run is partial or its key tile shorter than BN,
// then the online softmax. Returns whether O needs its rows rescaled by corrs.
template <int BN>
__device__ __forceinline__ bool fwd_tile_softmax(float (&s)[BN / 2], const FwdArgs& args, const RunCursor& cur, int lane,
                                                 const int (&tok)[2], float (&m)[2], float (&l)[2], float sl2,
                                                 float (&corrs)[2]) {
  fwd_tile_mask<BN>(s, args, cur, lane, tok);
  return fwd_softmax_tile<BN>(s, m, l, sl2, corrs);
}

// P as the A operands of O += P V: k16 step kk takes keys 16 kk .. +16 (accumulator blocks 2 kk, 2 kk + 1).
template <int BN, DType E = DType::kBf16>
__device__ __forceinline__ void fwd_pack_p(const float (&s)[BN / 2], uint32_t (&pa)[BN / 16][4]) {
#pragma unroll
  for (int kk = 0; kk < BN / 16; ++kk) {
    pa[kk][0] = pack2<E>(s[8 * kk + 0], s[8 * kk + 1]);
    pa[kk][1] = pack2<E>(s[8 * kk + 2], s[8 * kk + 3]);
    pa[kk][2] = pack2<E>(s[8 * kk + 4], s[8 * kk + 5]);
    pa[kk][3] = pack2<E>(s[8 * kk + 6], s[8 * kk + 7]);
  }
}

// The held-offset softmax (FwdWsSoftmax::kHeld). Once every row of the warp has seen a key, its offset m[h] is a score
// of the row, and any offset gives the same O and LSE as the running max provided the exponentials neither overflow
// nor underflow where it matters: scores far below m[h] underflow exactly as they would against the true max (m[h] is
// a real score of the row), and scores above it are safe while 2^(s - m) stays far from fp32's (and bf16's) range.
// So the tile is exponentiated against m[h] as it stands, without the max tree, its shuffles or O's rescale; when a
// row's partial sum of P passes kHeldLimit (a score more than 16 above the offset, in base-2 units) the warp keeps the
// raw scores and returns false, and the caller runs fwd_softmax_tile on them, which moves the offset. So P <= 2^16:
// O and l keep all but 16 bits of the fp32 headroom they have under the running max (P <= 1). fp16 operands hold
// at most 65504 (2^16 would round to inf), so there the limit is 2^15.
template <DType E>
constexpr float kHeldLimit = E == DType::kF16 ? 32768.f : 65536.f;  // 2^15, 2^16
// On success P goes straight into the A operands of O += P V (pn, as fwd_pack_p) and l[h] grows by the rows' sums; on
// failure s still holds the raw scores and pn, l are untouched. (P is packed here rather than copied back into s so
// that both of the caller's paths write pn and no register copies join them.)
// kEarlyPack (FwdWsSoftmax::kHeldEarlyPack, the default): P packed before the vote, so the packs need not wait for it
// (the fallback packs again).
template <int BN, bool kEarlyPack = false, DType E = DType::kBf16>
__device__ __forceinline__ bool fwd_softmax_held(const float (&s)[BN / 2], const float (&m)[2], float (&l)[2],
                                                 float sl2, uint32_t (&pn)[BN / 16][4]) {
  float e[BN / 2], t[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float u[BN / 8];
#pragma unroll
    for (int nb = 0; nb < BN / 8; ++nb) {
      e[4 * nb + 2 * h] = exp2_fast(fmaf(s[4 * nb + 2 * h], sl2, -m[h]));
      e[4 * nb + 2 * h + 1] = exp2_fast(fmaf(s[4 * nb + 2 * h + 1], sl2, -m[h]));
      u[nb] = e[4 * nb + 2 * h] + e[4 * nb + 2 * h + 1];
    }
#pragma unroll
    for (int w = BN / 16; w >= 1; w /= 2)
#pragma unroll
      for (int i = 0; i < w; ++i) u[i] += u[i + w];
    t[h] = u[0];
  }
  if constexpr (kEarlyPack) fwd_pack_p<BN, E>(e, pn);
  if (!__all_sync(0xffffffffu, t[0] <= kHeldLimit<E> && t[1] <= kHeldLimit<E>)) return false;  // also catches inf
  if constexpr (!kEarlyPack) fwd_pack_p<BN, E>(e, pn);
  l[0] += t[0];
  l[1] += t[1];
  return true;
}

// A listed tile's P into pn: the held offset once `held` (every row of the warp has an offset; false at an item's
// start), else, or where it does not hold, the online softmax, after which `held` is set once every row has an offset.
// Returns whether O needs its rows rescaled by corrs (never on the held path).
template <int BN, bool kEarlyPack = false, DType E = DType::kBf16>
__device__ __forceinline__ bool fwd_tile_p_held(float (&s)[BN / 2], const FwdArgs& args, const RunCursor& cur, int lane,
                                                const int (&tok)[2], float (&m)[2], float (&l)[2], float sl2,
                                                float (&corrs)[2], bool& held, uint32_t (&pn)[BN / 16][4]) {
  fwd_tile_mask<BN>(s, args, cur, lane, tok);
  if (held && fwd_softmax_held<BN, kEarlyPack, E>(s, m, l, sl2, pn)) return false;
  const bool rescale = fwd_softmax_tile<BN>(s, m, l, sl2, corrs);
  held = __all_sync(0xffffffffu, m[0] > -INFINITY && m[1] > -INFINITY);
  fwd_pack_p<BN, E>(s, pn);
  return rescale;
}

// O's rows times their factors, skipped when no row of the warp moved its max.
template <int D>
__device__ __forceinline__ void fwd_rescale_o(float (&o)[D / 2], bool rescale, const float (&corrs)[2]) {
  if (__any_sync(0xffffffffu, rescale)) {
#pragma unroll
    for (int j = 0; j < D / 8; ++j)
#pragma unroll
      for (int c = 0; c < 4; ++c) o[4 * j + c] *= corrs[c / 2];
  }
}

// Issues O += P V for one tile: k16 step kk takes keys 16 kk .. +16 of the V stage at vs16 (its start
// address >> 4); the caller fences before and commits / waits after.
// At D = 256 (the columns of V and O) two m64n128k16 per k step, on V's panels 0-1 and 2-3 and O's registers
// 0 .. 63 and 64 .. 127 (columns 0 .. 127 and 128 .. 255 in the accumulator layout).
template <int D, int BN, DType E = DType::kBf16>
__device__ __forceinline__ void fwd_issue_pv(float (&o)[D / 2], const uint32_t (&pa)[BN / 16][4], uint32_t vs16) {
  if constexpr (D == 256) {
    auto& lo = reinterpret_cast<float (&)[64]>(o[0]);
    auto& hi = reinterpret_cast<float (&)[64]>(o[64]);
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      wgmma_rs_m64n128k16<true, E>(lo, pa[kk], wgmma_desc16<BN * 128, 1024>(vs16 + kk * 16 * 128 / 16));
      wgmma_rs_m64n128k16<true, E>(hi, pa[kk], wgmma_desc16<BN * 128, 1024>(vs16 + (2 * BN * 128 + kk * 16 * 128) / 16));
    }
  } else {
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk)
      wgmma_rs_trans_b<D, E>(o, pa[kk], wgmma_desc16<BN * 128, 1024>(vs16 + kk * 16 * 128 / 16));
  }
}

// O += P V issued and waited for: O and P are the thread's again once it returns.
template <int D, int BN, DType E = DType::kBf16>
__device__ __forceinline__ void fwd_pv_waited(float (&o)[D / 2], uint32_t (&pa)[BN / 16][4], uint32_t vs16) {
  wgmma_fence();
  fwd_issue_pv<D, BN, E>(o, pa, vs16);
  wgmma_commit();
  wgmma_wait<0>();
  wgmma_fence_operands(o);
  wgmma_fence_operands(pa);
}

// O / l in the element type and the natural-log LSE = max ln 2 + ln(sum) (max in base-2 units); -inf and O = 0 for
// a row that saw no key.
template <int D, DType E = DType::kBf16>
__device__ __forceinline__ void fwd_store_o_lse(const FwdArgs& args, const float (&o)[D / 2], const float (&m)[2],
                                                const float (&l)[2], const int (&row)[2], const int (&tok)[2],
                                                int kvh, int lane) {
  const AttentionForwardParams& p = args.p;
  const int G = args.group, valid_rows = args.lists.major_tile_rows * G;
  auto* out = static_cast<elem_t<E>*>(p.o);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float sum = l[h];
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    if (row[h] >= valid_rows || tok[h] >= args.q_rows) continue;
    const float inv = sum > 0.f ? 1.f / sum : 0.f;
    const int head = kvh * G + row[h] % G;
    elem_t<E>* dst = out + tok[h] * p.o_row_stride + head * p.o_head_stride + 2 * (lane % 4);
#pragma unroll
    for (int j = 0; j < D / 8; ++j)
      *reinterpret_cast<uint32_t*>(dst + j * 8) = pack2<E>(o[4 * j + 2 * h] * inv, o[4 * j + 2 * h + 1] * inv);
    if (lane % 4 == 0)
      p.lse[tok[h] * p.lse_row_stride + head * p.lse_head_stride] = sum > 0.f ? m[h] * kLn2 + logf(sum) : -INFINITY;
  }
}

// The persistent forward's epilogue in two parts, so that the LSE's global stores come after the proxy fence that
// publishes the staged O (a fence waits for this thread's outstanding stores): the rows' sums over their quad, O / sum
// as pairs of the element type into the panel tile at sO (as fwd_stage_o_lse), then the LSE.
__device__ __forceinline__ void fwd_quad_sums(const float (&l)[2], float (&sum)[2]) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    sum[h] = l[h];
    sum[h] += __shfl_xor_sync(0xffffffffu, sum[h], 1);
    sum[h] += __shfl_xor_sync(0xffffffffu, sum[h], 2);
  }
}
// One of the thread's rows (h, packed row r, its quad's sum of P) as element pairs O / sum into the panel tile at sO.
template <int D, DType E = DType::kBf16>
__device__ __forceinline__ void fwd_stage_o_row(const float (&o)[D / 2], int h, float sum, int r, int lane, uint32_t sO,
                                                int BM) {
  const float inv = sum > 0.f ? 1.f / sum : 0.f;
  const uint32_t line = sO + r * 128 + (lane % 4) * 4;
#pragma unroll
  for (int j = 0; j < D / 8; ++j) {
    const uint32_t addr = line + (j / 8) * BM * 128 + (((j % 8) ^ (r % 8)) << 4);
    asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(addr), "r"(pack2<E>(o[4 * j + 2 * h] * inv, o[4 * j + 2 * h + 1] * inv))
                 : "memory");
  }
}
template <int D, DType E = DType::kBf16>
__device__ __forceinline__ void fwd_stage_o(const float (&o)[D / 2], const float (&sum)[2], const int (&row)[2], int lane,
                                            uint32_t sO, int BM) {
#pragma unroll
  for (int h = 0; h < 2; ++h) fwd_stage_o_row<D, E>(o, h, sum[h], row[h], lane, sO, BM);
}
__device__ __forceinline__ void fwd_store_lse(const FwdArgs& args, const float (&m)[2], const float (&sum)[2],
                                              const int (&row)[2], const int (&tok)[2], int kvh, int lane) {
  const AttentionForwardParams& p = args.p;
  const int G = args.group, valid_rows = args.lists.major_tile_rows * G;
#pragma unroll
  for (int h = 0; h < 2; ++h)
    if (lane % 4 == 0 && row[h] < valid_rows && tok[h] < args.q_rows) {
      const int head = kvh * G + row[h] % G;
      p.lse[tok[h] * p.lse_row_stride + head * p.lse_head_stride] = sum[h] > 0.f ? m[h] * kLn2 + logf(sum[h]) : -INFINITY;
    }
}

// fwd_store_o_lse with O staged in shared memory instead: this thread's element pairs of rows row[h] go into the panel
// tile at sO (panels of BM rows x 64 columns, 128-byte swizzle) for a TMA store; the LSE is written directly.
template <int D, DType E = DType::kBf16>
__device__ __forceinline__ void fwd_stage_o_lse(const FwdArgs& args, const float (&o)[D / 2], const float (&m)[2],
                                                const float (&l)[2], const int (&row)[2], const int (&tok)[2], int kvh,
                                                int lane, uint32_t sO, int BM) {
  const AttentionForwardParams& p = args.p;
  const int G = args.group, valid_rows = args.lists.major_tile_rows * G;
  __syncwarp();  // the warp's ldmatrix reads of these rows (its own Q rows) come first
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float sum = l[h];
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    fwd_stage_o_row<D, E>(o, h, sum, row[h], lane, sO, BM);
    if (lane % 4 == 0 && row[h] < valid_rows && tok[h] < args.q_rows) {
      const int head = kvh * G + row[h] % G;
      p.lse[tok[h] * p.lse_row_stride + head * p.lse_head_stride] = sum > 0.f ? m[h] * kLn2 + logf(sum) : -INFINITY;
    }
  }
}

template <int D, FwdBarriers kBarriers = kFwdBarriers, FwdLoads kLoads = kFwdLoads, DType E = DType::kBf16, int DV = D>
__global__ void __launch_bounds__(FwdWgmmaShape<D, DV>::kThreads, FwdWgmmaShape<D, DV>::kBlocksPerSm)
    attention_fwd_wgmma_kernel(const FwdArgs args) {
  using S = FwdWgmmaShape<D, DV>;
  using T = elem_t<E>;
  constexpr bool kOne = kBarriers == FwdBarriers::kOne;
  constexpr int BM = S::kRows, BN = S::kKeys;
  T* sQ = reinterpret_cast<T*>(dynamic_smem_1024());
  T* sK = sQ + BM * D;        // [2][BN x D panels]
  T* sV = sK + 2 * BN * D;    // [2][BN x DV panels]

  const AttentionForwardParams& p = args.p;
  const auto& L = args.lists;
  const int tile = L.order[blockIdx.x / p.hkv];  // longest tiles first, heads of one tile adjacent
  const int kvh = blockIdx.x % p.hkv;
  const int G = args.group;
  const int t0 = tile * L.major_tile_rows;
  const int valid_rows = L.major_tile_rows * G;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int wg = warp / 4;
  const auto* q = static_cast<const T*>(p.q);
  const auto* k = static_cast<const T*>(p.k);
  const auto* v = static_cast<const T*>(p.v);

  // packed row r = (token t0 + r / G, q head kvh * G + r % G)
  load_panel_async<D, S::kThreads>(sQ, BM, q, [&](int r) -> const T* {
    const int t = t0 + r / G;
    if (r >= valid_rows || t >= args.q_rows) return nullptr;
    return q + t * p.q_row_stride + (kvh * G + r % G) * p.q_head_stride;
  });
  const int e_end = L.offsets[tile + 1];
  prefetch_entries_l1(L.entries, L.offsets[tile], e_end);
  RunCursor cur = RunCursor::first(L.entries, L.offsets[tile], e_end);
  // kPerThread: this thread's chunk, first row and shared offset (element units) in every K/V tile. Only where K and
  // V rows have the same width and a whole number of rows per step (not at (192, 128): those take kGeneric).
  constexpr int kChunks = D / 8, kRowStep = S::kThreads / kChunks, kLoadIters = BN / kRowStep;
  constexpr bool kPerThreadLoads = kLoads == FwdLoads::kPerThread && D == DV && S::kThreads % kChunks == 0;
  static_assert(!kPerThreadLoads || (S::kThreads % kChunks == 0 && BN % kRowStep == 0 && kRowStep % 8 == 0),
                "kPerThread loads: whole rows per step, row step a multiple of the 8-row swizzle period");
  const int ld_row = threadIdx.x / kChunks, ld_chunk = threadIdx.x % kChunks;
  const uint32_t ld_smem = swz_panel(ld_row, ld_chunk * 8, BN);  // + j * kRowStep * 64 for row ld_row + j * kRowStep
  auto load_kv = [&](int kt, int stage) {
    const int k0 = L.minor_start[kt];  // BN rows from the tile's start, whatever its length
    if constexpr (kPerThreadLoads) {
      const int r0 = k0 + ld_row;
      const T* ks = k + static_cast<int64_t>(r0) * p.k_row_stride + kvh * p.k_head_stride + ld_chunk * 8;
      const T* vs = v + static_cast<int64_t>(r0) * p.v_row_stride + kvh * p.v_head_stride + ld_chunk * 8;
      T* kd = sK + stage * BN * D + ld_smem;
      T* vd = sV + stage * BN * D + ld_smem;
#pragma unroll
      for (int j = 0; j < kLoadIters; ++j) {
        const bool ok = r0 + j * kRowStep < args.kv_rows;
        cp_async_16(kd + j * kRowStep * 64, ok ? ks + j * kRowStep * p.k_row_stride : k, ok);
        cp_async_16(vd + j * kRowStep * 64, ok ? vs + j * kRowStep * p.v_row_stride : v, ok);
      }
    } else {
      load_panel_async<D, S::kThreads>(sK + stage * BN * D, BN, k, [&](int r) -> const T* {
        return k0 + r < args.kv_rows ? k + (k0 + r) * p.k_row_stride + kvh * p.k_head_stride : nullptr;
      });
      load_panel_async<DV, S::kThreads>(sV + stage * BN * DV, BN, v, [&](int r) -> const T* {
        return k0 + r < args.kv_rows ? v + (k0 + r) * p.v_row_stride + kvh * p.v_head_stride : nullptr;
      });
    }
  };
  if (cur.entry < e_end) load_kv(cur.tile, 0);
  cp_async_commit();

  // this thread's rows: warp * 16 + lane / 4 + 8 h (the warpgroup's 64 rows start at wg * 64)
  int row[2], tok[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    row[h] = warp * 16 + lane / 4 + 8 * h;
    tok[h] = t0 + row[h] / G;
  }
  float o[DV / 2];  // register 4 j + c: (row h = c / 2, column 8 j + 2 (lane % 4) + c % 2)
#pragma unroll
  for (int i = 0; i < DV / 2; ++i) o[i] = 0.f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  const float sl2 = p.scale * kLog2e;  // softmax in base 2: exp(x * scale) = exp2(x * scale * log2 e)
  // descriptor start addresses (bytes >> 4): this warpgroup's 64 rows of Q's panel 0; K and V stage 0
  const uint32_t q16 = (smem_addr(sQ) + wg * 64 * 128) >> 4;
  const uint32_t k16 = smem_addr(sK) >> 4, v16 = smem_addr(sV) >> 4;
  constexpr uint32_t kStage16 = BN * D * 2 / 16;    // one K stage
  constexpr uint32_t kVStage16 = BN * DV * 2 / 16;  // one V stage

  for (int stage = 0; cur.entry < e_end; stage ^= 1) {
    const RunCursor next = cur.next(L.entries, e_end);
    if constexpr (!kOne) {
      if (next.entry < e_end) load_kv(next.tile, stage ^ 1);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    fence_proxy_async_shared();  // this thread's cp.async data -> the tensor cores' reads
    __syncthreads();
    if constexpr (kOne) {
      if (next.entry < e_end) load_kv(next.tile, stage ^ 1);
      cp_async_commit();
    }
    const uint32_t ks16 = k16 + stage * kStage16, vs16 = v16 + stage * kVStage16;

    // S = Q K^T for the warpgroup's 64 rows x BN keys; step kk covers head-dim columns 16 kk .. +16
    float s[BN / 2];
    if constexpr (!kOne) {
#pragma unroll
      for (int i = 0; i < BN / 2; ++i) s[i] = 0.f;
    }
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      const uint32_t off = (kk % 4) * 32;  // 16 columns = 32 bytes inside a 128-byte panel row
      const uint64_t da = wgmma_desc16<16, 1024>(q16 + ((kk / 4) * BM * 128 + off) / 16);
      const uint64_t db = wgmma_desc16<16, 1024>(ks16 + ((kk / 4) * BN * 128 + off) / 16);
      wgmma_ss_m64n64k16<false, false, E>(s, da, db, !kOne || kk > 0);
    }
    wgmma_commit();
    wgmma_wait<0>();
    wgmma_fence_operands(s);

    float corrs[2];
    const bool rescale = fwd_tile_softmax<BN>(s, args, cur, lane, tok, m, l, sl2, corrs);
    fwd_rescale_o<DV>(o, rescale, corrs);
    uint32_t pa[BN / 16][4];
    fwd_pack_p<BN, E>(s, pa);
    fwd_pv_waited<DV, BN, E>(o, pa, vs16);
    if constexpr (!kOne) __syncthreads();  // the next iteration's prefetch overwrites this stage
    cur = next;
  }
  cp_async_wait<0>();

  fwd_store_o_lse<DV, E>(args, o, m, l, row, tok, kvh, lane);
}

template <int D, FwdBarriers kBarriers = kFwdBarriers, FwdLoads kLoads = kFwdLoads, DType E = DType::kBf16, int DV = D>
void launch_fwd_wgmma(const FwdArgs& a, cudaStream_t stream) {
  using S = FwdWgmmaShape<D, DV>;
  const int64_t blocks = static_cast<int64_t>(a.lists.num_major) * a.p.hkv;
  if (blocks == 0) return;
  auto* kernel = attention_fwd_wgmma_kernel<D, kBarriers, kLoads, E, DV>;
  check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, S::kSmemBytes),
             "attention_forward: shared memory limit");
  kernel<<<static_cast<unsigned>(blocks), S::kThreads, S::kSmemBytes, stream>>>(a);
  check_cuda(cudaGetLastError(), "attention_forward: launch");
}

}  // namespace treecp::cuda::detail
