// wgmma backward kernel instantiated for head dim 64, bf16 and fp16 (each warpgroup's dQ over its own keys:
// attention_bwd_wgmma.cuh). Selected by Mainloop::kWgmma only until it is measured against mma.sync (docs/kernels.md).
#include "kernels/cuda/attention_bwd_wgmma.cuh"

namespace treecp::cuda::detail {
void launch_bwd_wgmma_d64(const BwdArgs& a, cudaStream_t stream) {
  with_dtype(a.p.dtype, [&](auto e) { launch_bwd_wgmma<64, true, kBwdOverlap, kBwdLoads, decltype(e)::value>(a, stream); });
}
}  // namespace treecp::cuda::detail
