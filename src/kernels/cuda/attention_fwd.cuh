// Forward slice attention: one block per (query tile, KV head). A query tile packs
// kFwdBlockRows / group tokens x the group's q heads (GQA packing: the whole group shares each K/V
// tile loaded into shared memory). The block walks its tile's KV-tile list (ancestors' tiles, then
// its own diagonal) with a two-stage cp.async pipeline and an online softmax in registers.
#pragma once

#include <cfloat>

#include "kernels/cuda/attention_fwd_mask.cuh"
#include "kernels/cuda/launch.hpp"
#include "kernels/cuda/mma.cuh"

namespace treecp::cuda::detail {

// M = row fragments of 16 per warp. M = 1: 8 warps x 16 rows, Q fragments kept in registers (up to Dqk = 128; past
// it Q is re-read from shared memory, as at M = 2, to stay under 255 registers).
// M = 2: 4 warps x 32 rows, each K/V fragment read from shared memory feeds two MMAs (half the
// shared-memory traffic per FLOP), Q re-read from shared memory to stay under 255 registers, and two
// blocks per SM instead of one.
// D is Dqk (the columns of Q and K), DV the columns of V and O (attention_dims.hpp's kAttentionDims).
template <int D, int M, int DV = D>
struct FwdShape {
  static constexpr int kRows = kFwdBlockRows;
  static constexpr int kKeys = kFwdBlockKeys;
  static constexpr int kWarps = kRows / (16 * M);
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kBlocksPerSm = M == 1 ? 1 : 2;
  static constexpr int kSmemBytes = ((kRows + 2 * kKeys) * D + 2 * kKeys * DV) * 2;  // Q + two stages of K and V
  static constexpr bool kQInRegisters = M == 1 && D <= 128;
  static_assert(kSmemBytes <= 227 * 1024, "mma.sync forward: Q and two K/V stages must fit 227 KiB");
};

template <int D, int M, DType E = DType::kBf16, int DV = D>
__global__ void __launch_bounds__(FwdShape<D, M, DV>::kThreads, FwdShape<D, M, DV>::kBlocksPerSm)
    attention_fwd_kernel(const FwdArgs args) {
  using S = FwdShape<D, M, DV>;
  using T = elem_t<E>;
  constexpr int BM = S::kRows, BN = S::kKeys;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sK = sQ + BM * D;
  T* sV = sK + 2 * BN * D;  // [2][BN][DV]

  const AttentionForwardParams& p = args.p;
  const auto& L = args.lists;
  // Longest tiles first across all KV heads (the heads of one tile are adjacent): a head-major order
  // would start the last head's longest tiles late and leave a tail.
  const int tile = L.order[blockIdx.x / p.hkv];
  const int kvh = blockIdx.x % p.hkv;
  const int G = args.group;
  const int t0 = tile * L.major_tile_rows;
  const int valid_rows = L.major_tile_rows * G;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const auto* q = static_cast<const T*>(p.q);
  const auto* k = static_cast<const T*>(p.k);
  const auto* v = static_cast<const T*>(p.v);

  // packed row r = (token t0 + r / G, q head kvh * G + r % G)
  load_tile_async<D, S::kThreads>(sQ, BM, q, [&](int r) -> const T* {
    const int t = t0 + r / G;
    if (r >= valid_rows || t >= args.q_rows) return nullptr;
    return q + t * p.q_row_stride + (kvh * G + r % G) * p.q_head_stride;
  });
  const int e_end = L.offsets[tile + 1];
  RunCursor cur = RunCursor::first(L.entries, L.offsets[tile], e_end);
  auto load_kv = [&](int kt, int stage) {
    const int k0 = L.minor_start[kt];  // BN rows from the tile's start, whatever its length
    load_tile_async<D, S::kThreads>(sK + stage * BN * D, BN, k, [&](int r) -> const T* {
      return k0 + r < args.kv_rows ? k + (k0 + r) * p.k_row_stride + kvh * p.k_head_stride : nullptr;
    });
    load_tile_async<DV, S::kThreads>(sV + stage * BN * DV, BN, v, [&](int r) -> const T* {
      return k0 + r < args.kv_rows ? v + (k0 + r) * p.v_row_stride + kvh * p.v_head_stride : nullptr;
    });
  };
  if (cur.entry < e_end) load_kv(cur.tile, 0);
  cp_async_commit();

  // this lane's rows: fragment f, half h -> row warp * 16 M + 16 f + lane / 4 + 8 h
  int row[M][2], tok[M][2];
#pragma unroll
  for (int f = 0; f < M; ++f)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      row[f][h] = warp * 16 * M + 16 * f + lane / 4 + 8 * h;
      tok[f][h] = t0 + row[f][h] / G;
    }
  float o[M][DV / 8][4];
#pragma unroll
  for (int f = 0; f < M; ++f)
#pragma unroll
    for (int j = 0; j < DV / 8; ++j) o[f][j][0] = o[f][j][1] = o[f][j][2] = o[f][j][3] = 0.f;
  float m[M][2], l[M][2];
#pragma unroll
  for (int f = 0; f < M; ++f) m[f][0] = m[f][1] = -INFINITY, l[f][0] = l[f][1] = 0.f;
  constexpr int kQRegs = S::kQInRegisters ? D / 16 : 1;  // M = 1 keeps Q in registers (up to Dqk = 128)
  uint32_t qf[kQRegs][4];
  const float sl2 = p.scale * kLog2e;  // softmax in base 2: exp(x * scale) = exp2(x * scale * log2 e)

