// The wgmma kernels' variants (attention_fwd_wgmma.cuh barriers and loads, attention_bwd_wgmma.cuh overlap and loads),
// launched directly so the GPU tests also check the ones the defaults do not select.
#include <iterator>

#include "kernels/cuda/attention_bwd_wgmma.cuh"
#include "kernels/cuda/launch.hpp"
#include "kernels/cuda/attention_fwd_wgmma.cuh"

namespace treecp::cuda::test {

int fwd_wgmma_variant_count() { return 6; }

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
  // variants 4 and 5: the warp-specialised TMA forward (attention_fwd_ws.cu) in the two configs the library holds,
  // FwdWsConfig::kDefault and kPersistent, where it applies, else the default
  if (variant == 5) {
    static int* counter = nullptr;  // one workspace for the test process, its counter zeroed by each launch
    if (counter == nullptr) check_cuda(cudaMalloc(&counter, detail::fwd_ws_workspace_bytes()), "test workspace");
    if (head_dim == 128 && detail::launch_fwd_ws_d128(a, nullptr, detail::FwdWsConfig::kPersistent, counter)) return;
  }
  if (variant == 4 && head_dim == 128 && detail::launch_fwd_ws_d128(a, nullptr, detail::FwdWsConfig::kDefault)) return;
  if (variant >= 4) variant = 3;
  if (head_dim == 64) launch_fwd_wgmma_d<64>(a, variant);
  else launch_fwd_wgmma_d<128>(a, variant);
}

namespace {
using detail::BwdWsConfig;
using detail::BwdWsWalk;
// The warp-specialised backward's configs the tests run: every field's both values against the defaults
constexpr BwdWsConfig kBwdWsConfigs[] = {
    {.dq_by_tma = false},                                            // dQ by red.global.add
    {.dkdv_by_tma = false},                                          // dK / dV by the consumer threads
    {.walk = BwdWsWalk::kForward, .dq_by_tma = false},               // every walk forward
    {.walk = BwdWsWalk::kForward, .dkdv_by_tma = false},
    {.walk = BwdWsWalk::kReversed, .segment_order = true, .dkdv_by_tma = false},
    {.segment_order = true, .dq_by_tma = false},                     // the segment order, first wave reversed
    {.dkdv_by_tma = false, .skip_idle = false},                      // without warpgroup 1's idle-step skip
    BwdWsConfig::kDefault,
    BwdWsConfig::kSegmentOrder,
};
constexpr int kBwdWsFirst = 5;  // the variant numbers of kBwdWsConfigs start here
}  // namespace

int bwd_wgmma_variant_count() { return kBwdWsFirst + static_cast<int>(std::size(kBwdWsConfigs)); }

// kNone / kDkv / kDkvDq with the per-thread Q/dO loads, then kDkvDq and kNone with the generic loads
// (the per-thread loads fall back to the generic ones when G does not divide 16: the G = 3 case); from 5 the
// warp-specialised backward (attention_bwd_ws.cu) in the configs of kBwdWsConfigs where it applies (G dividing 64),
// else variant 2
void launch_bwd_wgmma_variant(const detail::BwdArgs& a, int variant) {
  using detail::BwdLoads;
  using detail::BwdOverlap;
  if (variant >= kBwdWsFirst && detail::launch_bwd_ws_d128(a, nullptr, kBwdWsConfigs[variant - kBwdWsFirst])) return;
  if (variant >= kBwdWsFirst) variant = 2;
  if (variant == 0) detail::launch_bwd_wgmma<128, true, BwdOverlap::kNone, BwdLoads::kPerThread>(a, nullptr);
  else if (variant == 1) detail::launch_bwd_wgmma<128, true, BwdOverlap::kDkv, BwdLoads::kPerThread>(a, nullptr);
  else if (variant == 2) detail::launch_bwd_wgmma<128, true, BwdOverlap::kDkvDq, BwdLoads::kPerThread>(a, nullptr);
  else if (variant == 3) detail::launch_bwd_wgmma<128, true, BwdOverlap::kDkvDq, BwdLoads::kGeneric>(a, nullptr);
  else detail::launch_bwd_wgmma<128, true, BwdOverlap::kNone, BwdLoads::kGeneric>(a, nullptr);
}

}  // namespace treecp::cuda::test
