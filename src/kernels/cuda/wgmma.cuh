// Hopper warpgroup MMA (wgmma, sm_90a) building blocks for the forward kernel: shared-memory matrix
// descriptors for the 128-byte swizzled layout, the fence / commit / wait protocol, and the three
// instruction shapes the kernel issues (PTX ISA "Asynchronous Warpgroup Level Matrix Multiply").
//
// Shared-memory layout ("panels"): a tile of R rows x C 16-bit columns is stored as C/64 panels of
// R rows x 64 columns (128 bytes a row); 16-byte chunk c of row r sits at chunk c ^ (r % 8) of its row.
// With each panel 1024-byte aligned this is exactly the hardware's 128-byte swizzle (address bits
// 4..6 XOR bits 7..9), so one layout serves the cp.async stores and the wgmma reads.
//
// Accumulator layout of m64nNk16 (fp32): warp w of the warpgroup holds rows 16 w .. 16 w + 15; its
// register 4 j + c is (row lane/4 + 8 (c/2), column 8 j + 2 (lane%4) + c%2), i.e. the mma.sync C
// fragments of mma.cuh side by side. The register A operand (bf16 or fp16, m64k16) is the mma.sync A fragment
// of the warp's 16 rows, so P goes from accumulators to A operands by packing pairs, as in mma.cuh.
#pragma once

#include <cstdint>

#include "kernels/cuda/mma.cuh"

