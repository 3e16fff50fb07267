// The wgmma kernels' variants (attention_fwd_wgmma.cuh barriers, attention_bwd_wgmma.cuh overlap),
// launched directly so the GPU tests also check the ones the defaults do not select.
#include "kernels/cuda/attention_bwd_wgmma.cuh"
#include "kernels/cuda/attention_fwd_wgmma.cuh"

namespace treecp::cuda::test {

int fwd_wgmma_variant_count() { return 2; }

void launch_fwd_wgmma_variant(const detail::FwdArgs& a, int head_dim, int variant) {
  using detail::FwdBarriers;
  const FwdBarriers b = variant == 0 ? FwdBarriers::kTwo : FwdBarriers::kOne;
  if (head_dim == 64) {
    if (b == FwdBarriers::kTwo) detail::launch_fwd_wgmma<64, FwdBarriers::kTwo>(a, nullptr);
    else detail::launch_fwd_wgmma<64, FwdBarriers::kOne>(a, nullptr);
  } else {
    if (b == FwdBarriers::kTwo) detail::launch_fwd_wgmma<128, FwdBarriers::kTwo>(a, nullptr);
    else detail::launch_fwd_wgmma<128, FwdBarriers::kOne>(a, nullptr);
  }
}

int bwd_wgmma_variant_count() { return 3; }

void launch_bwd_wgmma_variant(const detail::BwdArgs& a, int variant) {
  using detail::BwdOverlap;
  if (variant == 0) detail::launch_bwd_wgmma<128, true, BwdOverlap::kNone>(a, nullptr);
  else if (variant == 1) detail::launch_bwd_wgmma<128, true, BwdOverlap::kDkv>(a, nullptr);
  else detail::launch_bwd_wgmma<128, true, BwdOverlap::kDkvDq>(a, nullptr);
}

}  // namespace treecp::cuda::test
