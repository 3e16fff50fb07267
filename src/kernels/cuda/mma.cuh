// Warp-level building blocks shared by the attention kernels: cp.async tile loads into a swizzled
// shared-memory layout, ldmatrix fragment loads, the m16n8k16 tensor-core MMA on bf16 or fp16 operands (DType), and
// the slice visibility test. Fragment layouts follow the PTX ISA "mma.m16n8k16" figures (the same for both types):
//   C/D (16x8 fp32): c0,c1 at (row lane/4, col 2*(lane%4)+{0,1}); c2,c3 at row + 8.
//   A (16x16 16-bit): a0a1 (r, k), a2a3 (r+8, k), a4a5 (r, k+8), a6a7 (r+8, k+8), r = lane/4, k = 2*(lane%4).
//   B (16x8 16-bit):  b0b1 (k, n), b2b3 (k+8, n), k = 2*(lane%4), n = lane/4.
#pragma once

#include <cstdint>

#include "kernels/cuda/attention.hpp"
#include "kernels/cuda/elem.cuh"
#include "kernels/cuda/visibility.hpp"

namespace treecp::cuda::detail {

// Shared-memory tiles are rows of `kCols` 16-bit elements cut into 16-byte chunks; chunk c of row r is stored at
// chunk c ^ (r % 8), so the 8 rows an ldmatrix phase reads fall in 8 different bank groups.
template <int kCols>
__device__ __forceinline__ uint32_t swz(int row, int col) {
  static_assert(kCols % 64 == 0, "rows must hold a multiple of 8 chunks");
  return static_cast<uint32_t>(row * kCols + ((((col >> 3) ^ (row & 7))) << 3) + (col & 7));
}

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// The kernel's dynamic shared memory from its first 1024-byte boundary (the 128-byte swizzle's atom); the launches
// that use it allocate 1024 bytes more than their layout.
__device__ __forceinline__ unsigned char* dynamic_smem_1024() {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  const uint32_t raw_addr = smem_addr(smem_raw);
  return smem_raw + (((raw_addr + 1023) & ~1023u) - raw_addr);
}

// 16-byte global->shared copy; src_bytes = 0 writes zeros (rows past the buffer).
__device__ __forceinline__ void cp_async_16(void* dst, const void* src, bool valid) {
  const int n = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src), "r"(n));
}
__device__ __forceinline__ void cp_async_4(void* dst, const void* src, bool valid) {
  const int n = valid ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_addr(dst)), "l"(src), "r"(n));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// D = A * B + D, bf16 or fp16 inputs, fp32 accumulators.
template <DType E = DType::kBf16>
__device__ __forceinline__ void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#define TREECP_MMA_M16N8K16(TYPE)                                                                       \
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." TYPE "." TYPE                                   \
               ".f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"                          \
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])                                         \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1))
  if constexpr (E == DType::kF16) TREECP_MMA_M16N8K16("f16");
  else TREECP_MMA_M16N8K16("bf16");
#undef TREECP_MMA_M16N8K16
}


// Fire-and-forget fp32 add of two adjacent floats (sm_90 vector reduction; 8-byte aligned).
__device__ __forceinline__ void red_add_f32x2(float* dst, float a, float b) {
  asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(dst), "f"(a), "f"(b) : "memory");
}
// The same under a predicate, without a branch: ptxas serialises every wgmma of a kernel when a divergent
// branch sits between a wgmma and its wait (warning C7518).
__device__ __forceinline__ void red_add_f32x2_if(bool pred, float* dst, float a, float b) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %3, 0;\n@p red.global.add.v2.f32 [%0], {%1, %2};\n}\n" ::"l"(dst),
               "f"(a), "f"(b), "r"(static_cast<int>(pred))
               : "memory");
}

