// kernels/: the local math of every layer kind: its contracts (shapes.hpp, slice.hpp) and their CPU
// (cpu/) and CUDA (cuda/) implementations. Knows no rows, plans or ranks.
//
// What a GDN/KDA layer needs on the GPU beside the chunk kernels (gdn.hpp): the affine summary algebra on the
// runtime's interleaved maps (runtime/backend.hpp: item = every head's M [rows][rows] then E [rows][cols]), the
// q/k L2 normalisation and the short convolution along logical predecessors. Bodies and launch sequences:
// layer_ops_device.cuh (also run by the CPU suite's emulation). Every call enqueues on `stream`, never waits for
// the host, and throws treecp::Error on bad arguments or a failed launch. Inputs are 16-bit bit patterns (bf16 or
// fp16: `dtype`, Conv1dDeviceParams::dtype); maps, states and gradients fp32; gradients are added into.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/layer_ops_types.hpp"
#include "kernels/shapes.hpp"

namespace treecp::cuda {

// Device scratch (floats) that affine_compose (for `items` items), affine_seed and affine_adjoint (items = 1) need.
int64_t affine_workspace_floats(const AffineShape& sh, int64_t items);

void affine_identity(const AffineShape& sh, float* map, cudaStream_t stream);
// later = later ∘ earlier, item by item (earlier runs first).
void affine_compose(const AffineShape& sh, int64_t items, float* later, const float* earlier, float* workspace,
                    cudaStream_t stream);
// (M, E) -> (0, M state + E); state null: (0, E).
void affine_seed(const AffineShape& sh, float* map, const float* state, float* workspace, cudaStream_t stream);
// out = (Mᵀ, a), or with g = dL/dS_out: (0, Mᵀ g + a). a, g: states [heads][rows][cols].
void affine_adjoint(const AffineShape& sh, const float* map, const float* a, const float* g, float* out,
                    float* workspace, cudaStream_t stream);
// state = E of the map.
void affine_state(const AffineShape& sh, const float* map, float* state, cudaStream_t stream);
// The map from gdn_summary's contiguous M [heads][rows][rows] and E [heads][rows][cols].
void affine_interleave(const AffineShape& sh, const float* M, const float* E, float* map, cudaStream_t stream);

// y = x / sqrt(|x|² + kL2NormEps) for `groups` vectors of `dim` (kernels/cpu/gdn.hpp); x and y of `dtype`.
void l2norm_forward(const uint16_t* x, int64_t groups, int dim, uint16_t* y, DType dtype, cudaStream_t stream);
// dx += (dy - y (y·dy)) / sqrt(|x|² + eps).
void l2norm_backward(const uint16_t* x, const float* dy, int64_t groups, int dim, float* dx, DType dtype,
                     cudaStream_t stream);

// y [out_rows][C] of p.dtype.
void conv1d_forward(const Conv1dDeviceParams& p, uint16_t* y, cudaStream_t stream);
// dx [rows][C] (halo rows included), dweight [C][width] and dbias [C] (may be null) added into.
void conv1d_backward(const Conv1dDeviceParams& p, const float* dy, float* dx, float* dweight, float* dbias,
                     cudaStream_t stream);

}  // namespace treecp::cuda
