// Internal, part of gdn_device.cuh (included after gdn_fla_device.cuh, whose helpers and forward kernels it uses): the
// GDN backward split as FLA's chunk backward splits it (GdnCudaParams::fla_split), scalar gate, dk and dv 64 or 128,
// every product bf16 mma.sync m16n8k16 with fp32 accumulation. Per chunk (64 tokens, G the cumulative gate inside
// it, γ = e^G, Γ_ij = e^{G_i - G_j}, G_C the chunk's last, T = X diag(β) with X = L⁻¹, W = T (γ ⊙ K), U = T V,
// v_new = U - W h, h' = e^{G_C} h + Kᵀ (v_new ⊙ e^{G_C - G}), y = scale (diag(γ) Q h + (Q Kᵀ ⊙ Γ, j <= i) v_new)):
//   recompute  the forward's prep (W, U, G, and X = L⁻¹ as bf16) and scan (the chunk-start states h, v_new);
//   local      per (chunk, head): dv_loc = scale (Q Kᵀ ⊙ Γ, j <= i)ᵀ dY and dYs = scale γ ⊙ dY, both bf16;
//   dscan      per (run, head, BV columns), chunks in reverse, the state gradient dh [dk][BV] in mma accumulators:
//              dh' (the chunk-end gradient) stored bf16; dv2 = dv_loc + e^{G_C - G} ⊙ (K dh') stored bf16 (the whole
//              gradient of v_new); dh <- e^{G_C} dh' + Qᵀ dYs - Wᵀ dv2; at the run's start dL/dS_in;
//   grads      per (chunk, head), fully parallel, every intermediate in shared memory or registers:
//              dS = scale dY v_newᵀ ⊙ Γ (j <= i); dq = scale γ ⊙ (dY hᵀ) + dS K;
//              dW = -dv2 hᵀ; dKst = Tᵀ dW; dv = Tᵀ dv2; dT = dW Kstᵀ + dv2 Vᵀ (j <= i);
//              dX = dT diag(β); dL = -Xᵀ dX Xᵀ; E = dL ⊙ β_i Γ (j < i);
//              dk = dSᵀ Q + e^{G_C - G} ⊙ (v_new dh'ᵀ) + γ ⊙ dKst + E K + Eᵀ K;
//              dβ_j = Σ_i X_ij dT_ij + Σ_c dL_jc Γ_jc (k_j · k_c);
//              dG_i = Σ over every use of G_i (the pair terms as row sums minus column sums of dS ⊙ (Q Kᵀ) and
//              E ⊙ (K Kᵀ), the row terms ⟨dq_1, q⟩, -⟨dk_h, k⟩ and ⟨γ dKst, k⟩, and at G_C the state's:
//              Σ_i ⟨dk_h, k⟩_i + e^{G_C} ⟨h, dh'⟩), then dg = its reverse cumulative sum inside the chunk.
// As the forward's bodies these run on the CPU emulation too (gdn_mma_b16_pair's host path), at 256 threads.
// Design, workspace and measurements: docs/kernels.md ("The FLA-like split backward").
#pragma once

