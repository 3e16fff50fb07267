// Forward kernels instantiated for (Dqk, Dv) = (192, 128), MLA's dense form, bf16 and fp16 (one translation unit per
// head-dim pair). Q stays in shared memory at both row counts (FwdShape::kQInRegisters: Dqk > 128).
#include "kernels/cuda/attention_fwd.cuh"

namespace treecp::cuda::detail {
void launch_fwd_d192(const FwdArgs& a, int rows_per_warp, cudaStream_t stream) {
  with_dtype(a.p.dtype, [&](auto e) {
    if (rows_per_warp == 16) launch_fwd<192, 1, decltype(e)::value, 128>(a, stream);
    else launch_fwd<192, 2, decltype(e)::value, 128>(a, stream);
  });
}
}  // namespace treecp::cuda::detail