// Copies `rows` rows of kCols 16-bit elements from global (row r at src_row(r), nullptr = zeros) into a swizzled
// tile, 16 bytes per thread per step. `base` is any valid global address (unread, for zero rows).
template <int kCols, int kThreads, class T, class RowPtr>
__device__ __forceinline__ void load_tile_async(T* tile, int rows, const T* base, RowPtr src_row) {
  static_assert(sizeof(T) == 2, "16-bit elements");
  constexpr int kChunks = kCols / 8;
  for (int i = threadIdx.x; i < rows * kChunks; i += kThreads) {
    const int r = i / kChunks, c = i % kChunks;
    const T* src = src_row(r);
    cp_async_16(tile + swz<kCols>(r, c * 8), src ? src + c * 8 : base, src != nullptr);
  }
}

// lo <= x < hi in one unsigned compare (wrap-around arithmetic, so no signed overflow). The
// visibility test of a slice is in_range(q, q0, q1) && in_range(k, k0, k1) && in_range(q - k, dmin, dmax);
// the kernels hoist the row and column parts out of their element loops.
__device__ __forceinline__ bool in_range(int x, int lo, int hi) {
  return static_cast<unsigned>(x) - static_cast<unsigned>(lo) < static_cast<unsigned>(hi) - static_cast<unsigned>(lo);
}

// 2^x on the special-function unit (ex2.approx.ftz: about 2 ulp, 2^-inf = 0); exp2f adds range fix-ups
// the softmax does not need.
__device__ __forceinline__ float exp2_fast(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ DeviceSlice load_slice(const DeviceSlice* p) {
  const int4* v = reinterpret_cast<const int4*>(p);
  const int4 a = __ldg(v), b = __ldg(v + 1);
  return DeviceSlice{a.x, a.y, a.z, a.w, b.x, b.y, 0, 0};
}

// Walks the tiles of a run-length tile list: entry index and the tile inside that entry's run.
struct RunCursor {
  int entry, tile;
  static __device__ __forceinline__ RunCursor first(const TileEntry* e, int begin, int end) {
    return RunCursor{begin, begin < end ? e[begin].tile_begin : 0};
  }
  __device__ __forceinline__ RunCursor next(const TileEntry* e, int end) const {
    if (tile + 1 < e[entry].tile_end) return RunCursor{entry, tile + 1};
    return RunCursor{entry + 1, entry + 1 < end ? e[entry + 1].tile_begin : 0};
  }
};

// The same walk in either direction (reverse: last tile first). more() is false once the walk
// has left [begin, end); `stop` is the entry index one step past the last one walked, so while more() holds
// the walk is reversed exactly when entry > stop (no register for the direction: the producer warps run at 24).
struct TileWalk {
  int entry, tile, stop;
  static __device__ __forceinline__ TileWalk first(const TileEntry* e, int begin, int end, bool reverse) {
    if (!reverse) {
      const RunCursor c = RunCursor::first(e, begin, end);
      return TileWalk{c.entry, c.tile, end};
    }
    return TileWalk{end - 1, begin < end ? e[end - 1].tile_end - 1 : 0, begin - 1};
  }
  __device__ __forceinline__ bool more() const { return entry != stop; }
  __device__ __forceinline__ void advance(const TileEntry* e) {
    if (entry < stop) {  // RunCursor's step
      const RunCursor c = RunCursor{entry, tile}.next(e, stop);
      entry = c.entry;
      tile = c.tile;
    } else {
      if (--tile >= e[entry].tile_begin) return;
      if (--entry != stop) tile = e[entry].tile_end - 1;
    }
  }
};

// Pulls a major tile's run entries [begin, end) into L1 (warp 0, one 128-byte line per lane and step), so
// RunCursor::next at a run boundary and the per-step entry reads hit L1 instead of waiting on L2; the
// kernels' K/V and Q/dO copies bypass L1, so the lines stay.
__device__ __forceinline__ void prefetch_entries_l1(const TileEntry* e, int begin, int end) {
  if (threadIdx.x >= 32) return;
  for (int i = begin + static_cast<int>(threadIdx.x) * 8; i < end; i += 32 * 8)
    asm volatile("prefetch.global.L1 [%0];\n" ::"l"(e + i));
}

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

}  // namespace treecp::cuda::detail
