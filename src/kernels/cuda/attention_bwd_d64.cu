// Backward kernel instantiated for head dim 64 (one translation unit per instantiation).
#include "kernels/cuda/attention_bwd.cuh"

namespace treecp::cuda::detail {
void launch_bwd_d64(const BwdArgs& a, cudaStream_t stream) { launch_bwd<64>(a, stream); }
}  // namespace treecp::cuda::detail
