// Internal, part of gdn_device.cuh (included from it after the classic kernels, whose helpers it uses): the GDN
// forward split as FLA's chunk forward splits it (GdnCudaParams::fla_split), scalar gate, dk and dv 64 or 128, bf16
// tensor cores throughout (GdnPrecision::bf16_tensor_scans' arithmetic):
//   prep   per (chunk, head), fully parallel: the chunk's cumulative gate G, L⁻¹ (L = I + diag(β) K Kᵀ ⊙ Γ, strictly
//          lower) and W = L⁻¹ diag(β) (e^G ⊙ K), U = L⁻¹ diag(β) V, written compact: W, U bf16 [64][dk | dv], G fp32.
//   scan   per (run, head, BV state columns), chunks in order, the state h [dk][BV] in mma.sync accumulator fragments
//          (fp32, registers): hT = bf16(h) (the chunk-start state, stored for the output kernel),
//          v_new = U - W h (stored, bf16), h <- e^{G_last} h + Kᵀ (v_new ⊙ e^{G_last - G}); W, K, U and G of the next
//          chunk double-buffered by cp.async while this one computes.
//   output per (chunk, head), fully parallel: Y = scale (diag(e^G) Q h + (Q Kᵀ ⊙ Γ, j <= i) v_new).
// Every product is mma.sync m16n8k16 on bf16 operands from shared memory with fp32 accumulation (gdn_mma_b16, whose
// host path computes each lane's four results itself, so the CPU emulation runs these bodies; only the fragments'
// register positions are the GPU tests' to check). The bodies assume the GPU's 256 threads (8 warps): the emulated
// tests launch them so. Design and workspace: docs/kernels.md ("The FLA-like split forward").
#pragma once