namespace treecp::cuda::detail {

// c[j0 .. j0 + 2 NP) (pairs of 8-column tiles, columns n0 .. n0 + 16 NP) += A[r0, r0 + 16) x [kb, ke) · B[kb, ke) x
// those columns (layouts as gdn_mma_b16_pair's).
template <bool kAkm, bool kBkn, int NP, int N>
TREECP_GDN_FN void gdn_fla_rows(float (&c)[N][4], int j0, const uint16_t* A, int lda, const uint16_t* B, int ldb,
                                int r0, int n0, int kb, int ke, int lane) {
  for (int k0 = kb; k0 < ke; k0 += 16)
    TREECP_GDN_UNROLL
    for (int p = 0; p < NP; ++p)
      gdn_mma_b16_pair<kAkm, kBkn>(c[j0 + 2 * p], c[j0 + 2 * p + 1], A, lda, B, ldb, r0, n0 + 16 * p, k0, lane);
}

// Rows [0, n) of a [.., width] array of bf16 or fp32 (row stride src_ld elements) as bf16 into shared memory (row
// stride ld), rows [n, 64) zero; `scaled` (optional, row stride lds) gets bf16(f[i] x) from the unrounded value. The
// kernels take bf16 dY by gdn_fla_stage_dy and widen only fp32 here.
TREECP_GDN_FN void gdn_fla_rows16(uint16_t* dst, int ld, const void* src, bool f32, int64_t src_ld, int n, int width,
                                  int tid, int nthr, uint16_t* scaled = nullptr, int lds = 0,
                                  const float* f = nullptr) {
  for (int idx = tid; idx < kGdnChunk * width / 2; idx += nthr) {
    const int i = idx / (width / 2), d = 2 * (idx % (width / 2));
    float x0 = 0.f, x1 = 0.f;
    if (i < n) {
      const int64_t at = i * src_ld + d;
      if (f32) {
        x0 = static_cast<const float*>(src)[at];
        x1 = static_cast<const float*>(src)[at + 1];
      } else {
        x0 = bf16_to_float(static_cast<const uint16_t*>(src)[at]);
        x1 = bf16_to_float(static_cast<const uint16_t*>(src)[at + 1]);
      }
    }
    gdn_store_pair16(dst + i * ld + d, x0, x1);
    if (scaled) gdn_store_pair16(scaled + i * lds + d, f[i] * x0, f[i] * x1);
  }
}

// Whether dY is staged by cp.async: bf16 and 4-byte aligned (the rows' offsets are multiples of 128 bytes).
TREECP_GDN_FN bool gdn_fla_dy_async(const void* dy, bool f32) {
  return !f32 && reinterpret_cast<uintptr_t>(dy) % 4 == 0;
}
// dY's element `at` (bf16 or fp32) as a pointer.
TREECP_GDN_FN const void* gdn_fla_dy_row(const void* dy, bool f32, int64_t at) {
  return f32 ? static_cast<const void*>(static_cast<const float*>(dy) + at)
             : static_cast<const void*>(static_cast<const uint16_t*>(dy) + at);
}
// dY rows [0, n) of bf16 (token stride H DV) into shared memory by cp.async (the caller commits and waits), rows
// [n, 64) zero: the loads in flight together, where a widening loop would wait on each behind its shared store.
template <int W>
TREECP_GDN_FN void gdn_fla_stage_dy(uint16_t* dst, int ld, const uint16_t* src, int H, int n, int tid, int nthr) {
  gdn_stage_rows<2 * W, kGdnChunk>(dst, src, n, 2 * int64_t{H} * W, 2 * ld, tid, nthr);
  for (int idx = tid; idx < (kGdnChunk - n) * W; idx += nthr) dst[(n + idx / W) * ld + idx % W] = 0;
}

// 64 rows of `width` bf16 from shared memory (row stride ld) to global (row stride width), 16 bytes a copy.
TREECP_GDN_FN void gdn_fla_store_rows(uint16_t* dst, const uint16_t* src, int ld, int rows, int width, int tid,
                                      int nthr) {
  for (int idx = tid; idx < rows * width / 8; idx += nthr) {
    const int row = idx / (width / 8), col = (idx % (width / 8)) * 8;
#if defined(__CUDA_ARCH__)
    *reinterpret_cast<uint4*>(dst + row * width + col) = *reinterpret_cast<const uint4*>(src + row * ld + col);
#else
    std::memcpy(dst + row * width + col, src + row * ld + col, 16);
#endif
  }
}

// x0 M[i][d] + x1 M[i][d + 1] of a bf16 matrix in shared memory (d even: one 4-byte load).
TREECP_GDN_FN float gdn_fla_dot2(const uint16_t* M, int ld, int i, int d, float x0, float x1) {
  const uint32_t w = gdn_pair16(GdnB16Mat{M, ld, 1}, i, d);
  return x0 * bf16_to_float(static_cast<uint16_t>(w & 0xffffu)) + x1 * bf16_to_float(static_cast<uint16_t>(w >> 16));
}

// Σ x[k] y[k] over 8 bf16 elements of two 16-byte aligned rows in shared memory (two 16-byte loads).
TREECP_GDN_FN float gdn_fla_dot8(const uint16_t* x, const uint16_t* y) {
  uint32_t a[4], b[4];
#if defined(__CUDA_ARCH__)
  const uint4 u = *reinterpret_cast<const uint4*>(x), v = *reinterpret_cast<const uint4*>(y);
  a[0] = u.x, a[1] = u.y, a[2] = u.z, a[3] = u.w;
  b[0] = v.x, b[1] = v.y, b[2] = v.z, b[3] = v.w;
#else
  std::memcpy(a, x, 16);
  std::memcpy(b, y, 16);
#endif
  float s = 0.f;
  TREECP_GDN_UNROLL
  for (int k = 0; k < 4; ++k)
    s += bf16_to_float(static_cast<uint16_t>(a[k] & 0xffffu)) * bf16_to_float(static_cast<uint16_t>(b[k] & 0xffffu)) +
         bf16_to_float(static_cast<uint16_t>(a[k] >> 16)) * bf16_to_float(static_cast<uint16_t>(b[k] >> 16));
  return s;
}

// *p += x for a float in global memory with one adding thread: a fire-and-forget red.global.add.f32 on the device.
TREECP_GDN_FN void gdn_fla_add1(float* p, float x) {
#if defined(__CUDA_ARCH__)
  asm volatile("red.global.add.f32 [%0], %1;\n" ::"l"(p), "f"(x) : "memory");
#else
  *p += x;
#endif
}

// dst[row][col] += f[hh] o (rows r0 + g + 8 hh below n, columns c0 + 8 j + 2 q and + 1) for a warp's accumulator
// tiles (8-byte aligned pairs). Every element has one adding thread (chunks do not overlap), so on the device each
// pair is one fire-and-forget red.global.add.v2.f32: the same sum as a load, an add and a store, without the load's
// latency in the block's critical path (long-scoreboard stalls, these loads among them, were 1.84 of the ~7 cycles
// between a warp's instructions in run 148's profile of the gradients kernel). The host adds in place.
template <int NT>
TREECP_GDN_FN void gdn_fla_add_tiles(float* dst, int64_t ld, const float (&o)[NT][4], int r0, int c0, int g, int q, int n,
                                     const float (&f)[2]) {
  TREECP_GDN_UNROLL
  for (int j = 0; j < NT; ++j)
    TREECP_GDN_UNROLL
    for (int hh = 0; hh < 2; ++hh) {
      const int row = r0 + g + hh * 8;
      float* p = dst + row * ld + c0 + j * 8 + 2 * q;
      if (row < n) {
        const float x0 = f[hh] * o[j][2 * hh], x1 = f[hh] * o[j][2 * hh + 1];
#if defined(__CUDA_ARCH__)
        red_add_f32x2(p, x0, x1);
#else
        p[0] += x0;
        p[1] += x1;
#endif
      }
    }
}

// ---- local: one block (8 warps) per (chunk, head). Q, K [64][DK + 8] and dY [64][DV + 8] bf16 in shared memory
// (rows past the chunk zero), C = Q Kᵀ ⊙ Γ (j <= i < n) as bf16 [64][72]; dv_loc = scale Cᵀ dY (a warp one row block
// of 16 keys j and half the columns; k blocks i >= j only). Writes dv_loc and dYs = bf16(scale γ dY) [64][DV].
struct GdnFlaLocalArgs {
  const GdnChunkDesc* chunks;
  unsigned char* ws;
  GdnFlaBlock fb;
  const uint16_t* q;
  const uint16_t* k;
  const void* dy;  // [S, H, DV], bf16 or fp32 (dy_f32)
  bool dy_f32;
  int32_t heads;
  float scale;
};
template <int DK, int DV>
struct GdnFlaLocalKernel {
  using Args = GdnFlaLocalArgs;
  static constexpr const char* kName = "gdn fla bwd local";
  static constexpr int C = kGdnChunk;
  static constexpr int kLk = DK + 8, kLv = DV + 8, kLc = C + 8;
  static constexpr int64_t kQBytes = 2 * int64_t{C} * kLk, kVBytes = 2 * int64_t{C} * kLv, kCBytes = 2 * int64_t{C} * kLc;
  static constexpr int64_t kBytes = 2 * kQBytes + 2 * kVBytes + kCBytes + 2 * 4 * C;
  static size_t smem_bytes(const Args&) { return static_cast<size_t>(kBytes); }

