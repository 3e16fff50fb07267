// The warp-specialised forward's two library configs, bf16 and fp16 (attention_fwd_ws.cuh has the kernel).
#include "kernels/cuda/attention_fwd_ws.cuh"

namespace treecp::cuda::detail {

bool launch_fwd_ws_d128(const FwdArgs& a, cudaStream_t stream, const FwdWsConfig& config, int* counter) {
  if (config == FwdWsConfig::kDefault)
    return with_dtype(a.p.dtype, [&](auto e) {
      return launch_fwd_ws<FwdWsConfig::kDefault, decltype(e)::value>(a, stream, nullptr, counter);
    });
  if (config == FwdWsConfig::kPersistent)
    return with_dtype(a.p.dtype, [&](auto e) {
      return launch_fwd_ws<FwdWsConfig::kPersistent, decltype(e)::value>(a, stream, nullptr, counter);
    });
  fail("attention_forward (ws): only FwdWsConfig::kDefault and kPersistent are compiled into the library "
       "(attention_fwd_ws.cuh's launch_fwd_ws<C> instantiates the others)");
}

}  // namespace treecp::cuda::detail
