// Internal: the GDN/KDA chunk kernels' bodies and the host code that schedules them, written once for two
// executors: gdn.cu (nvcc: each body becomes a __global__ kernel) and tests/test_gdn_cuda_emulated.cpp (the host
// compiler: each block's threads are std::threads and block_sync() a std::barrier), so the CPU suite runs the very
// code the GPU runs. Bodies use only block-wide barriers, shared and global memory and, on the tensor-core paths, the
// warp's mma.sync behind gdn_mma_tf32x3, gdn_mma_bf16_term and gdn_block_bf16 (whose host paths compute each lane's
// results themselves); they take (block, thread, threads) as arguments. Math of kernels/cpu/gdn.hpp; the plan is in
// docs/kernels.md.
//
// Per (chunk, head) of c <= 64 tokens, G_i = Σ_{t<=i} g_t (per key channel; the scalar gate broadcasts):
//   prep:   Qst = e^G ⊙ Q, Kst = e^G ⊙ K, R = e^{G_last - G} ⊙ K, P (j < i) and C (j <= i) pair matrices,
//           L⁻¹ (L = I + diag(β) P) by forward substitution, U = L⁻¹ diag(β) V, W = L⁻¹ diag(β) Kst, egl = e^{G_last}
//   scan:   per (run, head, 32 or 16 state columns), chunks in order: D = U - W S; Y = scale (Qst S + C D);
//           S <- diag(egl) S + Rᵀ D (the split forward and the backward: no Y, S0 and D stored instead)
//   output: (split forward) per (chunk, head): Y = scale (Qst S0 + C D)
//   bwd scan: chunks in reverse: dD = scale Cᵀ dY + R dS; dS <- diag(egl) dS + scale Qstᵀ dY - Wᵀ dD
//   grads:  per (chunk, head), from the chunk-start state S0 and dS at the chunk end: kernels/cpu's chunk backward
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "core/error.hpp"
#include "kernels/cuda/dtype.hpp"
#include "kernels/cuda/gdn_types.hpp"

#if defined(__CUDACC__)
#include "kernels/cuda/attention.hpp"  // check_cuda
#include "kernels/cuda/mma.cuh"        // mma_m16n8k16, pack2 (bf16 by default)
#define TREECP_GDN_FN __device__ inline
#define TREECP_GDN_HD __host__ __device__ inline
#define TREECP_GDN_UNROLL _Pragma("unroll")
namespace treecp::cuda::detail {
TREECP_GDN_FN void block_sync() { __syncthreads(); }
}  // namespace treecp::cuda::detail
#else
#include <barrier>
#define TREECP_GDN_FN inline
#define TREECP_GDN_HD inline
#define TREECP_GDN_UNROLL
namespace treecp::cuda::detail {
// The emulator sets each thread's barrier before it runs a block.
inline thread_local std::barrier<>* emulated_block_barrier = nullptr;
inline void block_sync() { emulated_block_barrier->arrive_and_wait(); }
}  // namespace treecp::cuda::detail
#endif

namespace treecp::cuda::detail {
TREECP_GDN_HD float bits_to_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}
TREECP_GDN_HD uint32_t float_to_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}
}  // namespace treecp::cuda::detail

namespace treecp::cuda::detail {

constexpr int kGdnChunk = 64;        // tokens per chunk (rows of the chunk-local matrices)
constexpr int kGdnTile = 32;         // default state columns per block of the scans (GdnCudaParams::scan_columns)
constexpr int kGdnThreads = 256;     // threads per block of every GDN kernel
constexpr int kGdnMaxDim = 256;      // dk, dv at most (the scans' shared state tile: (dk + 64) x 32 fp32)

TREECP_GDN_HD float bf16_to_float(uint16_t h) { return bits_to_float(static_cast<uint32_t>(h) << 16); }
// Round to nearest even; NaN stays NaN (the device's one cvt.rn.bf16.f32 instruction; the host's integer form gives
// the same bits for every number, and a NaN of another payload).
TREECP_GDN_HD uint16_t float_to_bf16(float f) {
#if defined(__CUDA_ARCH__)
  return __bfloat16_as_ushort(__float2bfloat16_rn(f));
#else
  uint32_t u = float_to_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
#endif
}
// lo and hi rounded as float_to_bf16, packed (lo in the low half): one cvt.rn.bf16x2.f32 on the device.
TREECP_GDN_HD uint32_t gdn_bf16x2(float lo, float hi) {
#if defined(__CUDA_ARCH__)
  uint32_t r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
#else
  return static_cast<uint32_t>(float_to_bf16(lo)) | (static_cast<uint32_t>(float_to_bf16(hi)) << 16);
#endif
}

// x rounded to bf16 (as float_to_bf16, back to float).
TREECP_GDN_HD float gdn_round_bf16(float x) { return bf16_to_float(float_to_bf16(x)); }

// The activations' 16-bit element type E (GdnCudaParams::dtype): an element's value, and an fp32 rounded to nearest
// even into one (fp16: to inf from 65520 on, as the device's __float2half_rn).
template <DType E>
TREECP_GDN_HD float gdn_from16(uint16_t h) {
  if constexpr (E == DType::kBf16) {
    return bf16_to_float(h);
  } else {
#if defined(__CUDA_ARCH__)
    return __half2float(__ushort_as_half(h));
#else
    return bits_to_f32(h, DType::kF16);
#endif
  }
}
template <DType E>
TREECP_GDN_HD uint16_t gdn_to16(float f) {
  if constexpr (E == DType::kBf16) {
    return float_to_bf16(f);
  } else {
#if defined(__CUDA_ARCH__)
    return __half_as_ushort(__float2half_rn(f));
#else
    return f32_to_bits(f, DType::kF16);
#endif
  }
}

// How a chunk-parallel kernel computes its products (a template argument of prep and the gradients): register-blocked
// fp32 FMA, 3xTF32 mma.sync (GdnCudaParams::tensor_cores) or bf16 mma.sync (GdnPrecision::bf16_tensor); with
// kGdnF16 added, the activations (q, k, v, g, beta, y, dy) are fp16 rather than bf16. The kernels' template argument
// kMath is that sum, so each element type is its own instantiation and the bf16 kernels' code is what it was.
// fp16 activations take the fp32 products only: the bf16 products round intermediates (the chunk-start state, D,
// L⁻¹ diag(β) Kst, the gradients' dS) whose magnitudes the inputs do not bound into their 16-bit operands, and fp16's
// largest finite value 65504 (bf16's range is fp32's) would turn a large state into inf; gdn_check refuses them.
enum GdnMath : int { kGdnFma = 0, kGdnTf32x3 = 1, kGdnBf16 = 2, kGdnF16 = 4 };
TREECP_GDN_HD constexpr int gdn_math(int k) { return k & 3; }
TREECP_GDN_HD constexpr DType gdn_elem(int k) { return (k & kGdnF16) ? DType::kF16 : DType::kBf16; }

struct GdnChunkDesc {
  int64_t t;    // first token
  int32_t len;  // tokens, 1..64
  int32_t run;
};
struct GdnRunDesc {
  int32_t chunk_begin, chunk_count, in_slot, out_slot;
};

// Offsets (floats) of the chunk-local arrays in one (chunk, head) block of the workspace. Rows of 64 tokens;
// a chunk of c < 64 tokens uses the first c rows (and the first c columns of the 64 x 64 ones).
struct GdnBlock {
  int64_t G = 0, Qst = 0, Kst = 0, R = 0, W = 0;  // [64][dk]
  int64_t U = 0;                                  // [64][dv]
  int64_t P = 0, C = 0;                           // [64][64]: P[i][j] (j < i), C[i][j] (j <= i)
  int64_t Ti = 0;                                 // [64][64]: L⁻¹, L = I + diag(β) P (unit lower triangular)
  int64_t egl = 0;                                // [dk]
  // the split forward and the backward
  int64_t S0 = 0, D = 0;  // [dk][dv]: the state at the chunk start; [64][dv]: D = U - W S0
  bool states_bf16 = false;  // S0 and D stored as bf16 (the split forward on bf16 products), half the floats
  // backward only
  int64_t dSe = 0;               // [dk][dv]: dL/dS at the chunk end
  int64_t dD = 0, dX = 0;        // [64][dv]
  int64_t dZ = 0, dGm = 0, rr = 0;  // [64][dk]
  int64_t dL = 0, dC = 0;        // [64][64]
  int64_t pq = 0, pk = 0, pt = 0;  // [64][dk]: the scalar gate's pair sums (gdn gradients)
  int64_t size = 0;

  // `states`: S0 and D (the split forward's output kernel reads them; the backward always has them, in fp32), as
  // bf16 with `bf16`.
  static GdnBlock make(int dk, int dv, bool backward, bool states = false, bool bf16 = false) {
    GdnBlock b;
    int64_t at = 0;
    auto take = [&](int64_t n) {
      const int64_t o = at;
      at += (n + 63) / 64 * 64;  // 256-byte aligned arrays
      return o;
    };
    const int64_t c = kGdnChunk;
    b.G = take(c * dk); b.Qst = take(c * dk); b.Kst = take(c * dk); b.R = take(c * dk); b.W = take(c * dk);
    b.U = take(c * dv);
    b.P = take(c * c); b.C = take(c * c); b.Ti = take(c * c);
    b.egl = take(dk);
    if (backward || states) {
      b.states_bf16 = !backward && bf16;
      const int64_t per = b.states_bf16 ? 2 : 1;  // elements a float holds
      b.S0 = take((int64_t{dk} * dv + per - 1) / per);
      b.D = take((c * dv + per - 1) / per);
    }
    if (backward) {
      b.dSe = take(int64_t{dk} * dv);
      b.dD = take(c * dv); b.dX = take(c * dv);
      b.dZ = take(c * dk); b.dGm = take(c * dk); b.rr = take(c * dk);
      b.dL = take(c * c); b.dC = take(c * c);
      b.pq = take(c * dk); b.pk = take(c * dk); b.pt = take(c * dk);
    }
    b.size = at;
    return b;
  }
};

// ---- block products: out(i, j) = Σ_l A(i, l) B(l, j), register-blocked. Each thread owns a TM x TN tile of the
// output, its rows ti + r * mt and columns tj + c * nt (strided, so that the lanes of a warp read consecutive
// columns of a B panel and one row, or rows in distinct banks, of an A panel); the operands come through shared
// memory in panels of kGdnPanel inner indices, each staged once per round of nthr tiles (one round at the GPU's
// 256 threads for the shapes the kernels use). Every thread of the block must call it (it holds barriers).

constexpr int kGdnPanel = 32;  // inner indices per staged panel

// A read-only view of a matrix in global (or shared) memory: element (i, j) at p[i * rs + j * cs], fp32 or (`half`)
// 16-bit of type E.
template <DType E = DType::kBf16>
struct GdnViewT {
  static constexpr DType kElem = E;
  const void* p;
  int64_t rs, cs;
  bool half = false;
  TREECP_GDN_FN float at(int i, int j) const {
    const int64_t o = i * rs + j * cs;
    return half ? gdn_from16<E>(static_cast<const uint16_t*>(p)[o]) : static_cast<const float*>(p)[o];
  }
  // The transposed matrix.
  TREECP_GDN_FN GdnViewT t() const { return {p, cs, rs, half}; }
};
using GdnView = GdnViewT<DType::kBf16>;
TREECP_GDN_HD GdnView gdn_view(const float* p, int64_t rs, int64_t cs = 1) { return {p, rs, cs, false}; }

// Row strides of the staged panels: A [rows][kGdnPanel + 1] and B [kGdnPanel][cols | 1] (odd: a warp's lanes,
// reading one column of several rows, or writing one, hit distinct banks); for tensor cores A [rows][kGdnPanel + 4]
// and B [kGdnPanel][32k + 8] (the fragments' lanes 4g + q read bank 4g + q of A and 8q + g of B).
TREECP_GDN_HD int gdn_panel_lda(bool tensor) { return tensor ? kGdnPanel + 4 : kGdnPanel + 1; }
TREECP_GDN_HD int gdn_panel_ldb(int cols, bool tensor) { return tensor ? (cols + 31) / 32 * 32 + 8 : (cols | 1); }

// The bf16 path's panels (gdn_block_bf16): rows of kGdnBf16Panel inner indices, bf16.
constexpr int kGdnBf16Panel = 64;
constexpr int kGdnBf16Ld = kGdnBf16Panel + 8;  // bf16 elements per staged row (36 words)

// The bf16 path's panels in floats, and the row stride of its result tile [16-rounded rows][ld] fp32.
TREECP_GDN_HD int64_t gdn_bf16_panel_floats(int rows, int cols) {
  return static_cast<int64_t>((rows + 15) / 16 * 16 + (cols + 7) / 8 * 8) * kGdnBf16Ld / 2;
}
TREECP_GDN_HD int gdn_bf16_tile_ld(int cols) { return (cols + 7) / 8 * 8 + 4; }

// Floats of shared memory gdn_block_product needs for outputs of at most `rows` x `cols` (any path).
TREECP_GDN_HD int64_t gdn_product_smem(int rows, int cols) {
  const int64_t f32 = static_cast<int64_t>(rows) * gdn_panel_lda(true) + static_cast<int64_t>(kGdnPanel) * gdn_panel_ldb(cols, true);
  const int64_t b16 = gdn_bf16_panel_floats(rows, cols) + static_cast<int64_t>((rows + 15) / 16 * 16) * gdn_bf16_tile_ld(cols);
  return f32 > b16 ? f32 : b16;
}

// Copies the panel [0, rows) x [l0, l0 + kGdnPanel) of A (zeros past `inner`) to dst [rows][ld] when `a`, else the
// panel [l0, l0 + kGdnPanel) x [0, cols) of B to dst [kGdnPanel][ld]; the index along which the source is
// contiguous varies fastest across threads.
// A thread issues the loads of kGdnStageBatch elements before it stores the first (a store waits for its load, and
// one load at a time was a memory round trip per element).
constexpr int kGdnStageBatch = 4;
template <class V>
TREECP_GDN_FN void gdn_stage_panel(float* dst, int ld, const V& v, bool a, int extent, int l0, int inner, int tid,
                                   int nthr) {
  const bool inner_fast = a ? v.cs == 1 : v.rs == 1;
  const int total = extent * kGdnPanel;
  for (int base = tid; base < total; base += kGdnStageBatch * nthr) {
    float val[kGdnStageBatch];
    int at[kGdnStageBatch];
    TREECP_GDN_UNROLL
    for (int b = 0; b < kGdnStageBatch; ++b) {
      const int idx = base + b * nthr;
      const int x = inner_fast ? idx / kGdnPanel : idx % extent;  // the row of A or the column of B
      const int l = inner_fast ? idx % kGdnPanel : idx / extent;
      const bool in = idx < total && l0 + l < inner;
      val[b] = in ? (a ? v.at(x, l0 + l) : v.at(l0 + l, x)) : 0.f;
      at[b] = idx < total ? (a ? x * ld + l : l * ld + x) : -1;
    }
    TREECP_GDN_UNROLL
    for (int b = 0; b < kGdnStageBatch; ++b)
      if (at[b] >= 0) dst[at[b]] = val[b];
  }
}

// One term s A B of a sum of products over operands already in shared memory: A(i, l) = A[i * ars + l * acs],
// B(l, j) = B[l * brs + j * bcs], l < len.
struct GdnTerm {
  const float* A;
  int ars, acs;
  const float* B;
  int brs, bcs;
  int len;
  float s;
};
// ---- tensor cores (GdnCudaParams::tensor_cores): the chunk products as mma.sync m16n8k8 with tf32 operands, each operand split in two
// (x = hi + lo, hi = tf32(x), lo = tf32(x - hi)) and three products accumulated (lo·hi, hi·lo, hi·hi: "3xTF32"),
// which leaves an error of about 2^-21 of each product, the size of fp32 rounding over the inner sums, so the
// fp32 tolerances of the tests hold. Fragments of the PTX ISA's m16n8k8 .tf32 layout, g = lane / 4, q = lane % 4:
//   A (16 x 8): a0 (g, q), a1 (g + 8, q), a2 (g, q + 4), a3 (g + 8, q + 4);  B (8 x 8): b0 (q, g), b1 (q + 4, g)
//   C (16 x 8): c0 (g, 2q), c1 (g, 2q + 1), c2 (g + 8, 2q), c3 (g + 8, 2q + 1)
// The host path computes each lane's four C elements from the operands directly with the same split, so the CPU
// suite checks the tiling, the bounds, the output positions and the arithmetic; the operand fragments' positions
// (the loads feeding the instruction) only the GPU tests check.

// Round to tf32 (10-bit significand) to nearest, ties away from zero (cvt.rna.tf32.f32).
TREECP_GDN_HD float gdn_tf32(float x) {
#if defined(__CUDA_ARCH__)
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
  return __uint_as_float(r & 0xffffe000u);
#else
  uint32_t u = float_to_bits(x);
  if ((u & 0x7f800000u) != 0x7f800000u) u += 0x1000u;  // finite: half an ulp of tf32 on the magnitude
  return bits_to_float(u & 0xffffe000u);
#endif
}

// c += the term's A[r0 .. r0 + 16)[k0 .. k0 + 8) B[k0 .. k0 + 8)[c0 .. c0 + 8) (zeros past rows, cols, len).
TREECP_GDN_FN void gdn_mma_tf32x3(float (&c)[4], const GdnTerm& m, int r0, int c0, int k0, int rows, int cols,
                                  int lane) {
  const int g = lane >> 2, q = lane & 3;
  auto A = [&](int i, int k) { return i < rows && k < m.len ? m.s * m.A[i * m.ars + k * m.acs] : 0.f; };
  auto B = [&](int k, int j) { return k < m.len && j < cols ? m.B[k * m.brs + j * m.bcs] : 0.f; };
#if defined(__CUDA_ARCH__)
  const float a[4] = {A(r0 + g, k0 + q), A(r0 + g + 8, k0 + q), A(r0 + g, k0 + q + 4), A(r0 + g + 8, k0 + q + 4)};
  const float b[2] = {B(k0 + q, c0 + g), B(k0 + q + 4, c0 + g)};
  uint32_t ah[4], al[4], bh[2], bl[2];
  TREECP_GDN_UNROLL
  for (int i = 0; i < 4; ++i) {
    const float hi = gdn_tf32(a[i]);
    ah[i] = __float_as_uint(hi);
    al[i] = __float_as_uint(gdn_tf32(a[i] - hi));
  }
  TREECP_GDN_UNROLL
  for (int i = 0; i < 2; ++i) {
    const float hi = gdn_tf32(b[i]);
    bh[i] = __float_as_uint(hi);
    bl[i] = __float_as_uint(gdn_tf32(b[i] - hi));
  }
  auto mma = [&](const uint32_t (&x)[4], const uint32_t (&y)[2]) {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(x[0]), "r"(x[1]), "r"(x[2]), "r"(x[3]), "r"(y[0]), "r"(y[1]));
  };
  mma(al, bh);
  mma(ah, bl);
  mma(ah, bh);
#else
  for (int e = 0; e < 4; ++e) {
    const int i = r0 + g + (e >> 1) * 8, j = c0 + 2 * q + (e & 1);
    float lh = 0.f, hl = 0.f, hh = 0.f;
    for (int k = k0; k < k0 + 8; ++k) {
      const float x = A(i, k), y = B(k, j);
      const float xh = gdn_tf32(x), yh = gdn_tf32(y);
      const float xl = gdn_tf32(x - xh), yl = gdn_tf32(y - yh);
      lh += xl * yh;
      hl += xh * yl;
      hh += xh * yh;
    }
    c[e] += lh;
    c[e] += hl;
    c[e] += hh;
  }
#endif
}