namespace treecp::cuda::detail {

// Element offset of (row, col) in a panel tile of `rows` rows.
__device__ __forceinline__ uint32_t swz_panel(int row, int col, int rows) {
  return static_cast<uint32_t>((col >> 6) * rows * 64 + row * 64 + ((((col >> 3) & 7) ^ (row & 7)) << 3) + (col & 7));
}

// Matrix descriptor (64-bit): start address >> 4 in bits 0-13, leading byte offset >> 4 in 16-29,
// stride byte offset >> 4 in 32-45, base offset 0 (atoms are 1024-byte aligned), layout type in
// 62-63 with 1 = 128-byte swizzle.
//  K-major operand (rows x 64-column panel, reduction along the row): SBO = 1024 bytes between groups of
//    8 rows; LBO unused (a k16 step stays inside one 128-byte row). Step k16 = +32 bytes, next panel =
//    +rows * 128 bytes.
//  MN-major operand (B = V: rows are the reduction index, columns the output index): SBO = 1024 bytes
//    between groups of 8 reduction rows, LBO = rows * 128 bytes between 64-column panels.
__device__ __forceinline__ uint64_t wgmma_desc(uint32_t smem_byte_addr, uint32_t lbo_bytes, uint32_t sbo_bytes) {
  return static_cast<uint64_t>((smem_byte_addr & 0x3FFFF) >> 4) |
         (static_cast<uint64_t>((lbo_bytes & 0x3FFFF) >> 4) << 16) |
         (static_cast<uint64_t>((sbo_bytes & 0x3FFFF) >> 4) << 32) | (1ull << 62);
}

// The same descriptor from a start address already shifted (addr >> 4) and compile-time LBO / SBO: the
// high word (SBO, 128-byte swizzle) is an immediate and a k step or a stage is one add to addr16, so
// the main loops spend no instructions rebuilding descriptors between wgmmas. addr16 < 2^14 (shared
// memory is below 256 KiB), so OR-ing the LBO field above it cannot carry.
template <uint32_t kLbo, uint32_t kSbo>
__device__ __forceinline__ uint64_t wgmma_desc16(uint32_t addr16) {
  uint64_t d;
  asm("mov.b64 %0, {%1, %2};\n" : "=l"(d) : "r"(addr16 | ((kLbo >> 4) << 16)), "n"(((kSbo >> 4) & 0x3FFF) | (1u << 30)));
  return d;
}

// Orders this warpgroup's register writes before the next wgmma reads them (accumulators, A operands).
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Ties accumulator registers to the preceding wait: without it the compiler may read them between the
// asynchronous wgmma and its wait (it sees no dependency through the wait's asm).
template <int N>
__device__ __forceinline__ void wgmma_fence_operands(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
// The same for register A operands, which the asynchronous wgmma reads until its wait.
template <int N>
__device__ __forceinline__ void wgmma_fence_operands(uint32_t (&a)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; ++i)
#pragma unroll
    for (int c = 0; c < 4; ++c) asm volatile("" : "+r"(a[i][c])::"memory");
}
// Generic-proxy writes to shared memory (cp.async, st.shared) become visible to wgmma's async proxy.
__device__ __forceinline__ void fence_proxy_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// Copies `rows` rows of D 16-bit elements into a panel tile (rows x D), 16 bytes per thread per step.
template <int D, int kThreads, class T, class RowPtr>
__device__ __forceinline__ void load_panel_async(T* tile, int rows, const T* base, RowPtr src_row) {
  static_assert(sizeof(T) == 2, "16-bit elements");
  constexpr int kChunks = D / 8;
  for (int i = threadIdx.x; i < rows * kChunks; i += kThreads) {
    const int r = i / kChunks, c = i % kChunks;
    const T* src = src_row(r);
    cp_async_16(tile + swz_panel(r, c * 8, rows), src ? src + c * 8 : base, src != nullptr);
  }
}

// The instructions below take bf16 or fp16 operands (E: their PTX type, "bf16" or "f16"), fp32 accumulators.
// D += A B, both from shared memory; kTransA / kTransB = true: that operand is MN-major (its rows are
// the reduction index), false: K-major. accumulate = false: D = A B (D's old values are not read, so a
// first k step needs no zeroed accumulator: no register moves between a wgmma fence and the GEMM).
template <bool kTransA, bool kTransB, DType E = DType::kBf16>
__device__ __forceinline__ void wgmma_ss_m64n64k16(float (&d)[32], uint64_t desc_a, uint64_t desc_b,
                                                   bool accumulate = true) {
#define TREECP_WGMMA(TYPE) \
  asm volatile( \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %36, 0;\n" \
      "wgmma.mma_async.sync.aligned.m64n64k16.f32." TYPE "." TYPE " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, %34, %35;\n}\n" \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]) \
      : "l"(desc_a), "l"(desc_b), "n"(kTransA ? 1 : 0), "n"(kTransB ? 1 : 0), "r"(static_cast<int>(accumulate)))
  if constexpr (E == DType::kF16) TREECP_WGMMA("f16");
  else TREECP_WGMMA("bf16");
#undef TREECP_WGMMA
}

// D += A B with A in registers; kTransB = true: B is MN-major (rows of B are the reduction index).
template <bool kTransB, DType E = DType::kBf16>
__device__ __forceinline__ void wgmma_rs_m64n64k16(float (&d)[32], const uint32_t (&a)[4], uint64_t desc_b) {
#define TREECP_WGMMA(TYPE) \
  asm volatile( \
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n" \
      "wgmma.mma_async.sync.aligned.m64n64k16.f32." TYPE "." TYPE " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, %37;\n}\n" \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]) \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "n"(kTransB ? 1 : 0))
  if constexpr (E == DType::kF16) TREECP_WGMMA("f16");
  else TREECP_WGMMA("bf16");
#undef TREECP_WGMMA
}

template <bool kTransB, DType E = DType::kBf16>
__device__ __forceinline__ void wgmma_rs_m64n128k16(float (&d)[64], const uint32_t (&a)[4], uint64_t desc_b) {
#define TREECP_WGMMA(TYPE) \
  asm volatile( \
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n" \
      "wgmma.mma_async.sync.aligned.m64n128k16.f32." TYPE "." TYPE " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, %69;\n}\n" \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]) \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "n"(kTransB ? 1 : 0))
  if constexpr (E == DType::kF16) TREECP_WGMMA("f16");
  else TREECP_WGMMA("bf16");
#undef TREECP_WGMMA
}


// O += P V for a head dim of 64 or 128 (one wgmma of N = D).
template <int D, DType E = DType::kBf16>
__device__ __forceinline__ void wgmma_rs_trans_b(float (&d)[D / 2], const uint32_t (&a)[4], uint64_t desc_b) {
  if constexpr (D == 64) wgmma_rs_m64n64k16<true, E>(d, a, desc_b);
  else wgmma_rs_m64n128k16<true, E>(d, a, desc_b);
}

}  // namespace treecp::cuda::detail