  static TREECP_GDN_FN void run(const Args& a, int64_t block, int tid, int nthr, float* smem) {
    const int H = a.heads;
    const int64_t chunk = block / H;
    const int h = static_cast<int>(block % H);
    const GdnChunkDesc cd = a.chunks[chunk];
    const int n = cd.len;
    unsigned char* c = a.ws + (chunk * H + h) * a.fb.size;
    const int lane = tid & 31, warp = tid >> 5, g = lane >> 2, q = lane & 3;
    unsigned char* sm = reinterpret_cast<unsigned char*>(smem);
    uint16_t* Qs = reinterpret_cast<uint16_t*>(sm);
    uint16_t* Ks = reinterpret_cast<uint16_t*>(sm + kQBytes);
    uint16_t* Ys = reinterpret_cast<uint16_t*>(sm + 2 * kQBytes);            // dY
    uint16_t* Ss = reinterpret_cast<uint16_t*>(sm + 2 * kQBytes + kVBytes);  // dYs, then dv_loc
    uint16_t* Cs = reinterpret_cast<uint16_t*>(sm + 2 * kQBytes + 2 * kVBytes);
    float* Gs = reinterpret_cast<float*>(sm + 2 * kQBytes + 2 * kVBytes + kCBytes);
    float* fs = Gs + C;  // scale e^G
    const int64_t row = 2 * int64_t{H} * DK;
    gdn_stage_rows<2 * DK, C>(Qs, a.q + (cd.t * H + h) * DK, n, row, 2 * kLk, tid, nthr);
    gdn_stage_rows<2 * DK, C>(Ks, a.k + (cd.t * H + h) * DK, n, row, 2 * kLk, tid, nthr);
    gdn_stage_rows<4 * C, 1>(Gs, c + a.fb.G, 1, 4 * C, 4 * C, tid, nthr);
    const int64_t y0 = (cd.t * H + h) * int64_t{DV};
    const bool dy_async = gdn_fla_dy_async(a.dy, a.dy_f32);
    if (dy_async) gdn_fla_stage_dy<DV>(Ys, kLv, static_cast<const uint16_t*>(a.dy) + y0, H, n, tid, nthr);
    gdn_async_commit();
    for (int idx = tid; idx < (C - n) * DK; idx += nthr) {
      Qs[(n + idx / DK) * kLk + idx % DK] = 0;
      Ks[(n + idx / DK) * kLk + idx % DK] = 0;
    }
    gdn_async_wait<0>();
    block_sync();
    if (tid < C) fs[tid] = tid < n ? a.scale * expf(Gs[tid]) : 0.f;
    block_sync();
    if (!dy_async)  // fp32 (dYs from the unrounded values) or an unaligned bf16 dY, element by element
      gdn_fla_rows16(Ys, kLv, gdn_fla_dy_row(a.dy, a.dy_f32, y0), a.dy_f32, int64_t{H} * DV, n, DV, tid, nthr, Ss,
                     kLv, fs);
    else
      for (int idx = tid; idx < C * DV / 2; idx += nthr) {
        const int i = idx / (DV / 2), d = 2 * (idx % (DV / 2));
        gdn_store_pair16(Ss + i * kLv + d, fs[i] * bf16_to_float(Ys[i * kLv + d]),
                         fs[i] * bf16_to_float(Ys[i * kLv + d + 1]));
      }
    // C: warp w rows 16 (w / 2), columns 32 (w % 2) .. + 32; pairs above the diagonal skipped.
    const int rb = warp / 2;
    float cc[4][4];
    gdn_fla_zero(cc);
    TREECP_GDN_UNROLL
    for (int p = 0; p < 2; ++p)
      if ((warp % 2) * 2 + p <= rb)
        gdn_fla_rows<false, false, 1>(cc, 2 * p, Qs, kLk, Ks, kLk, rb * 16, (warp % 2) * 32 + 16 * p, 0, DK, lane);
    TREECP_GDN_UNROLL
    for (int j = 0; j < 4; ++j)
      TREECP_GDN_UNROLL
      for (int hh = 0; hh < 2; ++hh) {
        const int i = rb * 16 + g + hh * 8, j0 = (warp % 2) * 32 + j * 8 + 2 * q;
        float x[2];
        TREECP_GDN_UNROLL
        for (int u = 0; u < 2; ++u)
          x[u] = j0 + u <= i && i < n ? cc[j][2 * hh + u] * expf(Gs[i] - Gs[j0 + u]) : 0.f;
        gdn_store_pair16(Cs + i * kLc + j0, x[0], x[1]);
      }
    block_sync();  // C, dY and dYs complete
    uint16_t* gs = reinterpret_cast<uint16_t*>(c + a.fb.DOS);
    gdn_fla_store_rows(gs, Ss, kLv, C, DV, tid, nthr);
    // dv_loc = scale Cᵀ dY: A = Cᵀ (C stored [i][j]: k-major), B = dY [i][e]; k blocks i >= j.
    constexpr int NP = DV / 32;
    float o[2 * NP][4];
    gdn_fla_zero(o);
    const int n0 = (warp % 2) * (DV / 2);
    gdn_fla_rows<true, true, NP>(o, 0, Cs, kLc, Ys, kLv, rb * 16, n0, rb * 16, C, lane);
    block_sync();  // every thread done with dYs (stored) before dv_loc goes over it
    TREECP_GDN_UNROLL
    for (int j = 0; j < 2 * NP; ++j)
      TREECP_GDN_UNROLL
      for (int hh = 0; hh < 2; ++hh)
        gdn_store_pair16(Ss + (rb * 16 + g + hh * 8) * kLv + n0 + j * 8 + 2 * q, a.scale * o[j][2 * hh],
                         a.scale * o[j][2 * hh + 1]);
    block_sync();
    gdn_fla_store_rows(reinterpret_cast<uint16_t*>(c + a.fb.DVL), Ss, kLv, C, DV, tid, nthr);
  }
};

// ---- dscan: one block (8 warps) per (run, head, BV state columns); chunks in reverse. The gradient dh [DK][BV] lives
// in mma accumulator fragments (fp32) as the forward scan's state does (same tiles a warp). Shared, bf16 unless said,
// double-buffered per chunk: K, Q, W [64][DK + 8], dYs's and dv_loc's columns [64][BV + 8], G [64] fp32; then dhT
// [BV][DK + 8] (bf16(dh')ᵀ, the B operand of K dh') and nd2 [64][BV + 8] (-dv2 by token, the B operand of Wᵀ dv2).
// Per chunk: dhT's store, dv2 (stored) and nd2, dh <- e^{G_C} dh + Qᵀ dYs + Wᵀ nd2, then the next dhT (as the scan's
// hT). Two barriers a chunk.
struct GdnFlaDscanArgs {
  const GdnRunDesc* runs;
  const GdnChunkDesc* chunks;
  unsigned char* ws;
  GdnFlaBlock fb;
  const uint16_t* q;
  const uint16_t* k;
  int32_t heads, dv;
  const float* d_state_out;  // by out_slot; null or -1 = zero
  float* d_state_in;         // by in_slot; null = not written (may alias d_state_out: a block reads its tile first)
};
template <int DK, int BV>
struct GdnFlaDscanKernel {
  using Args = GdnFlaDscanArgs;
  static constexpr const char* kName = "gdn fla bwd scan";
  static constexpr int kWarps = kGdnThreads / 32;
  static constexpr int C = kGdnChunk;
  static constexpr int kLk = DK + 8, kLu = BV + 8;
  static constexpr int kMT = DK / 16, kNT = BV / 8;
  static constexpr int kHT = kMT * kNT / kWarps;       // gradient tiles a warp
  static constexpr int kVT = (C / 16) * kNT / kWarps;  // dv2 tiles a warp
  static_assert(kHT >= 1 && kVT >= 1 && kHT * kWarps == kMT * kNT && kVT * kWarps == (C / 16) * kNT,
                "the warps split the gradient and dv2 tiles evenly");
  static constexpr int64_t kMBytes = 2 * int64_t{C} * kLk, kUBytes = 2 * int64_t{C} * kLu, kGBytes = 4 * C;
  static constexpr int64_t kBufBytes = 3 * kMBytes + 2 * kUBytes + kGBytes;  // K, Q, W, dYs, dv_loc, G
  static constexpr int64_t kBytes = 2 * kBufBytes + 2 * int64_t{BV} * kLk + kUBytes;
  static size_t smem_bytes(const Args&) { return static_cast<size_t>(kBytes); }

