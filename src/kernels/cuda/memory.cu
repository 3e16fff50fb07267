#include "kernels/cuda/memory.hpp"

#include <algorithm>
#include <limits>
#include <vector>

#include "core/error.hpp"
#include "kernels/cuda/attention.hpp"
#include "kernels/cuda/elem.cuh"

namespace treecp::cuda {

// ---- the pool

DevicePool::~DevicePool() {
  for (auto& [size, ptr] : free_.drain()) cudaFree(ptr);
  for (auto& [ptr, size] : used_) cudaFree(ptr);  // a destructor cannot report; blocks still out die with it
}

void* DevicePool::allocate(size_t bytes) {
  const size_t want = block_size(bytes);
  std::lock_guard<std::mutex> lock(m_);
  void* ptr = free_.take(want);
  if (ptr == nullptr) {
    cudaError_t st = cudaMalloc(&ptr, want);
    if (st == cudaErrorMemoryAllocation && !free_.empty()) {  // give the cache back and try once more
      cudaGetLastError();
      for (auto& [s, p] : free_.drain()) {
        cudaFree(p);
        reserved_ -= s;
      }
      st = cudaMalloc(&ptr, want);
    }
    if (st != cudaSuccess) {
      cudaGetLastError();
      fail("device memory: cannot allocate ", want, " bytes (", allocated_, " in use, ", reserved_,
           " reserved by treecp): ", cudaGetErrorString(st));
    }
    reserved_ += want;
    ++mallocs_;
  }
  used_[ptr] = want;
  allocated_ += want;
  peak_ = std::max(peak_, allocated_);
  return ptr;
}

void DevicePool::deallocate(void* ptr) {
  if (ptr == nullptr) return;
  std::lock_guard<std::mutex> lock(m_);
  auto it = used_.find(ptr);
  require(it != used_.end(), "device memory: a block given back that the pool did not hand out");
  allocated_ -= it->second;
  free_.give(it->second, ptr);
  used_.erase(it);
}

void DevicePool::release_cached() {
  std::lock_guard<std::mutex> lock(m_);
  for (auto& [size, ptr] : free_.drain()) {
    check_cuda(cudaFree(ptr), "device memory: cudaFree");
    reserved_ -= size;
  }
}

size_t DevicePool::allocated_bytes() const {
  std::lock_guard<std::mutex> lock(m_);
  return allocated_;
}
size_t DevicePool::reserved_bytes() const {
  std::lock_guard<std::mutex> lock(m_);
  return reserved_;
}
size_t DevicePool::peak_allocated_bytes() const {
  std::lock_guard<std::mutex> lock(m_);
  return peak_;
}
void DevicePool::reset_peak() {
  std::lock_guard<std::mutex> lock(m_);
  peak_ = allocated_;
}
int64_t DevicePool::device_mallocs() const {
  std::lock_guard<std::mutex> lock(m_);
  return mallocs_;
}

// ---- row lists and row moves

DeviceRowList upload_row_list(DevicePool& pool, const RowSpan* spans, size_t count, cudaStream_t stream) {
  std::vector<int2> pairs;
  for (size_t i = 0; i < count; ++i) {
    require(spans[i].rows >= 0 && spans[i].src_row >= 0 && spans[i].dst_row >= 0 &&
                spans[i].src_row + spans[i].rows <= std::numeric_limits<int32_t>::max() &&
                spans[i].dst_row + spans[i].rows <= std::numeric_limits<int32_t>::max(),
            "row list: span ", i, " out of the int32 row range");
    for (int64_t r = 0; r < spans[i].rows; ++r)
      pairs.push_back(make_int2(static_cast<int>(spans[i].src_row + r), static_cast<int>(spans[i].dst_row + r)));
  }
  DeviceRowList list;
  list.rows = static_cast<int64_t>(pairs.size());
  list.pairs = static_cast<int2*>(pool.allocate(pairs.size() * sizeof(int2)));
  if (!pairs.empty())
    check_cuda(cudaMemcpyAsync(list.pairs, pairs.data(), pairs.size() * sizeof(int2), cudaMemcpyHostToDevice, stream),
               "row list: copy");
  return list;
}

namespace {

constexpr int kThreads = 256;

// One block per row (grid-stride over rows); threads stride over 16-byte chunks when aligned.
__global__ void pack_rows_kernel(const uint16_t* src, int64_t src_width, const int2* pairs, int64_t rows,
                                 uint16_t* dst, int64_t dst_width, int64_t dst_col, bool vec) {
  for (int64_t i = blockIdx.x; i < rows; i += gridDim.x) {
    const int2 p = pairs[i];
    const uint16_t* s = src + static_cast<int64_t>(p.x) * src_width;
    uint16_t* d = dst + static_cast<int64_t>(p.y) * dst_width + dst_col;
    if (vec) {
      const int64_t n = src_width / 8;
      for (int64_t j = threadIdx.x; j < n; j += blockDim.x)
        reinterpret_cast<uint4*>(d)[j] = reinterpret_cast<const uint4*>(s)[j];
    } else {
      for (int64_t j = threadIdx.x; j < src_width; j += blockDim.x) d[j] = s[j];
    }
  }
}

__global__ void add_rows_kernel(const float* src, int64_t src_width, int64_t src_col, int64_t cols, const int2* pairs,
                                int64_t rows, float* dst, bool vec) {
  for (int64_t i = blockIdx.x; i < rows; i += gridDim.x) {
    const int2 p = pairs[i];
    const float* s = src + static_cast<int64_t>(p.x) * src_width + src_col;
    float* d = dst + static_cast<int64_t>(p.y) * cols;
    // Atomic: a row sent to several peers comes back from each of them, so two blocks may add into one row.
    if (vec) {
      for (int64_t j = threadIdx.x; j < cols / 4; j += blockDim.x) {
        const float4 a = reinterpret_cast<const float4*>(s)[j];
#if __CUDA_ARCH__ >= 900
        atomicAdd(reinterpret_cast<float4*>(d) + j, a);
#else
        atomicAdd(d + 4 * j, a.x), atomicAdd(d + 4 * j + 1, a.y), atomicAdd(d + 4 * j + 2, a.z),
            atomicAdd(d + 4 * j + 3, a.w);
#endif
      }
    } else {
      for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) atomicAdd(d + j, s[j]);
    }
  }
}

template <DType E>
__global__ void f32_to_elem_kernel(const float* src, detail::elem_t<E>* dst, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    dst[i] = detail::Elem<E>::from_float(src[i]);
}
template <DType E>
__global__ void elem_to_f32_kernel(const detail::elem_t<E>* src, float* dst, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    dst[i] = detail::Elem<E>::to_float(src[i]);
}

__device__ __forceinline__ uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

// core/random.hpp's uniform_at, then round to nearest even (to_bf16 / to_f16 in runtime/cuda_backend.cpp).
template <DType E>
__global__ void fill_uniform_kernel(detail::elem_t<E>* dst, int64_t n, uint64_t seed_mix, uint64_t first) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const uint64_t bits = splitmix64(seed_mix ^ ((first + static_cast<uint64_t>(i)) * 0xD1B54A32D192ED03ULL));
    const double u = static_cast<double>(bits >> 11) * 0x1.0p-52 - 1.0;
    dst[i] = detail::Elem<E>::from_float(static_cast<float>(u));
  }
}

