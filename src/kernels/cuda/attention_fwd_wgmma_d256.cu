// wgmma forward kernel instantiated for (Dqk, Dv) = (256, 256), bf16 and fp16: one block per SM (193 KiB of shared
// memory), O += P V as two m64n128k16 per k step (fwd_issue_pv).
#include "kernels/cuda/attention_fwd_wgmma.cuh"

namespace treecp::cuda::detail {
void launch_fwd_wgmma_d256(const FwdArgs& a, cudaStream_t stream) {
  with_dtype(a.p.dtype, [&](auto e) {
    launch_fwd_wgmma<256, kFwdBarriers, kFwdLoads, decltype(e)::value, 256>(a, stream);
  });
}
}  // namespace treecp::cuda::detail
