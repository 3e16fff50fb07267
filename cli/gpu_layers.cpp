// `treecp gdn --device cuda` and `treecp conv1d --device cuda`: the layer's CP (runtime/gdn_cp.hpp,
// runtime/conv_cp.hpp) on GPU ranks through the CUDA backend and NCCL, on the inputs the command read and checked
// (rounded to bf16 or fp16, --dtype, on upload), outputs gathered to rank 0 over the MPI world for the command to write.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <vector>

#include "arrays.hpp"
#include "command.hpp"
#include "core/error.hpp"
#include "gpu.hpp"
#include "runtime/cpu_backend.hpp"
#include "runtime/redistribute.hpp"
#include "runtime/row_map.hpp"

#if defined(TREECP_HAVE_CUDA) && defined(TREECP_HAVE_NCCL)
#include "comm/nccl_communicator.hpp"
#include "runtime/conv_cp.hpp"
#include "runtime/cuda_backend.hpp"
#include "runtime/gdn_cp.hpp"
#define TREECP_GPU_CLI 1
#endif

namespace treecp::cli {

cuda::DType layer_gpu_dtype(const Args& args, bool gpu) {
  require(gpu || !args.has("--dtype"), "--dtype goes with --device cuda (on CPU ranks the inputs' npy dtype, float32 "
          "or float64, is the precision)");
  return args.get_choice("--dtype", "bf16", {"bf16", "fp16"}) == "fp16" ? cuda::DType::kF16 : cuda::DType::kBf16;
}

void require_fits(cuda::DType dtype, const NpyArray& a, const std::string& name) {
  if (dtype == cuda::DType::kF16) require_magnitude_at_most(a, name, 65504.0, "fp16's largest finite value, --dtype fp16");
}

#ifndef TREECP_GPU_CLI

GpuLayerResult gdn_on_gpus(Communicator&, const Row&, const GdnShape&, const GdnPlan&, const GdnArrays&, double, int,
                           cuda::DType, cuda::GdnPrecision, bool, bool) {
  fail("--device cuda: this treecp was built without CUDA and NCCL (install the CUDA toolkit with NCCL and rebuild)");
}
GpuLayerResult conv1d_on_gpus(Communicator&, const Row&, const ConvShape&, const Ownership&, const ConvArrays&, double,
                              cuda::DType) {
  fail("--device cuda: this treecp was built without CUDA and NCCL (install the CUDA toolkit with NCCL and rebuild)");
}

#else

namespace {

using Clock = std::chrono::steady_clock;

double ms_since(Clock::time_point t) { return std::chrono::duration<double, std::milli>(Clock::now() - t).count(); }

// A rank's rows of a whole-row host array as a device buffer of the backend's 16-bit type, rounded to nearest even
// (all of it without ranges: a weight).
CudaBackend::Act upload_act(CudaBackend& be, const std::vector<double>& full, int64_t width,
                            const std::vector<TokenRange>* ranges) {
  const std::vector<double> mine = ranges ? rows_of<double>(full, width, *ranges) : full;
  std::vector<cuda::bf16_t> bits(mine.size());
  for (size_t i = 0; i < mine.size(); ++i) bits[i] = cuda::f32_to_bits(static_cast<float>(mine[i]), be.dtype());
  CudaBackend::Act b = be.alloc_act(static_cast<int64_t>(bits.size()));
  be.upload(b, bits);
  return b;
}
CudaBackend::Grad upload_f32(CudaBackend& be, const std::vector<double>& full, int64_t width,
                             const std::vector<TokenRange>& ranges) {
  const std::vector<float> mine = rows_of<float>(full, width, ranges);
  CudaBackend::Grad b = be.alloc_grad(static_cast<int64_t>(mine.size()));
  be.upload(b, mine);
  return b;
}
std::vector<double> host_values(CudaBackend& be, const CudaBackend::Act& b) {
  const std::vector<cuda::bf16_t> bits = be.download(b);
  std::vector<double> out(bits.size());
  for (size_t i = 0; i < bits.size(); ++i) out[i] = cuda::bits_to_f32(bits[i], be.dtype());
  return out;
}
std::vector<double> host_values(CudaBackend& be, const CudaBackend::Grad& b) {
  const std::vector<float> v = be.download(b);
  return {v.begin(), v.end()};
}

// One synchronised span of the ranks: the device's queue drained, then a barrier.
void settle(CudaBackend& be, Communicator& world) {
  be.synchronize();
  world.barrier();
}

double positive_timeout(double timeout_s) { return timeout_s > 0 ? timeout_s : Communicator::kDefaultTimeoutS; }

}  // namespace

GpuLayerResult gdn_on_gpus(Communicator& world, const Row& row, const GdnShape& shape, const GdnPlan& plan,
                           const GdnArrays& in, double timeout_s, int reps, cuda::DType dtype,
                           cuda::GdnPrecision precision, bool fla_split, bool keep_forward) {
  auto nccl = gpu_communicator(world, positive_timeout(timeout_s));
  CudaBackend be(nullptr, dtype);
  be.set_gdn_precision(precision);
  be.set_gdn_fla_split(fla_split);  // taken per call where it qualifies (cuda::gdn_fla_split_takes)
  be.set_gdn_keep_forward(keep_forward);  // the inputs stay as they are between the forward and the backward here
  nccl->set_compute_stream(be.stream());
  const Ownership layout = gdn_ownership(row, plan);
  const std::vector<TokenRange>& mine = layout[static_cast<size_t>(world.rank())];
  const int64_t qk = shape.qk_width(), vw = shape.v_width(), gw = shape.g_width(), H = shape.heads;
  GdnCP<CudaBackend> cp(plan, row, shape, *nccl, be);
  const int64_t rows = cp.owned_rows();
  const CudaBackend::Act q = upload_act(be, *in.q, qk, &mine), k = upload_act(be, *in.k, qk, &mine),
                         v = upload_act(be, *in.v, vw, &mine), g = upload_act(be, *in.g, gw, &mine),
                         beta = upload_act(be, *in.beta, H, &mine);
  CudaBackend::Act y = be.alloc_act(rows * vw);
  GpuLayerResult r;
  // The median of `reps` synchronised calls of f, each after an untimed `before`, and one untimed call first when
  // reps > 1.
  auto timed = [&](auto&& before, auto&& f) {
    if (reps > 1) {
      before();
      f();
    }
    std::vector<double> ms;
    for (int i = 0; i < reps; ++i) {
      before();
      settle(be, world);
      const auto t = Clock::now();
      f();
      settle(be, world);
      ms.push_back(ms_since(t));
    }
    std::nth_element(ms.begin(), ms.begin() + reps / 2, ms.end());
    return ms[static_cast<size_t>(reps / 2)];
  };
  r.forward_ms = timed([] {}, [&] { cp.forward(q, k, v, g, beta, y); });
  CpuBackend<double> host;
  auto gather = [&](const std::vector<double>& a, int64_t width) { return gather_to_root(world, host, a, layout, width); };
  r.outputs.push_back(gather(host_values(be, y), vw));
  if (in.dout) {
    const CudaBackend::Act dy = upload_act(be, *in.dout, vw, &mine);
    CudaBackend::Grad dq = be.alloc_grad(rows * qk), dk = be.alloc_grad(rows * qk), dv = be.alloc_grad(rows * vw),
                      dg = be.alloc_grad(rows * gw), dbeta = be.alloc_grad(rows * H);
    r.backward_ms = timed([&] { for (CudaBackend::Grad* x : {&dq, &dk, &dv, &dg, &dbeta}) be.zero(*x); },  // it accumulates
                          [&] { cp.backward(dy, dq, dk, dv, dg, dbeta); });
    r.outputs.push_back(gather(host_values(be, dq), qk));
    r.outputs.push_back(gather(host_values(be, dk), qk));
    r.outputs.push_back(gather(host_values(be, dv), vw));
    r.outputs.push_back(gather(host_values(be, dg), gw));
    r.outputs.push_back(gather(host_values(be, dbeta), H));
  }
  return r;
}

GpuLayerResult conv1d_on_gpus(Communicator& world, const Row& row, const ConvShape& shape, const Ownership& layout,
                              const ConvArrays& in, double timeout_s, cuda::DType dtype) {
  auto nccl = gpu_communicator(world, positive_timeout(timeout_s));
  CudaBackend be(nullptr, dtype);
  nccl->set_compute_stream(be.stream());
  const std::vector<TokenRange>& mine = layout[static_cast<size_t>(world.rank())];
  const int64_t C = shape.channels;
  ConvCP<CudaBackend> cp(layout, row, shape, *nccl, be);
  const int64_t rows = cp.owned_rows();
  const CudaBackend::Act x = upload_act(be, *in.x, C, &mine), w = upload_act(be, *in.weight, C, nullptr);
  CudaBackend::Act b;
  if (in.bias) b = upload_act(be, *in.bias, C, nullptr);
  CudaBackend::Act y = be.alloc_act(rows * C);
  GpuLayerResult r;
  settle(be, world);
  auto t = Clock::now();
  cp.forward(x, w, in.bias ? &b : nullptr, y);
  settle(be, world);
  r.forward_ms = ms_since(t);
  CpuBackend<double> host;
  r.outputs.push_back(gather_to_root(world, host, host_values(be, y), layout, C));
  if (in.dout) {
    const CudaBackend::Grad dy = upload_f32(be, *in.dout, C, mine);
    CudaBackend::Grad dx = be.alloc_grad(rows * C), dw = be.alloc_grad(C * shape.width), db = be.alloc_grad(C);
    settle(be, world);
    t = Clock::now();
    cp.backward(dy, dx, dw, in.bias ? &db : nullptr);
    settle(be, world);
    r.backward_ms = ms_since(t);
    r.outputs.push_back(gather_to_root(world, host, host_values(be, dx), layout, C));
    // The weight gradients are summed over the ranks already: rank 0's copy is the total.
    r.outputs.push_back(world.rank() == 0 ? host_values(be, dw) : std::vector<double>{});
    if (in.bias) r.outputs.push_back(world.rank() == 0 ? host_values(be, db) : std::vector<double>{});
  }
  return r;
}

#endif

}  // namespace treecp::cli