  static TREECP_GDN_FN void run(const Args& a, int64_t block, int tid, int nthr, float* smem) {
    const int H = a.heads, dv = a.dv;
    const GdnFlaColumnBlock cb = GdnFlaColumnBlock::of<BV>(block, H, dv);
    const int h = cb.head, e0 = cb.e0;
    const GdnRunDesc rd = a.runs[cb.run];
    const int lane = tid & 31, warp = tid >> 5, g = lane >> 2, q = lane & 3;
    unsigned char* sm = reinterpret_cast<unsigned char*>(smem);
    auto Ksm = [&](int b) { return reinterpret_cast<uint16_t*>(sm + b * kBufBytes); };
    auto Qsm = [&](int b) { return reinterpret_cast<uint16_t*>(sm + b * kBufBytes + kMBytes); };
    auto Wsm = [&](int b) { return reinterpret_cast<uint16_t*>(sm + b * kBufBytes + 2 * kMBytes); };
    auto Ysm = [&](int b) { return reinterpret_cast<uint16_t*>(sm + b * kBufBytes + 3 * kMBytes); };
    auto Lsm = [&](int b) { return reinterpret_cast<uint16_t*>(sm + b * kBufBytes + 3 * kMBytes + kUBytes); };
    auto Gsm = [&](int b) { return reinterpret_cast<float*>(sm + b * kBufBytes + 3 * kMBytes + 2 * kUBytes); };
    uint16_t* dhT = reinterpret_cast<uint16_t*>(sm + 2 * kBufBytes);  // [BV][kLk]
    uint16_t* nd2 = dhT + BV * kLk;                                    // [64][kLu]
    auto blk_of = [&](int ci) { return a.ws + (static_cast<int64_t>(rd.chunk_begin + ci) * H + h) * a.fb.size; };
    auto issue = [&](int ci, int b, const GdnChunkDesc& cd) {
      if (ci >= 0) {
        const unsigned char* c = blk_of(ci);
        const int64_t row = 2 * int64_t{H} * DK;
        gdn_stage_rows<2 * DK, C>(Ksm(b), a.k + (cd.t * H + h) * DK, cd.len, row, 2 * kLk, tid, nthr);
        gdn_stage_rows<2 * DK, C>(Qsm(b), a.q + (cd.t * H + h) * DK, cd.len, row, 2 * kLk, tid, nthr);
        gdn_stage_rows<2 * DK, C>(Wsm(b), c + a.fb.W, C, 2 * DK, 2 * kLk, tid, nthr);
        gdn_stage_rows<2 * BV, C>(Ysm(b), c + a.fb.DOS + 2 * e0, C, 2 * int64_t{dv}, 2 * kLu, tid, nthr);
        gdn_stage_rows<2 * BV, C>(Lsm(b), c + a.fb.DVL + 2 * e0, C, 2 * int64_t{dv}, 2 * kLu, tid, nthr);
        gdn_stage_rows<kGBytes, 1>(Gsm(b), c + a.fb.G, 1, kGBytes, static_cast<int>(kGBytes), tid, nthr);
        uint16_t* K = Ksm(b);
        uint16_t* Q = Qsm(b);
        for (int idx = tid; idx < (C - cd.len) * DK; idx += nthr) {  // rows past the chunk: zero, not stale
          K[(cd.len + idx / DK) * kLk + idx % DK] = 0;
          Q[(cd.len + idx / DK) * kLk + idx % DK] = 0;
        }
      }
      gdn_async_commit();
    };
    const int last = rd.chunk_count - 1;
    // The descriptors a step ahead of their use, as the forward scan's.
    GdnChunkDesc cd_cur = last >= 0 ? a.chunks[rd.chunk_begin + last] : GdnChunkDesc{};
    GdnChunkDesc cd_next = last >= 1 ? a.chunks[rd.chunk_begin + last - 1] : cd_cur;
    issue(last, last & 1, cd_cur);
    float acc[kHT][4];
    const int64_t ssz = int64_t{DK} * dv;
    const float* dso = (a.d_state_out && rd.out_slot >= 0) ? a.d_state_out + (int64_t{rd.out_slot} * H + h) * ssz : nullptr;
    gdn_fla_state_in<kHT, kNT>(acc, dso, dv, e0, warp, g, q);
    gdn_fla_store_tiles_T<kHT, kNT>(dhT, kLk, acc, warp, lane);  // dhT = bf16(dh')ᵀ, the run's end
    for (int ci = last; ci >= 0; --ci) {
      const int b = ci & 1;
      const int n = cd_cur.len;
      unsigned char* c = blk_of(ci);
      gdn_async_wait<0>();
      block_sync();  // chunk ci's operands landed, dhT complete; chunk ci + 1 done with buffer b ^ 1 and nd2
      issue(ci - 1, b ^ 1, cd_next);
      cd_cur = cd_next;
      if (ci >= 2) cd_next = a.chunks[rd.chunk_begin + ci - 2];
      gdn_fla_store_rows(reinterpret_cast<uint16_t*>(c + a.fb.DH) + int64_t{e0} * DK, dhT, kLk, BV, DK, tid, nthr);
      // dv2 = dv_loc + e^{G_C - G} ⊙ (K dh'), zero past the chunk.
      const float* Gc = Gsm(b);
      const float gl = Gc[n - 1];
      const uint16_t* Ls = Lsm(b);
      uint16_t* gd = reinterpret_cast<uint16_t*>(c + a.fb.DV2);
      float v[kVT][4];
      gdn_fla_zero(v);
      gdn_fla_tiles_halves<kVT, kNT>(v, Ksm(b), kLk, dhT, kLk, DK, warp, lane);
      TREECP_GDN_UNROLL
      for (int j = 0; j < kVT; ++j) {
        const int T = warp * kVT + j, m = T / kNT, nn = T % kNT;
        TREECP_GDN_UNROLL
        for (int half = 0; half < 2; ++half) {
          const int t = m * 16 + g + half * 8, col = nn * 8 + 2 * q;
          const float f = t < n ? expf(gl - Gc[t]) : 0.f;
          const uint32_t l = gdn_pair16(GdnB16Mat{Ls, kLu, 1}, t, col);
          const float x0 = t < n ? bf16_to_float(static_cast<uint16_t>(l & 0xffffu)) + f * v[j][2 * half] : 0.f;
          const float x1 = t < n ? bf16_to_float(static_cast<uint16_t>(l >> 16)) + f * v[j][2 * half + 1] : 0.f;
          gdn_store_pair16(gd + t * dv + e0 + col, x0, x1);
          gdn_store_pair16(nd2 + t * kLu + col, -x0, -x1);
        }
      }
      block_sync();  // nd2 complete; every read of dhT (K dh', its store) done
      // dh <- e^{G_C} dh' + Qᵀ dYs + Wᵀ nd2 (A operands k-major from [t][d], B by token)
      const float eg = expf(gl);
      TREECP_GDN_UNROLL
      for (int j = 0; j < kHT; ++j)
        TREECP_GDN_UNROLL
        for (int e = 0; e < 4; ++e) acc[j][e] *= eg;
      gdn_fla_tiles<kHT, kNT, true, true, true>(acc, Qsm(b), kLk, Ysm(b), kLu, C, warp, lane, Wsm(b), nd2);
      // The previous chunk's dhT straight away, covered by the barrier that opens it (two barriers a chunk).
      if (ci > 0) gdn_fla_store_tiles_T<kHT, kNT>(dhT, kLk, acc, warp, lane);
    }
    gdn_async_wait<0>();  // the empty group past the first chunk
    if (a.d_state_in && rd.in_slot >= 0)
      gdn_fla_state_out<kHT, kNT>(acc, a.d_state_in + (int64_t{rd.in_slot} * H + h) * ssz, dv, e0, warp, g, q);
  }
};

// ---- grads: one block (8 warps) per (chunk, head); the formulas in the file's head. Two tilings: the 64 x 64 pair
// matrices as the prep's A (warp w rows 16 (w / 2), columns 32 (w % 2) .. + 32, in registers at the same positions
// for every such product, so that their element-wise combinations stay in registers), and the 64 x N row matrices
// (dq, dk, dW, dKst, dv) as warp w rows 16 (w / 2), columns N / 2 (w % 2) .. + N / 2. Shared, bf16 unless said: Q, K
// [64][DK + 8], dY, v_new, dv2, V [64][DV + 8], h and dh' transposed [DV][DK + 8] (over which dW, dX, then M and E go
// once both are dead), X and dS [64][72], G, β, e^G and the partial sums (fp32). Every gradient element is added by
// one thread (chunks do not overlap). dG's and dβ's row and column terms are summed in thread-owned slots, then a
// thread a row adds its slots, and the reverse cumulative sum gives dg.
struct GdnFlaGradArgs {
  const GdnChunkDesc* chunks;
  const unsigned char* ws;
  GdnFlaBlock fb;
  const uint16_t* q;
  const uint16_t* k;
  const uint16_t* v;
  const uint16_t* beta;
  const void* dy;
  bool dy_f32;
  int32_t heads;
  float scale;
  float *dq, *dk, *dv, *dg, *dbeta;  // added into; null = not computed (the others still are)
};
template <int DK, int DV>
struct GdnFlaGradKernel {
  using Args = GdnFlaGradArgs;
  static constexpr const char* kName = "gdn fla bwd grads";
  static constexpr int C = kGdnChunk;
  static constexpr int kLk = DK + 8, kLv = DV + 8, kLc = C + 8;
  static constexpr int64_t kKBytes = 2 * int64_t{C} * kLk, kVBytes = 2 * int64_t{C} * kLv;
  static constexpr int64_t kHBytes = 2 * int64_t{DV} * kLk, kCBytes = 2 * int64_t{C} * kLc;
  // fp32 tail: G, β, e^G, dG (full), then the slots: dG rows from the row tiling [64][8], from the pair tiling rows
  // [64][8] and columns [64][32], dβ rows [64][8] and columns [64][32], a thread's state terms [256], their 32
  // partial sums, and dG's sums over blocks of 8 rows [8].
  static constexpr int kTail = 4 * C + C * (8 + 8 + 32 + 8 + 32) + kGdnThreads + 32 + C / 8;
  // dW, dX / E and M go over h and dh' where they fit (dv 128), else after them (dk 128 with dv 64).
  static constexpr bool kOverlay = kKBytes + 2 * kCBytes <= 2 * kHBytes;
  static constexpr int64_t kLateBytes = kOverlay ? 0 : kKBytes + 2 * kCBytes;
  static constexpr int64_t kBytes =
      2 * kKBytes + 4 * kVBytes + 2 * kHBytes + 2 * kCBytes + kLateBytes + 4 * int64_t{kTail};
  static_assert(kBytes <= 232448, "fits one SM's shared memory");
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
    int64_t at = 0;
    auto take = [&](int64_t bytes) {
      unsigned char* p = sm + at;
      at += bytes;
      return p;
    };
    uint16_t* Qs = reinterpret_cast<uint16_t*>(take(kKBytes));
    uint16_t* Ks = reinterpret_cast<uint16_t*>(take(kKBytes));
    uint16_t* Ys = reinterpret_cast<uint16_t*>(take(kVBytes));  // dY
    uint16_t* Ns = reinterpret_cast<uint16_t*>(take(kVBytes));  // v_new
    uint16_t* Ds = reinterpret_cast<uint16_t*>(take(kVBytes));  // dv2
    uint16_t* Vs = reinterpret_cast<uint16_t*>(take(kVBytes));  // v
    uint16_t* Hs = reinterpret_cast<uint16_t*>(take(kHBytes));  // h transposed [e][d]
    uint16_t* Gh = reinterpret_cast<uint16_t*>(take(kHBytes));  // dh' transposed [e][d]
    uint16_t* Xs = reinterpret_cast<uint16_t*>(take(kCBytes));  // X = L⁻¹ [i][j]
    uint16_t* Ss = reinterpret_cast<uint16_t*>(take(kCBytes));  // dS [i][j]
    unsigned char* late = kOverlay ? reinterpret_cast<unsigned char*>(Hs) : take(kLateBytes);
    uint16_t* Wd = reinterpret_cast<uint16_t*>(late);            // dW [i][d], once h and dh' are dead
    uint16_t* B1 = reinterpret_cast<uint16_t*>(late + kKBytes);  // dX, then E
    uint16_t* B2 = B1 + C * kLc;                                 // M = Xᵀ dX
    float* Gs = reinterpret_cast<float*>(take(4 * int64_t{kTail}));
    float* bs = Gs + C;
    float* eGs = bs + C;
    float* dGs = eGs + C;
    float* rowR = dGs + C;      // [64][8]: dG from the row tiling
    float* rowP = rowR + 8 * C;  // [64][8]: dG rows from the pair tiling
    float* colP = rowP + 8 * C;  // [64][32]: dG columns from the pair tiling
    float* rowB = colP + 32 * C;  // [64][8]: dβ rows
    float* colB = rowB + 8 * C;   // [64][32]: dβ columns
    float* st = colB + 32 * C;    // [256]: the state terms of dG_C
    float* stp = st + kGdnThreads;  // [32]: their partial sums
    float* blk = stp + 32;          // [8]: dG's sums over blocks of 8 rows
    const int64_t rk = 2 * int64_t{H} * DK, rv = 2 * int64_t{H} * DV;
    // Two copy groups: what step 1 reads (Q, K, v_new, G, dY), then the rest, which lands while step 1 runs.
    gdn_stage_rows<2 * DK, C>(Qs, a.q + (cd.t * H + h) * DK, n, rk, 2 * kLk, tid, nthr);
    gdn_stage_rows<2 * DK, C>(Ks, a.k + (cd.t * H + h) * DK, n, rk, 2 * kLk, tid, nthr);
    gdn_stage_rows<2 * DV, C>(Ns, c + a.fb.V, C, 2 * DV, 2 * kLv, tid, nthr);
    gdn_stage_rows<4 * C, 1>(Gs, c + a.fb.G, 1, 4 * C, 4 * C, tid, nthr);
    const bool dy_async = gdn_fla_dy_async(a.dy, a.dy_f32);
    if (dy_async)
      gdn_fla_stage_dy<DV>(Ys, kLv, static_cast<const uint16_t*>(a.dy) + (cd.t * H + h) * int64_t{DV}, H, n, tid, nthr);
    gdn_async_commit();
    gdn_stage_rows<2 * DK, DV>(Hs, c + a.fb.H, DV, 2 * DK, 2 * kLk, tid, nthr);
    gdn_stage_rows<2 * DK, DV>(Gh, c + a.fb.DH, DV, 2 * DK, 2 * kLk, tid, nthr);
    gdn_stage_rows<2 * DV, C>(Ds, c + a.fb.DV2, C, 2 * DV, 2 * kLv, tid, nthr);
    gdn_stage_rows<2 * DV, C>(Vs, a.v + (cd.t * H + h) * DV, n, rv, 2 * kLv, tid, nthr);
    gdn_stage_rows<2 * C, C>(Xs, c + a.fb.X, C, 2 * C, 2 * kLc, tid, nthr);
    gdn_async_commit();
    for (int idx = tid; idx < (C - n) * DK; idx += nthr) {
      Qs[(n + idx / DK) * kLk + idx % DK] = 0;
      Ks[(n + idx / DK) * kLk + idx % DK] = 0;
    }
    for (int idx = tid; idx < (C - n) * DV; idx += nthr) Vs[(n + idx / DV) * kLv + idx % DV] = 0;
    if (tid < C) bs[tid] = tid < n ? bf16_to_float(a.beta[(cd.t + tid) * H + h]) : 0.f;
    const int64_t y0 = (cd.t * H + h) * int64_t{DV};
    if (!dy_async) gdn_fla_rows16(Ys, kLv, gdn_fla_dy_row(a.dy, a.dy_f32, y0), a.dy_f32, int64_t{H} * DV, n, DV, tid, nthr);
    gdn_async_wait<1>();  // step 1's group
    block_sync();
    if (tid < C) eGs[tid] = expf(Gs[tid]);
    block_sync();

