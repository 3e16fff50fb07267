// plan/: pure data between the row and the runtime: ownership, the dense, GDN/KDA, Mamba-2 and sparse MLA
// planners, their cost models, and the Plans they produce (no tensor values).
//
// Fitting the cost model (plan/cost.hpp) to measurements, and judging a fit on plans it was not fitted on.
//
// Stages: every measured stage (its load as the cost model sees it, and its measured ms) gives one equation
//   ms = launch + compute_pairs / throughput(local|remote, forward|backward) + merge x query_tokens (remote)
//        + range x ranges
// solved for the seven unknowns by non-negative least squares on relative errors (each row divided by its
// measured ms, so a 0.1 ms stage counts as much as a 10 ms one; the judge is |log(measured / predicted)|).
// A throughput with no sample keeps the base value; the underfill term is set to zero (its effect is in the
// fitted launch). With fewer than three samples per unknown only the throughputs are fitted, launch, merge,
// range and underfill keeping the base values. Token-local work: per rank and pass, (measured pass - measured stages) / owned tokens,
// least squares through the origin. Links: exchanges of known bytes give latency + bytes / bandwidth on one
// node (two ranks) and the rank bandwidth from more ranks.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "plan/cost.hpp"

namespace treecp {

struct StageSample {
  StageLoad load;
  bool remote = false;
  Pass pass = Pass::Forward;
  double measured_ms = 0.0;
};

// One rank's whole pass: what its stages did not explain is token-local work.
struct PassSample {
  Pass pass = Pass::Forward;
  int64_t owned_tokens = 0;
  double measured_ms = 0.0;         // the pass
  double measured_stages_ms = 0.0;  // the sum of its stages
};

// An all-to-all with `bytes_per_peer` from every rank to every other of `ranks`, timed until all landed.
struct LinkSample {
  int ranks = 2;
  int64_t bytes_per_peer = 0;
  double measured_ms = 0.0;
};

struct Calibration {
  CostModel costs;
  int stage_samples = 0, pass_samples = 0, link_samples = 0;
  double stage_fit_error = 0.0;  // mean |log(measured / predicted)| over the stage samples fitted
};

Calibration calibrate(const CostModel& base, const std::vector<StageSample>& stages,
                      const std::vector<PassSample>& passes, const std::vector<LinkSample>& links);

// mean |log(measured / predicted)| over pairs with both > 0; 0 for none.
double mean_abs_log_error(const std::vector<std::pair<double, double>>& measured_predicted);

// Non-negative least squares: argmin |A x - b| subject to x >= 0 (Lawson-Hanson); A row-major, rows x cols.
std::vector<double> nnls(const std::vector<double>& a, const std::vector<double>& b, int rows, int cols);

}  // namespace treecp
