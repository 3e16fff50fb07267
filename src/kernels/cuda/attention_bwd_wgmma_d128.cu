// wgmma backward kernel instantiated for head dim 128, bf16 (one translation unit per instantiation: with the fp16
// kernel in the same unit the compiler inlined the shared helpers differently and the bf16 kernel's code changed).
#include "kernels/cuda/attention_bwd_wgmma.cuh"

namespace treecp::cuda::detail {
void launch_bwd_wgmma_d128(const BwdArgs& a, cudaStream_t stream) {
  if (a.p.dtype == DType::kF16) launch_bwd_wgmma_d128_f16(a, stream);
  else launch_bwd_wgmma<128>(a, stream);
}
}  // namespace treecp::cuda::detail