unsigned grid_for(int64_t rows) { return static_cast<unsigned>(std::clamp<int64_t>(rows, 1, 65535)); }
bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

void pack_rows_b16(const uint16_t* src, int64_t src_width, const DeviceRowList& list, uint16_t* dst,
                    int64_t dst_width, int64_t dst_col, cudaStream_t stream) {
  if (list.rows == 0 || src_width == 0) return;
  const bool vec = aligned16(src) && aligned16(dst) && src_width % 8 == 0 && dst_width % 8 == 0 && dst_col % 8 == 0;
  pack_rows_kernel<<<grid_for(list.rows), kThreads, 0, stream>>>(src, src_width, list.pairs, list.rows, dst, dst_width,
                                                                  dst_col, vec);
  check_cuda(cudaGetLastError(), "pack_rows: launch");
}

void add_rows_f32(const float* src, int64_t src_width, int64_t src_col, int64_t cols, const DeviceRowList& list,
                  float* dst, cudaStream_t stream) {
  if (list.rows == 0 || cols == 0) return;
  const bool vec = aligned16(src) && aligned16(dst) && src_width % 4 == 0 && src_col % 4 == 0 && cols % 4 == 0;
  add_rows_kernel<<<grid_for(list.rows), kThreads, 0, stream>>>(src, src_width, src_col, cols, list.pairs, list.rows,
                                                                 dst, vec);
  check_cuda(cudaGetLastError(), "add_rows: launch");
}

void f32_to_elem(const float* src, uint16_t* dst, int64_t n, cudaStream_t stream, DType dtype) {
  if (n == 0) return;
  with_dtype(dtype, [&](auto e) {
    constexpr DType E = decltype(e)::value;
    f32_to_elem_kernel<E><<<grid_for((n + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
        src, reinterpret_cast<detail::elem_t<E>*>(dst), n);
  });
  check_cuda(cudaGetLastError(), "f32_to_elem: launch");
}
void elem_to_f32(const uint16_t* src, float* dst, int64_t n, cudaStream_t stream, DType dtype) {
  if (n == 0) return;
  with_dtype(dtype, [&](auto e) {
    constexpr DType E = decltype(e)::value;
    elem_to_f32_kernel<E><<<grid_for((n + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
        reinterpret_cast<const detail::elem_t<E>*>(src), dst, n);
  });
  check_cuda(cudaGetLastError(), "elem_to_f32: launch");
}

void fill_uniform(uint16_t* dst, int64_t n, uint64_t seed, uint64_t first, cudaStream_t stream, DType dtype) {
  if (n == 0) return;
  // splitmix64(seed) on the host: the same function, so the device applies only the index part
  uint64_t x = seed + 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  x ^= x >> 31;
  with_dtype(dtype, [&](auto e) {
    constexpr DType E = decltype(e)::value;
    fill_uniform_kernel<E><<<grid_for((n + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
        reinterpret_cast<detail::elem_t<E>*>(dst), n, x, first);
  });
  check_cuda(cudaGetLastError(), "fill_uniform: launch");
}

}  // namespace treecp::cuda
