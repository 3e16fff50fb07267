// The one dispatch place: argument checks, then head dim -> kernel instantiation (each launcher then takes the
// instantiation of the params' dtype).
#include "core/error.hpp"
#include "kernels/cuda/launch.hpp"

namespace treecp::cuda {
namespace {

// The main loops that kDefault selects (docs/benchmarks-gpu.md has the measurements): the forward first
// tries the warp-specialised kernel (head dim 128, G dividing 128, a driver with the tensor-map encoder)
// and otherwise takes kFwdMainloop; the backward likewise tries its warp-specialised kernel (head dim 128,
// G dividing 64) before kBwdMainloop. Which kernels exist at each (Dqk, Dv): docs/kernels.md.
constexpr Mainloop kFwdMainloop = Mainloop::kWgmma;
constexpr Mainloop kBwdMainloop = Mainloop::kWgmma;
// kDefault at the other dims, measured on an H200 (run 139, docs/benchmarks-gpu.md): the wgmma forward at (192, 128)
// and (256, 256) (1.4-2.0x mma.sync) and the wgmma backward at 64 (1.4-1.5x); the backward at (192, 128) and
// (256, 256) has only mma.sync (docs/kernels.md says why).
constexpr Mainloop kFwdMainloopNewDims = Mainloop::kWgmma;    // (192, 128), (256, 256)
constexpr Mainloop kBwdMainloop64 = Mainloop::kWgmma;
// The main loop kDefault stands for, per direction and head dim (the warp-specialised kernels are tried first at 128).
Mainloop default_fwd_mainloop(int32_t head_dim) { return head_dim <= 128 ? kFwdMainloop : kFwdMainloopNewDims; }
Mainloop default_bwd_mainloop(int32_t head_dim) {
  return head_dim == 128 ? kBwdMainloop : head_dim == 64 ? kBwdMainloop64 : Mainloop::kMmaSync;
}
// The warp-specialised backward's config for this plan: the segment order with every walk reversed where the plan
// says it shares more through the L2 cache (DeviceTilePlan::bwd_segment_order), else the default order with the
// first wave reversed; both with dQ, dK and dV by TMA bulk reductions where the buffers' alignment allows it.
const detail::BwdWsConfig& bwd_ws_config(const DeviceTilePlan& plan, int32_t hkv) {
  return plan.bwd_segment_order(hkv, detail::sm_count()) ? detail::BwdWsConfig::kSegmentOrder
                                                         : detail::BwdWsConfig::kDefault;
}

void check_common(const char* who, DType dtype, int32_t hq, int32_t hkv, int32_t head_dim, int32_t value_dim,
                  float scale, const DeviceTilePlan& plan) {
  require(dtype == DType::kBf16 || dtype == DType::kF16, who, ": dtype must be kBf16 or kF16, got ",
          static_cast<int>(dtype));
  require(hq >= 1 && hkv >= 1 && hq % hkv == 0, who, ": hq must be a positive multiple of hkv, got hq ", hq,
          " hkv ", hkv);
  require(hq / hkv == plan.group, who, ": the plan was built for group ", plan.group, " but hq/hkv is ", hq / hkv);
  require(attention_dims_supported(head_dim, value_dim), who, ": (head_dim, value_dim) must be one of ",
          attention_dims_list(), " (value_dim 0 = head_dim), got (", head_dim, ", ", value_dim, ")");
  require(scale > 0.f, who, ": scale must be > 0, got ", scale);
}

// Strides of 16-bit rows must keep 16-byte alignment for the vector copies.
void check_aligned(const char* who, const char* name, const void* ptr, int64_t row_stride, int64_t head_stride) {
  require(ptr != nullptr, who, ": ", name, " is null");
  require(reinterpret_cast<uintptr_t>(ptr) % 16 == 0 && row_stride % 8 == 0 && head_stride % 8 == 0, who, ": ", name,
          " must be 16-byte aligned with strides that are multiples of 8 elements");
}

// The warp-specialised forward: persistent where the caller gave a large enough workspace (FwdWsConfig::kPersistent),
// else one block per query tile (FwdWsConfig::kDefault: Q in registers, the intra-warpgroup overlap, O by TMA).
bool launch_fwd_ws(const detail::FwdArgs& a, cudaStream_t stream) {
  const AttentionForwardParams& p = a.p;
  if (p.workspace != nullptr) {
    require(p.workspace_bytes >= detail::fwd_ws_workspace_bytes(), "attention_forward: workspace_bytes must be at least ",
            detail::fwd_ws_workspace_bytes(), " (attention_forward_workspace_bytes()), got ", p.workspace_bytes);
    require(reinterpret_cast<uintptr_t>(p.workspace) % 16 == 0, "attention_forward: workspace must be 16-byte aligned");
    return detail::launch_fwd_ws_d128(a, stream, detail::FwdWsConfig::kPersistent, static_cast<int*>(p.workspace));
  }
  return detail::launch_fwd_ws_d128(a, stream, detail::FwdWsConfig::kDefault);
}

// mma.sync kernels by (Dqk, Dv)
void launch_fwd_mma(const detail::FwdArgs& a, int rows_per_warp, cudaStream_t stream) {
  switch (a.p.head_dim) {
    case 64: detail::launch_fwd_d64(a, rows_per_warp, stream); break;
    case 128: detail::launch_fwd_d128(a, rows_per_warp, stream); break;
    case 192: detail::launch_fwd_d192(a, rows_per_warp, stream); break;
    default: detail::launch_fwd_d256(a, stream); break;  // rows_per_warp 16 (checked by the caller)
  }
}
void launch_bwd_mma(const detail::BwdArgs& a, cudaStream_t stream) {
  switch (a.p.head_dim) {
    case 64: detail::launch_bwd_d64(a, stream); break;
    case 128: detail::launch_bwd_d128(a, stream); break;
    case 192: detail::launch_bwd_d192(a, stream); break;
    default: detail::launch_bwd_d256(a, stream); break;
  }
}

}  // namespace

size_t attention_forward_workspace_bytes() { return detail::fwd_ws_workspace_bytes(); }

void attention_forward(const AttentionForwardParams& p, const DeviceTilePlan& plan, cudaStream_t stream) {
  const char* who = "attention_forward";
  const int32_t dv = value_dim_of(p);
  check_common(who, p.dtype, p.hq, p.hkv, p.head_dim, dv, p.scale, plan);
  if (plan.q_rows == 0) return;
  check_aligned(who, "q", p.q, p.q_row_stride, p.q_head_stride);
  if (plan.kv_rows > 0) {
    check_aligned(who, "k", p.k, p.k_row_stride, p.k_head_stride);
    check_aligned(who, "v", p.v, p.v_row_stride, p.v_head_stride);
  }
  require(p.o && p.lse, who, ": o and lse are required");
  detail::FwdArgs a{p, plan.fwd, plan.slices, static_cast<int32_t>(plan.q_rows), static_cast<int32_t>(plan.kv_rows),
                    plan.group};
  const Mainloop mainloop = p.mainloop == Mainloop::kDefault ? default_fwd_mainloop(p.head_dim) : p.mainloop;
  require(mainloop == Mainloop::kMmaSync || mainloop == Mainloop::kWgmma || mainloop == Mainloop::kWgmmaWs, who,
          ": mainloop must be kDefault, kMmaSync, kWgmma or kWgmmaWs, got ", static_cast<int>(p.mainloop));
  // Without keys every row gets O = 0 and LSE = -inf: the mma.sync kernel writes them from empty tile lists
  // (a TMA tensor map cannot describe an empty K or V, so the warp-specialised kernel cannot run).
  const bool no_keys = plan.kv_rows == 0;
  if (mainloop == Mainloop::kWgmmaWs && !no_keys) {
    require(p.head_dim == 128 && kFwdBlockRows % plan.group == 0, who,
            ": kWgmmaWs needs head_dim 128 and a group dividing ", kFwdBlockRows, ", got head_dim ", p.head_dim,
            " group ", plan.group);
    require(launch_fwd_ws(a, stream), who,
            ": kWgmmaWs needs the driver's cuTensorMapEncodeTiled, which this driver does not provide");
    return;
  }
  // kDefault: the warp-specialised kernel where it applies (measured fastest, docs/benchmarks-gpu.md)
  if (p.mainloop == Mainloop::kDefault && p.head_dim == 128 && !no_keys && launch_fwd_ws(a, stream)) return;
  // (256, 256) has the 16-rows-per-warp mma.sync kernel only: 32 rows would hold 256 fp32 of O per thread
  const int default_rows = dv == 256 ? 16 : kFwdRowsPerWarp;
  if (no_keys) {
    launch_fwd_mma(a, default_rows, stream);
    return;
  }
  if (mainloop == Mainloop::kWgmma) {
    switch (p.head_dim) {
      case 64: detail::launch_fwd_wgmma_d64(a, stream); break;
      case 128: detail::launch_fwd_wgmma_d128(a, stream); break;
      case 192: detail::launch_fwd_wgmma_d192(a, stream); break;
      default: detail::launch_fwd_wgmma_d256(a, stream); break;
    }
    return;
  }
  const int rows_per_warp = p.rows_per_warp == 0 ? default_rows : p.rows_per_warp;
  require(rows_per_warp == 16 || rows_per_warp == 32, who, ": rows_per_warp must be 0, 16 or 32, got ",
          static_cast<int>(p.rows_per_warp));
  require(dv != 256 || rows_per_warp == 16, who, ": rows_per_warp must be 0 or 16 at (256, 256), got ",
          static_cast<int>(p.rows_per_warp));
  launch_fwd_mma(a, rows_per_warp, stream);
}

void attention_backward(const AttentionBackwardParams& p, const DeviceTilePlan& plan, cudaStream_t stream) {
  const char* who = "attention_backward";
  const int32_t dv = value_dim_of(p);
  check_common(who, p.dtype, p.hq, p.hkv, p.head_dim, dv, p.scale, plan);
  if (plan.q_rows == 0 || plan.kv_rows == 0) return;
  check_aligned(who, "q", p.q, p.q_row_stride, p.q_head_stride);
  check_aligned(who, "k", p.k, p.k_row_stride, p.k_head_stride);
  check_aligned(who, "v", p.v, p.v_row_stride, p.v_head_stride);
  check_aligned(who, "d_o", p.d_o, p.o_row_stride, p.o_head_stride);
  require(p.lse && p.dsum && p.dq && p.dk && p.dv, who, ": lse, dsum, dq, dk and dv are required");
  require(p.dq_row_stride % 2 == 0 && p.dq_head_stride % 2 == 0 && p.dk_row_stride % 2 == 0 &&
              p.dk_head_stride % 2 == 0,
          who, ": fp32 gradient strides must be even (float2 accesses)");
  require(p.dv_row_stride % 2 == 0 && p.dv_head_stride % 2 == 0, who,
          ": fp32 gradient strides must be even (float2 accesses)");
  detail::BwdArgs a{p, plan.bwd, plan.slices, static_cast<int32_t>(plan.q_rows), static_cast<int32_t>(plan.kv_rows),
                    plan.group};
  // dv's strides as the kernels at Dv != Dqk read them (0: dk's; the kernels at Dv == Dqk read dk's)
  require(dv != p.head_dim || ((p.dv_row_stride == 0 || p.dv_row_stride == p.dk_row_stride) &&
                               (p.dv_head_stride == 0 || p.dv_head_stride == p.dk_head_stride)),
          who, ": at value_dim = head_dim dv takes dk's strides: dv_row_stride / dv_head_stride must be 0 or equal them");
  if (dv != p.head_dim) {
    require((p.dv_row_stride != 0 || p.dk_row_stride <= INT32_MAX) &&
                (p.dv_head_stride != 0 || p.dk_head_stride <= INT32_MAX),
            who, ": dv_row_stride / dv_head_stride 0 take dk's strides, which exceed int32 here; give dv's");
    if (a.p.dv_row_stride == 0) a.p.dv_row_stride = static_cast<int32_t>(p.dk_row_stride);
    if (a.p.dv_head_stride == 0) a.p.dv_head_stride = static_cast<int32_t>(p.dk_head_stride);
  }
  // the main loop is checked before anything (the Dsum kernel) is launched
  const Mainloop mainloop = p.mainloop != Mainloop::kDefault ? p.mainloop : default_bwd_mainloop(p.head_dim);
  require(mainloop == Mainloop::kMmaSync || (mainloop == Mainloop::kWgmma && (p.head_dim == 128 || p.head_dim == 64)) ||
              (mainloop == Mainloop::kWgmmaWs && p.head_dim == 128),
          who, ": mainloop must be kDefault or kMmaSync, or kWgmma at (64, 64) / (128, 128), or kWgmmaWs at head_dim 128; got ",
          static_cast<int>(p.mainloop), " at (head_dim, value_dim) (", p.head_dim, ", ", dv, ")");
  require(mainloop != Mainloop::kWgmmaWs || kBwdBlockRows % plan.group == 0, who, ": kWgmmaWs needs a group dividing ",
          kBwdBlockRows, ", got ", plan.group);
  if (!p.dsum_ready) {
    require(p.o != nullptr, who, ": o is required unless dsum_ready");
    check_aligned(who, "o", p.o, p.o_row_stride, p.o_head_stride);  // the Dsum kernel reads 16 bytes at a time
    detail::launch_bwd_dsum(a, stream);
  }
  if (mainloop == Mainloop::kWgmmaWs) {
    require(detail::launch_bwd_ws_d128(a, stream, bwd_ws_config(plan, p.hkv)), who,
            ": kWgmmaWs needs the driver's cuTensorMapEncodeTiled, which this driver does not provide");
    return;
  }
  // kDefault at head dim 128: the warp-specialised kernel where it applies (measured fastest)
  if (p.mainloop == Mainloop::kDefault && p.head_dim == 128 &&
      detail::launch_bwd_ws_d128(a, stream, bwd_ws_config(plan, p.hkv)))
    return;
  if (mainloop == Mainloop::kWgmma && p.head_dim == 128) detail::launch_bwd_wgmma_d128(a, stream);
  else if (mainloop == Mainloop::kWgmma) detail::launch_bwd_wgmma_d64(a, stream);
  else launch_bwd_mma(a, stream);
}

}  // namespace treecp::cuda