// c += the term's A[r0 .. r0 + 16)[k0 .. k0 + 16) B[k0 .. k0 + 16)[c0 .. c0 + 8) with both operands rounded to bf16
// (zeros past rows, cols, len), fp32 accumulation: mma.sync m16n8k16 (fragments: mma.cuh). The host path sums each
// lane's elements in order (the products of two bf16 values are exact in fp32; only the order of the adds differs).
TREECP_GDN_FN void gdn_mma_bf16_term(float (&c)[4], const GdnTerm& m, int r0, int c0, int k0, int rows, int cols,
                                     int lane) {
  const int g = lane >> 2, q = lane & 3;
  auto A = [&](int i, int k) { return i < rows && k < m.len ? m.s * m.A[i * m.ars + k * m.acs] : 0.f; };
  auto B = [&](int k, int j) { return k < m.len && j < cols ? m.B[k * m.brs + j * m.bcs] : 0.f; };
#if defined(__CUDA_ARCH__)
  const int k = k0 + 2 * q;
  const uint32_t a[4] = {pack2(A(r0 + g, k), A(r0 + g, k + 1)), pack2(A(r0 + g + 8, k), A(r0 + g + 8, k + 1)),
                         pack2(A(r0 + g, k + 8), A(r0 + g, k + 9)),
                         pack2(A(r0 + g + 8, k + 8), A(r0 + g + 8, k + 9))};
  mma_m16n8k16(c, a, pack2(B(k, c0 + g), B(k + 1, c0 + g)), pack2(B(k + 8, c0 + g), B(k + 9, c0 + g)));
#else
  for (int e = 0; e < 4; ++e) {
    const int i = r0 + g + (e >> 1) * 8, j = c0 + 2 * q + (e & 1);
    float acc = 0.f;
    for (int k = k0; k < k0 + 16; ++k) acc += gdn_round_bf16(A(i, k)) * gdn_round_bf16(B(k, j));
    c[e] += acc;
  }
#endif
}

// out(i, j, Σ_terms s A B) for a rows x cols output in 16 x 8 tiles, one warp a tile at a time (whole warps only:
// threads past the last full warp idle), 3xTF32 or (kBf16) bf16 operands; no barrier.
template <bool kBf16 = false, int NT, class F>
TREECP_GDN_FN void gdn_warp_product(int rows, int cols, const GdnTerm (&terms)[NT], int tid, int nthr, F&& out) {
  const int lane = tid % 32, warp = tid / 32, warps = nthr / 32;
  const int mt = (rows + 15) / 16, nt = (cols + 7) / 8;
  const int g = lane >> 2, q = lane & 3;
  for (int tile = warp; warp < warps && tile < mt * nt; tile += warps) {
    const int r0 = (tile / nt) * 16, c0 = (tile % nt) * 8;
    float c[4] = {0.f, 0.f, 0.f, 0.f};
    for (int k = 0; k < NT; ++k)
      for (int k0 = 0; k0 < terms[k].len; k0 += kBf16 ? 16 : 8)
        if constexpr (kBf16)
          gdn_mma_bf16_term(c, terms[k], r0, c0, k0, rows, cols, lane);
        else
          gdn_mma_tf32x3(c, terms[k], r0, c0, k0, rows, cols, lane);
    for (int e = 0; e < 4; ++e) {
      const int i = r0 + g + (e >> 1) * 8, j = c0 + 2 * q + (e & 1);
      if (i < rows && j < cols) out(i, j, c[e]);
    }
  }
}

// The register tile of one thread: rows ti + r * mt, columns tj + c * nt of a rows x cols output, indices past it
// clamped onto its last row / column (read, never written).
template <int TM, int TN>
struct GdnRegTile {
  int ti, tj, mt, nt, rows, cols;
  int ri[TM], cj[TN];
  float acc[TM][TN];
  TREECP_GDN_FN GdnRegTile(int tile, int rows_, int cols_) : rows(rows_), cols(cols_) {
    mt = (rows + TM - 1) / TM;
    nt = (cols + TN - 1) / TN;
    ti = tile / nt;
    tj = tile % nt;
    TREECP_GDN_UNROLL
    for (int r = 0; r < TM; ++r) ri[r] = ti + r * mt < rows ? ti + r * mt : rows - 1;
    TREECP_GDN_UNROLL
    for (int c = 0; c < TN; ++c) cj[c] = tj + c * nt < cols ? tj + c * nt : cols - 1;
    TREECP_GDN_UNROLL
    for (int r = 0; r < TM; ++r)
      TREECP_GDN_UNROLL
      for (int c = 0; c < TN; ++c) acc[r][c] = 0.f;
  }
  // acc += s A B over inner indices [0, len): A(i, l) = A[i * ars + l * acs], B(l, j) = B[l * brs + j * bcs].
  TREECP_GDN_FN void mma(const float* A, int ars, int acs, const float* B, int brs, int bcs, int len, float s = 1.f) {
    for (int l = 0; l < len; ++l) {
      float a[TM], b[TN];
      TREECP_GDN_UNROLL
      for (int r = 0; r < TM; ++r) a[r] = s * A[ri[r] * ars + l * acs];
      TREECP_GDN_UNROLL
      for (int c = 0; c < TN; ++c) b[c] = B[l * brs + cj[c] * bcs];
      TREECP_GDN_UNROLL
      for (int r = 0; r < TM; ++r)
        TREECP_GDN_UNROLL
        for (int c = 0; c < TN; ++c) acc[r][c] += a[r] * b[c];
    }
  }
  template <class F>
  TREECP_GDN_FN void store(F&& out) const {
    TREECP_GDN_UNROLL
    for (int r = 0; r < TM; ++r)
      TREECP_GDN_UNROLL
      for (int c = 0; c < TN; ++c) {
        const int i = ti + r * mt, j = tj + c * nt;
        if (i < rows && j < cols) out(i, j, acc[r][c]);
      }
  }
};

// The block product on tensor cores: each warp holds up to kGdnWarpTiles 16 x 8 tiles of the output (tiles w,
// w + warps, ... of a round) across the panels.
constexpr int kGdnWarpTiles = 8;
template <class VA, class VB, class F>
TREECP_GDN_FN void gdn_block_mma(int rows, int cols, int inner, const VA& A, const VB& B, float* smem, int tid,
                                 int nthr, F&& out) {
  const int lane = tid % 32, warp = tid / 32, warps = nthr / 32;
  const int g = lane >> 2, q = lane & 3;
  const int nt = (cols + 7) / 8, tiles = (rows + 15) / 16 * nt;
  const int la = gdn_panel_lda(true), lb = gdn_panel_ldb(cols, true);
  float* As = smem;            // [rows][la]
  float* Bs = smem + rows * la;  // [kGdnPanel][lb]
  for (int base = 0; base < tiles; base += warps * kGdnWarpTiles) {
    float c[kGdnWarpTiles][4];
    TREECP_GDN_UNROLL
    for (int k = 0; k < kGdnWarpTiles; ++k)
      TREECP_GDN_UNROLL
      for (int e = 0; e < 4; ++e) c[k][e] = 0.f;
    for (int l0 = 0; l0 < inner; l0 += kGdnPanel) {
      block_sync();  // the previous panel (or the caller's writes of the operands) done
      gdn_stage_panel(As, la, A, true, rows, l0, inner, tid, nthr);
      gdn_stage_panel(Bs, lb, B, false, cols, l0, inner, tid, nthr);
      block_sync();
      const GdnTerm m{As, la, 1, Bs, lb, 1, inner - l0 < kGdnPanel ? inner - l0 : kGdnPanel, 1.f};
      TREECP_GDN_UNROLL
      for (int k = 0; k < kGdnWarpTiles; ++k) {
        const int tile = base + warp + k * warps;
        if (warp < warps && tile < tiles)
          for (int k0 = 0; k0 < m.len; k0 += 8)
            gdn_mma_tf32x3(c[k], m, (tile / nt) * 16, (tile % nt) * 8, k0, rows, cols, lane);
      }
    }
    TREECP_GDN_UNROLL
    for (int k = 0; k < kGdnWarpTiles; ++k) {
      const int tile = base + warp + k * warps;
      if (warp >= warps || tile >= tiles) continue;
      TREECP_GDN_UNROLL
      for (int e = 0; e < 4; ++e) {
        const int i = (tile / nt) * 16 + g + (e >> 1) * 8, j = (tile % nt) * 8 + 2 * q + (e & 1);
        if (i < rows && j < cols) out(i, j, c[k][e]);
      }
    }
  }
  block_sync();  // outputs written before anyone reads them or restages over the panels
}

// ---- the block product on bf16 tensor cores (GdnPrecision::bf16_tensor). Both operands are staged into shared memory
// as bf16 with the inner index contiguous, A [16-rounded rows][kGdnBf16Ld] and B transposed [8-rounded cols][kGdnBf16Ld],
// in panels of kGdnBf16Panel inner indices (one panel for inner <= 64: two barriers a product), so that every fragment
// register (two consecutive inner indices) is one 32-bit shared load: row stride 36 words puts lanes 4g + q on bank
// 4g + q. The copy reads 4 consecutive elements along whichever index the source has contiguous (one 16-byte fp32 or
// 8-byte bf16 load where aligned), and each thread issues all its loads of a batch before its first store. Each warp
// owns one 16-row band and up to kGdnBf16WarpTiles consecutive 8-column tiles of it: the A fragment is loaded once
// per 16 inner indices for all of them.
constexpr int kGdnBf16WarpTiles = 8;

// Four source elements (x .. x + 3, l) (x_fast) or (x, l .. l + 3) as floats, zeros outside [0, extent) x [0, len);
// element (x, l) is p[x * xs + l * ls]. `vec`: the four lie in range and one aligned vector holds them.
template <class V>
TREECP_GDN_FN void gdn_load4(const V& v, int64_t xs, int64_t ls, bool x_fast, bool vec, int x, int l, int extent,
                             int len, float (&o)[4]) {
  const int64_t at = x * xs + l * ls;
  if (vec) {
#if defined(__CUDA_ARCH__)
    if (v.half) {
      const uint2 u = *reinterpret_cast<const uint2*>(static_cast<const uint16_t*>(v.p) + at);
      if constexpr (V::kElem == DType::kF16) {
        const float2 lo = Elem<DType::kF16>::to_float2(u.x), hi = Elem<DType::kF16>::to_float2(u.y);
        o[0] = lo.x; o[1] = lo.y; o[2] = hi.x; o[3] = hi.y;
      } else {
        o[0] = __uint_as_float(u.x << 16); o[1] = __uint_as_float(u.x & 0xffff0000u);
        o[2] = __uint_as_float(u.y << 16); o[3] = __uint_as_float(u.y & 0xffff0000u);
      }
    } else {
      const float4 f = *reinterpret_cast<const float4*>(static_cast<const float*>(v.p) + at);
      o[0] = f.x; o[1] = f.y; o[2] = f.z; o[3] = f.w;
    }
    return;
#endif
  }
  const int64_t step = x_fast ? xs : ls;
  TREECP_GDN_UNROLL
  for (int u = 0; u < 4; ++u) {
    const bool in = x_fast ? (x + u < extent && l < len) : (x < extent && l + u < len);
    const int64_t o1 = at + u * step;
    o[u] = !in ? 0.f : v.half ? gdn_from16<V::kElem>(static_cast<const uint16_t*>(v.p)[o1]) : static_cast<const float*>(v.p)[o1];
  }
}

// dst[x][l] = bf16(A(x, l0 + l)) (a) or bf16(B(l0 + l, x)) for x < xn, l < ln (both multiples of 4; zeros at x >= extent
// and at l0 + l >= inner), row stride kGdnBf16Ld.
template <class V>
TREECP_GDN_FN void gdn_stage_bf16(uint16_t* dst, const V& v, bool a, int extent, int xn, int l0, int inner, int ln,
                                  int tid, int nthr) {
  const int64_t xs = a ? v.rs : v.cs, ls = a ? v.cs : v.rs;
  const bool x_fast = ls != 1 && xs == 1;
  const int len = inner - l0;
  const char* base = static_cast<const char*>(v.p) + l0 * ls * (v.half ? 2 : 4);
  const V w{base, v.rs, v.cs, v.half};
  const int64_t other = x_fast ? ls : xs;  // stride of the slow index: vectors stay aligned when it is a multiple of 4
  const bool aligned = (reinterpret_cast<uintptr_t>(base) % (v.half ? 8 : 16) == 0) && other % 4 == 0 &&
                       (x_fast ? xs : ls) == 1;
  // Groups of 4 along the contiguous index. Along l: consecutive threads take consecutive groups of a row (coalesced
  // loads, 8-byte stores). Along x: 8 consecutive threads take 8 groups of x (128 contiguous bytes of fp32) at one l,
  // the next 8 the next l, so that a warp's 2-byte stores of one x fall on 4 rows rather than 32 (4-way, not 16-way,
  // bank conflicts).
  const int fast_n = (x_fast ? xn : ln) / 4;
  const int groups = x_fast ? (fast_n + 7) / 8 * 8 * ln : fast_n * xn;
  constexpr int kBatch = 4;
  for (int g0 = tid; g0 < groups; g0 += kBatch * nthr) {
    float val[kBatch][4];
    int xi[kBatch], li[kBatch];
    bool ok[kBatch];
    TREECP_GDN_UNROLL
    for (int b = 0; b < kBatch; ++b) {
      const int g = g0 + b * nthr;
      if (x_fast) {
        const int xg = g % 8 + g / (8 * ln) * 8;
        xi[b] = xg * 4;
        li[b] = g / 8 % ln;
        ok[b] = g < groups && xg < fast_n;
      } else {
        xi[b] = g / fast_n;
        li[b] = g % fast_n * 4;
        ok[b] = g < groups;
      }
      if (ok[b]) {
        const bool vec = aligned && (x_fast ? (xi[b] + 3 < extent && li[b] < len) : (xi[b] < extent && li[b] + 3 < len));
        gdn_load4(w, xs, ls, x_fast, vec, xi[b], li[b], extent, len, val[b]);
      }
    }
    TREECP_GDN_UNROLL
    for (int b = 0; b < kBatch; ++b) {
      if (!ok[b]) continue;
      if (x_fast) {
        TREECP_GDN_UNROLL
        for (int u = 0; u < 4; ++u) dst[(xi[b] + u) * kGdnBf16Ld + li[b]] = float_to_bf16(val[b][u]);
      } else {
        uint16_t* d = dst + xi[b] * kGdnBf16Ld + li[b];
#if defined(__CUDA_ARCH__)
        *reinterpret_cast<uint2*>(d) = make_uint2(pack2(val[b][0], val[b][1]), pack2(val[b][2], val[b][3]));
#else
        for (int u = 0; u < 4; ++u) d[u] = float_to_bf16(val[b][u]);
#endif
      }
    }
  }
}

template <class VA, class VB, class F>
TREECP_GDN_FN void gdn_block_bf16(int rows, int cols, int inner, const VA& A, const VB& B, float* smem, int tid,
                                  int nthr, F&& out) {
  const int lane = tid % 32, warp = tid / 32, warps = nthr / 32;
  const int g = lane >> 2, q = lane & 3;
  const int mt = (rows + 15) / 16, nt = (cols + 7) / 8;
  int per = (mt * nt + warps - 1) / warps;  // tiles a warp: one round of warps where they fit
  per = per < 1 ? 1 : per > kGdnBf16WarpTiles ? kGdnBf16WarpTiles : per;
  const int groups = (nt + per - 1) / per, units = mt * groups;
  uint16_t* As = reinterpret_cast<uint16_t*>(smem);  // [mt * 16][kGdnBf16Ld]
  uint16_t* Bs = As + mt * 16 * kGdnBf16Ld;          // [nt * 8][kGdnBf16Ld]
  float* tile = smem + gdn_bf16_panel_floats(rows, cols);  // [mt * 16][ld]: the result, for the epilogue
  const int ld = gdn_bf16_tile_ld(cols);
  for (int base = 0; base < units; base += warps) {
    const int unit = base + warp;
    const bool mine = warp < warps && unit < units;
    const int m0 = (mine ? unit / groups : 0) * 16, n0 = (mine ? unit % groups : 0) * per;  // row, first 8-column tile
    float c[kGdnBf16WarpTiles][4];
    TREECP_GDN_UNROLL
    for (int t = 0; t < kGdnBf16WarpTiles; ++t)
      TREECP_GDN_UNROLL
      for (int e = 0; e < 4; ++e) c[t][e] = 0.f;
    for (int l0 = 0; l0 < inner; l0 += kGdnBf16Panel) {
      const int ln = ((inner - l0 < kGdnBf16Panel ? inner - l0 : kGdnBf16Panel) + 15) / 16 * 16;
      block_sync();  // the previous panel (or the caller's writes of the operands) done
      gdn_stage_bf16(As, A, true, rows, mt * 16, l0, inner, ln, tid, nthr);
      gdn_stage_bf16(Bs, B, false, cols, nt * 8, l0, inner, ln, tid, nthr);
      block_sync();
      if (!mine) continue;
      for (int k0 = 0; k0 < ln; k0 += 16) {
#if defined(__CUDA_ARCH__)
        const uint16_t* ar = As + (m0 + g) * kGdnBf16Ld + k0 + 2 * q;
        const uint32_t af[4] = {*reinterpret_cast<const uint32_t*>(ar),
                                *reinterpret_cast<const uint32_t*>(ar + 8 * kGdnBf16Ld),
                                *reinterpret_cast<const uint32_t*>(ar + 8),
                                *reinterpret_cast<const uint32_t*>(ar + 8 * kGdnBf16Ld + 8)};
        TREECP_GDN_UNROLL
        for (int t = 0; t < kGdnBf16WarpTiles; ++t) {
          if (t >= per || n0 + t >= nt) break;
          const uint16_t* br = Bs + ((n0 + t) * 8 + g) * kGdnBf16Ld + k0 + 2 * q;
          mma_m16n8k16(c[t], af, *reinterpret_cast<const uint32_t*>(br), *reinterpret_cast<const uint32_t*>(br + 8));
        }
#else
        for (int t = 0; t < per && n0 + t < nt; ++t)
          for (int e = 0; e < 4; ++e) {
            const int i = m0 + g + (e >> 1) * 8, j = (n0 + t) * 8 + 2 * q + (e & 1);
            float acc = 0.f;
            for (int k = k0; k < k0 + 16; ++k)
              acc += bf16_to_float(As[i * kGdnBf16Ld + k]) * bf16_to_float(Bs[j * kGdnBf16Ld + k]);
            c[t][e] += acc;
          }
#endif
      }
    }
    if (!mine) continue;
    TREECP_GDN_UNROLL
    for (int t = 0; t < kGdnBf16WarpTiles; ++t) {
      if (t >= per || n0 + t >= nt) break;
      TREECP_GDN_UNROLL
      for (int e = 0; e < 4; ++e) tile[(m0 + g + (e >> 1) * 8) * ld + (n0 + t) * 8 + 2 * q + (e & 1)] = c[t][e];
    }
  }
  block_sync();
  // The epilogue from shared memory, consecutive threads on consecutive columns: one instance of `out` (not one per
  // accumulator register: the gradients' epilogues unrolled 32 times took 234 registers) and coalesced global
  // accesses inside it.
  for (int idx = tid; idx < rows * cols; idx += nthr) {
    const int i = idx / cols, j = idx % cols;
    out(i, j, tile[i * ld + j]);
  }
  block_sync();  // outputs written before anyone reads them or restages over the panels and the tile
}

