// Forward kernel instantiated for (Dqk, Dv) = (256, 256), bf16 and fp16: 16 rows per warp only (32 would hold an O
// accumulator of 256 fp32 registers per thread; attention.cpp refuses rows_per_warp 32 here).
#include "kernels/cuda/attention_fwd.cuh"

namespace treecp::cuda::detail {
void launch_fwd_d256(const FwdArgs& a, cudaStream_t stream) {
  with_dtype(a.p.dtype, [&](auto e) { launch_fwd<256, 1, decltype(e)::value, 256>(a, stream); });
}
}  // namespace treecp::cuda::detail
