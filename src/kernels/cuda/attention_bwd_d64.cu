// Backward kernel instantiated for head dim 64, bf16 and fp16 (one translation unit per head dim).
#include "kernels/cuda/attention_bwd.cuh"

namespace treecp::cuda::detail {
void launch_bwd_d64(const BwdArgs& a, cudaStream_t stream) {
  with_dtype(a.p.dtype, [&](auto e) { launch_bwd<64, true, decltype(e)::value>(a, stream); });
}
}  // namespace treecp::cuda::detail
