// wgmma backward kernel instantiated for head dim 128, fp16 (one translation unit per instantiation).
#include "kernels/cuda/attention_bwd_wgmma.cuh"

namespace treecp::cuda::detail {
void launch_bwd_wgmma_d128_f16(const BwdArgs& a, cudaStream_t stream) {
  launch_bwd_wgmma<128, true, kBwdOverlap, kBwdLoads, DType::kF16>(a, stream);
}
}  // namespace treecp::cuda::detail