  for (int stage = 0, first = 1; cur.entry < e_end; stage ^= 1, first = 0) {
    const RunCursor next = cur.next(L.entries, e_end);
    if (next.entry < e_end) load_kv(next.tile, stage ^ 1);
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    if constexpr (S::kQInRegisters) {
      if (first) {
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk)
          ldmatrix_x4(qf[kk], smem_addr(sQ + swz<D>(warp * 16 + lane % 16, kk * 16 + (lane / 16) * 8)));
      }
    }
    const T* k_s = sK + stage * BN * D;
    const T* v_s = sV + stage * BN * DV;

    // S = Q K^T for this warp's 16 M rows x BN keys
    float s[M][BN / 8][4];
#pragma unroll
    for (int f = 0; f < M; ++f)
#pragma unroll
      for (int j = 0; j < BN / 8; ++j) s[f][j][0] = s[f][j][1] = s[f][j][2] = s[f][j][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t a[M][4];
      if constexpr (S::kQInRegisters) {
#pragma unroll
        for (int c = 0; c < 4; ++c) a[0][c] = qf[kk][c];
      } else {
#pragma unroll
        for (int f = 0; f < M; ++f)
          ldmatrix_x4(a[f], smem_addr(sQ + swz<D>(warp * 16 * M + 16 * f + lane % 16, kk * 16 + (lane / 16) * 8)));
      }
#pragma unroll
      for (int np = 0; np < BN / 16; ++np) {
        uint32_t b[4];
        ldmatrix_x4(b, smem_addr(k_s + swz<D>(np * 16 + lane % 8 + (lane / 16) * 8, kk * 16 + ((lane / 8) % 2) * 8)));
#pragma unroll
        for (int f = 0; f < M; ++f) {
          mma_m16n8k16<E>(s[f][2 * np], a[f], b[0], b[1]);
          mma_m16n8k16<E>(s[f][2 * np + 1], a[f], b[2], b[3]);
        }
      }
    }

    const TileEntry e = L.entries[cur.entry];
    const int ka = L.minor_start[cur.tile], kb = L.minor_start[cur.tile + 1];
    if (e.mask_count > 0 || kb - ka < BN) {  // a partial run, or a tile shorter than BN (keys from kb on are the next tile's)
      uint32_t vis[M];
      fwd_visible_bits<BN, M>(args, e, ka, kb, lane, tok, vis);
#pragma unroll
      for (int f = 0; f < M; ++f)
#pragma unroll
        for (int nb = 0; nb < BN / 8; ++nb)
#pragma unroll
          for (int c = 0; c < 4; ++c)
            if (!(vis[f] >> (nb * 4 + c) & 1u)) s[f][nb][c] = -INFINITY;
    }

