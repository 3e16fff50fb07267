// The wgmma kernels' variants (attention_fwd_wgmma.cuh barriers and loads, attention_bwd_wgmma.cuh overlap),
// launched directly so the GPU tests also check the ones the defaults do not select.
#include "kernels/cuda/attention_bwd_wgmma.cuh"
#include "kernels/cuda/attention_fwd_wgmma.cuh"

namespace treecp::cuda::test {

int fwd_wgmma_variant_count() { return 4; }

namespace {
template <int D>
void launch_fwd_wgmma_d(const detail::FwdArgs& a, int variant) {
  using detail::FwdBarriers;
  using detail::FwdLoads;
  if (variant == 0) detail::launch_fwd_wgmma<D, FwdBarriers::kTwo, FwdLoads::kGeneric>(a, nullptr);
  else if (variant == 1) detail::launch_fwd_wgmma<D, FwdBarriers::kOne, FwdLoads::kGeneric>(a, nullptr);
  else if (variant == 2) detail::launch_fwd_wgmma<D, FwdBarriers::kTwo, FwdLoads::kPerThread>(a, nullptr);
  else detail::launch_fwd_wgmma<D, FwdBarriers::kOne, FwdLoads::kPerThread>(a, nullptr);
}
}  // namespace

void launch_fwd_wgmma_variant(const detail::FwdArgs& a, int head_dim, int variant) {
  if (head_dim == 64) launch_fwd_wgmma_d<64>(a, variant);
  else launch_fwd_wgmma_d<128>(a, variant);
}

int bwd_wgmma_variant_count() { return 3; }

void launch_bwd_wgmma_variant(const detail::BwdArgs& a, int variant) {
  using detail::BwdOverlap;
  if (variant == 0) detail::launch_bwd_wgmma<128, true, BwdOverlap::kNone>(a, nullptr);
  else if (variant == 1) detail::launch_bwd_wgmma<128, true, BwdOverlap::kDkv>(a, nullptr);
  else detail::launch_bwd_wgmma<128, true, BwdOverlap::kDkvDq>(a, nullptr);
}

}  // namespace treecp::cuda::test