// The block product on kMath's arithmetic (GdnMath).
template <int kMath, int TM, int TN, class VA, class VB, class F>
TREECP_GDN_FN void gdn_block_product(int rows, int cols, int inner, const VA& A, const VB& B, float* smem,
                                     int tid, int nthr, F&& out) {
  if constexpr (gdn_math(kMath) == kGdnBf16) {
    static_assert(VA::kElem == DType::kBf16 && VB::kElem == DType::kBf16, "bf16 products take bf16 activations");
    gdn_block_bf16(rows, cols, inner, A, B, smem, tid, nthr, out);
    return;
  } else if constexpr (gdn_math(kMath) == kGdnTf32x3) {
    gdn_block_mma(rows, cols, inner, A, B, smem, tid, nthr, out);
    return;
  }
  const int tiles = ((rows + TM - 1) / TM) * ((cols + TN - 1) / TN);
  const int la = gdn_panel_lda(false), lb = gdn_panel_ldb(cols, false);
  float* As = smem;              // [rows][la]
  float* Bs = smem + rows * la;  // [kGdnPanel][lb]
  for (int base = 0; base < tiles; base += nthr) {
    const bool mine = base + tid < tiles;
    GdnRegTile<TM, TN> rt(mine ? base + tid : 0, rows, cols);
    for (int l0 = 0; l0 < inner; l0 += kGdnPanel) {
      block_sync();  // the previous panel (or the caller's writes of the operands) done
      gdn_stage_panel(As, la, A, true, rows, l0, inner, tid, nthr);
      gdn_stage_panel(Bs, lb, B, false, cols, l0, inner, tid, nthr);
      block_sync();
      if (mine) rt.mma(As, la, 1, Bs, lb, 1, inner - l0 < kGdnPanel ? inner - l0 : kGdnPanel, 1.f);
    }
    if (mine) rt.store(out);
  }
  block_sync();  // outputs written before anyone reads them or restages over the panels
}

// ---- the scans' register tiles on vector loads: each thread owns TM consecutive rows and TN consecutive columns
// of the output (not strided as GdnRegTile), so that B's TN columns of one inner index are one 8- or 16-byte load
// and A's TM rows one 16-byte load when A is stored transposed (its rows contiguous: ars == 1), or each row's next
// four inner indices one 16-byte load when A is row-major (acs == 1). Operands in shared memory with row strides and
// bases that are multiples of 4 floats; rows up to the tile's end (rows rounded up to TM) and columns up to cols
// rounded up to TN must lie inside the operands' buffers (read, never stored). A warp's lanes then read 2-4
// distinct A addresses (broadcast) and 8 or 16 consecutive B vectors: one shared-memory wavefront a load, about
// a third of the strided tile's load instructions per multiply-add.
template <int N>
TREECP_GDN_FN void gdn_load_vec(const float* p, float (&v)[N]) {
  static_assert(N == 2 || N == 4, "2 or 4 floats");
#if defined(__CUDA_ARCH__)
  if constexpr (N == 4) {
    const float4 x = *reinterpret_cast<const float4*>(p);
    v[0] = x.x; v[1] = x.y; v[2] = x.z; v[3] = x.w;
  } else {
    const float2 x = *reinterpret_cast<const float2*>(p);
    v[0] = x.x; v[1] = x.y;
  }
#else
  std::memcpy(v, p, sizeof(v));
#endif
}
// Two floats to p[0], p[1] in one 8-byte store (p 8-byte aligned).
TREECP_GDN_FN void gdn_store_vec(float* p, float a, float b) {
#if defined(__CUDA_ARCH__)
  *reinterpret_cast<float2*>(p) = make_float2(a, b);
#else
  p[0] = a;
  p[1] = b;
#endif
}

template <int TM, int TN, int NT, class F>
TREECP_GDN_FN void gdn_vec_product(int rows, int cols, const GdnTerm (&terms)[NT], int tid, int nthr, F&& out) {
  const int mt = (rows + TM - 1) / TM, nt = (cols + TN - 1) / TN;
  for (int tile = tid; tile < mt * nt; tile += nthr) {
    const int i0 = (tile / nt) * TM, j0 = (tile % nt) * TN;
    float acc[TM][TN];
    TREECP_GDN_UNROLL
    for (int r = 0; r < TM; ++r)
      TREECP_GDN_UNROLL
      for (int c = 0; c < TN; ++c) acc[r][c] = 0.f;
    TREECP_GDN_UNROLL  // the terms' fields in registers, not a stack copy indexed at run time
    for (int k = 0; k < NT; ++k) {
      const GdnTerm& m = terms[k];
      const float* B = m.B + j0;
      float part[TM][TN];  // the term's product, scaled once at the end (no multiply per inner index)
      TREECP_GDN_UNROLL
      for (int r = 0; r < TM; ++r)
        TREECP_GDN_UNROLL
        for (int c = 0; c < TN; ++c) part[r][c] = 0.f;
      if (m.ars == 1) {  // A transposed: A(i0 .. i0 + TM, l) is one vector
        const float* A = m.A + i0;
        for (int l = 0; l < m.len; ++l) {
          float a[TM], b[TN];
          gdn_load_vec(A + l * m.acs, a);
          gdn_load_vec(B + l * m.brs, b);
          TREECP_GDN_UNROLL
          for (int r = 0; r < TM; ++r)
            TREECP_GDN_UNROLL
            for (int c = 0; c < TN; ++c) part[r][c] += a[r] * b[c];
        }
      } else {  // A row-major: four inner indices of one row are one vector
        const float* A = m.A + i0 * m.ars;
        int l = 0;
        for (; l + 4 <= m.len; l += 4) {
          float a[TM][4];
          TREECP_GDN_UNROLL
          for (int r = 0; r < TM; ++r) gdn_load_vec(A + r * m.ars + l, a[r]);
          TREECP_GDN_UNROLL
          for (int x = 0; x < 4; ++x) {
            float b[TN];
            gdn_load_vec(B + (l + x) * m.brs, b);
            TREECP_GDN_UNROLL
            for (int r = 0; r < TM; ++r)
              TREECP_GDN_UNROLL
              for (int c = 0; c < TN; ++c) part[r][c] += a[r][x] * b[c];
          }
        }
        for (; l < m.len; ++l) {
          float b[TN];
          gdn_load_vec(B + l * m.brs, b);
          TREECP_GDN_UNROLL
          for (int r = 0; r < TM; ++r)
            TREECP_GDN_UNROLL
            for (int c = 0; c < TN; ++c) part[r][c] += A[r * m.ars + l] * b[c];
        }
      }
      TREECP_GDN_UNROLL
      for (int r = 0; r < TM; ++r)
        TREECP_GDN_UNROLL
        for (int c = 0; c < TN; ++c) acc[r][c] += m.s * part[r][c];
    }
    TREECP_GDN_UNROLL
    for (int r = 0; r < TM; ++r)
      TREECP_GDN_UNROLL
      for (int c = 0; c < TN; ++c)
        if (i0 + r < rows && j0 + c < cols) out(i0 + r, j0 + c, acc[r][c]);
  }
}

// The scans' products: rows (64 tokens, or dk state rows) x tc state columns, tiles sized for about one per thread
// at the GPU's 256 threads (4 x 4 for dk x 32, 4 x 2 for 64 x 32; half at 16 columns); on tensor cores (3xTF32 or
// bf16 fragments read from the fp32 operands) as kMath says.
template <int kMath, int NT, class F>
TREECP_GDN_FN void gdn_scan_product(int rows, int cols, int tc, const GdnTerm (&terms)[NT], int tid, int nthr,
                                    F&& out) {
  if constexpr (gdn_math(kMath) != kGdnFma) {
    gdn_warp_product<gdn_math(kMath) == kGdnBf16>(rows, cols, terms, tid, nthr, out);
  } else if (tc > 16) {
    if (rows > kGdnChunk)
      gdn_vec_product<4, 4>(rows, cols, terms, tid, nthr, out);
    else
      gdn_vec_product<4, 2>(rows, cols, terms, tid, nthr, out);
  } else if (rows > kGdnChunk) {
    gdn_vec_product<4, 2>(rows, cols, terms, tid, nthr, out);
  } else {
    gdn_vec_product<2, 2>(rows, cols, terms, tid, nthr, out);
  }
}

// Inputs as every kernel reads them: 16-bit elements of type E (the kernel's gdn_elem(kMath)).
struct GdnInputs {
  const uint16_t* q;
  const uint16_t* k;
  const uint16_t* v;
  const uint16_t* g;
  const uint16_t* beta;
  int32_t heads, dk, dv;
  bool scalar_gate;
  template <DType E>
  TREECP_GDN_FN float qk(const uint16_t* x, int64_t t, int h, int d) const {
    return gdn_from16<E>(x[(t * heads + h) * dk + d]);
  }
  template <DType E>
  TREECP_GDN_FN float vv(int64_t t, int h, int e) const { return gdn_from16<E>(v[(t * heads + h) * dv + e]); }
  template <DType E>
  TREECP_GDN_FN float gate(int64_t t, int h, int d) const {
    return gdn_from16<E>(scalar_gate ? g[t * heads + h] : g[(t * heads + h) * dk + d]);
  }
  template <DType E>
  TREECP_GDN_FN float b(int64_t t, int h) const { return gdn_from16<E>(beta[t * heads + h]); }
  // Rows t, t + 1, ... of head h of q or k (dk columns) or of v (dv columns) as a matrix view.
  template <DType E>
  TREECP_GDN_FN GdnViewT<E> rows(const uint16_t* x, int64_t t, int h, int width) const {
    return {x + (t * heads + h) * width, static_cast<int64_t>(heads) * width, 1, true};
  }
};

// y / dy: 16-bit of type E or fp32 [S, H, dv].
template <DType E>
TREECP_GDN_FN float load_out(const void* p, bool f32, int64_t at) {
  return f32 ? static_cast<const float*>(p)[at] : gdn_from16<E>(static_cast<const uint16_t*>(p)[at]);
}
template <DType E>
TREECP_GDN_FN void store_out(void* p, bool f32, int64_t at, float x) {
  if (f32)
    static_cast<float*>(p)[at] = x;
  else
    static_cast<uint16_t*>(p)[at] = gdn_to16<E>(x);
}

// Rows [0, n) x columns [0, w) of a 16-bit input of type E (row stride src_ld elements) widened into shared memory
// (row stride ld): 8-byte loads of four elements where the rows allow, so that a thread has several loads in flight.
template <DType E>
TREECP_GDN_FN void gdn_load_rows16(float* dst, int ld, const uint16_t* src, int64_t src_ld, int n, int w, int tid,
                                      int nthr) {
  if ((w % 4 == 0) && (src_ld % 4 == 0) && reinterpret_cast<uintptr_t>(src) % 8 == 0) {
    const int q = w / 4, total = n * q;
    for (int base = tid; base < total; base += kGdnStageBatch * nthr) {  // a batch's loads before its first store
      uint16_t v[kGdnStageBatch][4];
      TREECP_GDN_UNROLL
      for (int b = 0; b < kGdnStageBatch; ++b) {
        const int idx = base + b * nthr;
        if (idx >= total) break;
        const int i = idx / q, j = (idx % q) * 4;
#if defined(__CUDA_ARCH__)
        const uint2 x = *reinterpret_cast<const uint2*>(src + i * src_ld + j);
        v[b][0] = static_cast<uint16_t>(x.x & 0xffffu); v[b][1] = static_cast<uint16_t>(x.x >> 16);
        v[b][2] = static_cast<uint16_t>(x.y & 0xffffu); v[b][3] = static_cast<uint16_t>(x.y >> 16);
#else
        std::memcpy(v[b], src + i * src_ld + j, sizeof(v[b]));
#endif
      }
      TREECP_GDN_UNROLL
      for (int b = 0; b < kGdnStageBatch; ++b) {
        const int idx = base + b * nthr;
        if (idx >= total) break;
        const int i = idx / q, j = (idx % q) * 4;
        TREECP_GDN_UNROLL
        for (int x = 0; x < 4; ++x) dst[i * ld + j + x] = gdn_from16<E>(v[b][x]);
      }
    }
  } else {
    for (int idx = tid; idx < n * w; idx += nthr) dst[(idx / w) * ld + idx % w] = gdn_from16<E>(src[(idx / w) * src_ld + idx % w]);
  }
}

// out(i, j, Σ_terms s A B) over operands in shared memory with any strides, on kMath's arithmetic (GdnMath:
// register-blocked as GdnRegTile, or on tensor cores); no barrier.
template <int kMath, int TM, int TN, int NT, class F>
TREECP_GDN_FN void gdn_smem_product(int rows, int cols, const GdnTerm (&terms)[NT], int tid, int nthr, F&& out) {
  if constexpr (gdn_math(kMath) != kGdnFma) {
    gdn_warp_product<gdn_math(kMath) == kGdnBf16>(rows, cols, terms, tid, nthr, out);
    return;
  }
  const int tiles = ((rows + TM - 1) / TM) * ((cols + TN - 1) / TN);
  for (int tile = tid; tile < tiles; tile += nthr) {
    GdnRegTile<TM, TN> rt(tile, rows, cols);
    TREECP_GDN_UNROLL
    for (int k = 0; k < NT; ++k) rt.mma(terms[k].A, terms[k].ars, terms[k].acs, terms[k].B, terms[k].brs, terms[k].bcs,
                                        terms[k].len, terms[k].s);
    rt.store(out);
  }
}

// ---- L⁻¹ of L = I + diag(β) P (P strictly lower, n <= 64 rows) into X (row stride ldx), all in shared memory, in
// 16 x 16 blocks: each diagonal block by forward substitution (one (block, column) a thread, chains of at most 16 rows
// of at most 15 terms), then the blocks below the diagonal one sub-diagonal at a time, d = i - j = 1, 2, 3:
//   X_ij = -X_ii Σ_{k=j}^{i-1} L_ik X_kj,  L_ik = diag(β_i) P_ik (k < i)
// as two small products (T_ij = Σ_k L_ik X_kj into `scratch` [3][16][17], then -X_ii T_ij), each element one thread's
// sum: 2 barriers a sub-diagonal, 7 in all. Entries above the diagonal are zero.
constexpr int kGdnInvBlock = 16;
TREECP_GDN_FN void gdn_block_inverse(const float* P, int lp, const float* beta, int n, float* X, int ldx, float* scratch,
                                     int tid, int nthr) {
  constexpr int B = kGdnInvBlock, lt = B + 1;
  const int nb = (n + B - 1) / B;
  for (int task = tid; task < nb * B; task += nthr) {
    const int kb = task / B, col = task;  // column col of diagonal block kb
    if (col >= n) continue;
    const int end = (kb + 1) * B < n ? (kb + 1) * B : n;
    for (int i = 0; i < col; ++i) X[i * ldx + col] = 0.f;
    for (int i = col; i < end; ++i) {
      const float* p = P + i * lp;
      float x[2] = {0.f, 0.f};  // two partial sums: half the chain of dependent adds
      int j = col;
      for (; j + 2 <= i; j += 2) {
        x[0] += p[j] * X[j * ldx + col];
        x[1] += p[j + 1] * X[(j + 1) * ldx + col];
      }
      if (j < i) x[0] += p[j] * X[j * ldx + col];
      X[i * ldx + col] = (i == col ? 1.f : 0.f) - beta[i] * (x[0] + x[1]);
    }
  }
  block_sync();
  for (int d = 1; d < nb; ++d) {
    const int blocks = nb - d;  // (i, j) = (j + d, j), j < blocks
    for (int idx = tid; idx < blocks * B * B; idx += nthr) {
      const int j = idx / (B * B), r = idx / B % B, cc = idx % B;
      const int row = (j + d) * B + r, col = j * B + cc;
      if (row >= n) continue;
      const float* p = P + row * lp;
      float acc = 0.f;
      for (int k = j * B; k < (j + d) * B; ++k) acc += p[k] * X[k * ldx + col];
      scratch[(j * B + r) * lt + cc] = beta[row] * acc;
    }
    block_sync();
    for (int idx = tid; idx < blocks * B * B; idx += nthr) {
      const int j = idx / (B * B), r = idx / B % B, cc = idx % B;
      const int i0 = (j + d) * B, row = i0 + r, col = j * B + cc;
      if (row >= n) continue;
      const float* xi = X + row * ldx + i0;
      float acc = 0.f;
      for (int m = 0; m <= r; ++m) acc += xi[m] * scratch[(j * B + m) * lt + cc];  // X_ii lower triangular
      X[row * ldx + col] = -acc;
    }
    block_sync();
  }
}