    // online softmax; rows are shared by the 4 lanes of a quad
    bool rescale = false;  // some row of this warp raised its max: O needs the correction
    float corrs[M][2];
#pragma unroll
    for (int f = 0; f < M; ++f)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float mx = m[f][h];
#pragma unroll
        for (int nb = 0; nb < BN / 8; ++nb) mx = fmaxf(mx, fmaxf(s[f][nb][2 * h], s[f][nb][2 * h + 1]) * sl2);
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float base = mx == -INFINITY ? 0.f : mx;  // all masked so far: keep exp2 finite
        const float corr = exp2_fast(m[f][h] - base);
        m[f][h] = mx;
        float sum = 0.f;
#pragma unroll
        for (int nb = 0; nb < BN / 8; ++nb) {
          s[f][nb][2 * h] = exp2_fast(fmaf(s[f][nb][2 * h], sl2, -base));
          s[f][nb][2 * h + 1] = exp2_fast(fmaf(s[f][nb][2 * h + 1], sl2, -base));
          sum += s[f][nb][2 * h] + s[f][nb][2 * h + 1];
        }
        l[f][h] = l[f][h] * corr + sum;
        corrs[f][h] = corr;
        rescale |= corr != 1.f;
      }
    // Late in a long row the max rarely moves: skip the D/4 multiplies per row when no row of the
    // warp needs them (a warp-uniform branch).
    if (__any_sync(0xffffffffu, rescale)) {
#pragma unroll
      for (int f = 0; f < M; ++f)
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
          for (int j = 0; j < DV / 8; ++j) {
            o[f][j][2 * h] *= corrs[f][h];
            o[f][j][2 * h + 1] *= corrs[f][h];
          }
    }

    // O += P V; the accumulator layout of P is the A-operand layout, two key blocks per k16 step
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      uint32_t a[M][4];
#pragma unroll
      for (int f = 0; f < M; ++f) {
        a[f][0] = pack2<E>(s[f][2 * kk][0], s[f][2 * kk][1]);
        a[f][1] = pack2<E>(s[f][2 * kk][2], s[f][2 * kk][3]);
        a[f][2] = pack2<E>(s[f][2 * kk + 1][0], s[f][2 * kk + 1][1]);
        a[f][3] = pack2<E>(s[f][2 * kk + 1][2], s[f][2 * kk + 1][3]);
      }
#pragma unroll
      for (int dp = 0; dp < DV / 16; ++dp) {
        uint32_t b[4];
        ldmatrix_x4_trans(b, smem_addr(v_s + swz<DV>(kk * 16 + lane % 8 + ((lane / 8) % 2) * 8, dp * 16 + (lane / 16) * 8)));
#pragma unroll
        for (int f = 0; f < M; ++f) {
          mma_m16n8k16<E>(o[f][2 * dp], a[f], b[0], b[1]);
          mma_m16n8k16<E>(o[f][2 * dp + 1], a[f], b[2], b[3]);
        }
      }
    }
    __syncthreads();  // the next iteration's prefetch overwrites this stage
    cur = next;
  }
  cp_async_wait<0>();

  auto* out = static_cast<T*>(p.o);
#pragma unroll
  for (int f = 0; f < M; ++f)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float sum = l[f][h];
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      if (row[f][h] >= valid_rows || tok[f][h] >= args.q_rows) continue;
      const float inv = sum > 0.f ? 1.f / sum : 0.f;
      const int head = kvh * G + row[f][h] % G;
      T* dst = out + tok[f][h] * p.o_row_stride + head * p.o_head_stride + 2 * (lane % 4);
#pragma unroll
      for (int j = 0; j < DV / 8; ++j)
        *reinterpret_cast<uint32_t*>(dst + j * 8) = pack2<E>(o[f][j][2 * h] * inv, o[f][j][2 * h + 1] * inv);
      // natural-log LSE = max * ln 2 + ln(sum) with max kept in base-2 units
      if (lane % 4 == 0)
        p.lse[tok[f][h] * p.lse_row_stride + head * p.lse_head_stride] = sum > 0.f ? m[f][h] * kLn2 + logf(sum) : -INFINITY;
    }
}

template <int D, int M, DType E = DType::kBf16, int DV = D>
void launch_fwd(const FwdArgs& a, cudaStream_t stream) {
  using S = FwdShape<D, M, DV>;
  const int64_t blocks = static_cast<int64_t>(a.lists.num_major) * a.p.hkv;
  if (blocks == 0) return;
  check_cuda(cudaFuncSetAttribute(attention_fwd_kernel<D, M, E, DV>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  S::kSmemBytes),
             "attention_forward: shared memory limit");
  attention_fwd_kernel<D, M, E, DV><<<static_cast<unsigned>(blocks), S::kThreads, S::kSmemBytes, stream>>>(a);
  check_cuda(cudaGetLastError(), "attention_forward: launch");
}

}  // namespace treecp::cuda::detail
