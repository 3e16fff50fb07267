// plan/: pure data between the row and the runtime: ownership, the dense, GDN/KDA, Mamba-2 and sparse MLA
// planners, their cost models, and the Plans they produce (no tensor values).
//
// A Plan: which rank owns which token chunks, and which stages each rank runs with which remote KV.
// Pure data (no tensor values), JSON round trip, computed once per row and reused by every layer with
// the same geometry. The runtime only executes it.
//
// Waves: a plan has `num_waves` remote waves. Every rank runs stage 0 (local: owned queries against
// owned keys) and then one stage per wave, in order, even when its part of a wave is empty (zero-sized
// exchange) so that every rank enters every collective in the same order. Wave w's KV exchange
// delivers, to each rank, the ranges listed in stages[w + 1].recv[peer]; the sender lists the same
// ranges in its stages[w + 1].send[receiver]. In backward, the dK/dV of exactly those received ranges
// go back to their owner (the mirror of the forward exchange).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "core/json.hpp"
#include "kernels/slice.hpp"
#include "plan/ownership.hpp"

namespace treecp {

// Where a plan's ownership came from: the ownership generators of the planner (plan/planner.hpp, in
// kLayouts; Searched refines the best of the others), or Ring, the ring-attention baseline of
// plan/baselines.hpp, which the planner never produces.
enum class Layout { Contiguous, Zigzag, Perdoc, Family, Searched, Ring };
inline constexpr Layout kLayouts[] = {Layout::Contiguous, Layout::Zigzag, Layout::Perdoc, Layout::Family,
                                      Layout::Searched};
// "contiguous", "zigzag", "perdoc", "family", "searched", "ring".
const char* layout_name(Layout layout);
// The names of kLayouts, in that order: what a --layout option or the Python package accepts.
const std::vector<std::string>& layout_names();
// The layout of a name (any of the six: a plan file may hold a baseline's); throws treecp::Error naming
// the known ones.
Layout parse_layout(std::string_view name);

struct Stage {
  // Visible pairs this stage computes, in canonical token ids: every q row is owned by this rank;
  // k rows are owned (stage 0) or received in this stage's wave (stages >= 1).
  std::vector<Slice> slices;
  // Per peer rank (size cp): KV ranges received from / sent to that peer in this stage's wave.
  // Empty for stage 0. A range is fetched at most once per rank per wave (sorted, disjoint).
  std::vector<std::vector<TokenRange>> recv;
  std::vector<std::vector<TokenRange>> send;
  int64_t pairs = 0;  // sum of slice areas
};

struct RankPlan {
  std::vector<TokenRange> owned;  // sorted, disjoint, unions of whole chunks
  std::vector<Stage> stages;      // size num_waves + 1; stages[0] is local
  // Predictions by the cost model (filled by the planner, reported by the CLI and `treecp run`).
  double predicted_forward_ms = 0.0;
  double predicted_backward_ms = 0.0;
  int64_t owned_tokens() const;
  int64_t pairs() const;
};

struct Plan {
  Layout layout = Layout::Searched;
  int cp = 1;
  int64_t tokens = 0;
  int64_t window = 0;                 // 0 = none; visibility the slices encode
  std::vector<int64_t> chunk_bounds;  // chunk c = [chunk_bounds[c], chunk_bounds[c + 1])
  std::vector<int32_t> chunk_owner;   // rank of each chunk
  int num_waves = 0;
  std::vector<RankPlan> ranks;        // size cp
  int64_t visible_pairs = 0;
  double predicted_makespan_ms = 0.0;
  // The backward's remote KV: kept from the forward (more memory) or fetched again, one wave ahead (more
  // traffic); priced by the cost model, chosen by the planner (PlanOptions::backward_kv).
  bool refetch_backward = false;
};

class Row;

// Who holds which tokens under the plan: ranks[r].owned for every rank.
Ownership plan_ownership(const Plan& plan);

// Checks that a plan fits the row and window and is executable: rank count (expected_cp > 0 also
// checks it against the communicator size), token count, chunk bounds and owners, owned ranges,
// recv/send mirror, one fetch per range per rank per wave, slices inside owned or received ranges,
// stage pair counts, and that every visible pair is computed exactly once (per row slice areas,
// overlaps checked exactly; never O(S^2), never per chunk pair). Throws treecp::Error whose
// message starts with "plan:" and names the rank, stage and slice at fault.
void validate_plan(const Plan& plan, const Row& row, int64_t window, int expected_cp = 0);

// JSON form (docs: plan_to_json). Keys: layout, cp, tokens, window, num_waves, visible_pairs,
// predicted_makespan_ms, backward_kv ("keep" | "refetch"), chunk_bounds, chunk_owner, ranks[] {rank, owned_ranges [[b, e]...],
// owned_tokens, pairs, predicted_forward_ms, predicted_backward_ms, stages[] {wave, pairs,
// remote_ranges [[b, e]...] (derived: all received ranges, sorted), recv/send [per peer [[b, e]...]],
// slices [[q_begin, q_end, k_begin, k_end, diag_min, diag_max]...]}}.
json::Value plan_to_json(const Plan& plan);
// Reads what plan_to_json writes (extra keys are ignored); throws treecp::Error on a malformed plan.
// Structure only: call validate_plan against the row before executing it.
Plan plan_from_json(const json::Value& v);
Plan plan_from_json_text(std::string_view text);

}  // namespace treecp
