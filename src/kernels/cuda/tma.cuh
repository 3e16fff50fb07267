// Hopper building blocks of the warp-specialised kernels (attention_fwd_ws.cu, attention_bwd_ws.cu):
// mbarriers with transaction counts, setmaxnreg, 3-D TMA tile loads, the register-A S GEMM, and the host
// side of TMA (the driver's tensor-map encoder through the runtime, so nothing links libcuda).
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>

#include <cstdint>

#include "core/error.hpp"
#include "kernels/cuda/launch.hpp"

namespace treecp::cuda::detail {

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
// Makes mbarrier initialisation visible to the async proxy (TMA) before the block barrier that follows.
__device__ __forceinline__ void mbar_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
// Barrier `id` (1..15; 0 is __syncthreads) over `count` threads, whole warps.
__device__ __forceinline__ void named_barrier_sync(int id, int count) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}

// S += A B with A in registers and B K-major in shared memory; accumulate = false overwrites S.
template <DType E = DType::kBf16>
__device__ __forceinline__ void wgmma_rs_m64n64k16_kmajor(float (&d)[32], const uint32_t (&a)[4], uint64_t desc_b,
                                                          bool accumulate) {
#define TREECP_WGMMA(TYPE) \
  asm volatile( \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n" \
      "wgmma.mma_async.sync.aligned.m64n64k16.f32." TYPE "." TYPE " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n" \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]) \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(static_cast<int>(accumulate)))
  if constexpr (E == DType::kF16) TREECP_WGMMA("f16");
  else TREECP_WGMMA("bf16");
#undef TREECP_WGMMA
}

// The box at coordinates (c0 = column, c1 = head, c2 = row) of a 3-D tensor map into shared memory at dst;
// completion counts its bytes on the mbarrier.
__device__ __forceinline__ void tma_load_3d(uint32_t dst, const CUtensorMap* map, int c0, int c1, int c2, uint32_t mbar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(mbar)
      : "memory");
}

// Adds the shared-memory box src into the box at (c0, c1, c2) of a 3-D fp32 tensor map (elements past the
// tensor's bounds are skipped), as one bulk group of this thread.
__device__ __forceinline__ void tma_reduce_add_3d(const CUtensorMap* map, int c0, int c1, int c2, uint32_t src) {
  asm volatile(
      "cp.reduce.async.bulk.tensor.3d.global.shared::cta.add.tile.bulk_group [%0, {%1, %2, %3}], [%4];\n" ::"l"(
          reinterpret_cast<uint64_t>(map)),
      "r"(c0), "r"(c1), "r"(c2), "r"(src)
      : "memory");
}
// Stores the shared-memory box src into the box at (c0, c1, c2) of a 3-D tensor map (elements past the tensor's
// bounds are skipped), as one bulk group of this thread.
__device__ __forceinline__ void tma_store_3d(const CUtensorMap* map, int c0, int c1, int c2, uint32_t src) {
  asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.tile.bulk_group [%0, {%1, %2, %3}], [%4];\n" ::"l"(
                   reinterpret_cast<uint64_t>(map)),
               "r"(c0), "r"(c1), "r"(c2), "r"(src)
               : "memory");
}
__device__ __forceinline__ void bulk_commit_group() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// Waits until this thread's bulk groups have read their shared-memory sources (the buffer may be reused).
__device__ __forceinline__ void bulk_wait_group_read0() {
  asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
}
// Waits until this thread's bulk groups have completed, their global writes included.
__device__ __forceinline__ void bulk_wait_group0() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }

// The driver's tensor-map encoder, looked up once through the runtime (no libcuda link); nullptr when
// the driver does not provide it, and the default paths then take the cp.async kernels.
inline PFN_cuTensorMapEncodeTiled_v12000 encode_tiled() {
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

// [rows, heads, 128] with element strides, elements of elem_bytes (bf16, fp16 or fp32); box = box_cols columns x
// box_heads x box_rows with the 128-byte swizzle (box_cols x elem_bytes = 128: the panel layout of wgmma.cuh
// for 16-bit elements). `who` names the caller in the error.
inline CUtensorMap tensor_map_3d(const char* who, CUtensorMapDataType type, int elem_bytes, const void* ptr, int64_t rows,
                                 int64_t heads, int64_t row_stride, int64_t head_stride, uint32_t box_cols,
                                 uint32_t box_heads, uint32_t box_rows) {
  CUtensorMap m;
  cuuint64_t dims[3] = {128u, static_cast<cuuint64_t>(heads), static_cast<cuuint64_t>(rows)};
  cuuint64_t strides[2] = {static_cast<cuuint64_t>(head_stride * elem_bytes), static_cast<cuuint64_t>(row_stride * elem_bytes)};
  cuuint32_t box[3] = {box_cols, box_heads, box_rows};
  cuuint32_t elem[3] = {1, 1, 1};
  const CUresult r = encode_tiled()(&m, type, 3, const_cast<void*>(ptr), dims, strides, box, elem,
                                    CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                    CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  // The encoder's limits: a 16-byte aligned base, strides multiples of 16 bytes, every dimension >= 1.
  require(r == CUDA_SUCCESS, who, ": cuTensorMapEncodeTiled failed with ", static_cast<int>(r), " on [", rows, " rows, ",
          heads, " heads, 128] at ", ptr, " (", reinterpret_cast<uintptr_t>(ptr) % 16, " bytes past 16-byte alignment), strides ",
          row_stride, " / ", head_stride, " elements of ", elem_bytes, " bytes, box ", box_cols, " x ", box_heads, " x ",
          box_rows);
  return m;
}
// A [rows, heads, 128] tensor of bf16 or fp16 elements in 64-column boxes (wgmma.cuh's panels).
inline CUtensorMap tensor_map_d128(const char* who, DType dtype, const void* ptr, int64_t rows, int64_t heads,
                                   int64_t row_stride, int64_t head_stride, uint32_t box_heads, uint32_t box_rows) {
  return tensor_map_3d(who, dtype == DType::kF16 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2,
                       ptr, rows, heads, row_stride, head_stride, 64, box_heads, box_rows);
}

}  // namespace treecp::cuda::detail
