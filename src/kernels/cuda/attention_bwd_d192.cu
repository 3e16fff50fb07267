// Backward kernel instantiated for (Dqk, Dv) = (192, 128), bf16 and fp16 (one translation unit per head-dim pair).
#include "kernels/cuda/attention_bwd.cuh"

namespace treecp::cuda::detail {
void launch_bwd_d192(const BwdArgs& a, cudaStream_t stream) {
  with_dtype(a.p.dtype, [&](auto e) { launch_bwd<192, true, decltype(e)::value, 128>(a, stream); });
}
}  // namespace treecp::cuda::detail