// ---- prep: one block per (chunk, head). The chunk's keys and queries (and a per-channel gate) are read from
// global once, widened into shared memory [64][max(dk, dv) + 1] (rows padded to an odd stride, so that a warp's
// threads reading one column of several rows hit distinct banks); every later step reads them there: the
// cumulative gates, the decayed rows (all threads, one element each), the pair matrices P and C. Shared memory also
// holds beta and the scalar gate's sums [64], P and L⁻¹ diag(β) [64][65]; the U and W products' panels reuse the
// keys' and queries' space once P and C are done.
struct GdnPrepArgs {
  GdnInputs in;
  const GdnChunkDesc* chunks;
  float* cache;
  GdnBlock blk;
};
template <int kMath>  // the products' arithmetic and the activations' type (GdnMath)
struct GdnPrepKernel {
  static constexpr DType E = gdn_elem(kMath);
  using Args = GdnPrepArgs;
  static constexpr const char* kName = "gdn prep";
  static TREECP_GDN_HD int row_ld(int dk, int dv) { return (dk > dv ? dk : dv) + 1; }
  // Floats of the keys' and queries' rows, or of the panels where those are more.
  static TREECP_GDN_HD int64_t rows_floats(int dk, int dv) {
    const int widest = dk > dv ? (dk > kGdnChunk ? dk : kGdnChunk) : (dv > kGdnChunk ? dv : kGdnChunk);
    const int64_t kq = 2 * int64_t{kGdnChunk} * row_ld(dk, dv), panels = gdn_product_smem(kGdnChunk, widest);
    return kq > panels ? kq : panels;
  }
  // KDA: the keys decayed to each 16-row block's first token, for the pairs below the diagonal blocks.
  static constexpr int kKdaRef = kGdnInvBlock;                             // rows of a reference block
  static constexpr int kKdaRefRows = kKdaRef * (1 + 2 + 3);               // blocks 1, 2, 3: 16, 32, 48 rows
  static TREECP_GDN_HD int kda_ref_at(int I) { return kKdaRef * I * (I - 1) / 2; }  // block I's first row
  static size_t smem_bytes(const Args& a) {
    const int64_t gates = a.in.scalar_gate ? 0 : int64_t{kGdnChunk + kKdaRefRows} * row_ld(a.in.dk, a.in.dv);
    return static_cast<size_t>(2 * kGdnChunk + rows_floats(a.in.dk, a.in.dv) + gates +
                               2 * kGdnChunk * (kGdnChunk + 1)) *
           sizeof(float);
  }
  static TREECP_GDN_FN void run(const Args& a, int64_t block, int tid, int nthr, float* smem) {
    const int H = a.in.heads, dk = a.in.dk, dv = a.in.dv;
    const bool scalar = a.in.scalar_gate;
    const int64_t chunk = block / H;
    const int h = static_cast<int>(block % H);
    const GdnChunkDesc cd = a.chunks[chunk];
    const int64_t t = cd.t;
    const int n = cd.len;
    float* c = a.cache + (chunk * H + h) * a.blk.size;
    float* P = c + a.blk.P;
    float* C = c + a.blk.C;
    float* Ti = c + a.blk.Ti;
    const int ld = row_ld(dk, dv), lc = kGdnChunk + 1;  // row strides of the staged rows
    float* bs = smem;                                   // [64]
    float* gr = smem + kGdnChunk;                       // [64], scalar gate
    float* Ks = smem + 2 * kGdnChunk;                   // [64][ld]
    float* Qs = Ks + kGdnChunk * ld;                    // [64][ld]
    float* panels = Ks;                                 // once P and C are done
    float* Gs = Ks + rows_floats(dk, dv);               // [64][ld], per-channel gates
    float* Bk = Gs + (scalar ? 0 : kGdnChunk * ld);     // [96][ld], per-channel gates: the reference blocks' keys
    float* Ps = Bk + (scalar ? 0 : kKdaRefRows * ld);   // [64][lc]
    float* Tb = Ps + kGdnChunk * lc;                    // [64][lc]: L⁻¹ diag(β)
    const int64_t row = static_cast<int64_t>(H) * dk;  // elements between tokens of q, k and a per-channel gate
    gdn_load_rows16<E>(Ks, ld, a.in.k + (t * H + h) * dk, row, n, dk, tid, nthr);
    gdn_load_rows16<E>(Qs, ld, a.in.q + (t * H + h) * dk, row, n, dk, tid, nthr);
    if (!scalar) gdn_load_rows16<E>(Gs, ld, a.in.g + (t * H + h) * dk, row, n, dk, tid, nthr);
    for (int i = tid; i < n; i += nthr) {
      bs[i] = a.in.b<E>(t + i, h);
      if (scalar) gr[i] = a.in.gate<E>(t + i, h, 0);
    }
    block_sync();
    // G_i = Σ_{s<=i} g_s, in place, per key channel (one sum for a scalar gate); e^{G_last}.
    if (scalar) {
      if (tid == 0)
        for (int i = 1; i < n; ++i) gr[i] += gr[i - 1];
    } else {
      for (int d = tid; d < dk; d += nthr)
        for (int i = 1; i < n; ++i) Gs[i * ld + d] += Gs[(i - 1) * ld + d];
    }
    block_sync();
    auto gsum = [&](int i, int d) { return scalar ? gr[i] : Gs[i * ld + d]; };
    for (int d = tid; d < dk; d += nthr) c[a.blk.egl + d] = expf(gsum(n - 1, d));
    // The decayed rows, one element a thread.
    for (int idx = tid; idx < n * dk; idx += nthr) {
      const int i = idx / dk, d = idx % dk;
      const float gi = gsum(i, d), ki = Ks[i * ld + d];
      const float eg = expf(gi);
      c[a.blk.G + idx] = gi;
      c[a.blk.Qst + idx] = eg * Qs[i * ld + d];
      c[a.blk.Kst + idx] = eg * ki;
      c[a.blk.R + idx] = expf(gsum(n - 1, d) - gi) * ki;
    }
    // P[i][j] = Σ_d k_i k_j e^{G_i - G_j} (j < i), C[i][j] = Σ_d q_i k_j e^{G_i - G_j} (j <= i); 0 elsewhere.
    // A scalar gate's decay is one factor per pair: P and C are the products K Kᵀ and Q Kᵀ, scaled.
    if (scalar) {
      const GdnTerm kk[1] = {{Ks, ld, 1, Ks, 1, ld, dk, 1.f}}, qk[1] = {{Qs, ld, 1, Ks, 1, ld, dk, 1.f}};
      gdn_smem_product<kMath, 4, 4>(n, n, kk, tid, nthr, [&](int i, int j, float acc) {
        const float p = j < i ? acc * expf(gr[i] - gr[j]) : 0.f;
        P[i * kGdnChunk + j] = p;
        Ps[i * lc + j] = p;
      });
      gdn_smem_product<kMath, 4, 4>(n, n, qk, tid, nthr, [&](int i, int j, float acc) {
        C[i * kGdnChunk + j] = j <= i ? acc * expf(gr[i] - gr[j]) : 0.f;
      });
    } else {
      // Per channel, e^{G_i - G_j} is one exponential per (pair, channel). Within a 16-row diagonal block the pairs
      // are summed so (pairs of rows 16 apart at most); below the diagonal blocks it factors through the first
      // token r = 16 I of row i's block I: e^{G_i - G_j} = e^{G_i - G_r} e^{G_r - G_j}, both exponents <= 0 for
      // non-positive gates (j < r <= i), so nothing overflows, and the pair sums there are products of
      // A = e^{G - G_r} ⊙ K (or Q) rows [r, r + 16) and Bk_I = e^{G_r - G} ⊙ K rows [0, r): 704 exponentials a
      // channel instead of 2,080, the rest on the products' arithmetic.
      for (int idx = tid; idx < n * n; idx += nthr) {  // zero above the diagonal
        const int i = idx / n, j = idx % n;
        if (j > i) {
          P[i * kGdnChunk + j] = 0.f;
          Ps[i * lc + j] = 0.f;
          C[i * kGdnChunk + j] = 0.f;
        }
      }
      // The diagonal blocks' pairs j <= i, enumerated block by block (a warp: two rows of one block, so that a
      // warp's lanes are idle only above the diagonal within it).
      for (int idx = tid; idx < kGdnChunk * kKdaRef; idx += nthr) {
        const int blk = idx / (kKdaRef * kKdaRef), i = blk * kKdaRef + idx / kKdaRef % kKdaRef,
                  j = blk * kKdaRef + idx % kKdaRef;
        if (j > i || i >= n) continue;
        float pk = 0.f, pq = 0.f;
        const float* ki = Ks + i * ld;
        const float* qi = Qs + i * ld;
        const float* kj = Ks + j * ld;
        const float* gi = Gs + i * ld;
        const float* gj = Gs + j * ld;
        for (int d = 0; d < dk; ++d) {
          const float x = kj[d] * expf(gi[d] - gj[d]);
          pk += ki[d] * x;
          pq += qi[d] * x;
        }
        if (j == i) pk = 0.f;
        P[i * kGdnChunk + j] = pk;
        Ps[i * lc + j] = pk;
        C[i * kGdnChunk + j] = pq;
      }
      for (int I = 1; I * kKdaRef < n; ++I) {  // Bk_I[j][d] = e^{G_r - G_j} k_j, j < r = 16 I
        const int r0 = I * kKdaRef;
        float* B = Bk + kda_ref_at(I) * ld;
        for (int idx = tid; idx < r0 * dk; idx += nthr) {
          const int j = idx / dk, d = idx % dk;
          B[j * ld + d] = expf(Gs[r0 * ld + d] - Gs[j * ld + d]) * Ks[j * ld + d];
        }
      }
      block_sync();  // the diagonal blocks' pair sums and Bk read the rows as they were
      for (int idx = tid; idx < n * dk; idx += nthr) {  // rows i >= 16 decayed to their block's first token
        const int i = idx / dk, d = idx % dk, r0 = i / kKdaRef * kKdaRef;
        if (r0 == 0) continue;
        const float e = expf(Gs[i * ld + d] - Gs[r0 * ld + d]);
        Ks[i * ld + d] *= e;
        Qs[i * ld + d] *= e;
      }
      block_sync();
      for (int I = 1; I * kKdaRef < n; ++I) {
        const int r0 = I * kKdaRef, rows = n - r0 < kKdaRef ? n - r0 : kKdaRef;
        const float* B = Bk + kda_ref_at(I) * ld;
        const GdnTerm kk[1] = {{Ks + r0 * ld, ld, 1, B, 1, ld, dk, 1.f}}, qk[1] = {{Qs + r0 * ld, ld, 1, B, 1, ld, dk, 1.f}};
        gdn_smem_product<kMath, 2, 2>(rows, r0, kk, tid, nthr, [&](int i, int j, float acc) {
          P[(r0 + i) * kGdnChunk + j] = acc;
          Ps[(r0 + i) * lc + j] = acc;
        });
        gdn_smem_product<kMath, 2, 2>(rows, r0, qk, tid, nthr, [&](int i, int j, float acc) {
          C[(r0 + i) * kGdnChunk + j] = acc;
        });
      }
    }
    block_sync();
    // L⁻¹ (L = I + diag(β) P) in 16 x 16 blocks, so that every step keeps most threads busy (one column a thread over
    // all 64 rows left 3 of 4 idle on a chain of ~2 k dependent FMA): gdn_block_inverse. The chunk's solve is then
    // two products, U = L⁻¹ diag(β) V and W = L⁻¹ diag(β) Kst.
    gdn_block_inverse(Ps, lc, bs, n, Tb, lc, panels, tid, nthr);  // ends on a barrier
    for (int idx = tid; idx < n * n; idx += nthr) {
      const int i = idx / n, j = idx % n;
      Ti[i * kGdnChunk + j] = Tb[i * lc + j];
      Tb[i * lc + j] *= bs[j];
    }
    const GdnView tb = gdn_view(Tb, lc);
    gdn_block_product<kMath, 4, 8>(n, dv, n, tb, a.in.rows<E>(a.in.v, t, h, dv), panels, tid, nthr,
                            [&](int i, int e, float acc) { c[a.blk.U + i * dv + e] = acc; });
    gdn_block_product<kMath, 4, 8>(n, dk, n, tb, gdn_view(c + a.blk.Kst, dk), panels, tid, nthr,
                            [&](int i, int d, float acc) { c[a.blk.W + i * dk + d] = acc; });
  }
};

// ---- asynchronous global -> shared copies (cp.async, sm_80 and later). The scans issue a chunk matrix's copy right
// after the last read of its buffer and wait for it (gdn_async_wait, then a barrier) right before its first read,
// so its global latency overlaps the products in between. The host executor copies at once, so a copy issued while
// another thread still reads the buffer shows there as a wrong result.
TREECP_GDN_FN void gdn_async_copy(void* dst, const void* src, int bytes) {  // 4, 8 or 16 bytes, both aligned to it
#if defined(__CUDA_ARCH__)
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  if (bytes == 16)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(src) : "memory");
  else if (bytes == 8)
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(s), "l"(src) : "memory");
  else
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(s), "l"(src) : "memory");
#else
  std::memcpy(dst, src, static_cast<size_t>(bytes));
#endif
}
// Closes this thread's copies issued since the last commit into one group.
TREECP_GDN_FN void gdn_async_commit() {
#if defined(__CUDA_ARCH__)
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}
// Waits until at most kPending of this thread's committed groups are in flight (the older ones have landed); a
// barrier after it makes every thread's copies visible to the block.
template <int kPending>
TREECP_GDN_FN void gdn_async_wait() {
#if defined(__CUDA_ARCH__)
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
#endif
}

// Whether rows of row_bytes bytes at src (row stride src_ld bytes) can be copied by gdn_stage_async.
TREECP_GDN_HD bool gdn_async_ok(const void* src, int64_t row_bytes, int64_t src_ld) {
  return (reinterpret_cast<uintptr_t>(src) | static_cast<uint64_t>(row_bytes) | static_cast<uint64_t>(src_ld)) % 4 == 0;
}
// Copies `rows` rows of row_bytes bytes (row strides src_ld and dst_ld bytes) asynchronously, in the widest unit of
// 16, 8 or 4 bytes that both bases, both strides and the row length allow (gdn_async_ok: at least 4).
TREECP_GDN_FN void gdn_stage_async(void* dst, const void* src, int rows, int row_bytes, int64_t src_ld, int dst_ld,
                                   int tid, int nthr) {
  const uint64_t all = reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src) |
                       static_cast<uint64_t>(row_bytes) | static_cast<uint64_t>(src_ld) | static_cast<uint64_t>(dst_ld);
  const int unit = all % 16 == 0 ? 16 : all % 8 == 0 ? 8 : 4;
  const int per_row = row_bytes / unit;
  if (per_row == 0) return;
  // Unit idx = tid + k nthr as (row i, unit u), stepped without a division per copy.
  const int di = nthr / per_row, du = nthr % per_row;
  int i = tid / per_row, u = tid % per_row;
  while (i < rows) {
    gdn_async_copy(static_cast<char*>(dst) + static_cast<int64_t>(i) * dst_ld + u * unit,
                   static_cast<const char*>(src) + i * src_ld + u * unit, unit);
    i += di;
    u += du;
    if (u >= per_row) {
      u -= per_row;
      ++i;
    }
  }
}
// The 16-byte units of `rows` rows of ROW_BYTES bytes (a multiple of 16; at most MAX_ROWS rows), as gdn_stage_rows
// and gdn_store_rows move them where `fits` (both bases and both strides 16-byte aligned, the block kGdnThreads
// threads: the device's launches and the emulation): thread tid takes unit tid % (ROW_BYTES / 16) of rows
// tid / (ROW_BYTES / 16) + k kGdnThreads / (ROW_BYTES / 16), unrolled: no division, no unit test and no loop counter a
// copy (the generic loop's ~30 instructions a copy were a third of the scans' instructions). f(d, s) moves one unit.
template <int ROW_BYTES, int MAX_ROWS>
struct GdnRowUnits {
  static constexpr int kPer = ROW_BYTES / 16;
  static_assert(ROW_BYTES % 16 == 0 && kPer >= 1 && kGdnThreads % kPer == 0, "whole 16-byte units, threads per row");
  static constexpr int kStep = kGdnThreads / kPer, kIters = (MAX_ROWS + kStep - 1) / kStep;
  static TREECP_GDN_FN bool fits(const void* dst, const void* src, int64_t src_ld, int64_t dst_ld, int nthr) {
    const uint64_t all = reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src) |
                         static_cast<uint64_t>(src_ld) | static_cast<uint64_t>(dst_ld);
    return nthr == kGdnThreads && all % 16 == 0;
  }
  template <class F>
  static TREECP_GDN_FN void each(void* dst, int64_t dst_ld, const void* src, int64_t src_ld, int rows, int tid, F&& f) {
    const int i0 = tid / kPer, off = (tid % kPer) * 16;
    char* d = static_cast<char*>(dst) + i0 * dst_ld + off;
    const char* s = static_cast<const char*>(src) + i0 * src_ld + off;
    TREECP_GDN_UNROLL
    for (int k = 0; k < kIters; ++k)
      if (i0 + k * kStep < rows) f(d + k * kStep * dst_ld, s + k * kStep * src_ld);
  }
};
// gdn_stage_async for rows of ROW_BYTES and at most MAX_ROWS of them, as the split kernels stage their operands: by
// GdnRowUnits where it fits, otherwise the generic loop.
template <int ROW_BYTES, int MAX_ROWS>
TREECP_GDN_FN void gdn_stage_rows(void* dst, const void* src, int rows, int64_t src_ld, int dst_ld, int tid,
                                  int nthr) {
  using Units = GdnRowUnits<ROW_BYTES, MAX_ROWS>;
  if (!Units::fits(dst, src, src_ld, dst_ld, nthr)) {
    gdn_stage_async(dst, src, rows, ROW_BYTES, src_ld, dst_ld, tid, nthr);
    return;
  }
  Units::each(dst, dst_ld, src, src_ld, rows, tid, [](char* d, const char* s) {
#if defined(__CUDA_ARCH__)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(static_cast<unsigned>(__cvta_generic_to_shared(d))),
                 "l"(s)
                 : "memory");
#else
    std::memcpy(d, s, 16);
#endif
  });
}
// The way back: `rows` rows of ROW_BYTES bytes (at most MAX_ROWS) from shared memory (row stride src_ld bytes) to
// global (dst_ld bytes), plain stores: 16-byte units by GdnRowUnits where it fits (whole sectors: the split output's
// 2-byte stores of y, a quarter of each 32-byte sector, held L2 92% busy in run 159), otherwise 2-byte units (the
// rows' elements are 2 or 4 bytes, the bases at least 2-byte aligned).
template <int ROW_BYTES, int MAX_ROWS>
TREECP_GDN_FN void gdn_store_rows(void* dst, int64_t dst_ld, const void* src, int src_ld, int rows, int tid,
                                  int nthr) {
  using Units = GdnRowUnits<ROW_BYTES, MAX_ROWS>;
  if (!Units::fits(dst, src, src_ld, dst_ld, nthr)) {
    constexpr int kHalves = ROW_BYTES / 2;
    for (int idx = tid; idx < rows * kHalves; idx += nthr) {
      const int i = idx / kHalves, u = idx % kHalves;
      reinterpret_cast<uint16_t*>(static_cast<char*>(dst) + i * dst_ld)[u] =
          reinterpret_cast<const uint16_t*>(static_cast<const char*>(src) + i * src_ld)[u];
    }
    return;
  }
  Units::each(dst, dst_ld, src, src_ld, rows, tid, [](char* d, const char* s) {
#if defined(__CUDA_ARCH__)
    *reinterpret_cast<uint4*>(d) = *reinterpret_cast<const uint4*>(s);
#else
    std::memcpy(d, s, 16);
#endif
  });
}

// Columns [0, cols) of rows [0, n) of a chunk matrix in the cache (row stride src_ld floats) into shared memory with
// row stride ld. A partial chunk's C is staged n x n: prep writes no column at or past n, so nothing reads them.
TREECP_GDN_FN void stage_rows_async(float* dst, const float* src, int n, int cols, int src_ld, int ld, int tid,
                                    int nthr) {
  gdn_stage_async(dst, src, n, cols * 4, int64_t{src_ld} * 4, ld * 4, tid, nthr);
}

// Element `at` of a saved chunk matrix (S0, D) in fp32 or bf16.
TREECP_GDN_FN void gdn_store_state(float* base, bool bf16, int64_t at, float x) {
  if (bf16)
    reinterpret_cast<uint16_t*>(base)[at] = float_to_bf16(x);
  else
    base[at] = x;
}

