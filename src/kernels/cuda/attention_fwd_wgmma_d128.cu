// wgmma forward kernel instantiated for head dim 128 (one translation unit per instantiation).
#include "kernels/cuda/attention_fwd_wgmma.cuh"

namespace treecp::cuda::detail {
void launch_fwd_wgmma_d128(const FwdArgs& a, cudaStream_t stream) { launch_fwd_wgmma<128>(a, stream); }
}  // namespace treecp::cuda::detail