namespace treecp::cuda::detail {

// A bf16 matrix in shared memory: element (i, j) at p[i * rs + j * cs].
struct GdnB16Mat {
  const uint16_t* p;
  int rs, cs;
  TREECP_GDN_FN uint16_t at(int i, int j) const { return p[i * rs + j * cs]; }
};

// Elements (i, j) and (i, j + 1) in one register, (i, j) in the low half: one 4-byte load where they are adjacent
// (cs 1; the layouts keep i * rs + j even), else two 2-byte loads.
TREECP_GDN_FN uint32_t gdn_pair16(const GdnB16Mat& m, int i, int j) {
  if (m.cs == 1) return *reinterpret_cast<const uint32_t*>(m.p + i * m.rs + j);
  return static_cast<uint32_t>(m.at(i, j)) | (static_cast<uint32_t>(m.at(i, j + 1)) << 16);
}

// c += A[r0, r0 + 16) x [k0, k0 + 16) · B[k0, k0 + 16) x [c0, c0 + 8), B given by its transpose Bt (Bt(j, k) =
// B(k, j)), both bf16, fp32 accumulation: mma.sync m16n8k16 (fragments: mma.cuh). The host path sums each lane's
// four elements in order (products of two bf16 are exact in fp32; only the order of the adds differs).
TREECP_GDN_FN void gdn_mma_b16(float (&c)[4], const GdnB16Mat& A, const GdnB16Mat& Bt, int r0, int c0, int k0,
                               int lane) {
  const int g = lane >> 2, q = lane & 3;
#if defined(__CUDA_ARCH__)
  const int k = k0 + 2 * q;
  const uint32_t a[4] = {gdn_pair16(A, r0 + g, k), gdn_pair16(A, r0 + g + 8, k), gdn_pair16(A, r0 + g, k + 8),
                         gdn_pair16(A, r0 + g + 8, k + 8)};
  mma_m16n8k16<DType::kBf16>(c, a, gdn_pair16(Bt, c0 + g, k), gdn_pair16(Bt, c0 + g, k + 8));
#else
  for (int e = 0; e < 4; ++e) {
    const int i = r0 + g + (e >> 1) * 8, j = c0 + 2 * q + (e & 1);
    float acc = 0.f;
    for (int k = k0; k < k0 + 16; ++k) acc += bf16_to_float(A.at(i, k)) * bf16_to_float(Bt.at(j, k));
    c[e] += acc;
  }
#endif
}

// c0 += A[r0, r0 + 16) x [k0, k0 + 16) · B[k0, k0 + 16) x [n0, n0 + 8) and c1 the same at columns [n0 + 8, n0 + 16),
// bf16 in shared memory with 16-byte aligned rows: A row-major [m][k] (k contiguous, row stride lda) or (kAkm) stored
// as [k][m] (m contiguous: Kᵀ from K by token); B as [k][n] (kBkn: n contiguous, row stride ldb, V or Kst by token)
// or as its transpose [n][k] (k contiguous, K by token). On the GPU two ldmatrix.x4 (.trans for the operands stored
// k-major) load A's fragment and B's for both tiles: 2 load instructions for two mma where gdn_mma_b16 takes 12 to 20
// (its operands strided by rows are two 2-byte loads a register). Lane l addresses row l % 8 of 8 x 8 matrix l / 8,
// the matrices in the fragments' register order (mma.cuh; as the attention kernels load them, the transposed A as
// the backward's dSᵀ). The host path is gdn_mma_b16's on the same elements.
template <bool kAkm, bool kBkn>
TREECP_GDN_FN void gdn_mma_b16_pair(float (&c0)[4], float (&c1)[4], const uint16_t* A, int lda, const uint16_t* B,
                                    int ldb, int r0, int n0, int k0, int lane) {
#if defined(__CUDA_ARCH__)
  const int mi = lane >> 3, ri = lane & 7;
  uint32_t a[4], b[4];
  if constexpr (kAkm)
    ldmatrix_x4_trans(a, smem_addr(A + (k0 + ri + (mi >> 1) * 8) * lda + r0 + (mi & 1) * 8));
  else
    ldmatrix_x4(a, smem_addr(A + (r0 + ri + (mi & 1) * 8) * lda + k0 + (mi >> 1) * 8));
  if constexpr (kBkn)
    ldmatrix_x4_trans(b, smem_addr(B + (k0 + ri + (mi & 1) * 8) * ldb + n0 + (mi >> 1) * 8));
  else
    ldmatrix_x4(b, smem_addr(B + (n0 + ri + (mi >> 1) * 8) * ldb + k0 + (mi & 1) * 8));
  mma_m16n8k16<DType::kBf16>(c0, a, b[0], b[1]);
  mma_m16n8k16<DType::kBf16>(c1, a, b[2], b[3]);
#else
  const GdnB16Mat Am = kAkm ? GdnB16Mat{A, 1, lda} : GdnB16Mat{A, lda, 1};
  const GdnB16Mat Bt = kBkn ? GdnB16Mat{B, 1, ldb} : GdnB16Mat{B, ldb, 1};
  gdn_mma_b16(c0, Am, Bt, r0, n0, k0, lane);
  gdn_mma_b16(c1, Am, Bt, r0, n0 + 8, k0, lane);
#endif
}

// Two adjacent bf16 elements p[0], p[1] (p 4-byte aligned) from fp32.
TREECP_GDN_FN void gdn_store_pair16(uint16_t* p, float lo, float hi) {
  const uint32_t w = gdn_bf16x2(lo, hi);
#if defined(__CUDA_ARCH__)
  *reinterpret_cast<uint32_t*>(p) = w;
#else
  std::memcpy(p, &w, 4);
#endif
}

// p[0, 8) = bf16(f · p[0, 8)) in place, bf16 in shared memory (p 16-byte aligned): one 16-byte load and store.
TREECP_GDN_FN void gdn_scale8_bf16(uint16_t* p, float f) {
  uint32_t w[4];
#if defined(__CUDA_ARCH__)
  const uint4 x = *reinterpret_cast<const uint4*>(p);
  w[0] = x.x; w[1] = x.y; w[2] = x.z; w[3] = x.w;
#else
  std::memcpy(w, p, 16);
#endif
  TREECP_GDN_UNROLL
  for (int u = 0; u < 4; ++u)
    w[u] = gdn_bf16x2(f * bf16_to_float(static_cast<uint16_t>(w[u] & 0xffffu)),
                      f * bf16_to_float(static_cast<uint16_t>(w[u] >> 16)));
#if defined(__CUDA_ARCH__)
  *reinterpret_cast<uint4*>(p) = make_uint4(w[0], w[1], w[2], w[3]);
#else
  std::memcpy(p, w, 16);
#endif
}

// Accumulator tiles to zero (the split kernels' products add into them).
template <int N>
TREECP_GDN_FN void gdn_fla_zero(float (&c)[N][4]) {
  TREECP_GDN_UNROLL
  for (int j = 0; j < N; ++j)
    TREECP_GDN_UNROLL
    for (int e = 0; e < 4; ++e) c[j][e] = 0.f;
}

// Byte offsets of one (chunk, head) block of the split's workspace (each 256-byte aligned).
struct GdnFlaBlock {
  int64_t W = 0, U = 0;  // prep: bf16 [64][dk], [64][dv] (rows past the chunk's tokens zero)
  int64_t G = 0;         // prep: fp32 [64], the cumulative gate (rows past the chunk: its last value)
  int64_t H = 0;         // scan: bf16 [dv][dk], the chunk-start state transposed (h[d][e] at H[e * dk + d])
  int64_t V = 0;         // scan: bf16 [64][dv], v_new = U - W h (rows past the chunk zero)
  // The backward's (gdn_fla_bwd_device.cuh), carved only for it (make's `backward`):
  int64_t X = 0;    // prep: bf16 [64][64], X = L⁻¹ (j <= i < n, else 0)
  int64_t DVL = 0;  // local: bf16 [64][dv], dv_loc = scale (Q Kᵀ ⊙ Γ, j <= i)ᵀ dY
  int64_t DOS = 0;  // local: bf16 [64][dv], dYs = scale e^G ⊙ dY
  int64_t DH = 0;   // dscan: bf16 [dv][dk], the chunk-end state gradient transposed (as H)
  int64_t DV2 = 0;  // dscan: bf16 [64][dv], the whole gradient of v_new
  int64_t size = 0;
  static GdnFlaBlock make(int dk, int dv, bool backward = false) {
    GdnFlaBlock b;
    int64_t at = 0;
    auto take = [&](int64_t bytes) {
      const int64_t o = at;
      at += (bytes + 255) / 256 * 256;
      return o;
    };
    b.W = take(2 * int64_t{kGdnChunk} * dk);
    b.U = take(2 * int64_t{kGdnChunk} * dv);
    b.G = take(4 * int64_t{kGdnChunk});
    b.H = take(2 * int64_t{dk} * dv);
    b.V = take(2 * int64_t{kGdnChunk} * dv);
    if (backward) {
      b.X = take(2 * int64_t{kGdnChunk} * kGdnChunk);
      b.DVL = take(2 * int64_t{kGdnChunk} * dv);
      b.DOS = take(2 * int64_t{kGdnChunk} * dv);
      b.DH = take(2 * int64_t{dk} * dv);
      b.DV2 = take(2 * int64_t{kGdnChunk} * dv);
    }
    b.size = at;
    return b;
  }
};

// ---- prep: one block (8 warps) per (chunk, head), every array in shared memory, nothing but W, U and G leaving it.
// The chunk's k and v rows land by cp.async straight as bf16 (the mma operands, no widening); beta and the gate by
// scalar loads meanwhile. Then, with few barriers and no thread alone on a serial chain:
//   G      a thread a row sums the gates j <= i in order (the serial sum's rounding; 64 broadcast loads, not a
//          64-step chain on one thread while 255 wait);
//   A      = diag(β) (K Kᵀ ⊙ e^{G_i - G_j}), strictly lower, fp32 [64][68]: 20 of the 32 tiles of 16 x 8 on bf16 mma
//          (those wholly above the diagonal skipped);
//   X      = L⁻¹ (L = I + A) in fp32, as the classic prep's model: the four diagonal 16 x 16 blocks by forward
//          substitution in registers (two warps, a lane a column: 120 FMAs on broadcast loads, no shared-memory
//          round trip per row), while the other six warps form Kst = bf16(e^G ⊙ K) over K in place; then the blocks
//          below by two doublings instead of three sub-diagonals: X_10 and X_32 (-X_ii A_ij X_jj), then the 32 x 32
//          block X_[23][01] = -X_[23][23] A_[23][01] X_[01][01], each as two fp32 products a thread 2 or 4 elements
//          (four barriers), the intermediates in A's dead upper triangle;
//   Tb     = bf16(X diag(β)) (zero above the diagonal and past the chunk) over A;
//   U, W   = Tb V, Tb Kst on bf16 mma (k blocks past each row block's diagonal skipped; a warp 16 columns of all
//          four row blocks, or of two whose triangles sum alike, so that the work is even across warps), staged bf16
//          in shared memory (U over X, W over Kst once every warp is done with it), written out in 16-byte stores.
// The products' fragments come by ldmatrix.x4 (gdn_mma_b16_pair: two load instructions for two mma), so that
// shared-memory load instructions (~600 a block for the products, ~2,800 for the fp32 inverse) do not bound it.
// Shared at dk = dv = 128: 69 KiB, three blocks an SM (kMinBlocks: <= 85 registers a thread). Twelve barriers.
struct GdnFlaPrepArgs {
  const GdnChunkDesc* chunks;
  unsigned char* ws;
  GdnFlaBlock fb;
  const uint16_t* k;     // [S, H, DK]
  const uint16_t* v;     // [S, H, DV]
  const uint16_t* g;     // [S, H], the log decay
  const uint16_t* beta;  // [S, H]
  int32_t heads;
  bool save_x = false;  // X = L⁻¹ as bf16 into the block (the backward's)
};
template <int DK, int DV>
struct GdnFlaPrepKernel {
  using Args = GdnFlaPrepArgs;
  static constexpr const char* kName = "gdn fla prep";
  static constexpr int kMinBlocks = 3;
  static constexpr int kWarps = kGdnThreads / 32;
  static constexpr int C = kGdnChunk;
  static constexpr int kLk = DK + 8, kLv = DV + 8;  // bf16 row strides: 4 words mod 32, fragment lanes on 32 banks
  static constexpr int kLa = C + 4;                  // fp32 row stride of A and X (16-byte aligned rows)
  static constexpr int kLt = C + 8;                  // bf16 row stride of Tb
  static_assert((DK == 64 || DK == 128) && (DV == 64 || DV == 128), "dk, dv 64 or 128");
  static constexpr int64_t kKBytes = 2 * int64_t{C} * kLk, kVBytes = 2 * int64_t{C} * kLv;
  static constexpr int64_t kABytes = 4 * int64_t{C} * kLa;  // A fp32, then Tb bf16 [64][kLt]
  static constexpr int64_t kXBytes = kABytes > 2 * int64_t{C} * kLv ? kABytes : 2 * int64_t{C} * kLv;  // X, then U
  static constexpr int64_t kBytes = kKBytes + kVBytes + kABytes + kXBytes + 3 * 4 * C;  // + beta, G, e^G
  static_assert(2 * int64_t{C} * kLt <= kABytes, "Tb fits over A");
  static size_t smem_bytes(const Args&) { return static_cast<size_t>(kBytes); }

