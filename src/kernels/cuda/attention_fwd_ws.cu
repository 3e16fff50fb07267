// The wgmma forward with warp specialisation, the default at head dim 128 (Mainloop::kWgmmaWs). Warpgroup 2
// holds a single producer thread that loads Q once and the run list's K/V tiles with TMA into a
// four-stage ring (mbarriers with transaction counts); warpgroups 0 and 1 (240 registers through
// setmaxnreg) only compute, each on its 64 rows, with no block barrier: a warpgroup waits for its
// stage to be full and releases it once its P V has retired. Same tile lists, masks, online softmax
// and epilogue as attention_fwd_wgmma.cuh (its fwd_* helpers). Needs head dim 128, G dividing 128 (Q's TMA box is 64
// columns x G heads x 128 / G tokens), 16-byte aligned rows.
#include <cuda.h>
#include <cudaTypedefs.h>

#include <cfloat>

#include "core/error.hpp"
#include "kernels/cuda/attention_fwd_wgmma.cuh"  // the per-tile steps both forward kernels share
#include "kernels/cuda/launch.hpp"
#include "kernels/cuda/mma.cuh"
#include "kernels/cuda/wgmma.cuh"

namespace treecp::cuda::detail {
namespace {

struct FwdWsArgs {
  CUtensorMap tq, tk, tv;  // 64-byte aligned by their type
  FwdArgs a;
};

constexpr int kWsD = 128, kWsRows = 128, kWsKeys = 64, kWsStages = 4;
constexpr int kWsThreads = 384;  // two consumer warpgroups, then the producer's
constexpr int kWsSmem = (kWsRows + 2 * kWsStages * kWsKeys) * kWsD * 2 + 8 * (1 + 2 * kWsStages) + 1024;

__device__ __forceinline__ void mbar_init(uint32_t addr, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(addr), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t addr) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(addr) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint32_t addr, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(addr), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t addr, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred done;\nWAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n}\n" ::"r"(addr),
      "r"(parity)
      : "memory");
}
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
// S += A B with A (Q) in registers and B (K) K-major in shared memory; accumulate = false overwrites S.
__device__ __forceinline__ void wgmma_rs_m64n64k16_kmajor(float (&d)[32], const uint32_t (&a)[4], uint64_t desc_b,
                                                          bool accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(static_cast<int>(accumulate)));
}

__device__ __forceinline__ void tma_load_3d(uint32_t dst, const CUtensorMap* map, int c0, int c1, int c2, uint32_t mbar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(mbar)
      : "memory");
}

// kQReg: Q in registers (ldmatrix once per block) as the A operand of S = Q K^T, so that GEMM reads only K
// from shared memory (half its operand traffic); costs 32 of the consumers' 240 registers.
// kOverlap: FA3's intra-warpgroup overlap. Tile n issues S(n) and then P V of tile n - 1; it waits only
// for S(n), and its mask and softmax run while P V(n - 1) is still on the tensor cores. O is rescaled
// once that P V has retired, and tile n's P goes to a second set of A registers.
template <bool kQReg, bool kOverlap>
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
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
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
      const int k0 = cur.tile * BN;
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

    const TileEntry e = L.entries[cur.entry];
    if (e.mask_count > 0) fwd_mask_tile<BN>(sc, args, e, cur.tile, lane, tok);
    float corrs[2];
    const bool rescale = fwd_softmax_tile<BN>(sc, m, l, sl2, corrs);
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

  fwd_store_o_lse<D>(args, o, m, l, row, tok, kvh, lane);
}

// The driver's tensor-map encoder, looked up once through the runtime (no libcuda link); nullptr when
// the driver does not provide it, and the default path then takes the cp.async kernel.
PFN_cuTensorMapEncodeTiled_v12000 encode_tiled() {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess) {
      (void)cudaGetLastError();  // leave no sticky error behind
      return static_cast<PFN_cuTensorMapEncodeTiled_v12000>(nullptr);
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
  }();
  return fn;
}

// [rows, heads, D] bf16 with element strides; box = 64 columns x box_heads x box_rows, 128-byte swizzle
CUtensorMap tensor_map(const void* ptr, int64_t rows, int64_t heads, int64_t row_stride, int64_t head_stride,
                       uint32_t box_heads, uint32_t box_rows) {
  CUtensorMap m;
  cuuint64_t dims[3] = {static_cast<cuuint64_t>(kWsD), static_cast<cuuint64_t>(heads), static_cast<cuuint64_t>(rows)};
  cuuint64_t strides[2] = {static_cast<cuuint64_t>(head_stride * 2), static_cast<cuuint64_t>(row_stride * 2)};
  cuuint32_t box[3] = {64, box_heads, box_rows};
  cuuint32_t elem[3] = {1, 1, 1};
  const CUresult r = encode_tiled()(&m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, const_cast<void*>(ptr), dims, strides, box,
                                    elem, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                    CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  require(r == CUDA_SUCCESS, "attention_forward (ws): cuTensorMapEncodeTiled failed with ", static_cast<int>(r));
  return m;
}

}  // namespace

bool launch_fwd_ws_d128(const FwdArgs& a, cudaStream_t stream, int variant) {
  if (a.p.head_dim != kWsD || kWsRows % a.group != 0 || encode_tiled() == nullptr) return false;
  const int64_t blocks = static_cast<int64_t>(a.lists.num_major) * a.p.hkv;
  if (blocks == 0) return true;
  FwdWsArgs w;
  w.a = a;
  w.tq = tensor_map(a.p.q, a.q_rows, a.p.hq, a.p.q_row_stride, a.p.q_head_stride, static_cast<uint32_t>(a.group),
                    static_cast<uint32_t>(kWsRows / a.group));
  w.tk = tensor_map(a.p.k, a.kv_rows, a.p.hkv, a.p.k_row_stride, a.p.k_head_stride, 1, kWsKeys);
  w.tv = tensor_map(a.p.v, a.kv_rows, a.p.hkv, a.p.v_row_stride, a.p.v_head_stride, 1, kWsKeys);
  auto* kernel = variant == 0 ? attention_fwd_ws_kernel<false, false>
                 : variant == 1 ? attention_fwd_ws_kernel<true, false>
                                : attention_fwd_ws_kernel<true, true>;
  check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kWsSmem),
             "attention_forward (ws): shared memory limit");
  kernel<<<static_cast<unsigned>(blocks), kWsThreads, kWsSmem, stream>>>(w);
  check_cuda(cudaGetLastError(), "attention_forward (ws): launch");
  return true;
}

}  // namespace treecp::cuda::detail