    const int rb = warp / 2, half = warp % 2;
    const int pc0 = half * 32;  // the pair tiling's first column
    // element (j, e) of a pair-tiling accumulator: row, column
    auto prow = [&](int e) { return rb * 16 + g + (e >> 1) * 8; };
    auto pcol = [&](int j, int e) { return pc0 + j * 8 + 2 * q + (e & 1); };
    float rowF[2] = {0.f, 0.f}, colF[8] = {}, rowBt[2] = {0.f, 0.f}, colBt[8] = {};
    auto pair_terms = [&](int j, int e, float f) {  // dG_i += f, dG_j -= f
      rowF[e >> 1] += f;
      colF[2 * j + (e & 1)] -= f;
    };
    // Pairs of 8-column tiles p of the pair tiling at or below the diagonal: (half * 2 + p) <= rb.
    // acc += A Bᵀ (A [i][k], B [j][k], both k-contiguous) over k in [0, ke).
    auto lower_pairs = [&](float (&acc)[4][4], const uint16_t* A, int lda, const uint16_t* B, int ldb, int ke) {
      TREECP_GDN_UNROLL
      for (int p = 0; p < 2; ++p)
        if (half * 2 + p <= rb)
          gdn_fla_rows<false, false, 1>(acc, 2 * p, A, lda, B, ldb, rb * 16, pc0 + 16 * p, 0, ke, lane);
    };