// Blocks of `tile` state columns over `width` (the scans' grid: per run and head).
TREECP_GDN_HD int64_t gdn_scan_tiles(int width, int tile) { return (width + tile - 1) / tile; }

// Row strides of the scans' staged matrices, chosen for the tensor-core fragments' bank pattern (lanes 4g + q read
// row g, column q of A, or row q, column g of B and of a transposed A): a matrix read as A has a stride of 4 mod 32
// (bank 4g + q), one read transposed or as B a stride of 8 mod 32 (bank 8q + g). The register-blocked path reads
// one or two rows of A a warp and consecutive columns of B, which any stride serves.
TREECP_GDN_HD int gdn_ld_rows(int cols) { return (cols + 31) / 32 * 32 + 4; }
TREECP_GDN_HD int gdn_ld_cols(int cols) { return (cols + 31) / 32 * 32 + 8; }

constexpr int64_t kGdnSmemMaxBytes = 227 * 1024;       // dynamic shared memory a block may opt in to on sm_90
constexpr int64_t kGdnSmemPerSmBytes = 228 * 1024;     // shared memory of one sm_90 SM
constexpr int64_t kGdnSmemReservedBytes = 1024;        // the system's share of it per resident block

// Floats of a scan's shared memory (layouts in the kernels below). `alias`: one buffer serves two chunk matrices
// (R over W in the forward, W over R in the backward, whose dY then has one buffer, read directly at each chunk's
// start) and each aliased copy waits at once behind a barrier; gdn_scan_alias takes it where it keeps more blocks on
// an SM: for a dk too large for separate buffers (above 192 at 32 columns) and at 16 columns (dk 128: two blocks an
// SM, not one).
TREECP_GDN_HD int64_t gdn_scan_floats(int dk, int tile, bool backward, bool alias) {
  const int64_t c = kGdnChunk, ls = tile + 8, ldr = gdn_ld_rows(dk), ldt = gdn_ld_cols(dk);
  const int64_t eg = (dk + 3) / 4 * 4;
  if (!backward)  // S, D, U; W (R), Qst, R; C; e^{G_last}
    return (dk + 2 * c) * ls + c * ((alias ? ldt : ldr) + ldr + (alias ? 0 : ldt) + gdn_ld_rows(kGdnChunk)) + eg;
  // dS, dD, two dY (one); bf16 dY; R (W), Qst, W; C; e^{G_last}
  return (dk + (alias ? 2 : 3) * c) * ls + (alias ? 0 : c * tile) + c * ((alias ? ldt : ldr) + ldt + (alias ? 0 : ldt) + gdn_ld_cols(kGdnChunk)) + eg;
}
// Blocks of `floats` shared floats one SM holds (0: over a block's limit).
TREECP_GDN_HD int64_t gdn_blocks_per_sm(int64_t floats) {
  const int64_t bytes = floats * static_cast<int64_t>(sizeof(float));
  return bytes > kGdnSmemMaxBytes ? 0 : kGdnSmemPerSmBytes / (bytes + kGdnSmemReservedBytes);
}
TREECP_GDN_HD bool gdn_scan_alias(int dk, int tile, bool backward) {
  return gdn_blocks_per_sm(gdn_scan_floats(dk, tile, backward, false)) <
         gdn_blocks_per_sm(gdn_scan_floats(dk, tile, backward, true));
}

// ---- scan: one block per (run, head, tile of `tile` state columns); chunks in order. Shared: S and D
// [dk | 64][tile + 8], U's columns [64][tile + 8], W and Qst [64][~dk + 4], R [64][~dk + 8], C [64][68] and e^{G_last}
// [dk]. Each chunk matrix has its own buffer, so its copy for the next chunk (cp.async) is issued right after this
// chunk's last read of it: W (and U) after D, Qst and C after Y, R (and e^{G_last}) at the next chunk's start; each
// copy lands while two products run. Three barriers a chunk. The state has `width` columns: dv for the state
// (and E), dk for the linear part M of a summary (use_u false: D = -W S, the state's recurrence with V = 0).
struct GdnScanArgs {
  const GdnRunDesc* runs;
  const GdnChunkDesc* chunks;
  float* cache;
  GdnBlock blk;
  int32_t heads, dk, dv, width;
  int32_t tile;  // state columns per block
  bool use_u;
  bool identity_init;     // S_in = I (dk x dk) instead of state_in
  const float* state_in;  // [slot][H][dk][width], by in_slot; null or -1 = zero
  float* state_out;       // by out_slot; null = not written
  bool save;              // the chunk-start states and D into the cache (the backward, the split forward)
  bool save_bf16;         // ... as bf16 (GdnBlock::states_bf16: the bf16 output kernel rounds them so anyway)
  void* y;                // null = not written
  bool y_f32;
  float scale;
};
template <int kMath>  // the products' arithmetic and the activations' type (GdnMath)
struct GdnScanKernel {
  static constexpr DType E = gdn_elem(kMath);
  using Args = GdnScanArgs;
  static constexpr const char* kName = "gdn scan";
  static size_t smem_bytes(const Args& a) {
    return static_cast<size_t>(gdn_scan_floats(a.dk, a.tile, false, gdn_scan_alias(a.dk, a.tile, false))) * sizeof(float);
  }
  static TREECP_GDN_FN void run(const Args& a, int64_t block, int tid, int nthr, float* smem) {
    const int tc = a.tile;  // state columns of this block
    const int H = a.heads, dk = a.dk, dv = a.dv, w = a.width;
    const int ls = tc + 8;                                   // row stride of S, D and U
    const int ldr = gdn_ld_rows(dk), ldt = gdn_ld_cols(dk);  // W, Qst read as A; R transposed
    const int lc = gdn_ld_rows(kGdnChunk);                   // C read as A
    const int64_t nt = (w + tc - 1) / tc;
    const int64_t r = block / (H * nt);
    const int h = static_cast<int>((block / nt) % H);
    const int e0 = static_cast<int>(block % nt) * tc;
    const int tw = w - e0 < tc ? w - e0 : tc;
    const GdnRunDesc rd = a.runs[r];
    const bool alias = gdn_scan_alias(dk, tc, false);
    float* S = smem;                                  // [dk][ls]
    float* Ds = S + dk * ls;                          // [64][ls]
    float* Us = Ds + kGdnChunk * ls;                  // [64][ls]
    float* Wb = Us + kGdnChunk * ls;                  // [64][ldr], or [64][ldt] holding R too
    float* Qb = Wb + kGdnChunk * (alias ? ldt : ldr);  // [64][ldr]
    float* Rb = alias ? Wb : Qb + kGdnChunk * ldr;     // [64][ldt]
    float* Cb = Qb + kGdnChunk * ldr + (alias ? 0 : kGdnChunk * ldt);  // [64][lc]
    float* eg = Cb + kGdnChunk * lc;                  // [dk]
    auto cache_of = [&](int ci) { return a.cache + ((rd.chunk_begin + ci) * H + h) * a.blk.size; };
    auto len_of = [&](int ci) { return a.chunks[rd.chunk_begin + ci].len; };
    // The copies for chunk ci, each group committed (empty past the last chunk) so that the waits count alike.
    auto issue_w = [&](int ci) {
      if (ci < rd.chunk_count) {
        const float* c = cache_of(ci);
        stage_rows_async(Wb, c + a.blk.W, len_of(ci), dk, dk, ldr, tid, nthr);
        if (a.use_u) stage_rows_async(Us, c + a.blk.U + e0, len_of(ci), tw, dv, ls, tid, nthr);
      }
      gdn_async_commit();
    };
    auto issue_qc = [&](int ci) {
      if (ci < rd.chunk_count && a.y) {
        const float* c = cache_of(ci);
        const int n = len_of(ci);
        stage_rows_async(Qb, c + a.blk.Qst, n, dk, dk, ldr, tid, nthr);
        stage_rows_async(Cb, c + a.blk.C, n, n, kGdnChunk, lc, tid, nthr);
      }
      gdn_async_commit();
    };
    auto issue_r = [&](int ci) {
      const float* c = cache_of(ci);
      stage_rows_async(Rb, c + a.blk.R, len_of(ci), dk, dk, ldt, tid, nthr);
      stage_rows_async(eg, c + a.blk.egl, 1, dk, dk, dk, tid, nthr);
      gdn_async_commit();
    };
    if (!alias) issue_w(0);
    issue_qc(0);
    // S[d][e] = S_in[d][e0 + e]
    const float* sin = (a.state_in && rd.in_slot >= 0) ? a.state_in + (static_cast<int64_t>(rd.in_slot) * H + h) * dk * w : nullptr;
    for (int idx = tid; idx < dk * tc; idx += nthr) {
      const int d = idx / tc, e = idx % tc;
      float s = 0.f;
      if (e < tw) {
        if (a.identity_init)
          s = d == e0 + e ? 1.f : 0.f;
        else if (sin)
          s = sin[d * w + e0 + e];
      }
      S[d * ls + e] = s;
    }
    for (int ci = 0; ci < rd.chunk_count; ++ci) {
      const int64_t chunk = rd.chunk_begin + ci;
      const GdnChunkDesc cd = a.chunks[chunk];
      const int n = cd.len;
      float* c = a.cache + (chunk * H + h) * a.blk.size;
      if (alias) {
        block_sync();  // R read: its buffer takes W
        issue_w(ci);
        gdn_async_wait<0>();
      } else {
        gdn_async_wait<1>();  // W and U landed (Qst and C may still be in flight)
      }
      block_sync();  // ... for every thread; S complete (the initial fill or the last update); R read
      if (!alias) issue_r(ci);
      if (a.save)
        for (int idx = tid; idx < dk * tc; idx += nthr) {
          const int d = idx / tc, e = idx % tc;
          if (e < tw) gdn_store_state(c + a.blk.S0, a.save_bf16, d * dv + e0 + e, S[d * ls + e]);
        }
      // D = U - W S
      const GdnTerm ws[1] = {{Wb, ldr, 1, S, ls, 1, dk, 1.f}};
      gdn_scan_product<kMath>(n, tw, tc, ws, tid, nthr, [&](int i, int e, float acc) {
        const float x = (a.use_u ? Us[i * ls + e] : 0.f) - acc;
        Ds[i * ls + e] = x;
        if (a.save) gdn_store_state(c + a.blk.D, a.save_bf16, i * dv + e0 + e, x);
      });
      if (!alias) gdn_async_wait<1>();  // Qst and C landed (R may still be in flight)
      block_sync();                     // D complete; W and U read
      if (alias)
        issue_r(ci);
      else
        issue_w(ci + 1);
      if (a.y) {
        // Y = scale ((e^G ⊙ Q) S + C D); C is zero above the diagonal within the chunk, so its n columns sum j <= i.
        const GdnTerm qc[2] = {{Qb, ldr, 1, S, ls, 1, dk, 1.f}, {Cb, lc, 1, Ds, ls, 1, n, 1.f}};
        gdn_scan_product<kMath>(n, tw, tc, qc, tid, nthr, [&](int i, int e, float acc) {
          store_out<E>(a.y, a.y_f32, (cd.t + i) * static_cast<int64_t>(H) * dv + static_cast<int64_t>(h) * dv + e0 + e,
                    a.scale * acc);
        });
      }
      if (alias)
        gdn_async_wait<0>();
      else
        gdn_async_wait<1>();  // R and e^{G_last} landed (the next W may still be in flight)
      block_sync();           // S, Qst and C read
      issue_qc(ci + 1);
      // S <- diag(e^{G_last}) S + Rᵀ D (each thread updates only the entries it reads)
      const GdnTerm upd[1] = {{Rb, 1, ldt, Ds, ls, 1, n, 1.f}};
      gdn_scan_product<kMath>(dk, tw, tc, upd, tid, nthr, [&](int d, int e, float acc) {
        S[d * ls + e] = S[d * ls + e] * eg[d] + acc;
      });
    }
    gdn_async_wait<0>();  // the empty groups past the last chunk
    block_sync();
    if (a.state_out && rd.out_slot >= 0) {
      float* so = a.state_out + (static_cast<int64_t>(rd.out_slot) * H + h) * dk * w;
      for (int idx = tid; idx < dk * tc; idx += nthr) {
        const int d = idx / tc, e = idx % tc;
        if (e < tw) so[d * w + e0 + e] = S[d * ls + e];
      }
    }
  }
};

// ---- backward scan: one block per (run, head, `tile` columns of dS); chunks in reverse. Shared: dS [dk][tile + 8],
// dD and two dY buffers [64][tile + 8], R [64][~dk + 4], Qst and W [64][~dk + 8], C [64][72], e^{G_last} [dk] and the
// next chunk's dY as it comes from global (bf16 or fp32 [64][tile]). R and C are copied (cp.async) for the next
// chunk while dS is updated, Qst, W and the next dY while dD is computed; two barriers a chunk. Stores dS at each
// chunk's end and dD into the cache for the gradient kernel.
struct GdnBwdScanArgs {
  const GdnRunDesc* runs;
  const GdnChunkDesc* chunks;
  float* cache;
  GdnBlock blk;
  int32_t heads, dk, dv;
  int32_t tile;  // columns of dS per block
  const void* dy;
  bool dy_f32;
  float scale;
  const float* d_state_out;  // by out_slot
  float* d_state_in;         // by in_slot
};
template <int kMath>  // the products' arithmetic and the activations' type (GdnMath)
struct GdnBwdScanKernel {
  static constexpr DType E = gdn_elem(kMath);
  using Args = GdnBwdScanArgs;
  static constexpr const char* kName = "gdn backward scan";
  static size_t smem_bytes(const Args& a) {
    return static_cast<size_t>(gdn_scan_floats(a.dk, a.tile, true, gdn_scan_alias(a.dk, a.tile, true))) * sizeof(float);
  }
  static TREECP_GDN_FN void run(const Args& a, int64_t block, int tid, int nthr, float* smem) {
    const int tc = a.tile;  // state columns of this block
    const int H = a.heads, dk = a.dk, dv = a.dv;
    const int ls = tc + 8;                                   // row stride of dS, dD and dY
    const int ldr = gdn_ld_rows(dk), ldt = gdn_ld_cols(dk);  // R read as A; Qst, W transposed
    const int lc = gdn_ld_cols(kGdnChunk);                   // C transposed
    const int64_t nt = (dv + tc - 1) / tc;
    const int64_t r = block / (H * nt);
    const int h = static_cast<int>((block / nt) % H);
    const int e0 = static_cast<int>(block % nt) * tc;
    const int tw = dv - e0 < tc ? dv - e0 : tc;
    const GdnRunDesc rd = a.runs[r];
    const bool alias = gdn_scan_alias(dk, tc, true);
    float* dS = smem;                                  // [dk][ls]
    float* dDs = dS + dk * ls;                         // [64][ls]
    float* dYb = dDs + kGdnChunk * ls;                 // [2][64][ls]: chunk ci's dY in buffer ci % 2 ([64][ls])
    float* raw = dYb + (alias ? 1 : 2) * kGdnChunk * ls;  // [64][tc] floats: the next chunk's bf16 dY (not aliased)
    float* Rb = raw + (alias ? 0 : kGdnChunk * tc);    // [64][ldr], or [64][ldt] holding W too
    float* Qb = Rb + kGdnChunk * (alias ? ldt : ldr);  // [64][ldt]
    float* Wb = alias ? Rb : Qb + kGdnChunk * ldt;     // [64][ldt]
    float* Cb = Qb + kGdnChunk * ldt * (alias ? 1 : 2);  // [64][lc]
    float* eg = Cb + kGdnChunk * lc;                   // [dk]
    const int64_t ssz = static_cast<int64_t>(dk) * dv;
    const int64_t dy_row = static_cast<int64_t>(H) * dv;  // elements between tokens
    const int dy_bytes = a.dy_f32 ? 4 : 2;
    auto cache_of = [&](int ci) { return a.cache + ((rd.chunk_begin + ci) * H + h) * a.blk.size; };
    auto len_of = [&](int ci) { return a.chunks[rd.chunk_begin + ci].len; };
    auto dy_at = [&](int ci) { return (a.chunks[rd.chunk_begin + ci].t * H + h) * static_cast<int64_t>(dv) + e0; };
    auto dy_buf = [&](int ci) { return alias ? dYb : dYb + (ci & 1) * kGdnChunk * ls; };
    // dY rows copy asynchronously when their bytes are 4-byte aligned (fp32, or bf16 at even dv), fp32 straight
    // into its buffer, bf16 into `raw` and widened after the wait; otherwise they are read directly.
    const bool dy_async = !alias && rd.chunk_count > 0 &&
                          gdn_async_ok(static_cast<const char*>(a.dy) + dy_at(0) * dy_bytes, int64_t{tw} * dy_bytes,
                                       dy_row * dy_bytes);
    auto load_dy = [&](int ci) {  // plain loads of chunk ci's dY into its buffer
      float* dst = dy_buf(ci);
      const int64_t at = dy_at(ci);
      for (int idx = tid; idx < len_of(ci) * tw; idx += nthr) {
        const int i = idx / tw, e = idx % tw;
        dst[i * ls + e] = load_out<E>(a.dy, a.dy_f32, at + i * dy_row + e);
      }
    };
    auto issue_rc = [&](int ci) {
      if (ci >= 0) {
        const float* c = cache_of(ci);
        const int n = len_of(ci);
        stage_rows_async(Rb, c + a.blk.R, n, dk, dk, ldr, tid, nthr);
        stage_rows_async(Cb, c + a.blk.C, n, n, kGdnChunk, lc, tid, nthr);
      }
      gdn_async_commit();
    };
    auto issue_w = [&](int ci) {
      stage_rows_async(Wb, cache_of(ci) + a.blk.W, len_of(ci), dk, dk, ldt, tid, nthr);
      gdn_async_commit();
    };
    // Qst, W (unless aliased) and e^{G_last} of chunk ci, with chunk ci - 1's dY.
    auto issue_qw = [&](int ci) {
      const float* c = cache_of(ci);
      const int n = len_of(ci);
      stage_rows_async(Qb, c + a.blk.Qst, n, dk, dk, ldt, tid, nthr);
      if (!alias) stage_rows_async(Wb, c + a.blk.W, n, dk, dk, ldt, tid, nthr);
      stage_rows_async(eg, c + a.blk.egl, 1, dk, dk, dk, tid, nthr);
      if (ci > 0 && dy_async) {
        const void* src = static_cast<const char*>(a.dy) + dy_at(ci - 1) * dy_bytes;
        if (a.dy_f32)
          gdn_stage_async(dy_buf(ci - 1), src, len_of(ci - 1), tw * 4, dy_row * 4, ls * 4, tid, nthr);
        else
          gdn_stage_async(raw, src, len_of(ci - 1), tw * 2, dy_row * 2, tw * 2, tid, nthr);
      }
      gdn_async_commit();
    };
    auto finish_dy = [&](int ci) {  // chunk ci's dY into its buffer once its copy (if any) has landed
      if (!dy_async) {
        load_dy(ci);
      } else if (!a.dy_f32) {
        const uint16_t* src = reinterpret_cast<const uint16_t*>(raw);
        float* dst = dy_buf(ci);
        for (int idx = tid; idx < len_of(ci) * tw; idx += nthr) dst[(idx / tw) * ls + idx % tw] = gdn_from16<E>(src[idx]);
      }
    };
    const float* dso = (a.d_state_out && rd.out_slot >= 0) ? a.d_state_out + (static_cast<int64_t>(rd.out_slot) * H + h) * ssz : nullptr;
    if (rd.chunk_count > 0) {
      if (!alias) {
        issue_rc(rd.chunk_count - 1);
        load_dy(rd.chunk_count - 1);
      }
    }
    for (int idx = tid; idx < dk * tc; idx += nthr) {
      const int d = idx / tc, e = idx % tc;
      dS[d * ls + e] = (dso && e < tw) ? dso[d * dv + e0 + e] : 0.f;
    }
    for (int ci = rd.chunk_count - 1; ci >= 0; --ci) {
      const int64_t chunk = rd.chunk_begin + ci;
      const int n = len_of(ci);
      float* c = a.cache + chunk * H * a.blk.size + h * a.blk.size;
      const float* dYs = dy_buf(ci);
      if (alias) {
        block_sync();  // W and dY read: their buffers take R and this chunk's dY
        issue_rc(ci);
        load_dy(ci);
      }
      gdn_async_wait<0>();  // R and C landed
      block_sync();         // ... for every thread; dS complete, dY staged; Qst, W and the other dY buffer read
      issue_qw(ci);
      for (int idx = tid; idx < dk * tc; idx += nthr) {
        const int d = idx / tc, e = idx % tc;
        if (e < tw) c[a.blk.dSe + d * dv + e0 + e] = dS[d * ls + e];
      }
      // dD = scale Cᵀ dY + R dS (Cᵀ is zero below the diagonal: the sum over all n rows of C is Σ_{m>=i})
      const GdnTerm cr[2] = {{Cb, 1, lc, dYs, ls, 1, n, a.scale}, {Rb, ldr, 1, dS, ls, 1, dk, 1.f}};
      gdn_scan_product<kMath>(n, tw, tc, cr, tid, nthr, [&](int i, int e, float acc) {
        dDs[i * ls + e] = acc;
        c[a.blk.dD + i * dv + e0 + e] = acc;
      });
      gdn_async_wait<0>();  // Qst, W, e^{G_last} and the next dY landed
      block_sync();         // dD complete; R, C and dS read
      if (alias) {
        issue_w(ci);
        gdn_async_wait<0>();
        block_sync();
      } else {
        issue_rc(ci - 1);
      }
      if (ci > 0 && !alias) finish_dy(ci - 1);  // into the buffer chunk ci + 1 read; visible at the next barrier
      // dS <- diag(e^{G_last}) dS + scale Qstᵀ dY - Wᵀ dD
      const GdnTerm qw[2] = {{Qb, 1, ldt, dYs, ls, 1, n, a.scale}, {Wb, 1, ldt, dDs, ls, 1, n, -1.f}};
      gdn_scan_product<kMath>(dk, tw, tc, qw, tid, nthr, [&](int d, int e, float acc) {
        dS[d * ls + e] = eg[d] * dS[d * ls + e] + acc;
      });
    }
    gdn_async_wait<0>();
    block_sync();
    if (a.d_state_in && rd.in_slot >= 0) {
      float* dsi = a.d_state_in + (static_cast<int64_t>(rd.in_slot) * H + h) * ssz;
      for (int idx = tid; idx < dk * tc; idx += nthr) {
        const int d = idx / tc, e = idx % tc;
        if (e < tw) dsi[d * dv + e0 + e] = dS[d * ls + e];
      }
    }
  }
};