  // out = Tb B (64 x WIDTH, B [64][WIDTH] by token, row stride ldb) as bf16 into `out` (row stride ldo); out null:
  // into B itself, once every warp is done reading it (one barrier, which every thread reaches).
  template <int WIDTH>
  static TREECP_GDN_FN void product_out(const uint16_t* Tb, uint16_t* B, int ldb, uint16_t* out, int ldo, int warp,
                                        int lane, int g, int q) {
    constexpr int NP = WIDTH / 16, kRB = 4 * NP / kWarps;  // column pairs; row blocks a warp
    static_assert(kRB == 2 || kRB == 4, "width 64 or 128");
    const int n0 = (warp % NP) * 16, half = warp / NP;
    float o[kRB][2][4];
    TREECP_GDN_UNROLL
    for (int r = 0; r < kRB; ++r) {
      const int m = kRB == 4 ? r : r == 0 ? half : 3 - half;
      TREECP_GDN_UNROLL
      for (int e = 0; e < 4; ++e) o[r][0][e] = o[r][1][e] = 0.f;
      TREECP_GDN_UNROLL
      for (int k0 = 0; k0 <= 48; k0 += 16)
        if (k0 <= m * 16) gdn_mma_b16_pair<false, true>(o[r][0], o[r][1], Tb, kLt, B, ldb, m * 16, n0, k0, lane);
    }
    if (!out) {
      block_sync();
      out = B;
      ldo = ldb;
    }
    TREECP_GDN_UNROLL
    for (int r = 0; r < kRB; ++r) {
      const int m = kRB == 4 ? r : r == 0 ? half : 3 - half;
      TREECP_GDN_UNROLL
      for (int j = 0; j < 2; ++j)
        TREECP_GDN_UNROLL
        for (int hh = 0; hh < 2; ++hh)
          gdn_store_pair16(out + (m * 16 + g + hh * 8) * ldo + n0 + j * 8 + 2 * q, o[r][j][2 * hh],
                           o[r][j][2 * hh + 1]);
    }
  }

