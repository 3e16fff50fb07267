// The wgmma kernels' variants (attention_fwd_wgmma.cuh barriers and loads, attention_bwd_wgmma.cuh overlap and loads),
// launched directly so the GPU tests also check the ones the defaults do not select.
#include "kernels/cuda/attention_bwd_wgmma.cuh"
#include "kernels/cuda/launch.hpp"
#include "kernels/cuda/attention_fwd_wgmma.cuh"

namespace treecp::cuda::test {

int fwd_wgmma_variant_count() { return 12; }

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
  // variants 4-7: the warp-specialised TMA forward (attention_fwd_ws.cu) with its launch variants 0-3 (5: Q in
  // registers, 6: also the intra-warpgroup overlap, 7: also O stored by TMA) where it applies, else the default
  // 8-11: its persistent forms (launch variants 5-8)
  if (variant >= 8 && variant <= 11) {
    static int* counter = nullptr;  // one workspace for the test process, its counter zeroed by each launch
    if (counter == nullptr) check_cuda(cudaMalloc(&counter, detail::fwd_ws_workspace_bytes()), "test workspace");
    if (head_dim == 128 && detail::launch_fwd_ws_d128(a, nullptr, variant - 3, nullptr, counter)) return;
  }
  if (variant >= 4 && variant < 8 && head_dim == 128 && detail::launch_fwd_ws_d128(a, nullptr, variant - 4)) return;
  if (variant >= 4) variant = 3;
  if (head_dim == 64) launch_fwd_wgmma_d<64>(a, variant);
  else launch_fwd_wgmma_d<128>(a, variant);
}

int bwd_wgmma_variant_count() { return 14; }

// kNone / kDkv / kDkvDq with the per-thread Q/dO loads, then kDkvDq and kNone with the generic loads
// (the per-thread loads fall back to the generic ones when G does not divide 16: the G = 3 case); 5-8: the
// warp-specialised backward (attention_bwd_ws.cu) with its launch variants 0-3 (dQ by red.global.add or TMA
// bulk reductions; first wave reversed or every walk forward), 9-10 with its segment order (9: every walk
// reversed, TMA dQ; 10: first wave reversed, red.global.add), 11 without warpgroup 1's idle-step skip (TMA
// dQ), 12 and 13 with dK / dV by TMA reductions (TMA dQ; 13 in the segment order), where it applies (G dividing
// 64), else variant 2
void launch_bwd_wgmma_variant(const detail::BwdArgs& a, int variant) {
  using detail::BwdLoads;
  using detail::BwdOverlap;
  const int ws = variant == 9    ? 1 | 4 | 8
                 : variant == 10 ? 8
                 : variant == 11 ? 1 | 16
                 : variant == 12 ? 1 | 64
                 : variant == 13 ? 1 | 4 | 8 | 64
                                 : variant - 5;
  if (variant >= 5 && detail::launch_bwd_ws_d128(a, nullptr, ws)) return;
  if (variant >= 5) variant = 2;
  if (variant == 0) detail::launch_bwd_wgmma<128, true, BwdOverlap::kNone, BwdLoads::kPerThread>(a, nullptr);
  else if (variant == 1) detail::launch_bwd_wgmma<128, true, BwdOverlap::kDkv, BwdLoads::kPerThread>(a, nullptr);
  else if (variant == 2) detail::launch_bwd_wgmma<128, true, BwdOverlap::kDkvDq, BwdLoads::kPerThread>(a, nullptr);
  else if (variant == 3) detail::launch_bwd_wgmma<128, true, BwdOverlap::kDkvDq, BwdLoads::kGeneric>(a, nullptr);
  else detail::launch_bwd_wgmma<128, true, BwdOverlap::kNone, BwdLoads::kGeneric>(a, nullptr);
}

}  // namespace treecp::cuda::test