// out(r, Σ_{m < len} term(r, m)) for rows r < rows: each row's sum in kGdnSumParts interleaved parts, one thread each
// (consecutive threads on consecutive m, so the loads coalesce, and each thread's chain of loads is a quarter of the
// row), the parts added through `scratch` [rows * kGdnSumParts]. Every thread must call it (two barriers).
constexpr int kGdnSumParts = 4;
template <class T, class F>
TREECP_GDN_FN void gdn_row_sums(int rows, int len, T&& term, float* scratch, int tid, int nthr, F&& out) {
  for (int task = tid; task < rows * kGdnSumParts; task += nthr) {
    const int r = task / kGdnSumParts;
    float acc = 0.f;
    for (int m = task % kGdnSumParts; m < len; m += kGdnSumParts) acc += term(r, m);
    scratch[task] = acc;
  }
  block_sync();
  for (int r = tid; r < rows; r += nthr) {
    float sum = 0.f;
    TREECP_GDN_UNROLL
    for (int q = 0; q < kGdnSumParts; ++q) sum += scratch[r * kGdnSumParts + q];
    out(r, sum);
  }
  block_sync();  // scratch free again
}

// ---- gradients: one block per (chunk, head), all of dk and dv, from S0, dSe, D and dD in the cache. The chunk
// products are block products; each token's gradients are one block's (runs do not overlap): plain adds, no
// atomics. Shared: beta [64], for the scalar gate its pair decays [64][64], and the products' panels.
struct GdnGradArgs {
  GdnInputs in;
  const GdnChunkDesc* chunks;
  float* cache;
  GdnBlock blk;
  const void* dy;
  bool dy_f32;
  float scale;
  float* dq;
  float* dk;
  float* dv;
  float* dg;
  float* dbeta;
};
template <int kMath>  // the products' arithmetic and the activations' type (GdnMath)
struct GdnGradKernel {
  static constexpr DType E = gdn_elem(kMath);
  using Args = GdnGradArgs;
  static constexpr const char* kName = "gdn gradients";
  // Two blocks an SM (at most 128 registers a thread; shared memory allows two at dk = dv = 128): the bf16 path would
  // take 189 and run one block of 8 warps an SM, too few to cover each staged panel's latency.
  static constexpr int kMinBlocks = 2;
  // KDA's pair gather with the decays factored below the diagonal 16 x 16 blocks (as prep's): the reference blocks'
  // keys Bk [96][dk] and the rows decayed to their block's first token, Ak and Aq [64][dk], over the panels' space;
  // only where that keeps two blocks an SM (dk <= 128), else the direct gather.
  static constexpr int kRef = kGdnInvBlock, kRefRows = kRef * (1 + 2 + 3);
  static TREECP_GDN_HD int64_t ref_floats(int dk) { return int64_t{kRefRows + 2 * kGdnChunk} * dk; }
  static TREECP_GDN_HD int64_t panel_floats(int dk, int dv) {
    const int wide = dk > dv ? dk : dv, widest = wide > kGdnChunk ? wide : kGdnChunk;
    return gdn_product_smem(kGdnChunk, widest);
  }
  static TREECP_GDN_HD bool kda_ref(bool scalar, int dk, int dv) {
    const int64_t p = panel_floats(dk, dv), r = ref_floats(dk), floats = kGdnChunk + (p > r ? p : r);
    return !scalar && (floats * 4 + kGdnSmemReservedBytes) * kMinBlocks <= kGdnSmemPerSmBytes;
  }
  static size_t smem_bytes(const Args& a) {
    const int64_t work = kda_ref(a.in.scalar_gate, a.in.dk, a.in.dv) ? std::max(panel_floats(a.in.dk, a.in.dv), ref_floats(a.in.dk))
                                                                     : panel_floats(a.in.dk, a.in.dv);
    return (kGdnChunk + (a.in.scalar_gate ? kGdnChunk * kGdnChunk : 0) + work) * sizeof(float);
  }
  static TREECP_GDN_FN void run(const Args& a, int64_t block, int tid, int nthr, float* smem) {
    const int H = a.in.heads, dk = a.in.dk, dv = a.in.dv;
    const int64_t chunk = block / H;
    const int h = static_cast<int>(block % H);
    const GdnChunkDesc cd = a.chunks[chunk];
    const int64_t t = cd.t;
    const int n = cd.len;
    constexpr int l64 = kGdnChunk;
    float* c = a.cache + (chunk * H + h) * a.blk.size;
    const float* G = c + a.blk.G;
    const float* Qst = c + a.blk.Qst;
    const float* Kst = c + a.blk.Kst;
    const float* R = c + a.blk.R;
    const float* W = c + a.blk.W;
    const float* U = c + a.blk.U;
    const float* P = c + a.blk.P;
    const float* Ti = c + a.blk.Ti;
    const float* S0 = c + a.blk.S0;
    const float* dSe = c + a.blk.dSe;
    const float* D = c + a.blk.D;
    const float* dD = c + a.blk.dD;
    const float* egl = c + a.blk.egl;
    float* dX = c + a.blk.dX;
    float* dZ = c + a.blk.dZ;
    float* dGm = c + a.blk.dGm;
    float* rr = c + a.blk.rr;
    float* dL = c + a.blk.dL;
    float* dC = c + a.blk.dC;
    float* bs = smem;               // [64]
    float* Ex = smem + kGdnChunk;   // scalar gate: [64][64], e^{G_i - G_j} (j <= i)
    const bool scalar = a.in.scalar_gate;
    float* panels = Ex + (scalar ? kGdnChunk * kGdnChunk : 0);
    const int64_t dy0 = (t * H + h) * static_cast<int64_t>(dv);
    const int64_t dy_row = static_cast<int64_t>(H) * dv;
    const GdnViewT<E> dyv = a.dy_f32 ? GdnViewT<E>{static_cast<const float*>(a.dy) + dy0, dy_row, 1, false}
                                     : GdnViewT<E>{static_cast<const uint16_t*>(a.dy) + dy0, dy_row, 1, true};
    float* gs = panels;  // [64]: the scalar gate's cumulative sums, until the first product
    for (int i = tid; i < n; i += nthr) {
      bs[i] = a.in.b<E>(t + i, h);
      if (scalar) gs[i] = G[i * dk];
    }
    block_sync();
    if (scalar)
      for (int idx = tid; idx < n * n; idx += nthr) {
        const int i = idx / n, j = idx % n;
        Ex[i * kGdnChunk + j] = j <= i ? expf(gs[i] - gs[j]) : 0.f;
      }
    // dC = scale dY Dᵀ (j <= i); dW = -dD S0ᵀ (into rr)
    gdn_block_product<kMath, 4, 4>(n, n, dv, dyv, gdn_view(D, dv).t(), panels, tid, nthr, [&](int i, int j, float acc) {
      dC[i * l64 + j] = j <= i ? a.scale * acc : 0.f;
    });
    gdn_block_product<kMath, 4, 8>(n, dk, dv, gdn_view(dD, dv), gdn_view(S0, dv).t(), panels, tid, nthr,
                            [&](int i, int d, float acc) { rr[i * dk + d] = -acc; });
    // Lᵀ [dX | dZ] = [dU | dW]: [dX | dZ] = L⁻ᵀ [dD | dW]
    const GdnView lit = gdn_view(Ti, l64).t();
    gdn_block_product<kMath, 4, 8>(n, dv, n, lit, gdn_view(dD, dv), panels, tid, nthr,
                            [&](int i, int e, float acc) { dX[i * dv + e] = acc; });
    gdn_block_product<kMath, 4, 8>(n, dk, n, lit, gdn_view(rr, dk), panels, tid, nthr,
                            [&](int i, int d, float acc) { dZ[i * dk + d] = acc; });
    // dL[i][j] = -(dX_i · U_j + dZ_i · W_j), j < i (the gradient of L = I + diag(β) P below the diagonal)
    gdn_block_product<kMath, 4, 4>(n, n, dv, gdn_view(dX, dv), gdn_view(U, dv).t(), panels, tid, nthr,
                            [&](int i, int j, float acc) { dL[i * l64 + j] = j < i ? -acc : 0.f; });
    gdn_block_product<kMath, 4, 4>(n, n, dk, gdn_view(dZ, dk), gdn_view(W, dk).t(), panels, tid, nthr,
                            [&](int i, int j, float acc) {
                              if (j < i) dL[i * l64 + j] -= acc;
                            });
    // beta and v: X = diag(β) V, Z = diag(β) Kst, L = I + diag(β) P; dbeta_i sums over [j < i | dv | dk]
    if (a.dbeta)
      gdn_row_sums(
          n, kGdnChunk + dv + dk,
          [&](int i, int m) {
            if (m < kGdnChunk) return m < i ? dL[i * kGdnChunk + m] * P[i * kGdnChunk + m] : 0.f;
            if (m < kGdnChunk + dv) return dX[i * dv + m - kGdnChunk] * a.in.vv<E>(t + i, h, m - kGdnChunk);
            return dZ[i * dk + m - kGdnChunk - dv] * Kst[i * dk + m - kGdnChunk - dv];
          },
          panels, tid, nthr, [&](int i, float db) { a.dbeta[(t + i) * H + h] += db; });
    if (a.dv)  // dv += diag(β) dX, a batch's loads issued before its stores (which the compiler cannot reorder)
      for (int base = tid; base < n * dv; base += kGdnStageBatch * nthr) {
        float add[kGdnStageBatch], old[kGdnStageBatch];
        int64_t at[kGdnStageBatch];
        TREECP_GDN_UNROLL
        for (int b = 0; b < kGdnStageBatch; ++b) {
          const int idx = base + b * nthr;
          at[b] = -1;
          if (idx >= n * dv) continue;
          const int i = idx / dv, e = idx % dv;
          at[b] = ((t + i) * H + h) * dv + e;
          add[b] = bs[i] * dX[idx];
          old[b] = a.dv[at[b]];
        }
        TREECP_GDN_UNROLL
        for (int b = 0; b < kGdnStageBatch; ++b)
          if (at[b] >= 0) a.dv[at[b]] = old[b] + add[b];
      }
    // scale dY S0ᵀ (into dGm) and D dSeᵀ (into rr): q's and R's gradients through the state terms
    gdn_block_product<kMath, 4, 8>(n, dk, dv, dyv, gdn_view(S0, dv).t(), panels, tid, nthr,
                            [&](int i, int d, float acc) { dGm[i * dk + d] = a.scale * acc; });
    gdn_block_product<kMath, 4, 8>(n, dk, dv, gdn_view(D, dv), gdn_view(dSe, dv).t(), panels, tid, nthr,
                            [&](int i, int d, float acc) { rr[i * dk + d] = acc; });
    // q, k and the cumulative gate of (token i, channel d): the state terms, then the pairs (i, j), j <= i, with i
    // the later token (dq, dk and dG through k_j e^{G_i - G_j}: x1 = pq, x2 = pk) and the pairs (m, i), m >= i, with
    // i the earlier (y = pt). dqv = dGm, dr = rr on entry; dG and dr R on return. A thread takes kGdnStageBatch
    // elements at a time and issues all their loads before its first store (the stores may alias the next element's
    // loads as far as the compiler knows: a round trip an element otherwise).
    float* pq = c + a.blk.pq;
    float* pk = c + a.blk.pk;
    float* pt = c + a.blk.pt;
    auto finish_all = [&] {
      constexpr int B = kGdnStageBatch;
      for (int base = tid; base < n * dk; base += B * nthr) {
        float dqv[B], dr[B], gi[B], gl[B], dz[B], qi[B], ki[B], qs[B], r[B], ks[B], x1[B], x2[B], y[B], oq[B], ok[B];
        TREECP_GDN_UNROLL
        for (int b = 0; b < B; ++b) {
          const int idx = base + b * nthr;
          if (idx >= n * dk) break;
          const int i = idx / dk, d = idx % dk;
          const int64_t o = ((t + i) * H + h) * dk + d;
          dqv[b] = dGm[idx]; dr[b] = rr[idx]; gi[b] = G[idx]; gl[b] = G[(n - 1) * dk + d]; dz[b] = bs[i] * dZ[idx];
          qi[b] = a.in.qk<E>(a.in.q, t + i, h, d); ki[b] = a.in.qk<E>(a.in.k, t + i, h, d);
          qs[b] = Qst[idx]; r[b] = R[idx]; ks[b] = Kst[idx]; x1[b] = pq[idx]; x2[b] = pk[idx]; y[b] = pt[idx];
          oq[b] = a.dq ? a.dq[o] : 0.f;
          ok[b] = a.dk ? a.dk[o] : 0.f;
        }
        TREECP_GDN_UNROLL
        for (int b = 0; b < B; ++b) {
          const int idx = base + b * nthr;
          if (idx >= n * dk) break;
          const int i = idx / dk, d = idx % dk;
          const int64_t o = ((t + i) * H + h) * dk + d;
          const float eg = expf(gi[b]), er = expf(gl[b] - gi[b]);
          const float dq = eg * dqv[b] + x1[b];
          const float dkk = er * dr[b] + eg * dz[b] + x2[b] + y[b];
          const float dG = dqv[b] * qs[b] - dr[b] * r[b] + dz[b] * ks[b] + ki[b] * x2[b] + qi[b] * x1[b] - y[b] * ki[b];
          if (a.dq) a.dq[o] = oq[b] + dq;
          if (a.dk) a.dk[o] = ok[b] + dkk;
          dGm[idx] = dG;
          rr[idx] = dr[b] * r[b];
        }
      }
    };
    if (scalar) {
      // The pair decay is one factor: with A1 = dC ⊙ Ex and A2 = diag(β) dL ⊙ Ex (j < i), the pair sums are
      // x1 = A1 K, x2 = A2 K and y = A1ᵀ Q + A2ᵀ K.
      for (int idx = tid; idx < n * n; idx += nthr) {
        const int i = idx / n, j = idx % n;
        const float ex = Ex[i * kGdnChunk + j];
        dC[i * l64 + j] *= ex;
        dL[i * l64 + j] = j < i ? bs[i] * dL[i * l64 + j] * ex : 0.f;
      }
      const GdnViewT<E> kr = a.in.rows<E>(a.in.k, t, h, dk), qr = a.in.rows<E>(a.in.q, t, h, dk);
      const GdnView a1 = gdn_view(dC, l64), a2 = gdn_view(dL, l64);
      gdn_block_product<kMath, 4, 8>(n, dk, n, a1, kr, panels, tid, nthr, [&](int i, int d, float acc) { pq[i * dk + d] = acc; });
      gdn_block_product<kMath, 4, 8>(n, dk, n, a2, kr, panels, tid, nthr, [&](int i, int d, float acc) { pk[i * dk + d] = acc; });
      gdn_block_product<kMath, 4, 8>(n, dk, n, a1.t(), qr, panels, tid, nthr, [&](int i, int d, float acc) { pt[i * dk + d] = acc; });
      gdn_block_product<kMath, 4, 8>(n, dk, n, a2.t(), kr, panels, tid, nthr,
                                     [&](int i, int d, float acc) { pt[i * dk + d] += acc; });
    } else if (kda_ref(false, dk, dv)) {
      // Per-channel decays: each (token i, channel d) gathers its pairs, directly (e^{G_i - G_j} per pair) inside its
      // 16-row block I, factored through a block's first token beyond it (both factors <= 1, as in prep):
      //   j < r = 16 I:   e^{G_i - G_j} = e^{G_i - G_r} e^{G_r - G_j}, Bk_I[j] = e^{G_r - G_j} k_j;
      //   m in block M > I (r' = 16 M): e^{G_m - G_i} = e^{G_m - G_r'} e^{G_r' - G_i}, Ak[m], Aq[m] = e^{G_m - G_r'} k_m, q_m;
      // about 20 exponentials an element instead of 65.
      block_sync();  // the panels' last reads are done
      float* Bk = panels;                           // [96][dk]: block I's rows from kda_ref_at(I)
      float* Ak = Bk + int64_t{kRefRows} * dk;      // [64][dk]
      float* Aq = Ak + int64_t{kGdnChunk} * dk;     // [64][dk]
      auto ref_at = [](int I) { return kRef * I * (I - 1) / 2; };
      for (int I = 1; I * kRef < n; ++I) {
        const int r0 = I * kRef;
        for (int idx = tid; idx < r0 * dk; idx += nthr) {
          const int j = idx / dk, d = idx % dk;
          Bk[(ref_at(I) + j) * dk + d] = a.in.qk<E>(a.in.k, t + j, h, d) * expf(G[r0 * dk + d] - G[j * dk + d]);
        }
      }
      for (int idx = kRef * dk + tid; idx < n * dk; idx += nthr) {
        const int m = idx / dk, d = idx % dk, r0 = m / kRef * kRef;
        const float e = expf(G[m * dk + d] - G[r0 * dk + d]);
        Ak[idx] = a.in.qk<E>(a.in.k, t + m, h, d) * e;
        Aq[idx] = a.in.qk<E>(a.in.q, t + m, h, d) * e;
      }
      block_sync();
      for (int idx = tid; idx < n * dk; idx += nthr) {
        const int i = idx / dk, d = idx % dk, I = i / kRef, r0 = I * kRef;
        const int r1 = r0 + kRef < n ? r0 + kRef : n;  // block I is [r0, r1)
        const float gi = G[i * dk + d];
        const float bi = bs[i];
        float x1 = 0.f, x2 = 0.f, y = 0.f;
        if (I > 0) {
          const float* B = Bk + ref_at(I) * dk + d;
          for (int j = 0; j < r0; ++j) {
            x1 += dC[i * l64 + j] * B[j * dk];
            x2 += dL[i * l64 + j] * B[j * dk];
          }
          const float e = expf(gi - G[r0 * dk + d]);
          x1 *= e;
          x2 *= bi * e;
        }
        for (int j = r0; j <= i; ++j) {
          const float kj = a.in.qk<E>(a.in.k, t + j, h, d) * expf(gi - G[j * dk + d]);
          x1 += dC[i * l64 + j] * kj;
          if (j < i) x2 += bi * dL[i * l64 + j] * kj;
        }
        for (int m = i; m < r1; ++m) {
          const float ex = expf(G[m * dk + d] - gi);
          const float dp = m > i ? bs[m] * dL[m * l64 + i] : 0.f;
          y += (dp * a.in.qk<E>(a.in.k, t + m, h, d) + dC[m * l64 + i] * a.in.qk<E>(a.in.q, t + m, h, d)) * ex;
        }
        for (int m0 = r1; m0 < n; m0 += kRef) {  // later blocks: m > i, so dp is always there
          const int m1 = m0 + kRef < n ? m0 + kRef : n;
          float part = 0.f;
          for (int m = m0; m < m1; ++m)
            part += bs[m] * dL[m * l64 + i] * Ak[m * dk + d] + dC[m * l64 + i] * Aq[m * dk + d];
          y += expf(G[m0 * dk + d] - gi) * part;
        }
        pq[idx] = x1;
        pk[idx] = x2;
        pt[idx] = y;
      }
      block_sync();
    } else {
      // Per-channel decays: each (token, channel) gathers its pairs, e^{G_i - G_j} per pair.
      for (int idx = tid; idx < n * dk; idx += nthr) {
        const int i = idx / dk, d = idx % dk;
        const float gi = G[i * dk + d];
        float x1 = 0.f, x2 = 0.f, y = 0.f;
        for (int j = 0; j <= i; ++j) {
          const float kj = a.in.qk<E>(a.in.k, t + j, h, d) * expf(gi - G[j * dk + d]);
          x1 += dC[i * l64 + j] * kj;
          if (j < i) x2 += bs[i] * dL[i * l64 + j] * kj;
        }
        for (int m = i; m < n; ++m) {
          const float ex = expf(G[m * dk + d] - gi);
          const float dp = m > i ? bs[m] * dL[m * l64 + i] : 0.f;
          y += (dp * a.in.qk<E>(a.in.k, t + m, h, d) + dC[m * l64 + i] * a.in.qk<E>(a.in.q, t + m, h, d)) * ex;
        }
        pq[idx] = x1;
        pk[idx] = x2;
        pt[idx] = y;
      }
      block_sync();
    }
    finish_all();
    block_sync();
    // G_i = Σ_{s<=i} g_s: dg_s = Σ_{i>=s} dG_i, the last row also taking R's and the start state's decay
    // (extra_d = Σ_i rr[i][d] + e^{G_last,d} Σ_e dSe[d][e] S0[d][e], summed over [n | dv]).
    gdn_row_sums(
        dk, n + dv,
        [&](int d, int m) { return m < n ? rr[m * dk + d] : egl[d] * (dSe[d * dv + m - n] * S0[d * dv + m - n]); },
        panels, tid, nthr, [&](int d, float extra) {
          float acc = extra;
          for (int i = n - 1; i >= 0; --i) {
            acc += dGm[i * dk + d];
            if (a.in.scalar_gate)
              dGm[i * dk + d] = acc;
            else if (a.dg)
              a.dg[((t + i) * H + h) * dk + d] += acc;
          }
        });
    if (a.in.scalar_gate && a.dg)  // a scalar gate sums its channels
      gdn_row_sums(
          n, dk, [&](int i, int d) { return dGm[i * dk + d]; }, panels, tid, nthr,
          [&](int i, float sum) { a.dg[(t + i) * H + h] += sum; });
  }
};