  static TREECP_GDN_FN void run(const Args& a, int64_t block, int tid, int nthr, float* smem) {
    const int H = a.heads;
    const int64_t chunk = block / H;
    const int h = static_cast<int>(block % H);
    const GdnChunkDesc cd = a.chunks[chunk];
    const int64_t t = cd.t;
    const int n = cd.len;
    const int lane = tid & 31, warp = tid >> 5, g = lane >> 2, q = lane & 3;
    unsigned char* c = a.ws + (chunk * H + h) * a.fb.size;
    unsigned char* sm = reinterpret_cast<unsigned char*>(smem);
    uint16_t* Ks = reinterpret_cast<uint16_t*>(sm);                    // [64][kLk]: K, then Kst, then W
    uint16_t* Vs = reinterpret_cast<uint16_t*>(sm + kKBytes);          // [64][kLv]: V
    float* Af = reinterpret_cast<float*>(sm + kKBytes + kVBytes);      // [64][kLa]: A
    uint16_t* Tb = reinterpret_cast<uint16_t*>(Af);                    // [64][kLt]: over A once X is done
    float* Xf = reinterpret_cast<float*>(sm + kKBytes + kVBytes + kABytes);  // [64][kLa]: X = L⁻¹
    uint16_t* Us = reinterpret_cast<uint16_t*>(Xf);                    // [64][kLv]: U, over X once Tb is formed
    float* bs = reinterpret_cast<float*>(sm + kKBytes + kVBytes + kABytes + kXBytes);  // [64]
    float* Gs = bs + C;   // [64]: the gates, then their cumulative sums
    float* eGs = Gs + C;  // [64]: e^G
    const int64_t row_k = 2 * int64_t{H} * DK, row_v = 2 * int64_t{H} * DV;  // bytes between tokens
    gdn_stage_rows<2 * DK, kGdnChunk>(Ks, a.k + (t * H + h) * DK, n, row_k, 2 * kLk, tid, nthr);
    gdn_stage_rows<2 * DV, kGdnChunk>(Vs, a.v + (t * H + h) * DV, n, row_v, 2 * kLv, tid, nthr);
    gdn_async_commit();
    for (int idx = tid; idx < (C - n) * DK; idx += nthr) Ks[(n + idx / DK) * kLk + idx % DK] = 0;  // not stale
    for (int idx = tid; idx < (C - n) * DV; idx += nthr) Vs[(n + idx / DV) * kLv + idx % DV] = 0;
    for (int i = tid; i < C; i += nthr) {
      bs[i] = i < n ? bf16_to_float(a.beta[(t + i) * H + h]) : 0.f;
      Gs[i] = i < n ? bf16_to_float(a.g[(t + i) * H + h]) : 0.f;
    }
    block_sync();  // the gates in
    float Gi = 0.f;
    if (tid < C)  // rows past the chunk take its last value (GdnFlaBlock::G)
      for (int j = 0; j <= (tid < n ? tid : n - 1); ++j) Gi += Gs[j];
    gdn_async_wait<0>();
    block_sync();  // every gate read; K and V landed for every thread
    if (tid < C) {
      Gs[tid] = Gi;
      eGs[tid] = expf(Gi);
      reinterpret_cast<float*>(c + a.fb.G)[tid] = Gi;
    }
    // A: warp w is row block w / 2, column tiles 4 (w % 2) .. + 3, in pairs of 16 columns (pair p holds a tile at or
    // below the diagonal exactly when p <= the row block).
    const int pm = warp / 2;
    float pc[4][4];
    gdn_fla_zero(pc);  // pc = K Kᵀ on those tiles
    TREECP_GDN_UNROLL
    for (int j = 0; j < 4; j += 2) {
      const int n0 = ((warp % 2) * 4 + j) * 8;
      if (n0 / 16 <= pm) {
        TREECP_GDN_UNROLL
        for (int k0 = 0; k0 < DK; k0 += 16)
          gdn_mma_b16_pair<false, false>(pc[j], pc[j + 1], Ks, kLk, Ks, kLk, pm * 16, n0, k0, lane);
      }
    }
    block_sync();  // G complete
    TREECP_GDN_UNROLL
    for (int hh = 0; hh < 2; ++hh) {
      const int i = pm * 16 + g + hh * 8;
      const float bi = bs[i], gi = Gs[i];
      TREECP_GDN_UNROLL
      for (int j = 0; j < 4; ++j) {
        const int jj = ((warp % 2) * 4 + j) * 8 + 2 * q;
        float x[2];
        gdn_load_vec(Gs + jj, x);  // G_jj, G_jj+1 (jj even)
        gdn_store_vec(Af + i * kLa + jj, jj < i && i < n ? bi * (pc[j][2 * hh] * expf(gi - x[0])) : 0.f,
                      jj + 1 < i && i < n ? bi * (pc[j][2 * hh + 1] * expf(gi - x[1])) : 0.f);
      }
    }
    block_sync();  // A complete; every warp done reading K
    if (warp < 2) {
      // Diagonal block b, column col: x = X_bb e_col by forward substitution, right-looking (acc[r] gathers
      // Σ_{j<r} A_rj x_j in order of j): rows above col come out 0, the upper triangle's zeros.
      const int b = warp * 2 + (lane >> 4), col = lane & 15, r0 = b * 16;
      float x[16], acc[16];
      TREECP_GDN_UNROLL
      for (int r = 0; r < 16; ++r) acc[r] = 0.f;
      TREECP_GDN_UNROLL
      for (int i = 0; i < 16; ++i) {
        x[i] = (i == col ? 1.f : 0.f) - acc[i];
        TREECP_GDN_UNROLL
        for (int r = i + 1; r < 16; ++r) acc[r] += Af[(r0 + r) * kLa + r0 + i] * x[i];
      }
      TREECP_GDN_UNROLL
      for (int i = 0; i < 16; ++i) Xf[(r0 + i) * kLa + r0 + col] = x[i];
    } else {
      for (int idx = tid - 64; idx < C * DK / 8; idx += nthr - 64) {  // Kst = bf16(e^G ⊙ K), 8 in place a step
        const int i = idx / (DK / 8);
        gdn_scale8_bf16(Ks + i * kLk + 8 * (idx % (DK / 8)), eGs[i]);
      }
    }
    block_sync();  // the diagonal blocks of X
    // X_10 and X_32: T = A_ij X_jj (16 x 16 each) into A's upper triangle at rows j0, columns i0 (never read as A),
    // then X_ij = -X_ii T. A thread two adjacent columns of one row.
    {
      const int blk = tid / 128, e = tid % 128, r = e / 8, cc = (e % 8) * 2;
      const int i0 = blk ? 48 : 16, j0 = i0 - 16;
      {
        float s0 = 0.f, s1 = 0.f, x[2];
        for (int k = 0; k < 16; ++k) {
          const float ak = Af[(i0 + r) * kLa + j0 + k];
          gdn_load_vec(Xf + (j0 + k) * kLa + j0 + cc, x);  // 8-byte aligned: even columns, kLa even
          s0 += ak * x[0];
          s1 += ak * x[1];
        }
        Af[(j0 + r) * kLa + i0 + cc] = s0;
        Af[(j0 + r) * kLa + i0 + cc + 1] = s1;
      }
      block_sync();
      {
        float s0 = 0.f, s1 = 0.f, x[2];
        for (int m = 0; m <= r; ++m) {
          const float xm = Xf[(i0 + r) * kLa + i0 + m];
          gdn_load_vec(Af + (j0 + m) * kLa + i0 + cc, x);
          s0 += xm * x[0];
          s1 += xm * x[1];
        }
        Xf[(i0 + r) * kLa + j0 + cc] = -s0;
        Xf[(i0 + r) * kLa + j0 + cc + 1] = -s1;
      }
      block_sync();
    }
    // X_[23][01]: M = A_[23][01] X_[01][01] (32 x 32, k from the column's block: X is zero above it) into A's dead
    // rows 32.., columns 32.. (its diagonal blocks and X_32's T, all done), then X = -X_[23][23] M. A thread four
    // adjacent columns of one row.
    {
      const int r = tid / 8, cc = (tid % 8) * 4, kb = cc < 16 ? 0 : 16;
      {
        float s[4] = {0.f, 0.f, 0.f, 0.f}, x[4];
        for (int k = kb; k < 32; ++k) {
          const float ak = Af[(32 + r) * kLa + k];
          gdn_load_vec(Xf + k * kLa + cc, x);  // 16-byte aligned: columns by 4, kLa a multiple of 4
          TREECP_GDN_UNROLL
          for (int u = 0; u < 4; ++u) s[u] += ak * x[u];
        }
        TREECP_GDN_UNROLL
        for (int u = 0; u < 4; ++u) Af[(32 + r) * kLa + 32 + cc + u] = s[u];
      }
      block_sync();
      {
        float s[4] = {0.f, 0.f, 0.f, 0.f}, x[4];
        for (int m = 0; m <= r; ++m) {
          const float xm = Xf[(32 + r) * kLa + 32 + m];
          gdn_load_vec(Af + (32 + m) * kLa + 32 + cc, x);
          TREECP_GDN_UNROLL
          for (int u = 0; u < 4; ++u) s[u] += xm * x[u];
        }
        TREECP_GDN_UNROLL
        for (int u = 0; u < 4; ++u) Xf[(32 + r) * kLa + cc + u] = -s[u];
      }
      block_sync();  // X complete; A dead
    }
    if (a.save_x) {
      uint16_t* gx = reinterpret_cast<uint16_t*>(c + a.fb.X);
      for (int idx = tid; idx < C * C / 2; idx += nthr) {
        const int i = idx / (C / 2), j = 2 * (idx % (C / 2));
        gdn_store_pair16(gx + i * C + j, i < n && j <= i ? Xf[i * kLa + j] : 0.f,
                         i < n && j + 1 <= i ? Xf[i * kLa + j + 1] : 0.f);
      }
    }
    for (int idx = tid; idx < C * C / 4; idx += nthr) {  // Tb = bf16(X diag(β)), j <= i < n, over A; 4 a step
      const int i = idx / (C / 4), j = 4 * (idx % (C / 4));
      float x[4], b[4];
      gdn_load_vec(Xf + i * kLa + j, x);
      gdn_load_vec(bs + j, b);
      const bool row = i < n;
      TREECP_GDN_UNROLL
      for (int u = 0; u < 4; ++u) x[u] = row && j + u <= i ? x[u] * b[u] : 0.f;
      gdn_store_pair16(Tb + i * kLt + j, x[0], x[1]);
      gdn_store_pair16(Tb + i * kLt + j + 2, x[2], x[3]);
    }
    block_sync();  // Tb complete; X dead
    // U = Tb V, then W = Tb Kst, in pairs of 8-column tiles: warp w the column pair w % NP (NP = width / 16) of
    // kRB row blocks, all four (width 128) or two whose triangles sum alike (width 64: {0, 3} or {1, 2}); a row
    // block m's k blocks stop at its diagonal (Tb is zero past it).
    product_out<DV>(Tb, Vs, kLv, Us, kLv, warp, lane, g, q);
    product_out<DK>(Tb, Ks, kLk, nullptr, 0, warp, lane, g, q);  // W over Kst, after a barrier inside
    block_sync();  // W and U staged
    // Out in 16-byte units: all 64 rows (past the chunk Tb's zero rows made them 0).
    gdn_store_rows<2 * DK, C>(c + a.fb.W, 2 * DK, Ks, 2 * kLk, C, tid, nthr);
    gdn_store_rows<2 * DV, C>(c + a.fb.U, 2 * DV, Us, 2 * kLv, C, tid, nthr);
  }
};

// The scans' register tiles of a [DK][BV] state (or its gradient): tile T = warp kHT + j is rows 16 (T / kNT),
// columns 8 (T % kNT); its element e sits at row 16 m + g + 8 (e >> 1), column 8 nn + 2 q + (e & 1). In from an fp32
// [DK][dv] block at column e0 (null: zero), out to one.
template <int kHT, int kNT>
TREECP_GDN_FN void gdn_fla_state_in(float (&acc)[kHT][4], const float* s, int dv, int e0, int warp, int g, int q) {
  TREECP_GDN_UNROLL
  for (int j = 0; j < kHT; ++j) {
    const int T = warp * kHT + j, m = T / kNT, nn = T % kNT;
    TREECP_GDN_UNROLL
    for (int e = 0; e < 4; ++e)
      acc[j][e] = s ? s[(m * 16 + g + (e >> 1) * 8) * dv + e0 + nn * 8 + 2 * q + (e & 1)] : 0.f;
  }
}
template <int kHT, int kNT>
TREECP_GDN_FN void gdn_fla_state_out(const float (&acc)[kHT][4], float* s, int dv, int e0, int warp, int g, int q) {
  TREECP_GDN_UNROLL
  for (int j = 0; j < kHT; ++j) {
    const int T = warp * kHT + j, m = T / kNT, nn = T % kNT;
    TREECP_GDN_UNROLL
    for (int e = 0; e < 4; ++e) s[(m * 16 + g + (e >> 1) * 8) * dv + e0 + nn * 8 + 2 * q + (e & 1)] = acc[j][e];
  }
}

// The warp's accumulator tiles c[j] (tile T = warp kT + j: rows 16 (T / kNT), columns 8 (T % kNT), as
// gdn_fla_tiles numbers them) rounded to bf16 and stored transposed: element (r, c) at dst[c * ld + r] (ld a multiple
// of 8, dst 16-byte aligned). On the device one stmatrix.trans a tile pair (x4: the two tiles' upper and lower 8 x 8
// halves; x2 for a lone tile), where 2-byte stores cost a store, a conversion and its address an element.
template <int kT, int kNT>
TREECP_GDN_FN void gdn_fla_store_tiles_T(uint16_t* dst, int ld, const float (&c)[kT][4], int warp, int lane) {
#if defined(__CUDA_ARCH__)
  const int mi = lane >> 3, ri = lane & 7;
  if constexpr (kT % 2 == 0 && kNT % 2 == 0) {
    TREECP_GDN_UNROLL
    for (int j = 0; j < kT; j += 2) {
      const int T = warp * kT + j, m = T / kNT, nn = T % kNT;
      const uint32_t addr = smem_addr(dst + (nn * 8 + (mi >> 1) * 8 + ri) * ld + m * 16 + (mi & 1) * 8);
      asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr),
                   "r"(gdn_bf16x2(c[j][0], c[j][1])), "r"(gdn_bf16x2(c[j][2], c[j][3])),
                   "r"(gdn_bf16x2(c[j + 1][0], c[j + 1][1])), "r"(gdn_bf16x2(c[j + 1][2], c[j + 1][3]))
                   : "memory");
    }
  } else {
    TREECP_GDN_UNROLL
    for (int j = 0; j < kT; ++j) {
      const int T = warp * kT + j, m = T / kNT, nn = T % kNT;
      const uint32_t addr = smem_addr(dst + (nn * 8 + ri) * ld + m * 16 + (mi & 1) * 8);
      asm volatile("stmatrix.sync.aligned.m8n8.x2.trans.shared.b16 [%0], {%1, %2};\n" ::"r"(addr),
                   "r"(gdn_bf16x2(c[j][0], c[j][1])), "r"(gdn_bf16x2(c[j][2], c[j][3]))
                   : "memory");
    }
  }
