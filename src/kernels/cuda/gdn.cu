// GDN / KDA chunk kernels on the device: each body of gdn_device.cuh becomes one __global__ kernel; the
// launch sequences are gdn_device.cuh's, shared with the host emulation the CPU tests run.
#include "kernels/cuda/gdn.hpp"

#include "kernels/cuda/gdn_device.cuh"

#include <algorithm>

namespace treecp::cuda {

size_t gdn_workspace_bytes(const GdnCudaParams& p, const std::vector<GdnCudaRun>& runs, GdnCallKind kind) {
  detail::gdn_check(p, runs, false);
  return detail::GdnSchedule(p, runs, kind).bytes;
}

size_t gdn_workspace_bytes(const GdnCudaParams& p, const std::vector<GdnCudaRun>& runs, bool backward) {
  if (backward) return gdn_workspace_bytes(p, runs, GdnCallKind::backward);
  return std::max(gdn_workspace_bytes(p, runs, GdnCallKind::forward), gdn_workspace_bytes(p, runs, GdnCallKind::summary));
}

void gdn_forward(const GdnCudaParams& p, const std::vector<GdnCudaRun>& runs, cudaStream_t stream) {
  detail::GdnDeviceExec x{stream};
  detail::gdn_forward_on(x, p, runs);
}

void gdn_summary(const GdnCudaParams& p, const std::vector<GdnCudaRun>& runs, float* M, float* E,
                 cudaStream_t stream) {
  detail::GdnDeviceExec x{stream};
  detail::gdn_summary_on(x, p, runs, M, E);
}

void gdn_backward(const GdnCudaParams& p, const std::vector<GdnCudaRun>& runs, const GdnCudaGrads& grads,
                  cudaStream_t stream) {
  detail::GdnDeviceExec x{stream};
  detail::gdn_backward_on(x, p, runs, grads);
}

void gdn_compose(int64_t count, int dk, int dv, const float* MB, const float* EB, const float* MA, const float* EA,
                 float* M, float* E, cudaStream_t stream) {
  detail::GdnDeviceExec x{stream};
  detail::gdn_compose_on(x, count, dk, dv, MB, EB, MA, EA, M, E);
}

void gdn_apply(int64_t count, int dk, int dv, const float* M, const float* E, const float* s, float* out,
               cudaStream_t stream) {
  detail::GdnDeviceExec x{stream};
  detail::gdn_apply_on(x, count, dk, dv, M, E, s, out);
}

void gdn_apply_transposed(int64_t count, int dk, int dv, const float* M, const float* a, const float* ds, float* out,
                          cudaStream_t stream) {
  detail::GdnDeviceExec x{stream};
  detail::gdn_apply_transposed_on(x, count, dk, dv, M, a, ds, out);
}

}  // namespace treecp::cuda
