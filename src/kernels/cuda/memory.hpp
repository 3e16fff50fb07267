// kernels/: the local math of every layer kind: its contracts (shapes.hpp, slice.hpp) and their CPU
// (cpu/) and CUDA (cuda/) implementations. Knows no rows, plans or ranks.
//
// Device memory for the runtime: a caching pool (cudaMalloc only while the pool grows; a step that
// repeats the previous step's sizes allocates nothing) and the row-move kernels the CP protocol needs
// (pack rows into a send buffer, add returned rows into an accumulator, bf16 or fp16 <-> fp32).
//
// The pool is stream-ordered for ONE stream, the way the runtime uses it: a block given back is handed out
// again to work enqueued later on that stream, which runs after the block's last use. Work on another
// stream (communication) must be ordered by events before such reuse (runtime/backend.hpp "Ordering").
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>

#include "kernels/cuda/block_cache.hpp"
#include "kernels/cuda/dtype.hpp"

namespace treecp::cuda {

class DevicePool {
 public:
  DevicePool() = default;
  ~DevicePool();
  DevicePool(const DevicePool&) = delete;
  DevicePool& operator=(const DevicePool&) = delete;

  // 256-byte aligned, at least `bytes` (0 gives a valid unique pointer). Throws treecp::Error when the
  // device is out of memory, with the request and what the pool holds.
  void* allocate(size_t bytes);
  void deallocate(void* ptr);
  // Returns every cached (free) block to the driver.
  void release_cached();

  size_t allocated_bytes() const;  // handed out now (block sizes)
  size_t reserved_bytes() const;   // obtained from cudaMalloc and not returned
  size_t peak_allocated_bytes() const;
  void reset_peak();
  int64_t device_mallocs() const;  // cudaMalloc calls so far (the steady state adds none)

  // Block size for a request: its size class (block_cache.hpp: at most 1/16 over the request, and a block
  // serves only its own class).
  static size_t block_size(size_t bytes) { return BlockCache::size_class(bytes); }

 private:
  mutable std::mutex m_;
  BlockCache free_;                    // cached blocks
  std::map<void*, size_t> used_;       // handed-out blocks
  size_t allocated_ = 0, reserved_ = 0, peak_ = 0;
  int64_t mallocs_ = 0;
};

// A row move: rows [src_row, src_row + rows) -> [dst_row, dst_row + rows), as the runtime lists them.
struct RowSpan {
  int64_t src_row, dst_row, rows;
};

// Row lists in device memory, expanded to one (src_row, dst_row) pair per row so that a kernel thread
// block finds its row without a search.
struct DeviceRowList {
  int2* pairs = nullptr;  // from the pool
  int64_t rows = 0;
};
// Builds the pairs on the host and copies them on `stream` (from pageable memory: no host wait).
DeviceRowList upload_row_list(DevicePool& pool, const RowSpan* spans, size_t count, cudaStream_t stream);

// dst[dst_row][dst_col, dst_col + src_width) = src[src_row][0, src_width), 16-bit elements (bf16 or fp16: a bit
// copy), for every pair. Widths and dst_col in elements; both rows 16-byte aligned (multiples of 8 elements) unless
// small.
void pack_rows_b16(const uint16_t* src, int64_t src_width, const DeviceRowList& list, uint16_t* dst,
                    int64_t dst_width, int64_t dst_col, cudaStream_t stream);
// dst[dst_row][0, cols) += src[src_row][src_col, src_col + cols), fp32, for every pair; pairs may share a dst
// row (a row sent to several peers returns from each): the adds are atomic.
void add_rows_f32(const float* src, int64_t src_width, int64_t src_col, int64_t cols, const DeviceRowList& list,
                  float* dst, cudaStream_t stream);
// Element-wise conversions (n elements) between fp32 and bf16 or fp16 (round to nearest even).
void f32_to_elem(const float* src, uint16_t* dst, int64_t n, cudaStream_t stream, DType dtype = DType::kBf16);
void elem_to_f32(const uint16_t* src, float* dst, int64_t n, cudaStream_t stream, DType dtype = DType::kBf16);

}  // namespace treecp::cuda

namespace treecp::cuda {
// dst[i] = uniform_at(seed, first + i) (core/random.hpp, the same bits as on the host) rounded to bf16 or fp16, n
// elements: inputs for runs and benchmarks made on the device, shard by shard.
void fill_uniform(uint16_t* dst, int64_t n, uint64_t seed, uint64_t first, cudaStream_t stream,
                  DType dtype = DType::kBf16);
}  // namespace treecp::cuda