#else
  const int g = lane >> 2, q = lane & 3;
  for (int j = 0; j < kT; ++j) {
    const int T = warp * kT + j, m = T / kNT, nn = T % kNT;
    for (int e = 0; e < 4; ++e)
      dst[(nn * 8 + 2 * q + (e & 1)) * ld + m * 16 + g + (e >> 1) * 8] = float_to_bf16(c[j][e]);
  }
#endif
}

// c += A · B (kTwo: + A2 · B2, the two interleaved a k step) on the scans' tiles of one warp: tile T = warp kT + j is
// rows 16 (T / kNT), columns 8 (T % kNT) of the [.. x 8 kNT] result, the inner index over [0, K); A and B as
// gdn_mma_b16_pair takes them (kAkm: A stored [k][m]; kBkn: B stored [k][n], else its transpose [n][k]; A2 and B2
// laid out and strided as A and B). Where a warp's tiles come in pairs of one row block (kT even) the fragments load
// by ldmatrix (gdn_mma_b16_pair), else by gdn_mma_b16.
template <int kT, int kNT, bool kAkm, bool kBkn, bool kTwo = false>
TREECP_GDN_FN void gdn_fla_tiles(float (&c)[kT][4], const uint16_t* A, int lda, const uint16_t* B, int ldb, int K,
                                 int warp, int lane, const uint16_t* A2 = nullptr, const uint16_t* B2 = nullptr) {
  if constexpr (kT % 2 == 0) {
    TREECP_GDN_UNROLL
    for (int j = 0; j < kT; j += 2) {
      const int T = warp * kT + j, m = T / kNT, nn = T % kNT;
      TREECP_GDN_UNROLL
      for (int k0 = 0; k0 < K; k0 += 16) {
        gdn_mma_b16_pair<kAkm, kBkn>(c[j], c[j + 1], A, lda, B, ldb, m * 16, nn * 8, k0, lane);
        if constexpr (kTwo) gdn_mma_b16_pair<kAkm, kBkn>(c[j], c[j + 1], A2, lda, B2, ldb, m * 16, nn * 8, k0, lane);
      }
    }
  } else {
    auto a_of = [&](const uint16_t* x) { return kAkm ? GdnB16Mat{x, 1, lda} : GdnB16Mat{x, lda, 1}; };
    auto bt_of = [&](const uint16_t* x) { return kBkn ? GdnB16Mat{x, 1, ldb} : GdnB16Mat{x, ldb, 1}; };
    const GdnB16Mat Am = a_of(A), Bt = bt_of(B), Am2 = a_of(kTwo ? A2 : A), Bt2 = bt_of(kTwo ? B2 : B);
    TREECP_GDN_UNROLL
    for (int j = 0; j < kT; ++j) {
      const int T = warp * kT + j, m = T / kNT, nn = T % kNT;
      TREECP_GDN_UNROLL
      for (int k0 = 0; k0 < K; k0 += 16) {
        gdn_mma_b16(c[j], Am, Bt, m * 16, nn * 8, k0, lane);
        if constexpr (kTwo) gdn_mma_b16(c[j], Am2, Bt2, m * 16, nn * 8, k0, lane);
      }
    }
  }
}

// c += A · B over k in [0, K) as gdn_fla_tiles<kT, kNT, false, false> (A [m][k], B as its transpose [n][k]), the two
// halves of k into separate accumulators added at the end: chains of K / 32 dependent mma instead of K / 16. The
// dscan's dv2 product takes it (its step's latency, not the tensor pipe, sets the time: dscan -5% with the
// descriptors below, run 151); the forward scan's v_new product ran 6% slower with it (run 151, 124 registers against
// 118) and keeps one k run.
template <int kT, int kNT>
TREECP_GDN_FN void gdn_fla_tiles_halves(float (&c)[kT][4], const uint16_t* A, int lda, const uint16_t* B, int ldb, int K,
                                        int warp, int lane) {
  float c2[kT][4];
  TREECP_GDN_UNROLL
  for (int j = 0; j < kT; ++j)
    TREECP_GDN_UNROLL
    for (int e = 0; e < 4; ++e) c2[j][e] = 0.f;
  gdn_fla_tiles<kT, kNT, false, false>(c, A, lda, B, ldb, K / 2, warp, lane);
  gdn_fla_tiles<kT, kNT, false, false>(c2, A + K / 2, lda, B + K / 2, ldb, K / 2, warp, lane);
  TREECP_GDN_UNROLL
  for (int j = 0; j < kT; ++j)
    TREECP_GDN_UNROLL
    for (int e = 0; e < 4; ++e) c[j][e] += c2[j][e];
}

