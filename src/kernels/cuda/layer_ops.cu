// The GDN/KDA layer's small kernels on the device: layer_ops_device.cuh's launch sequences on gdn_device.cuh's
// device executor (each body one __global__ kernel, 256 threads a block).
#include "kernels/cuda/layer_ops.hpp"

#include "kernels/cuda/layer_ops_device.cuh"

namespace treecp::cuda {

int64_t affine_workspace_floats(const AffineShape& sh, int64_t items) { return detail::affine_workspace_floats(sh, items); }

void affine_identity(const AffineShape& sh, float* map, cudaStream_t stream) {
  detail::GdnDeviceExec x{stream};
  detail::affine_identity_on(x, sh, map);
}

void affine_compose(const AffineShape& sh, int64_t items, float* later, const float* earlier, float* workspace,
                    cudaStream_t stream) {
  detail::GdnDeviceExec x{stream};
  detail::affine_compose_on(x, sh, items, later, earlier, workspace);
}

void affine_seed(const AffineShape& sh, float* map, const float* state, float* workspace, cudaStream_t stream) {
  detail::GdnDeviceExec x{stream};
  detail::affine_seed_on(x, sh, map, state, workspace);
}

void affine_adjoint(const AffineShape& sh, const float* map, const float* a, const float* g, float* out,
                    float* workspace, cudaStream_t stream) {
  detail::GdnDeviceExec x{stream};
  detail::affine_adjoint_on(x, sh, map, a, g, out, workspace);
}

void affine_state(const AffineShape& sh, const float* map, float* state, cudaStream_t stream) {
  detail::GdnDeviceExec x{stream};
  detail::affine_state_on(x, sh, map, state);
}

void affine_interleave(const AffineShape& sh, const float* M, const float* E, float* map, cudaStream_t stream) {
  detail::GdnDeviceExec x{stream};
  detail::affine_interleave_on(x, sh, M, E, map);
}

void l2norm_forward(const uint16_t* x, int64_t groups, int dim, uint16_t* y, DType dtype, cudaStream_t stream) {
  detail::GdnDeviceExec ex{stream};
  detail::l2norm_on(ex, detail::l2norm_args(x, nullptr, y, nullptr, groups, dim), dtype);
}

void l2norm_backward(const uint16_t* x, const float* dy, int64_t groups, int dim, float* dx, DType dtype,
                     cudaStream_t stream) {
  detail::GdnDeviceExec ex{stream};
  detail::l2norm_on(ex, detail::l2norm_args(x, dy, nullptr, dx, groups, dim), dtype);
}

void conv1d_forward(const Conv1dDeviceParams& p, uint16_t* y, cudaStream_t stream) {
  detail::GdnDeviceExec ex{stream};
  detail::conv1d_on(ex, detail::conv_args(p, y, nullptr, nullptr, nullptr, nullptr), p.dtype);
}

void conv1d_backward(const Conv1dDeviceParams& p, const float* dy, float* dx, float* dweight, float* dbias,
                     cudaStream_t stream) {
  detail::GdnDeviceExec ex{stream};
  detail::conv1d_on(ex, detail::conv_args(p, nullptr, dy, dx, dweight, dbias), p.dtype);
}

}  // namespace treecp::cuda
