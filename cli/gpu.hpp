// The GPU side of the CLI: `treecp run --device cuda` and `treecp bench cp` (one process per GPU, NCCL between
// them, MPI only to start them and to gather host results). Built into every treecp; without CUDA and NCCL
// the entry points refuse with one line.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "comm/communicator.hpp"
#include "kernels/shapes.hpp"
#include "plan/cost.hpp"
#include "plan/planner.hpp"
#include "tree/row.hpp"

namespace treecp::cli {

// Whether this treecp can run on GPUs (CUDA kernels and NCCL compiled in).
bool gpu_support();

struct GpuRunConfig {
  AttentionShape shape{32, 4, 128, 128};  // the layer (window included): planned, run and checked at it
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

}  // namespace treecp::cli