// The (run, head, first state column) of a scan-shaped block (gdn_fla_columns_on's grid: runs x heads x dv / BV).
struct GdnFlaColumnBlock {
  int64_t run;
  int head, e0;
  template <int BV>
  static TREECP_GDN_FN GdnFlaColumnBlock of(int64_t block, int heads, int dv) {
    const int64_t nt = dv / BV;
    return {block / (heads * nt), static_cast<int>((block / nt) % heads), static_cast<int>(block % nt) * BV};
  }
};

// ---- scan: one block (8 warps) per (run, head, BV state columns); chunks in order. The state h [DK][BV] is
// (DK / 16) x (BV / 8) accumulator tiles of 16 x 8, kHT a warp, in registers for the whole run (fp32). Shared, bf16
// unless said: W and K [2][64][DK + 8], U's columns [2][64][BV + 8], G [2][64] fp32 (double-buffered: chunk ci + 1's
// copies are issued right after the barrier that opens chunk ci), hT [BV][DK + 8] (h rounded to bf16, transposed: the
// B operand of W h, k-contiguous) and vsT [BV][64 + 8] (v_new ⊙ e^{G_last - G}, transposed: the B operand of Kᵀ vs).
// Row strides of 4 words mod 32 put a fragment's lanes 4g + q (row g, word q) on distinct banks, and the 8 rows of
// an ldmatrix phase too. Where a warp's tiles come in pairs of one row block (kVT, kHT even: every BV but 16) the
// fragments load by ldmatrix.x4 (gdn_mma_b16_pair; Kᵀ's by .trans from K [t][d]), else by gdn_mma_b16 (Kᵀ's by 2-byte
// loads). Two barriers a chunk: hT is stored right after the state update, so the barrier that opens
// a chunk covers it with the chunk's operands.
struct GdnFlaScanArgs {
  const GdnRunDesc* runs;
  const GdnChunkDesc* chunks;
  unsigned char* ws;
  GdnFlaBlock fb;
  const uint16_t* k;  // [S, H, dk]
  int32_t heads, dv;
  const float* state_in;  // [slot][H][dk][dv], by in_slot; null or -1 = zero
  float* state_out;       // by out_slot; null = not written
  bool save;              // hT and v_new into the workspace (for the output kernel, or the backward: keep_forward)
};
template <int DK, int BV>
struct GdnFlaScanKernel {
  using Args = GdnFlaScanArgs;
  static constexpr const char* kName = "gdn fla scan";
  static constexpr int kWarps = kGdnThreads / 32;
  static constexpr int kLk = DK + 8, kLu = BV + 8, kLv = kGdnChunk + 8;  // row strides (elements)
  static constexpr int kMT = DK / 16, kNT = BV / 8;
  static constexpr int kHT = kMT * kNT / kWarps;                 // state tiles a warp
  static constexpr int kVT = (kGdnChunk / 16) * kNT / kWarps;    // v_new tiles a warp
  static_assert(DK % 16 == 0 && BV % 8 == 0 && kHT >= 1 && kVT >= 1 && kHT * kWarps == kMT * kNT &&
                    kVT * kWarps == (kGdnChunk / 16) * kNT,
                "the warps split the state and v_new tiles evenly");
  static constexpr int64_t kWBytes = 2 * int64_t{kGdnChunk} * kLk, kUBytes = 2 * int64_t{kGdnChunk} * kLu;
  static constexpr int64_t kGBytes = 4 * kGdnChunk;
  static constexpr int64_t kBufBytes = 2 * kWBytes + kUBytes + kGBytes;  // W, K, U, G of one chunk
  static constexpr int64_t kBytes = 2 * kBufBytes + 2 * int64_t{BV} * kLk + 2 * int64_t{BV} * kLv;
  static size_t smem_bytes(const Args&) { return static_cast<size_t>(kBytes); }

