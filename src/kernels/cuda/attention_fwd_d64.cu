// Forward kernels instantiated for head dim 64, bf16 and fp16 (one translation unit per head dim).
#include "kernels/cuda/attention_fwd.cuh"

namespace treecp::cuda::detail {
void launch_fwd_d64(const FwdArgs& a, int rows_per_warp, cudaStream_t stream) {
  with_dtype(a.p.dtype, [&](auto e) {
    if (rows_per_warp == 16) launch_fwd<64, 1, decltype(e)::value>(a, stream);
    else launch_fwd<64, 2, decltype(e)::value>(a, stream);
  });
}
}  // namespace treecp::cuda::detail
