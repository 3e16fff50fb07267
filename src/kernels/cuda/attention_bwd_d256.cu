// Backward kernel instantiated for (Dqk, Dv) = (256, 256), bf16 and fp16: one Q / dO stage (BwdShape::kQStages; two
// would need 289 KiB of shared memory), dK and dV of 16 x 256 per warp (spilled in part past 255 registers).
#include "kernels/cuda/attention_bwd.cuh"

namespace treecp::cuda::detail {
void launch_bwd_d256(const BwdArgs& a, cudaStream_t stream) {
  with_dtype(a.p.dtype, [&](auto e) { launch_bwd<256, true, decltype(e)::value, 256>(a, stream); });
}
}  // namespace treecp::cuda::detail
