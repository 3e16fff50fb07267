// plan/: pure data between the row and the runtime: ownership, the dense, GDN/KDA, Mamba-2 and sparse MLA
// planners, their cost models, and the Plans they produce (no tensor values).
//
// How a Mamba-2 layer runs under context parallelism, and what each way is predicted to cost, beside the
// GDN planner (plan/gdn_plan.hpp), whose chain plans, cost model and pricing it reuses. The token owners
// come as an Ownership (plan/ownership.hpp; a dense plan's is plan_ownership(plan)); the summary
// strategy's layout is gdn_ownership(row, chains).
//
// The layer's inputs and outputs live with the TOKEN OWNERS (`tokens`: the dense attention plan's
// ownership in a hybrid model). Two strategies:
//   TRANSPOSE  one all-to-all moves each owner's x, dt, B, C of heads [head_cuts[r], head_cuts[r+1])
//              to rank r (heads balanced; a rank may hold none when H < ranks), which runs the whole
//              tree for its heads (runtime/mamba2_tree.hpp); a reverse all-to-all brings y home. The
//              backward mirrors both: dy out; dx, ddt, dB, dC back, where a B/C group that several
//              head shards read arrives from each of them and is summed by its token owner.
//   SUMMARY    the tokens move into a chain plan's layout (GdnPlan: chained segments split over the
//              ranks in rank order, local units whole on one rank) and run the affine-state protocol
//              of runtime/affine_cp.hpp with a scalar decay per head (H_out = a H_in + E); the outputs
//              move back. Useful when heads are fewer than ranks.
// Both are priced by one model (bytes moved, rounds of communication, sequential steps, the busiest
// rank's work); `auto` takes the cheaper.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "plan/gdn_plan.hpp"
#include "plan/ownership.hpp"
#include "tree/row.hpp"

namespace treecp {

struct Mamba2Shape {
  int heads = 64;
  int head_dim = 64;    // P
  int groups = 8;       // B/C groups
  int state_dim = 128;  // N
  int element_bytes = 4;
  int chunk = 64;

  // What one token carries into the scan (x, dt, B, C) for heads [h0, h1), in elements.
  int64_t input_elements(int h0, int h1) const;
};

// Multiply-adds of the chunked forward per token and head.
double mamba2_forward_madds(const Mamba2Shape& s);
// Forward + backward per token and head (a token of a local segment or of a head shard).
double mamba2_token_madds(const Mamba2Shape& s);
// Extra per token and head on a chained shard: its summary and the state-only backward.
double mamba2_chain_token_extra_madds(const Mamba2Shape& s);
// The summary strategy's terms for the affine-plan pricing (rows = 1, cols = N·P).
AffinePlanCosts mamba2_plan_costs(const Mamba2Shape& s, const GdnCostModel& model);

// The recurrent-layer coefficients (GdnCostModel's four terms) measured for the Mamba-2 kernels by
// bench_mamba2; config/mamba2_costs_cpu.json holds the same values.
GdnCostModel mamba2_cost_defaults();
GdnCostModel load_mamba2_costs(const std::string& path);

enum class Mamba2Strategy { Transpose, Summary };
const char* strategy_name(Mamba2Strategy s);
// "transpose", "summary", or "auto" (nullopt: the planner chooses); throws naming the choices otherwise.
std::optional<Mamba2Strategy> parse_mamba2_strategy(const std::string& name);

// Rank r holds heads [cuts[r], cuts[r + 1]): ranks + 1 near-equal cut points.
std::vector<int32_t> mamba2_head_cuts(int heads, int ranks);
// The B/C groups [begin, end) that heads [h0, h1) read (empty for no heads).
struct GroupRange {
  int begin = 0, end = 0;
  int size() const { return end - begin; }
};
GroupRange mamba2_groups_of(const Mamba2Shape& s, int h0, int h1);

struct Mamba2Price {
  double ms = 0;              // predicted forward + backward
  double work_ms = 0;         // the busiest rank's compute
  int64_t bytes = 0;          // moved between ranks, forward + backward, summed over ranks
  int64_t max_rank_bytes = 0; // the most any one rank sends plus receives
  int rounds = 0;             // collective rounds, forward + backward (each pays a latency)
  int steps = 0;              // sequential compute steps: depth buckets / DAG steps
};

struct Mamba2Plan {
  Mamba2Strategy strategy = Mamba2Strategy::Transpose;
  int ranks = 1;
  Ownership tokens;               // token owners' ranges (inputs and outputs)
  std::vector<int32_t> head_cuts;  // transpose: ranks + 1 cut points over the heads
  GdnPlan chains;                  // summary: the chain plan its tokens run under
  Mamba2Price transpose_price, summary_price;

  const Mamba2Price& price() const { return strategy == Mamba2Strategy::Transpose ? transpose_price : summary_price; }
};

// Prices both strategies for `tokens` (validated against the row) and picks the cheaper, unless
// `force` names one. The summary's chain plan is searched (search_affine_plan) with the cost of
// moving the tokens into its layout added.
Mamba2Plan plan_mamba2(const Row& row, const Ownership& tokens, const Mamba2Shape& shape, const GdnCostModel& model,
                       std::optional<Mamba2Strategy> force = std::nullopt);

// The chain plan for `chained` whose pieces follow the token owners where they can: each local unit
// on the rank that owns most of its tokens, a chained segment cut where its owners change when they
// ascend along it (otherwise evenly). It moves fewer tokens than make_gdn_plan's, which balances the
// ranks instead; plan_mamba2's search prices both.
GdnPlan mamba2_owner_aligned_plan(const Row& row, const Ownership& tokens, const std::vector<uint8_t>& chained);

// The two prices on their own (plan_mamba2 uses them; benchmarks print them).
Mamba2Price price_mamba2_transpose(const Row& row, const Ownership& tokens, const std::vector<int32_t>& head_cuts,
                                   const Mamba2Shape& shape, const GdnCostModel& model);
Mamba2Price price_mamba2_summary(const Row& row, const Ownership& tokens, GdnPlan& chains, const Mamba2Shape& shape,
                                 const GdnCostModel& model);

}  // namespace treecp
