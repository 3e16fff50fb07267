// Forward kernels instantiated for head dim 64 (one translation unit per head dim).
#include "kernels/cuda/attention_fwd.cuh"

namespace treecp::cuda::detail {
void launch_fwd_d64(const FwdArgs& a, int rows_per_warp, cudaStream_t stream) {
  if (rows_per_warp == 16) launch_fwd<64, 1>(a, stream);
  else launch_fwd<64, 2>(a, stream);
}
}  // namespace treecp::cuda::detail
