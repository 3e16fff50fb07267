// GDN / KDA chunk kernels on the device: each body of gdn_device.cuh becomes one __global__ kernel; the
// launch sequences are gdn_device.cuh's, shared with the host emulation the CPU tests run.
#include "kernels/cuda/gdn.hpp"

#include "kernels/cuda/attention.hpp"  // check_cuda
#include "kernels/cuda/gdn_device.cuh"

namespace treecp::cuda {
namespace detail {
namespace {

template <class K>
__global__ void __launch_bounds__(kGdnThreads) gdn_kernel(const typename K::Args a) {
  extern __shared__ float gdn_smem[];
  K::run(a, blockIdx.x, static_cast<int>(threadIdx.x), static_cast<int>(blockDim.x), gdn_smem);
}

struct DeviceExec {
  cudaStream_t stream;
  template <class K>
  void launch(int64_t blocks, const typename K::Args& a) {
    require(blocks > 0 && blocks <= 0x7fffffff, K::kName, ": ", blocks, " blocks do not fit one grid");
    const size_t smem = K::smem_bytes(a);
    require(smem <= 48 * 1024, K::kName, ": ", smem, " bytes of shared memory (48 KiB at most)");
    gdn_kernel<K><<<static_cast<unsigned>(blocks), kGdnThreads, smem, stream>>>(a);
    check_cuda(cudaGetLastError(), K::kName);
  }
  // From pageable host memory: the call returns once the bytes are staged, so `src` may go right after.
  void upload(void* dst, const void* src, size_t bytes) {
    check_cuda(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream), "gdn (cuda): descriptor upload");
  }
};

}  // namespace
}  // namespace detail

size_t gdn_workspace_bytes(const GdnCudaParams& p, const std::vector<GdnCudaRun>& runs, bool backward) {
  detail::gdn_check(p, runs, false);
  return detail::GdnSchedule(p, runs, backward).bytes;
}

void gdn_forward(const GdnCudaParams& p, const std::vector<GdnCudaRun>& runs, cudaStream_t stream) {
  detail::DeviceExec x{stream};
  detail::gdn_forward_on(x, p, runs);
}

void gdn_summary(const GdnCudaParams& p, const std::vector<GdnCudaRun>& runs, float* M, float* E,
                 cudaStream_t stream) {
  detail::DeviceExec x{stream};
  detail::gdn_summary_on(x, p, runs, M, E);
}

void gdn_backward(const GdnCudaParams& p, const std::vector<GdnCudaRun>& runs, const GdnCudaGrads& grads,
                  cudaStream_t stream) {
  detail::DeviceExec x{stream};
  detail::gdn_backward_on(x, p, runs, grads);
}

void gdn_compose(int64_t count, int dk, int dv, const float* MB, const float* EB, const float* MA, const float* EA,
                 float* M, float* E, cudaStream_t stream) {
  detail::DeviceExec x{stream};
  detail::gdn_compose_on(x, count, dk, dv, MB, EB, MA, EA, M, E);
}

void gdn_apply(int64_t count, int dk, int dv, const float* M, const float* E, const float* s, float* out,
               cudaStream_t stream) {
  detail::DeviceExec x{stream};
  detail::gdn_apply_on(x, count, dk, dv, M, E, s, out);
}

void gdn_apply_transposed(int64_t count, int dk, int dv, const float* M, const float* a, const float* ds, float* out,
                          cudaStream_t stream) {
  detail::DeviceExec x{stream};
  detail::gdn_apply_transposed_on(x, count, dk, dv, M, a, ds, out);
}

}  // namespace treecp::cuda