    // 1. S = Q Kᵀ and dA = dY v_newᵀ; dS = scale dA Γ (j <= i < n) into Ss; dS ⊙ S's pair terms.
    {
      float s[4][4], d[4][4];
      gdn_fla_zero(s);
      gdn_fla_zero(d);
      lower_pairs(s, Qs, kLk, Ks, kLk, DK);
      lower_pairs(d, Ys, kLv, Ns, kLv, DV);
      TREECP_GDN_UNROLL
      for (int j = 0; j < 4; ++j)
        TREECP_GDN_UNROLL
        for (int hh = 0; hh < 2; ++hh) {  // elements e = 2 hh, 2 hh + 1: one row, adjacent columns
          const int i = prow(2 * hh), j0 = pcol(j, 2 * hh);
          float ds[2];
          TREECP_GDN_UNROLL
          for (int u = 0; u < 2; ++u) {
            const int e = 2 * hh + u;
            ds[u] = j0 + u <= i && i < n ? a.scale * d[j][e] * expf(Gs[i] - Gs[j0 + u]) : 0.f;
            pair_terms(j, e, ds[u] * s[j][e]);
          }
          gdn_store_pair16(Ss + i * kLc + j0, ds[0], ds[1]);
        }
    }
    gdn_async_wait<0>();  // the second group
    block_sync();  // dS complete; h, dh', dv2, V and X landed

