// plan/: pure data between the row and the runtime: ownership, the dense, GDN/KDA, Mamba-2 and sparse MLA
// planners, their cost models, and the Plans they produce (no tensor values).
//
// The planner: layouts as ownership generators, the schedule (which remote key chunks each rank
// fetches in which wave), evaluation through the cost model, a bounded ownership search, and the
// construction of the Plan the runtime executes.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "plan/cost.hpp"
#include "plan/plan.hpp"
#include "plan/work.hpp"

namespace treecp {

class Row;

struct PlanOptions {
  Layout layout = Layout::Searched;
  int64_t chunk_tokens = 0;      // 0 = default_chunk_tokens(row, cp)
  int max_waves = 4;             // wave counts tried: 1..max_waves (0 when no rank needs remote KV)
  int search_evaluations = 160;  // budget of plan evaluations for the ownership moves
  int search_steps = 24;         // accepted moves at most
  double min_gain = 0.0005;      // a move must cut the search objective (makespan + imbalance) by this fraction
  int64_t perdoc_min_piece = 128;
  // The backward's remote KV: "keep" it from the forward, fetch it again ("refetch"), or "auto": keep where
  // the rank's memory bound (plan/memory.hpp + activations) fits CostModel::memory_limit_bytes_per_rank,
  // else refetch, each priced by the simulator.
  std::string backward_kv = "auto";
};

// One layout's best schedule, as the report shows it.
struct LayoutResult {
  Layout layout = Layout::Searched;
  int num_waves = 0;
  int64_t chunks = 0;
  double makespan_ms = 0.0;
  int64_t peak_memory_bytes = 0;  // the largest rank's owned activations + the runtime's buffers (plan/memory.hpp)
  bool fits_memory = true;
  bool refetch_backward = false;
};

struct PlanReport {
  std::vector<LayoutResult> layouts;  // every layout of kLayouts, in that order
  int64_t chunk_tokens = 0;           // chosen chunk size (the common grid)
  int evaluations = 0;                // plan evaluations, all layouts and the search together
  int search_moves = 0;               // accepted ownership moves
  double planning_ms = 0.0;           // wall time of make_plan
};

// Plans a row for `cp` ranks and a layer of `shape` (its window decides the visibility; its head dims
// the bytes a wave moves and the kernel tiles) with the requested layout; the report (optional) has
// every layout.
Plan make_plan(const Row& row, int cp, const AttentionShape& shape, const CostModel& costs, const PlanOptions& options,
               PlanReport* report = nullptr);

// The same ownership (chunk bounds and owners of `ownership`) with the schedule of another attention layer of
// the row (`shape`: its window): layers with different sliding windows share one token layout, so activations
// never move between them. The stages, their slices and the wave count (the best of 1..max_waves, or none when
// no rank needs remote keys) are planned for that window; the layout name is ownership's.
Plan plan_for_ownership(const Row& row, const Plan& ownership, const AttentionShape& shape, const CostModel& costs,
                        const PlanOptions& options = {});

// ---- the parts, exposed for tests and benchmarks

// Ownership generators: chunk -> rank.
std::vector<int32_t> contiguous_owner(const WorkMatrix& w, int cp);  // equal tokens, in order
std::vector<int32_t> zigzag_owner(const WorkMatrix& w, int cp);      // 2 cp groups folded
std::vector<int32_t> perdoc_owner(const Row& row, const WorkMatrix& w, int cp, int64_t min_piece);
// Whole families by longest-processing-time packing; with `split`, a family costlier than a rank's
// share is first cut into equal-cost contiguous pieces (the "family" layout); without, never (a
// search start that needs no communication).
std::vector<int32_t> family_owner(const Row& row, const WorkMatrix& w, const CostModel& c, int cp, bool split = true);
std::vector<int32_t> balanced_owner(const WorkMatrix& w, const CostModel& c, int cp);  // equal cost, in order

// Prices ownerships on one work matrix for a layer of `shape`; reuses its buffers between calls (not
// thread-safe).
class Evaluator {
 public:
  Evaluator(const WorkMatrix& w, const CostModel& c, const AttentionShape& shape, int cp);

  struct Result {
    Prediction prediction;
    int64_t peak_memory_bytes = 0;  // the largest rank's: owned activations + plan/memory.hpp's runtime peak
    bool fits_memory = true;
    bool valid = true;  // false when remote KV is needed but waves == 0
    bool refetch_backward = false;  // the backward fetches remote KV again (PlanOptions::backward_kv)
  };
  // "auto", "keep" or "refetch" (PlanOptions::backward_kv); evaluate() prices the choice.
  void set_backward_kv(const std::string& mode);
  // waves >= 1, or 0 when no rank needs remote KV.
  Result evaluate(const std::vector<int32_t>& owner, int waves);
  // Wave (0-based) in which `rank` fetches key chunk k in the last evaluation; -1 if it does not.
  int32_t wave_of(int rank, int32_t k) const;
  struct Fetch {
    int32_t chunk, wave;
  };
  // What `rank` fetches in the last evaluation, in chunk order.
  std::span<const Fetch> fetches(int rank) const {
    return {fetch_.data() + fetch_start_[rank], static_cast<size_t>(fetch_start_[rank + 1] - fetch_start_[rank])};
  }
  // Loads of the last evaluation.
  const std::vector<RankLoad>& loads() const { return loads_; }
  const std::vector<WaveTraffic>& traffic() const { return traffic_; }
  const WorkMatrix& work() const { return w_; }
  int cp() const { return cp_; }

 private:
  const WorkMatrix& w_;
  const CostModel& c_;
  AttentionShape shape_;
  int cp_;
  int32_t n_;
  Links links_;
  // Scratch of one entry per chunk (never cp x chunks): memory stays O(chunks) at any rank count.
  std::vector<int64_t> need_;
  std::vector<int64_t> need_compute_;  // need_'s tile-padded pairs
  std::vector<int32_t> wave_, touched_, by_rank_;
  std::vector<int64_t> by_rank_start_;
  std::vector<Fetch> fetch_;  // per rank, sorted by chunk: [fetch_start_[r], fetch_start_[r + 1])
  std::vector<int64_t> fetch_start_;
  std::vector<RankLoad> loads_;
  std::vector<WaveTraffic> traffic_;
  std::vector<int64_t> recv_tokens_;
  int kv_mode_ = 0;  // 0 auto, 1 keep, 2 refetch
};

// The Plan of an ownership and wave count on a work matrix, predictions included.
Plan build_plan(const std::vector<Slice>& row_slices, int64_t window, Evaluator& evaluator,
                const std::vector<int32_t>& owner, int waves, Layout layout);

// The loads a Plan implies (from its slices and ranges) priced with the same cost function, for a layer of
// `shape`.
Prediction simulate_plan(const Plan& plan, const AttentionShape& shape, const CostModel& costs);
// The same simulation span by span (what `treecp plan --svg` and `treecp run --trace` draw).
Timeline simulate_plan_timeline(const Plan& plan, const AttentionShape& shape, const CostModel& costs);

// The loads and traffic a Plan implies (from its slices and ranges), as simulate_plan prices them.
void plan_loads(const Plan& plan, const AttentionShape& shape, const CostModel& costs, std::vector<RankLoad>& loads,
                std::vector<WaveTraffic>& traffic);

}  // namespace treecp
