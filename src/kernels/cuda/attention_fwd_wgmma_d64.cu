// wgmma forward kernel instantiated for head dim 64, bf16 and fp16 (one translation unit per head dim).
#include "kernels/cuda/attention_fwd_wgmma.cuh"

namespace treecp::cuda::detail {
void launch_fwd_wgmma_d64(const FwdArgs& a, cudaStream_t stream) {
  with_dtype(a.p.dtype, [&](auto e) { launch_fwd_wgmma<64, kFwdBarriers, kFwdLoads, decltype(e)::value>(a, stream); });
}
}  // namespace treecp::cuda::detail