    // The row tiling: NP pairs of tiles, columns rc0 ..
    constexpr int NPK = DK / 32, NPV = DV / 32;
    const int rk0 = half * (DK / 2), rv0 = half * (DV / 2);
    auto rcol = [&](int c0, int j, int e) { return c0 + j * 8 + 2 * q + (e & 1); };
    const float one[2] = {1.f, 1.f};
    float rowG[2] = {0.f, 0.f};
    float state_term = 0.f;
    float* const gq = a.dq ? a.dq + (cd.t * H + h) * int64_t{DK} : nullptr;
    float* const gk = a.dk ? a.dk + (cd.t * H + h) * int64_t{DK} : nullptr;
    const int64_t rowq = int64_t{H} * DK;

    // 2. dq = scale γ ⊙ (dY hᵀ) (its ⟨., q⟩ into dG), + dS K.
    {
      float o[2 * NPK][4];
      gdn_fla_zero(o);
      gdn_fla_rows<false, true, NPK>(o, 0, Ys, kLv, Hs, kLk, rb * 16, rk0, 0, DV, lane);
      TREECP_GDN_UNROLL
      for (int j = 0; j < 2 * NPK; ++j)
        TREECP_GDN_UNROLL
        for (int hh = 0; hh < 2; ++hh) {
          const int i = rb * 16 + g + hh * 8;
          const float f = a.scale * eGs[i];
          o[j][2 * hh] *= f;
          o[j][2 * hh + 1] *= f;
          rowG[hh] += gdn_fla_dot2(Qs, kLk, i, rcol(rk0, j, 0), o[j][2 * hh], o[j][2 * hh + 1]);
        }
      gdn_fla_rows<false, true, NPK>(o, 0, Ss, kLc, Ks, kLk, rb * 16, rk0, 0, rb * 16 + 16, lane);
      if (gq) gdn_fla_add_tiles(gq, rowq, o, rb * 16, rk0, g, q, n, one);
    }
    // 3. dk = e^{G_C - G} ⊙ (v_new dh'ᵀ) (its ⟨., k⟩: minus into dG_i, plus into dG_C), + dSᵀ Q.
    float dk[2 * NPK][4];
    gdn_fla_zero(dk);
    const float gl = Gs[n - 1];
    gdn_fla_rows<false, true, NPK>(dk, 0, Ns, kLv, Gh, kLk, rb * 16, rk0, 0, DV, lane);
    {
      float f[2];
      TREECP_GDN_UNROLL
      for (int hh = 0; hh < 2; ++hh) {
        const int i = rb * 16 + g + hh * 8;
        f[hh] = i < n ? expf(gl - Gs[i]) : 0.f;
      }
      TREECP_GDN_UNROLL
      for (int j = 0; j < 2 * NPK; ++j)
        TREECP_GDN_UNROLL
        for (int hh = 0; hh < 2; ++hh) {
          dk[j][2 * hh] *= f[hh];
          dk[j][2 * hh + 1] *= f[hh];
          const float t =
              gdn_fla_dot2(Ks, kLk, rb * 16 + g + hh * 8, rcol(rk0, j, 0), dk[j][2 * hh], dk[j][2 * hh + 1]);
          rowG[hh] -= t;
          state_term += t;
        }
    }
    gdn_fla_rows<true, true, NPK>(dk, 0, Ss, kLc, Qs, kLk, rb * 16, rk0, rb * 16, C, lane);
    // 4. dW = -dv2 hᵀ (registers until h is dead); e^{G_C} ⟨h, dh'⟩ into the state term.
    float w[2 * NPK][4];
    gdn_fla_zero(w);
    gdn_fla_rows<false, true, NPK>(w, 0, Ds, kLv, Hs, kLk, rb * 16, rk0, 0, DV, lane);
    {
      float hd = 0.f;
      for (int idx = tid; idx < DV * DK / 8; idx += nthr) {  // eight columns a load
        const int e = idx / (DK / 8), d = 8 * (idx % (DK / 8));
        hd += gdn_fla_dot8(Hs + e * kLk + d, Gh + e * kLk + d);
      }
      state_term += expf(gl) * hd;
    }
    block_sync();  // h and dh' dead
    TREECP_GDN_UNROLL
    for (int j = 0; j < 2 * NPK; ++j)
      TREECP_GDN_UNROLL
      for (int hh = 0; hh < 2; ++hh)
        gdn_store_pair16(Wd + (rb * 16 + g + hh * 8) * kLk + rk0 + j * 8 + 2 * q, -w[j][2 * hh], -w[j][2 * hh + 1]);
    block_sync();  // dW complete
    // 5. dKst = Tᵀ dW = diag(β) Xᵀ dW (A = Xᵀ: k-major; k blocks i >= j): dk += γ ⊙ dKst, ⟨γ dKst, k⟩ into dG.
    gdn_fla_zero(w);
    gdn_fla_rows<true, true, NPK>(w, 0, Xs, kLc, Wd, kLk, rb * 16, rk0, rb * 16, C, lane);
    TREECP_GDN_UNROLL
    for (int j = 0; j < 2 * NPK; ++j)
      TREECP_GDN_UNROLL
      for (int hh = 0; hh < 2; ++hh) {
        const int i = rb * 16 + g + hh * 8;
        const float f = bs[i] * eGs[i];
        const float x0 = w[j][2 * hh] * f, x1 = w[j][2 * hh + 1] * f;
        dk[j][2 * hh] += x0;
        dk[j][2 * hh + 1] += x1;
        rowG[hh] += gdn_fla_dot2(Ks, kLk, i, rcol(rk0, j, 0), x0, x1);
      }
    // 6. dv = diag(β) Xᵀ dv2.
    {
      float o[2 * NPV][4];
      gdn_fla_zero(o);
      gdn_fla_rows<true, true, NPV>(o, 0, Xs, kLc, Ds, kLv, rb * 16, rv0, rb * 16, C, lane);
      const float f[2] = {bs[rb * 16 + g], bs[rb * 16 + g + 8]};
      if (a.dv) gdn_fla_add_tiles(a.dv + (cd.t * H + h) * int64_t{DV}, int64_t{H} * DV, o, rb * 16, rv0, g, q, n, f);
    }
    // 7. dT = (dW Kᵀ) diag(γ) + dv2 Vᵀ (j <= i < n): Σ_i X_ij dT_ij into dβ_j; dX = dT diag(β) into B1.
    {
      float t[4][4];
      gdn_fla_zero(t);
      lower_pairs(t, Wd, kLk, Ks, kLk, DK);
      TREECP_GDN_UNROLL
      for (int j = 0; j < 4; ++j)
        TREECP_GDN_UNROLL
        for (int e = 0; e < 4; ++e) t[j][e] *= eGs[pcol(j, e)];
      lower_pairs(t, Ds, kLv, Vs, kLv, DV);
      TREECP_GDN_UNROLL
      for (int j = 0; j < 4; ++j)
        TREECP_GDN_UNROLL
        for (int hh = 0; hh < 2; ++hh) {
          const int i = prow(2 * hh), j0 = pcol(j, 2 * hh);
          const uint32_t xw = gdn_pair16(GdnB16Mat{Xs, kLc, 1}, i, j0);
          float dx[2];
          TREECP_GDN_UNROLL
          for (int u = 0; u < 2; ++u) {
            const int e = 2 * hh + u;
            const bool ok = j0 + u <= i && i < n;
            const float x = bf16_to_float(static_cast<uint16_t>(u == 0 ? xw & 0xffffu : xw >> 16));
            colBt[2 * j + u] += ok ? x * t[j][e] : 0.f;
            dx[u] = ok ? t[j][e] * bs[j0 + u] : 0.f;
          }
          gdn_store_pair16(B1 + i * kLc + j0, dx[0], dx[1]);
        }
    }
    block_sync();  // dX complete
    // 8. M = Xᵀ dX (A = Xᵀ: k-major; X_ia is zero for i < a) into B2.
    {
      float m[4][4];
      gdn_fla_zero(m);
      gdn_fla_rows<true, true, 2>(m, 0, Xs, kLc, B1, kLc, rb * 16, pc0, rb * 16, C, lane);
      TREECP_GDN_UNROLL
      for (int j = 0; j < 4; ++j)
        TREECP_GDN_UNROLL
        for (int hh = 0; hh < 2; ++hh)
          gdn_store_pair16(B2 + (rb * 16 + g + hh * 8) * kLc + pc0 + j * 8 + 2 * q, m[j][2 * hh], m[j][2 * hh + 1]);
    }
    block_sync();  // M complete; dX dead
    // 9. dL = -M Xᵀ and K Kᵀ (j < i < n): E = dL β_i Γ into B1; dL Γ (K Kᵀ) into dβ_i; E ⊙ K Kᵀ's pair terms.
    {
      float l[4][4], s[4][4];
      gdn_fla_zero(l);
      gdn_fla_zero(s);
      lower_pairs(l, B2, kLc, Xs, kLc, C);
      lower_pairs(s, Ks, kLk, Ks, kLk, DK);
      TREECP_GDN_UNROLL
      for (int j = 0; j < 4; ++j)
        TREECP_GDN_UNROLL
        for (int hh = 0; hh < 2; ++hh) {
          const int i = prow(2 * hh), j0 = pcol(j, 2 * hh);
          float x[2];
          TREECP_GDN_UNROLL
          for (int u = 0; u < 2; ++u) {
            const int e = 2 * hh + u;
            const bool ok = j0 + u < i && i < n;
            const float dl = ok ? -l[j][e] * expf(Gs[i] - Gs[j0 + u]) : 0.f;  // dL Γ
            rowBt[hh] += dl * s[j][e];
            x[u] = dl * bs[i];
            pair_terms(j, e, x[u] * s[j][e]);
          }
          gdn_store_pair16(B1 + i * kLc + j0, x[0], x[1]);
        }
    }
    block_sync();  // E complete
    // 10. dk += E K + Eᵀ K.
    gdn_fla_rows<false, true, NPK>(dk, 0, B1, kLc, Ks, kLk, rb * 16, rk0, 0, rb * 16 + 16, lane);
    gdn_fla_rows<true, true, NPK>(dk, 0, B1, kLc, Ks, kLk, rb * 16, rk0, rb * 16, C, lane);
    if (gk) gdn_fla_add_tiles(gk, rowq, dk, rb * 16, rk0, g, q, n, one);
    // 11. The slots: rows (g, g + 8) of row block rb; row slots half * 4 + q, column slots rb * 8 + g.
    TREECP_GDN_UNROLL
    for (int hh = 0; hh < 2; ++hh) {
      const int i = rb * 16 + g + hh * 8;
      rowR[i * 8 + half * 4 + q] = rowG[hh];
      rowP[i * 8 + half * 4 + q] = rowF[hh];
      rowB[i * 8 + half * 4 + q] = rowBt[hh];
    }
    TREECP_GDN_UNROLL
    for (int j = 0; j < 4; ++j)
      TREECP_GDN_UNROLL
      for (int u = 0; u < 2; ++u) {
        const int jj = pc0 + j * 8 + 2 * q + u;
        colP[jj * 32 + rb * 8 + g] = colF[2 * j + u];
        colB[jj * 32 + rb * 8 + g] = colBt[2 * j + u];
      }
    st[tid] = state_term;
    block_sync();
    if (tid < C) {  // row tid's slots: dG_i without the state terms, and dβ_i
      float x = 0.f, y = 0.f;
      TREECP_GDN_UNROLL
      for (int s = 0; s < 8; ++s) {
        x += rowR[tid * 8 + s] + rowP[tid * 8 + s];
        y += rowB[tid * 8 + s];
      }
      TREECP_GDN_UNROLL
      for (int s = 0; s < 32; ++s) {
        x += colP[tid * 32 + s];
        y += colB[tid * 32 + s];
      }
      dGs[tid] = tid < n ? x : 0.f;
      if (a.dbeta && tid < n) gdn_fla_add1(a.dbeta + (cd.t + tid) * H + h, y);
    } else if (tid < C + 32) {  // the 256 state terms of dG_C in 32 partial sums (warp 2, idle otherwise)
      const int l = tid - C;
      float x = 0.f;
      TREECP_GDN_UNROLL
      for (int s = 0; s < kGdnThreads / 32; ++s) x += st[l * (kGdnThreads / 32) + s];
      stp[l] = x;
    }
    block_sync();
    if (tid < C / 8) {  // dG's sums over blocks of 8 rows
      float x = 0.f;
      TREECP_GDN_UNROLL
      for (int s = 0; s < 8; ++s) x += dGs[tid * 8 + s];
      blk[tid] = x;
    }
    block_sync();
    // dg_t = Σ_{i >= t} dG_i (G_i = Σ_{t <= i} g_t): the rest of t's block of 8, the blocks after it, and the state
    // terms, which belong to dG_{n-1} and so to every t < n. Rows past n hold 0.
    if (a.dg && tid < n) {
      float x = 0.f;
      TREECP_GDN_UNROLL
      for (int s = 0; s < 32; ++s) x += stp[s];
      const int b = tid / 8;
      TREECP_GDN_UNROLL
      for (int s = 0; s < 8; ++s)
        if (b * 8 + s >= tid) x += dGs[b * 8 + s];
      TREECP_GDN_UNROLL
      for (int s = 1; s < C / 8; ++s)
        if (b + s < C / 8) x += blk[b + s];
      gdn_fla_add1(a.dg + (cd.t + tid) * H + h, x);
    }
  }
};

}  // namespace treecp::cuda::detail
