// wgmma forward kernel instantiated for (Dqk, Dv) = (192, 128), bf16 and fp16: one block per SM (129 KiB of shared
// memory), K and V by the generic panel loads (24 chunks a K row do not divide 256 threads).
#include "kernels/cuda/attention_fwd_wgmma.cuh"

namespace treecp::cuda::detail {
void launch_fwd_wgmma_d192(const FwdArgs& a, cudaStream_t stream) {
  with_dtype(a.p.dtype, [&](auto e) {
    launch_fwd_wgmma<192, kFwdBarriers, FwdLoads::kGeneric, decltype(e)::value, 128>(a, stream);
  });
}
}  // namespace treecp::cuda::detail