// ---- output of the split forward (GdnCudaParams::split_forward): one block per (chunk, head),
// Y = scale (Qst S0 + C D) from the cache (prep's Qst and C, the saving scan's S0 and D) as two block products on the
// chunk-parallel arithmetic; the first one's result waits in shared memory [64][dv] for the second. C is zero above
// the diagonal, so its n columns sum j <= i.
struct GdnOutArgs {
  const GdnChunkDesc* chunks;
  const float* cache;
  GdnBlock blk;
  int32_t heads, dk, dv;
  void* y;
  bool y_f32;
  float scale;
};
template <int kMath>  // the products' arithmetic and the activations' type (GdnMath)
struct GdnOutKernel {
  static constexpr DType E = gdn_elem(kMath);
  using Args = GdnOutArgs;
  static constexpr const char* kName = "gdn output";
  static size_t smem_bytes(const Args& a) {
    return static_cast<size_t>(int64_t{kGdnChunk} * a.dv + gdn_product_smem(kGdnChunk, a.dv)) * sizeof(float);
  }
  static TREECP_GDN_FN void run(const Args& a, int64_t block, int tid, int nthr, float* smem) {
    const int H = a.heads, dk = a.dk, dv = a.dv;
    const int64_t chunk = block / H;
    const int h = static_cast<int>(block % H);
    const GdnChunkDesc cd = a.chunks[chunk];
    const int n = cd.len;
    const float* c = a.cache + (chunk * H + h) * a.blk.size;
    float* Ys = smem;                               // [64][dv]
    float* panels = smem + int64_t{kGdnChunk} * dv;
    const bool b16 = a.blk.states_bf16;
    gdn_block_product<kMath, 4, 8>(n, dv, dk, gdn_view(c + a.blk.Qst, dk), GdnView{c + a.blk.S0, dv, 1, b16}, panels,
                                   tid, nthr, [&](int i, int e, float acc) { Ys[i * dv + e] = acc; });
    const int64_t y0 = (cd.t * H + h) * static_cast<int64_t>(dv), y_row = static_cast<int64_t>(H) * dv;
    gdn_block_product<kMath, 4, 8>(n, dv, n, gdn_view(c + a.blk.C, kGdnChunk), GdnView{c + a.blk.D, dv, 1, b16}, panels,
                                   tid, nthr, [&](int i, int e, float acc) {
                                     store_out<E>(a.y, a.y_f32, y0 + i * y_row + e, a.scale * (Ys[i * dv + e] + acc));
                                   });
  }
};

// ---- out[b] = op(A[b]) B[b] + add[b]: one block per (item b, output row i); the block copies row i of op(A) to
// shared memory before writing row i of out, so out may alias A (not transposed) and add, never B.
struct GdnRowMatArgs {
  int64_t count;
  int32_t rows, inner, cols;  // op(A) rows x inner, B inner x cols
  const float* A;             // [count][rows][inner], or [count][inner][rows] transposed
  bool trans_a;
  const float* B;    // [count][inner][cols]
  const float* add;  // [count][rows][cols] or null
  float* out;        // [count][rows][cols]
};
struct GdnRowMatKernel {
  using Args = GdnRowMatArgs;
  static constexpr const char* kName = "gdn summary algebra";
  static size_t smem_bytes(const Args& a) { return static_cast<size_t>(a.inner) * sizeof(float); }
  static TREECP_GDN_FN void run(const Args& a, int64_t block, int tid, int nthr, float* smem) {
    const int64_t item = block / a.rows;
    const int i = static_cast<int>(block % a.rows);
    const float* A = a.A + item * a.rows * a.inner;
    const float* B = a.B + item * a.inner * a.cols;
    const int64_t o = item * a.rows * a.cols + static_cast<int64_t>(i) * a.cols;
    for (int l = tid; l < a.inner; l += nthr) smem[l] = a.trans_a ? A[l * a.rows + i] : A[i * a.inner + l];
    block_sync();
    for (int j = tid; j < a.cols; j += nthr) {
      float acc = a.add ? a.add[o + j] : 0.f;
      for (int l = 0; l < a.inner; ++l) acc += smem[l] * B[l * a.cols + j];
      a.out[o + j] = acc;
    }
  }
};

}  // namespace treecp::cuda::detail

#include "kernels/cuda/gdn_fla_device.cuh"      // the FLA-like split forward (GdnCudaParams::fla_split)
#include "kernels/cuda/gdn_fla_bwd_device.cuh"  // and its backward

namespace treecp::cuda::detail {

#if defined(__CUDACC__)
// ---- the device executor: each body as one __global__ kernel, launched on one stream
template <class K>
__global__ void __launch_bounds__(kGdnThreads) gdn_kernel(const typename K::Args a) {
  extern __shared__ float gdn_smem[];
  K::run(a, blockIdx.x, static_cast<int>(threadIdx.x), static_cast<int>(blockDim.x), gdn_smem);
}
// The same for a body that sets kMinBlocks: the registers a thread may take so that that many blocks fit an SM.
template <class K>
__global__ void __launch_bounds__(kGdnThreads, K::kMinBlocks) gdn_kernel_bounded(const typename K::Args a) {
  extern __shared__ float gdn_smem[];
  K::run(a, blockIdx.x, static_cast<int>(threadIdx.x), static_cast<int>(blockDim.x), gdn_smem);
}

struct GdnDeviceExec {
  cudaStream_t stream;
  template <class K>
  void launch(int64_t blocks, const typename K::Args& a) {
    require(blocks > 0 && blocks <= 0x7fffffff, K::kName, ": ", blocks, " blocks do not fit one grid");
    const size_t smem = K::smem_bytes(a);
    auto* kernel = [] {
      if constexpr (requires { K::kMinBlocks; })
        return gdn_kernel_bounded<K>;
      else
        return gdn_kernel<K>;
    }();
    if (smem > 48 * 1024)  // above the default limit a kernel must opt in (up to 227 KiB on sm_90)
      check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)),
                 K::kName);
    kernel<<<static_cast<unsigned>(blocks), kGdnThreads, smem, stream>>>(a);
    check_cuda(cudaGetLastError(), K::kName);
  }
  // From pageable host memory: the call returns once the bytes are staged, so `src` may go right after.
  void upload(void* dst, const void* src, size_t bytes) {
    check_cuda(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream), "gdn (cuda): descriptor upload");
  }
};
#endif

// ---- host side: checks, the chunk schedule, the workspace layout and the launch sequences (executor X:
// X::launch<Kernel>(blocks, args) and X::upload(dst, src, bytes), both in stream order).

// `pointers`: also that the inputs are given (a workspace size needs only the shapes).
inline void gdn_check(const GdnCudaParams& p, const std::vector<GdnCudaRun>& runs, bool pointers = true) {
  require(p.heads >= 1, "gdn (cuda): heads must be >= 1, got ", p.heads);
  require(p.dk >= 1 && p.dk <= kGdnMaxDim, "gdn (cuda): dk must be in [1, ", kGdnMaxDim, "], got ", p.dk);
  require(p.dv >= 1 && p.dv <= kGdnMaxDim, "gdn (cuda): dv must be in [1, ", kGdnMaxDim, "], got ", p.dv);
  require(p.tokens >= 0, "gdn (cuda): tokens must be >= 0, got ", p.tokens);
  require(p.gate == GdnGate::Scalar || p.gate == GdnGate::PerChannel, "gdn (cuda): unknown gate kind");
  require(p.scan_columns == 0 || p.scan_columns == 16 || p.scan_columns == 32 || (p.fla_split && p.scan_columns == 64),
          "gdn (cuda): scan_columns must be 0 (default), 16 or 32 (or 64 with fla_split), got ", p.scan_columns);
  if (p.fla_split) {
    require(p.gate == GdnGate::Scalar, "gdn (cuda): fla_split takes the scalar gate (GDN), not the per-channel one");
    require((p.dk == 64 || p.dk == 128) && (p.dv == 64 || p.dv == 128),
            "gdn (cuda): fla_split takes dk and dv of 64 or 128, got dk ", p.dk, ", dv ", p.dv);
    require(p.dtype == DType::kBf16 && p.precision == GdnPrecision::bf16_tensor_scans,
            "gdn (cuda): fla_split runs every product on bf16 tensor cores: it needs bf16 activations and precision "
            "bf16_tensor_scans, got precision ", gdn_precision_name(p.precision));
    require(!p.split_forward, "gdn (cuda): fla_split and split_forward are two forwards: set one");
    require(!pointers || ((reinterpret_cast<uintptr_t>(p.q) | reinterpret_cast<uintptr_t>(p.k) |
                           reinterpret_cast<uintptr_t>(p.v)) % 4 == 0),
            "gdn (cuda): fla_split copies q, k and v rows asynchronously: they must be 4-byte aligned");
  }
  require(!p.keep_forward || p.fla_split, "gdn (cuda): keep_forward keeps the FLA-like split's arrays: it needs fla_split");
  require(gdn_precision_known(p.precision), "gdn (cuda): unknown precision ", static_cast<int>(p.precision));
  require(p.dtype == DType::kBf16 || p.dtype == DType::kF16, "gdn (cuda): dtype must be bf16 or fp16, got ",
          static_cast<int>(p.dtype));
  // fp16 activations run the fp32 products only (why: GdnMath).
  require(p.dtype == DType::kBf16 || p.precision == GdnPrecision::fp32, "gdn (cuda): precision ",
          gdn_precision_name(p.precision),
          " needs bf16 activations (fp16 runs the fp32 products: its intermediates would overflow fp16's range)");
  std::vector<std::pair<int64_t, int64_t>> spans;
  for (size_t r = 0; r < runs.size(); ++r) {
    const GdnCudaRun& run = runs[r];
    require(0 <= run.t0 && run.t0 <= run.t1 && run.t1 <= p.tokens, "gdn (cuda): run ", r, " [", run.t0, ", ", run.t1,
            ") outside [0, ", p.tokens, ")");
    require(run.in_slot >= -1 && run.out_slot >= -1, "gdn (cuda): run ", r, ": slots must be >= -1");
    require(!pointers || run.in_slot < 0 || p.state_in, "gdn (cuda): run ", r, " has in_slot ", run.in_slot,
            " but state_in is null");
    if (run.t1 > run.t0) spans.emplace_back(run.t0, run.t1);
  }
  std::sort(spans.begin(), spans.end());
  for (size_t i = 1; i < spans.size(); ++i)
    require(spans[i].first >= spans[i - 1].second, "gdn (cuda): runs [", spans[i - 1].first, ", ", spans[i - 1].second,
            ") and [", spans[i].first, ", ", spans[i].second, ") overlap");
  require(!pointers || spans.empty() || (p.q && p.k && p.v && p.g && p.beta),
          "gdn (cuda): q, k, v, g and beta must be given");
}

// The chunk schedule of one call and its carving of the workspace: the chunk and run descriptors, then one block a
// (chunk, head) of the cache the call's kernels use: the classic kernels' GdnBlock (with S0 and D for split_forward's
// forward, the gradients' arrays for the backward) or, for a forward with fla_split, the split's GdnFlaBlock (the
// classic prep never runs then). `bytes` is where the last carve ends: what the call needs, no more.
struct GdnSchedule {
  std::vector<GdnChunkDesc> chunks;
  std::vector<GdnRunDesc> runs;
  GdnBlock blk;
  GdnFlaBlock fla;  // the split forward's blocks (GdnCudaParams::fla_split), at cache_at like the classic cache
  bool fla_split = false;  // the cache is fla's blocks
  size_t chunks_at = 0, runs_at = 0, cache_at = 0, bytes = 0;  // workspace offsets

  // A carve [begin, end) of the workspace, for the checks (tests/test_gdn_cuda_emulated.cpp).
  struct Carve {
    const char* what;
    size_t begin, end;
  };
  std::vector<Carve> carves() const {
    return {{"chunk descriptors", chunks_at, chunks_at + chunks.size() * sizeof(GdnChunkDesc)},
            {"run descriptors", runs_at, runs_at + runs.size() * sizeof(GdnRunDesc)},
            {fla_split ? "fla blocks" : "chunk blocks", cache_at, bytes}};
  }