  static TREECP_GDN_FN void run(const Args& a, int64_t block, int tid, int nthr, float* smem) {
    const int H = a.heads, dv = a.dv;
    const GdnFlaColumnBlock cb = GdnFlaColumnBlock::of<BV>(block, H, dv);
    const int h = cb.head, e0 = cb.e0;
    const GdnRunDesc rd = a.runs[cb.run];
    const int lane = tid & 31, warp = tid >> 5, g = lane >> 2, q = lane & 3;
    unsigned char* sm = reinterpret_cast<unsigned char*>(smem);
    auto Wsm = [&](int b) { return reinterpret_cast<uint16_t*>(sm + b * kBufBytes); };
    auto Ksm = [&](int b) { return reinterpret_cast<uint16_t*>(sm + b * kBufBytes + kWBytes); };
    auto Usm = [&](int b) { return reinterpret_cast<uint16_t*>(sm + b * kBufBytes + 2 * kWBytes); };
    auto Gsm = [&](int b) { return reinterpret_cast<float*>(sm + b * kBufBytes + 2 * kWBytes + kUBytes); };
    uint16_t* hT = reinterpret_cast<uint16_t*>(sm + 2 * kBufBytes);  // [BV][kLk]
    uint16_t* vsT = hT + BV * kLk;                                    // [BV][kLv]
    auto blk_of = [&](int ci) { return a.ws + (static_cast<int64_t>(rd.chunk_begin + ci) * H + h) * a.fb.size; };
    // Chunk ci's operands (descriptor cd) into buffer b, one group (empty past the last chunk, so that the waits count
    // alike).
    auto issue = [&](int ci, int b, const GdnChunkDesc& cd) {
      if (ci < rd.chunk_count) {
        const unsigned char* c = blk_of(ci);
        gdn_stage_rows<2 * DK, kGdnChunk>(Wsm(b), c + a.fb.W, kGdnChunk, 2 * DK, 2 * kLk, tid, nthr);
        gdn_stage_rows<2 * BV, kGdnChunk>(Usm(b), c + a.fb.U + 2 * e0, kGdnChunk, 2 * int64_t{dv}, 2 * kLu, tid, nthr);
        gdn_stage_rows<kGBytes, 1>(Gsm(b), c + a.fb.G, 1, kGBytes, static_cast<int>(kGBytes), tid, nthr);
        gdn_stage_rows<2 * DK, kGdnChunk>(Ksm(b), a.k + (cd.t * H + h) * DK, cd.len, 2 * int64_t{H} * DK, 2 * kLk,
                                          tid, nthr);
        uint16_t* K = Ksm(b);
        for (int idx = tid; idx < (kGdnChunk - cd.len) * DK; idx += nthr)  // rows past the chunk: zero, not stale
          K[(cd.len + idx / DK) * kLk + idx % DK] = 0;
      }
      gdn_async_commit();
    };
    // The descriptors a step ahead of their use: chunk ci + 2's loads during step ci, as its latency stood in the
    // critical path of every step where issue read it (5% of run 150's samples in the scan, 10% in the dscan).
    const int count = rd.chunk_count;
    GdnChunkDesc cd_cur = count > 0 ? a.chunks[rd.chunk_begin] : GdnChunkDesc{};
    GdnChunkDesc cd_next = count > 1 ? a.chunks[rd.chunk_begin + 1] : cd_cur;
    issue(0, 0, cd_cur);
    // The warp's state tiles: tile T = warp kHT + j is rows 16 (T / kNT), columns 8 (T % kNT) of h.
    float acc[kHT][4];
    const float* sin =
        (a.state_in && rd.in_slot >= 0) ? a.state_in + (static_cast<int64_t>(rd.in_slot) * H + h) * DK * dv : nullptr;
    gdn_fla_state_in<kHT, kNT>(acc, sin, dv, e0, warp, g, q);
    gdn_fla_store_tiles_T<kHT, kNT>(hT, kLk, acc, warp, lane);  // hT = bf16(h)ᵀ, the run's start
    for (int ci = 0; ci < count; ++ci) {
      const int b = ci & 1;
      const int n = cd_cur.len;
      unsigned char* c = blk_of(ci);
      gdn_async_wait<0>();
      // Chunk ci's operands landed and hT complete for every thread; chunk ci - 1 done with buffer b ^ 1 and vsT.
      block_sync();
      issue(ci + 1, b ^ 1, cd_next);
      cd_cur = cd_next;
      if (ci + 2 < count) cd_next = a.chunks[rd.chunk_begin + ci + 2];
      if (a.save) {  // hT's BV rows into H[e0 + e][d], 16 bytes a copy
        uint16_t* gh = reinterpret_cast<uint16_t*>(c + a.fb.H) + static_cast<int64_t>(e0) * DK;
        for (int idx = tid; idx < BV * DK / 8; idx += nthr) {
          const int row = idx / (DK / 8), col = (idx % (DK / 8)) * 8;
#if defined(__CUDA_ARCH__)
          *reinterpret_cast<uint4*>(gh + row * DK + col) = *reinterpret_cast<const uint4*>(hT + row * kLk + col);
#else
          std::memcpy(gh + row * DK + col, hT + row * kLk + col, 16);
#endif
        }
      }
      // v_new = U - W h; vsT = (v_new ⊙ e^{G_last - G})ᵀ, zero past the chunk's tokens.
      const float* Gc = Gsm(b);
      const float gl = Gc[n - 1];
      const uint16_t* Us = Usm(b);
      uint16_t* gv = reinterpret_cast<uint16_t*>(c + a.fb.V);
      float v[kVT][4];
      gdn_fla_zero(v);
      gdn_fla_tiles<kVT, kNT, false, false>(v, Wsm(b), kLk, hT, kLk, DK, warp, lane);
      TREECP_GDN_UNROLL
      for (int j = 0; j < kVT; ++j) {
        const int T = warp * kVT + j, m = T / kNT, nn = T % kNT;
        TREECP_GDN_UNROLL
        for (int half = 0; half < 2; ++half) {
          const int t = m * 16 + g + half * 8, col = nn * 8 + 2 * q;
          const uint32_t u = gdn_pair16(GdnB16Mat{Us, kLu, 1}, t, col);
          const float x0 = bf16_to_float(static_cast<uint16_t>(u & 0xffffu)) - v[j][2 * half];
          const float x1 = bf16_to_float(static_cast<uint16_t>(u >> 16)) - v[j][2 * half + 1];
          if (a.save) gdn_store_pair16(gv + t * dv + e0 + col, x0, x1);
          const float f = t < n ? expf(gl - Gc[t]) : 0.f;
          v[j][2 * half] = x0 * f;  // now v_new ⊙ e^{G_last - G}
          v[j][2 * half + 1] = x1 * f;
        }
      }
      gdn_fla_store_tiles_T<kVT, kNT>(vsT, kLv, v, warp, lane);
      block_sync();  // vsT complete; every read of hT (W h, its save) done
      // h <- e^{G_last} h + Kᵀ vs
      const float eg = expf(gl);
      TREECP_GDN_UNROLL
      for (int j = 0; j < kHT; ++j)
        TREECP_GDN_UNROLL
        for (int e = 0; e < 4; ++e) acc[j][e] *= eg;
      gdn_fla_tiles<kHT, kNT, true, false>(acc, Ksm(b), kLk, vsT, kLv, kGdnChunk, warp, lane);  // Kᵀ by .trans
      // The next chunk's hT straight away: the barrier that opens it then also covers hT (two barriers a chunk).
      if (ci + 1 < count) gdn_fla_store_tiles_T<kHT, kNT>(hT, kLk, acc, warp, lane);
    }
    gdn_async_wait<0>();  // the empty group past the last chunk
    if (a.state_out && rd.out_slot >= 0)
      gdn_fla_state_out<kHT, kNT>(acc, a.state_out + (static_cast<int64_t>(rd.out_slot) * H + h) * DK * dv, dv, e0,
                                  warp, g, q);
  }
};

// ---- output: one block (8 warps) per (chunk, head). Shared, bf16: Q and K rows [64][DK + 8] (from the inputs; rows
// past the chunk are never stored), the chunk-start state hT [DV][DK + 8], v_new [64][DV + 8], the masked pair matrix
// C [64][72], and G [64] fp32. C = Q Kᵀ ⊙ e^{G_i - G_j} (j <= i < n) in 32 tiles of 16 x 8, 4 a warp (tiles wholly
// above the diagonal skipped); then Y = scale (diag(e^G) Q h + C v_new) in 4 x DV / 8 tiles, DV / 16 a warp, both
// products into the same accumulators (C's column blocks past the tile's rows skipped). Every fragment by ldmatrix.x4
// (gdn_mma_b16_pair; v_new's by .trans: its k index, the token, strides rows).
struct GdnFlaOutArgs {
  const GdnChunkDesc* chunks;
  const unsigned char* ws;
  GdnFlaBlock fb;
  const uint16_t* q;
  const uint16_t* k;
  int32_t heads;
  void* y;
  bool y_f32;
  float scale;
};
template <int DK, int DV>
struct GdnFlaOutKernel {
  using Args = GdnFlaOutArgs;
  static constexpr const char* kName = "gdn fla output";
  static constexpr int kWarps = kGdnThreads / 32;
  static constexpr int kLk = DK + 8, kLv = DV + 8, kLc = kGdnChunk + 8;
  static constexpr int kCT = (kGdnChunk / 16) * (kGdnChunk / 8) / kWarps;  // C tiles a warp
  static constexpr int kOT = (kGdnChunk / 16) * (DV / 8) / kWarps;         // Y tiles a warp
  static_assert(DK % 16 == 0 && DV % 16 == 0 && kOT * kWarps == (kGdnChunk / 16) * (DV / 8) && kOT % 2 == 0 &&
                    kCT % 2 == 0,
                "tiles split evenly, in pairs of one row block");
  static constexpr int64_t kQBytes = 2 * int64_t{kGdnChunk} * kLk;
  static constexpr int64_t kHBytes = 2 * int64_t{DV} * kLk, kVBytes = 2 * int64_t{kGdnChunk} * kLv;
  static constexpr int64_t kCBytes = 2 * int64_t{kGdnChunk} * kLc;
  static constexpr int64_t kBytes = 2 * kQBytes + kHBytes + kVBytes + kCBytes + 4 * kGdnChunk;
  static constexpr int kLyf = DV + 4;  // fp32 row stride of the staged Y (16-byte aligned rows)
  static_assert(4 * int64_t{kGdnChunk} * kLyf <= 2 * kQBytes + kHBytes, "Y fits over Q, K and hT");
  static size_t smem_bytes(const Args&) { return static_cast<size_t>(kBytes); }

