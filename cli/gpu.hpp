// The GPU side of the CLI: `treecp run --device cuda`, `treecp gdn --device cuda`, `treecp conv1d --device cuda`
// and `treecp bench cp` (one process per GPU, NCCL between them, MPI only to start them and to gather host
// results). Built into every treecp; without CUDA and NCCL
// the entry points refuse with one line.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.hpp"
#include "core/npy.hpp"
#include "kernels/cuda/dtype.hpp"
#include "kernels/cuda/gdn_types.hpp"
#include "kernels/shapes.hpp"
#include "plan/cost.hpp"
#include "plan/gdn_plan.hpp"
#include "plan/ownership.hpp"
#include "plan/planner.hpp"
#include "tree/row.hpp"

namespace treecp {
class NcclCommunicator;
}

namespace treecp::cli {

class Args;

// Whether this treecp can run on GPUs (CUDA kernels and NCCL compiled in).
bool gpu_support();

// With CUDA and NCCL: the NCCL communicator of this process's GPU over `world` (one rank: device 0; several:
// from MPI, one device per local rank); a clear error without a device or without MPI for several ranks.
std::unique_ptr<NcclCommunicator> gpu_communicator(Communicator& world, double timeout_s);

// `treecp gdn` / `treecp conv1d`'s --dtype bf16|fp16 (bf16 by default): the 16-bit type the inputs are rounded to on
// upload and the GPU computes in; only with --device cuda (on CPU ranks the inputs' npy dtype is the precision).
cuda::DType layer_gpu_dtype(const Args& args, bool gpu);
// fp16 holds magnitudes up to 65504: each array given to an fp16 run must stay within (bf16 holds fp32's range).
void require_fits(cuda::DType dtype, const NpyArray& a, const std::string& name);

struct GpuRunConfig {
  AttentionShape shape{32, 4, 128, 128};  // the layer (window included): planned, run and checked at it
  cuda::DType dtype = cuda::DType::kBf16;  // of the activations (--dtype bf16 | fp16)
  bool sink = false;
  uint64_t seed = 0;
  bool json = false;
  bool full = false;        // no double reference: compare with one GPU running the whole row
  int reps = 5;             // timed forward+backward steps (after two warm-ups)
  std::string costs_path, source;
  std::string trace_path;  // --trace: a Chrome trace of the last step, CUDA-event spans beside the prediction
  double timeout_s = 300;
};

// One rank's part of `treecp run --device cuda` (every rank calls it; `world` spans the processes).
int run_on_gpus(Communicator& world, const Row& row, const CostModel& costs, const PlanOptions& options,
                const GpuRunConfig& cfg);

// The layers of `treecp gdn` / `treecp conv1d` on GPU ranks: every rank passes the whole row's arrays (host
// values, rounded to `dtype` (bf16 or fp16) on upload; dout null: forward only), runs its part of the plan (or ownership) through
// the CUDA backend over NCCL, and rank 0 gets the outputs of the whole row in packed order (fp32 values): gdn
// {y, dq, dk, dv, dg, dbeta}, conv1d {y, dx, dweight, dbias}; forward and backward wall times in ms (each ends
// with a device synchronisation and a barrier of the ranks).
struct GpuLayerResult {
  std::vector<std::vector<double>> outputs;  // rank 0 only
  double forward_ms = 0, backward_ms = 0;
};
struct GdnArrays {
  const std::vector<double>*q, *k, *v, *g, *beta, *dout;
};
// reps > 1: one untimed warm-up call of each direction, then the median of `reps` timed calls (the gradients zeroed
// before each backward, which accumulates); reps = 1: the first call, timed. keep_forward: the split forwards keep
// their arrays for the backward (CudaBackend::set_gdn_keep_forward), which then skips the split's prep and scan.
GpuLayerResult gdn_on_gpus(Communicator& world, const Row& row, const GdnShape& shape, const GdnPlan& plan,
                           const GdnArrays& in, double timeout_s, int reps = 1,
                           cuda::DType dtype = cuda::DType::kBf16,
                           cuda::GdnPrecision precision = cuda::GdnPrecision::fp32, bool fla_split = false,
                           bool keep_forward = false);
struct ConvArrays {
  const std::vector<double>*x, *weight, *bias, *dout;  // bias, dout may be null
};
GpuLayerResult conv1d_on_gpus(Communicator& world, const Row& row, const ConvShape& shape, const Ownership& layout,
                              const ConvArrays& in, double timeout_s, cuda::DType dtype = cuda::DType::kBf16);

}  // namespace treecp::cli