  GdnSchedule(const GdnCudaParams& p, const std::vector<GdnCudaRun>& in, GdnCallKind kind) {
    const bool backward = kind == GdnCallKind::backward;
    for (size_t r = 0; r < in.size(); ++r) {
      GdnRunDesc d{static_cast<int32_t>(chunks.size()), 0, in[r].in_slot, in[r].out_slot};
      for (int64_t t = in[r].t0; t < in[r].t1; t += kGdnChunk) {
        chunks.push_back({t, static_cast<int32_t>(std::min<int64_t>(kGdnChunk, in[r].t1 - t)), static_cast<int32_t>(r)});
        ++d.chunk_count;
      }
      runs.push_back(d);
    }
    // S0 and D only where the split forward's output kernel reads them (the summary never does).
    blk = GdnBlock::make(p.dk, p.dv, backward, kind == GdnCallKind::forward && p.split_forward,
                         p.precision != GdnPrecision::fp32);
    auto align = [](size_t x) { return (x + 255) / 256 * 256; };
    runs_at = align(chunks.size() * sizeof(GdnChunkDesc));
    cache_at = runs_at + align(runs.size() * sizeof(GdnRunDesc));
    const size_t pairs = chunks.size() * static_cast<size_t>(p.heads);
    fla_split = kind != GdnCallKind::summary && p.fla_split;
    // A forward that keeps its arrays for the backward (keep_forward) carves the backward's blocks.
    if (fla_split) fla = GdnFlaBlock::make(p.dk, p.dv, backward || p.keep_forward);
    bytes = cache_at + pairs * (fla_split ? static_cast<size_t>(fla.size) : static_cast<size_t>(blk.size) * sizeof(float));
  }
  unsigned char* fla_cache(const GdnCudaParams& p) const {
    return static_cast<unsigned char*>(p.workspace) + cache_at;
  }
  const GdnChunkDesc* dev_chunks(const GdnCudaParams& p) const {
    return reinterpret_cast<const GdnChunkDesc*>(static_cast<const char*>(p.workspace) + chunks_at);
  }
  const GdnRunDesc* dev_runs(const GdnCudaParams& p) const {
    return reinterpret_cast<const GdnRunDesc*>(static_cast<const char*>(p.workspace) + runs_at);
  }
  float* cache(const GdnCudaParams& p) const {
    return reinterpret_cast<float*>(static_cast<char*>(p.workspace) + cache_at);
  }
  // Checks the workspace and copies the descriptors into it.
  template <class X>
  void upload(X& x, const GdnCudaParams& p) const {
    require(p.workspace != nullptr || bytes == 0, "gdn (cuda): workspace is null (needs ", bytes, " bytes)");
    require(p.workspace_bytes >= bytes, "gdn (cuda): workspace of ", p.workspace_bytes, " bytes, needs ", bytes);
    require(reinterpret_cast<uintptr_t>(p.workspace) % 256 == 0, "gdn (cuda): workspace must be 256-byte aligned");
    if (!chunks.empty()) x.upload(static_cast<char*>(p.workspace) + chunks_at, chunks.data(), chunks.size() * sizeof(GdnChunkDesc));
    if (!runs.empty()) x.upload(static_cast<char*>(p.workspace) + runs_at, runs.data(), runs.size() * sizeof(GdnRunDesc));
  }
};

// Launches K<true> (tensor-core products) or K<false>: each path is its own kernel with its own registers.
// The chunk-parallel kernels' arithmetic for p (GdnMath), and the scans'.
inline int gdn_chunk_math(const GdnCudaParams& p) {
  return (p.precision != GdnPrecision::fp32 ? kGdnBf16 : p.tensor_cores ? kGdnTf32x3 : kGdnFma) |
         (p.dtype == DType::kF16 ? kGdnF16 : 0);
}
inline int gdn_scan_math(const GdnCudaParams& p) {
  return (p.precision == GdnPrecision::bf16_tensor_scans ? kGdnBf16 : p.tensor_cores ? kGdnTf32x3 : kGdnFma) |
         (p.dtype == DType::kF16 ? kGdnF16 : 0);
}
// Launches K<kGdnBf16>, K<kGdnTf32x3> or K<kGdnFma>, or one of the last two with kGdnF16 (gdn_check has refused
// fp16 on bf16 products).
template <template <int> class K, class X>
void gdn_launch_math(X& x, int math, int64_t blocks, const typename K<kGdnFma>::Args& a) {
  if (math == kGdnBf16)
    x.template launch<K<kGdnBf16>>(blocks, a);
  else if (math == kGdnTf32x3)
    x.template launch<K<kGdnTf32x3>>(blocks, a);
  else if (math == kGdnFma)
    x.template launch<K<kGdnFma>>(blocks, a);
  else if (math == (kGdnTf32x3 | kGdnF16))
    x.template launch<K<kGdnTf32x3 | kGdnF16>>(blocks, a);
  else
    x.template launch<K<kGdnFma | kGdnF16>>(blocks, a);
}

inline GdnInputs gdn_inputs(const GdnCudaParams& p) {
  return {static_cast<const uint16_t*>(p.q), static_cast<const uint16_t*>(p.k), static_cast<const uint16_t*>(p.v),
          static_cast<const uint16_t*>(p.g), static_cast<const uint16_t*>(p.beta), p.heads, p.dk, p.dv,
          p.gate == GdnGate::Scalar};
}

template <class X>
void gdn_prep_on(X& x, const GdnCudaParams& p, const GdnSchedule& s) {
  if (s.chunks.empty()) return;
  gdn_launch_math<GdnPrepKernel>(x, gdn_chunk_math(p), static_cast<int64_t>(s.chunks.size()) * p.heads,
                            GdnPrepArgs{gdn_inputs(p), s.dev_chunks(p), s.cache(p), s.blk});
}

inline int gdn_scan_tile(const GdnCudaParams& p) { return p.scan_columns > 0 ? p.scan_columns : kGdnTile; }

inline GdnScanArgs gdn_scan_args(const GdnCudaParams& p, const GdnSchedule& s, int width) {
  GdnScanArgs a{};
  a.runs = s.dev_runs(p);
  a.chunks = s.dev_chunks(p);
  a.cache = s.cache(p);
  a.blk = s.blk;
  a.heads = p.heads;
  a.dk = p.dk;
  a.dv = p.dv;
  a.width = width;
  a.tile = gdn_scan_tile(p);
  a.use_u = true;
  a.scale = p.scale;
  a.y_f32 = p.y_f32;
  return a;
}

template <class X>
void gdn_scan_on(X& x, const GdnCudaParams& p, const GdnSchedule& s, const GdnScanArgs& a) {
  if (s.runs.empty()) return;
  gdn_launch_math<GdnScanKernel>(x, gdn_scan_math(p), static_cast<int64_t>(s.runs.size()) * p.heads * gdn_scan_tiles(a.width, a.tile),
                            a);
}

// Slots a call writes must be distinct across runs (each is one block's plain store).
inline void gdn_check_distinct_slots(const std::vector<GdnCudaRun>& runs, bool in, const char* what) {
  std::vector<int32_t> slots;
  for (const GdnCudaRun& r : runs)
    if ((in ? r.in_slot : r.out_slot) >= 0) slots.push_back(in ? r.in_slot : r.out_slot);
  std::sort(slots.begin(), slots.end());
  for (size_t i = 1; i < slots.size(); ++i)
    require(slots[i] != slots[i - 1], "gdn (cuda): two runs write ", what, " slot ", slots[i]);
}

// The FLA-like split forward (GdnCudaParams::fla_split; gdn_check has taken the shape): prep per (chunk, head), the
// scan per (run, head, column block), the output per (chunk, head) where y is wanted.
// A scan-shaped kernel K<DK, BV> (the forward's scan, the backward's dscan) per (run, head, BV state columns) at
// p's dk and column count (0 = 32, 16, 32 or 64; gdn_check has taken them).
template <template <int, int> class K, class X>
void gdn_fla_columns_on(X& x, const GdnCudaParams& p, const GdnSchedule& s, const typename K<64, 32>::Args& a) {
  const int bv = p.scan_columns > 0 ? p.scan_columns : kGdnTile;
  auto with_bv = [&](auto dk) {
    constexpr int DK = decltype(dk)::value;
    const int64_t per_column = static_cast<int64_t>(s.runs.size()) * p.heads;
    if (bv == 16)
      x.template launch<K<DK, 16>>(per_column * (p.dv / 16), a);
    else if (bv == 64)
      x.template launch<K<DK, 64>>(per_column * (p.dv / 64), a);
    else
      x.template launch<K<DK, 32>>(per_column * (p.dv / 32), a);
  };
  if (p.dk == 64)
    with_bv(std::integral_constant<int, 64>{});
  else
    with_bv(std::integral_constant<int, 128>{});
}
// f(dk, dv) with the split's head dims as std::integral_constant<int, 64 or 128> (gdn_check has taken them).
template <class F>
void gdn_fla_with_dims(const GdnCudaParams& p, F&& f) {
  using D64 = std::integral_constant<int, 64>;
  using D128 = std::integral_constant<int, 128>;
  auto with_dv = [&](auto dk) {
    if (p.dv == 64) f(dk, D64{});
    else f(dk, D128{});
  };
  if (p.dk == 64) with_dv(D64{});
  else with_dv(D128{});
}
template <class X>
void gdn_fla_forward_on(X& x, const GdnCudaParams& p, const GdnSchedule& s) {
  const int64_t chunk_blocks = static_cast<int64_t>(s.chunks.size()) * p.heads;
  unsigned char* ws = s.fla_cache(p);
  if (chunk_blocks > 0) {
    GdnFlaPrepArgs a{s.dev_chunks(p), ws, s.fla, static_cast<const uint16_t*>(p.k),
                     static_cast<const uint16_t*>(p.v), static_cast<const uint16_t*>(p.g),
                     static_cast<const uint16_t*>(p.beta), p.heads};
    a.save_x = p.keep_forward;  // X = L⁻¹ for the backward
    gdn_fla_with_dims(p, [&](auto dk, auto dv) {
      x.template launch<GdnFlaPrepKernel<decltype(dk)::value, decltype(dv)::value>>(chunk_blocks, a);
    });
  }
  if (!s.runs.empty()) {
    const GdnFlaScanArgs a{s.dev_runs(p), s.dev_chunks(p), ws, s.fla, static_cast<const uint16_t*>(p.k), p.heads,
                           p.dv, p.state_in, p.state_out, p.y != nullptr || p.keep_forward};
    gdn_fla_columns_on<GdnFlaScanKernel>(x, p, s, a);
  }
  if (!p.y || chunk_blocks == 0) return;
  const GdnFlaOutArgs o{s.dev_chunks(p), ws, s.fla, static_cast<const uint16_t*>(p.q), static_cast<const uint16_t*>(p.k),
                        p.heads, p.y, p.y_f32, p.scale};
  gdn_fla_with_dims(p, [&](auto dk, auto dv) {
    x.template launch<GdnFlaOutKernel<decltype(dk)::value, decltype(dv)::value>>(chunk_blocks, o);
  });
}

// The FLA-like split backward (gdn_fla_bwd_device.cuh): the split forward's prep (keeping X = L⁻¹) and scan (the
// chunk-start states and v_new) again, unless a forward with keep_forward left them in the workspace; then the local
// kernel, the reverse scan of the state gradient, and the gradients per (chunk, head) where any is wanted.
template <class X>
void gdn_fla_backward_on(X& x, const GdnCudaParams& p, const GdnSchedule& s, const GdnCudaGrads& g) {
  const int64_t chunk_blocks = static_cast<int64_t>(s.chunks.size()) * p.heads;
  unsigned char* ws = s.fla_cache(p);
  const auto* q = static_cast<const uint16_t*>(p.q);
  const auto* k = static_cast<const uint16_t*>(p.k);
  if (chunk_blocks > 0 && !p.keep_forward) {
    GdnFlaPrepArgs a{s.dev_chunks(p), ws, s.fla, k, static_cast<const uint16_t*>(p.v),
                     static_cast<const uint16_t*>(p.g), static_cast<const uint16_t*>(p.beta), p.heads};
    a.save_x = true;
    gdn_fla_with_dims(p, [&](auto dk, auto dv) {
      x.template launch<GdnFlaPrepKernel<decltype(dk)::value, decltype(dv)::value>>(chunk_blocks, a);
    });
  }
  if (s.runs.empty()) return;
  if (!p.keep_forward) {
    const GdnFlaScanArgs a{s.dev_runs(p), s.dev_chunks(p), ws, s.fla, k, p.heads, p.dv, p.state_in, nullptr, true};
    gdn_fla_columns_on<GdnFlaScanKernel>(x, p, s, a);
  }
  if (chunk_blocks > 0) {
    const GdnFlaLocalArgs l{s.dev_chunks(p), ws, s.fla, q, k, g.dy, p.y_f32, p.heads, p.scale};
    gdn_fla_with_dims(p, [&](auto dk, auto dv) {
      x.template launch<GdnFlaLocalKernel<decltype(dk)::value, decltype(dv)::value>>(chunk_blocks, l);
    });
  }
  const GdnFlaDscanArgs d{s.dev_runs(p), s.dev_chunks(p), ws, s.fla, q, k, p.heads, p.dv, g.d_state_out, g.d_state_in};
  gdn_fla_columns_on<GdnFlaDscanKernel>(x, p, s, d);
  if (!g.any() || chunk_blocks == 0) return;
  const GdnFlaGradArgs r{s.dev_chunks(p), ws, s.fla, q, k, static_cast<const uint16_t*>(p.v),
                         static_cast<const uint16_t*>(p.beta), g.dy, p.y_f32, p.heads, p.scale,
                         g.dq, g.dk, g.dv, g.dg, g.dbeta};
  gdn_fla_with_dims(p, [&](auto dk, auto dv) {
    x.template launch<GdnFlaGradKernel<decltype(dk)::value, decltype(dv)::value>>(chunk_blocks, r);
  });
}

template <class X>
void gdn_forward_on(X& x, const GdnCudaParams& p, const std::vector<GdnCudaRun>& runs) {
  gdn_check(p, runs);
  for (size_t r = 0; r < runs.size(); ++r)
    require(runs[r].out_slot < 0 || p.state_out, "gdn (cuda): run ", r, " has out_slot ", runs[r].out_slot,
            " but state_out is null");
  gdn_check_distinct_slots(runs, false, "state_out");
  const GdnSchedule s(p, runs, GdnCallKind::forward);
  s.upload(x, p);
  if (s.fla_split) {
    gdn_fla_forward_on(x, p, s);
    return;
  }
  gdn_prep_on(x, p, s);
  GdnScanArgs a = gdn_scan_args(p, s, p.dv);
  a.state_in = p.state_in;
  a.state_out = p.state_out;
  if (!p.split_forward) {
    a.y = p.y;
    gdn_scan_on(x, p, s, a);
    return;
  }
  a.save = p.y != nullptr;  // S0 and D for the output kernel
  a.save_bf16 = s.blk.states_bf16;
  gdn_scan_on(x, p, s, a);
  if (p.y && !s.chunks.empty())
    gdn_launch_math<GdnOutKernel>(x, gdn_chunk_math(p), static_cast<int64_t>(s.chunks.size()) * p.heads,
                                  GdnOutArgs{s.dev_chunks(p), s.cache(p), s.blk, p.heads, p.dk, p.dv, p.y, p.y_f32,
                                             p.scale});
}

template <class X>
void gdn_summary_on(X& x, const GdnCudaParams& p, const std::vector<GdnCudaRun>& runs, float* M, float* E) {
  gdn_check(p, runs);
  require(M && E, "gdn (cuda) summary: M and E must be given");
  gdn_check_distinct_slots(runs, false, "summary");
  const GdnSchedule s(p, runs, GdnCallKind::summary);
  s.upload(x, p);
  gdn_prep_on(x, p, s);
  // M: the state recurrence without V from S_in = I; E: with V from S_in = 0.
  GdnScanArgs a = gdn_scan_args(p, s, p.dk);
  a.use_u = false;
  a.identity_init = true;
  a.state_out = M;
  gdn_scan_on(x, p, s, a);
  GdnScanArgs b = gdn_scan_args(p, s, p.dv);
  b.state_out = E;
  gdn_scan_on(x, p, s, b);
}

template <class X>
void gdn_backward_on(X& x, const GdnCudaParams& p, const std::vector<GdnCudaRun>& runs, const GdnCudaGrads& g) {
  gdn_check(p, runs);
  bool any_tokens = false;
  for (const GdnCudaRun& r : runs) any_tokens = any_tokens || r.t1 > r.t0;
  require(!any_tokens || g.dy, "gdn (cuda) backward: dy must be given");
  if (g.d_state_in) gdn_check_distinct_slots(runs, true, "d_state_in");
  const GdnSchedule s(p, runs, GdnCallKind::backward);
  s.upload(x, p);
  if (s.fla_split) {
    gdn_fla_backward_on(x, p, s, g);
    return;
  }
  gdn_prep_on(x, p, s);
  GdnScanArgs a = gdn_scan_args(p, s, p.dv);  // the chunk-start states and D, no output
  a.state_in = p.state_in;
  a.save = true;
  gdn_scan_on(x, p, s, a);
  if (!s.runs.empty())
    gdn_launch_math<GdnBwdScanKernel>(
        x, gdn_scan_math(p), static_cast<int64_t>(s.runs.size()) * p.heads * gdn_scan_tiles(p.dv, gdn_scan_tile(p)),
        GdnBwdScanArgs{s.dev_runs(p), s.dev_chunks(p), s.cache(p), s.blk, p.heads, p.dk, p.dv, gdn_scan_tile(p), g.dy,
                       p.y_f32, p.scale,
                       g.d_state_out, g.d_state_in});
  if (g.any() && !s.chunks.empty())
    gdn_launch_math<GdnGradKernel>(x, gdn_chunk_math(p), static_cast<int64_t>(s.chunks.size()) * p.heads,
                                     GdnGradArgs{gdn_inputs(p), s.dev_chunks(p), s.cache(p), s.blk, g.dy, p.y_f32,
                                                 p.scale, g.dq, g.dk, g.dv, g.dg, g.dbeta});
}

inline void gdn_check_algebra(int64_t count, int dk, int dv) {
  require(count >= 0, "gdn (cuda) summary algebra: count must be >= 0, got ", count);
  require(dk >= 1 && dk <= kGdnMaxDim && dv >= 1 && dv <= kGdnMaxDim, "gdn (cuda) summary algebra: dk and dv must be in [1, ",
          kGdnMaxDim, "], got ", dk, " and ", dv);
}

template <class X>
void gdn_rowmat_on(X& x, const GdnRowMatArgs& a) {
  require(a.A && a.B && a.out, "gdn (cuda) summary algebra: null input or output");
  if (a.count > 0) x.template launch<GdnRowMatKernel>(a.count * a.rows, a);
}

template <class X>
void gdn_compose_on(X& x, int64_t count, int dk, int dv, const float* MB, const float* EB, const float* MA,
                    const float* EA, float* M, float* E) {
  gdn_check_algebra(count, dk, dv);
  require(EB, "gdn (cuda) compose: EB is null");
  // E first: M may alias MB, which E still reads.
  gdn_rowmat_on(x, GdnRowMatArgs{count, dk, dk, dv, MB, false, EA, EB, E});
  gdn_rowmat_on(x, GdnRowMatArgs{count, dk, dk, dk, MB, false, MA, nullptr, M});
}

template <class X>
void gdn_apply_on(X& x, int64_t count, int dk, int dv, const float* M, const float* E, const float* s, float* out) {
  gdn_check_algebra(count, dk, dv);
  gdn_rowmat_on(x, GdnRowMatArgs{count, dk, dk, dv, M, false, s, E, out});
}

template <class X>
void gdn_apply_transposed_on(X& x, int64_t count, int dk, int dv, const float* M, const float* a, const float* ds,
                             float* out) {
  gdn_check_algebra(count, dk, dv);
  gdn_rowmat_on(x, GdnRowMatArgs{count, dk, dk, dv, M, true, ds, a, out});
}

}  // namespace treecp::cuda::detail