  static TREECP_GDN_FN void run(const Args& a, int64_t block, int tid, int nthr, float* smem) {
    const int H = a.heads;
    const int64_t chunk = block / H;
    const int h = static_cast<int>(block % H);
    const GdnChunkDesc cd = a.chunks[chunk];
    const int n = cd.len;
    const unsigned char* c = a.ws + (chunk * H + h) * a.fb.size;
    const int lane = tid & 31, warp = tid >> 5, g = lane >> 2, q = lane & 3;
    unsigned char* sm = reinterpret_cast<unsigned char*>(smem);
    uint16_t* Qs = reinterpret_cast<uint16_t*>(sm);
    uint16_t* Ks = reinterpret_cast<uint16_t*>(sm + kQBytes);
    uint16_t* Hs = reinterpret_cast<uint16_t*>(sm + 2 * kQBytes);
    uint16_t* Vs = reinterpret_cast<uint16_t*>(sm + 2 * kQBytes + kHBytes);
    uint16_t* Cs = reinterpret_cast<uint16_t*>(sm + 2 * kQBytes + kHBytes + kVBytes);
    float* Gs = reinterpret_cast<float*>(sm + 2 * kQBytes + kHBytes + kVBytes + kCBytes);
    const int64_t row = 2 * int64_t{H} * DK;  // bytes between tokens of q and k
    // Two copy groups: Q, K and G (C's operands) first, hT and v_new landing while C is formed.
    gdn_stage_rows<2 * DK, kGdnChunk>(Qs, a.q + (cd.t * H + h) * DK, n, row, 2 * kLk, tid, nthr);
    gdn_stage_rows<2 * DK, kGdnChunk>(Ks, a.k + (cd.t * H + h) * DK, n, row, 2 * kLk, tid, nthr);
    gdn_stage_rows<4 * kGdnChunk, 1>(Gs, c + a.fb.G, 1, 4 * kGdnChunk, 4 * kGdnChunk, tid, nthr);
    gdn_async_commit();
    gdn_stage_rows<2 * DK, DV>(Hs, c + a.fb.H, DV, 2 * DK, 2 * kLk, tid, nthr);
    gdn_stage_rows<2 * DV, kGdnChunk>(Vs, c + a.fb.V, kGdnChunk, 2 * DV, 2 * kLv, tid, nthr);
    gdn_async_commit();
    gdn_async_wait<1>();
    block_sync();
    // C: tile T = warp kCT + j is rows 16 (T / 8), columns 8 (T % 8); masked (select: stale rows past n never enter).
    // Pairs of tiles (T, T + 1), T even, share their rows: ldmatrix fragments (gdn_mma_b16_pair); pair p of 16
    // columns holds a tile at or below the diagonal exactly when p <= the row block.
    float cc[kCT][4];
    TREECP_GDN_UNROLL
    for (int j = 0; j < kCT; ++j)
      TREECP_GDN_UNROLL
      for (int e = 0; e < 4; ++e) cc[j][e] = 0.f;
    TREECP_GDN_UNROLL
    for (int j = 0; j < kCT; j += 2) {
      const int T = warp * kCT + j, m = T / (kGdnChunk / 8), nn = T % (kGdnChunk / 8);
      if (nn / 2 <= m) {
        TREECP_GDN_UNROLL
        for (int k0 = 0; k0 < DK; k0 += 16)
          gdn_mma_b16_pair<false, false>(cc[j], cc[j + 1], Qs, kLk, Ks, kLk, m * 16, nn * 8, k0, lane);
      }
    }
    TREECP_GDN_UNROLL
    for (int j = 0; j < kCT; ++j) {
      const int T = warp * kCT + j, m = T / (kGdnChunk / 8), nn = T % (kGdnChunk / 8);
      TREECP_GDN_UNROLL
      for (int e = 0; e < 4; ++e) {
        const int i = m * 16 + g + (e >> 1) * 8, jj = nn * 8 + 2 * q + (e & 1);
        Cs[i * kLc + jj] = float_to_bf16(jj <= i && i < n ? cc[j][e] * expf(Gs[i] - Gs[jj]) : 0.f);
      }
    }
    gdn_async_wait<0>();
    block_sync();  // C complete; hT and v_new landed
    float o[kOT][4];
    const int m = (warp * kOT) / (DV / 8);  // the warp's tiles share one row block
    TREECP_GDN_UNROLL
    for (int j = 0; j < kOT; ++j)
      TREECP_GDN_UNROLL
      for (int e = 0; e < 4; ++e) o[j][e] = 0.f;
    TREECP_GDN_UNROLL
    for (int k0 = 0; k0 < DK; k0 += 16)
      TREECP_GDN_UNROLL
      for (int j = 0; j < kOT; j += 2)
        gdn_mma_b16_pair<false, false>(o[j], o[j + 1], Qs, kLk, Hs, kLk, m * 16, ((warp * kOT + j) % (DV / 8)) * 8,
                                       k0, lane);
    const float eg0 = expf(Gs[m * 16 + g]), eg1 = expf(Gs[m * 16 + g + 8]);
    TREECP_GDN_UNROLL
    for (int j = 0; j < kOT; ++j) {
      o[j][0] *= eg0; o[j][1] *= eg0;
      o[j][2] *= eg1; o[j][3] *= eg1;
    }
    TREECP_GDN_UNROLL
    for (int k0 = 0; k0 < kGdnChunk; k0 += 16) {
      if (k0 > m * 16) break;  // C is zero past the rows' diagonal
      TREECP_GDN_UNROLL
      for (int j = 0; j < kOT; j += 2)
        gdn_mma_b16_pair<false, true>(o[j], o[j + 1], Cs, kLc, Vs, kLv, m * 16, ((warp * kOT + j) % (DV / 8)) * 8, k0,
                                      lane);
    }
    // Y staged over Q, K and hT (every warp done reading them), then out by whole rows (gdn_store_rows).
    block_sync();
    auto col_of = [&](int j) { return ((warp * kOT + j) % (DV / 8)) * 8 + 2 * q; };
    const int64_t y_at = (cd.t * H + h) * static_cast<int64_t>(DV), y_row = static_cast<int64_t>(H) * DV;
    if (a.y_f32) {
      float* Yf = reinterpret_cast<float*>(sm);  // [64][kLyf]
      TREECP_GDN_UNROLL
      for (int j = 0; j < kOT; ++j)
        TREECP_GDN_UNROLL
        for (int hh = 0; hh < 2; ++hh) {
          float* p = Yf + (m * 16 + g + hh * 8) * kLyf + col_of(j);
          p[0] = a.scale * o[j][2 * hh];
          p[1] = a.scale * o[j][2 * hh + 1];
        }
      block_sync();
      gdn_store_rows<4 * DV, kGdnChunk>(static_cast<float*>(a.y) + y_at, 4 * y_row, Yf, 4 * kLyf, n, tid, nthr);
    } else {
      uint16_t* Yb = reinterpret_cast<uint16_t*>(sm);  // [64][kLv]
      TREECP_GDN_UNROLL
      for (int j = 0; j < kOT; ++j)
        TREECP_GDN_UNROLL
        for (int hh = 0; hh < 2; ++hh)
          gdn_store_pair16(Yb + (m * 16 + g + hh * 8) * kLv + col_of(j), a.scale * o[j][2 * hh],
                           a.scale * o[j][2 * hh + 1]);
      block_sync();
      gdn_store_rows<2 * DV, kGdnChunk>(static_cast<uint16_t*>(a.y) + y_at, 2 * y_row, Yb, 2 * kLv, n, tid, nthr);
    }
  }
};

}  // namespace treecp::cuda::detail
