#include "plan/baselines.hpp"

#include <algorithm>

#include "core/error.hpp"
#include "plan/planner.hpp"
#include "tree/row.hpp"
#include "tree/slice.hpp"

namespace treecp {

Plan ring_plan(const Row& row, int cp, const AttentionShape& shape, const CostModel& costs) {
  const int64_t window = shape.window;
  require(cp >= 1, "ring_plan: cp must be >= 1, got ", cp);
  const int64_t S = row.tokens();
  PlanOptions opt;
  opt.layout = Layout::Zigzag;
  opt.chunk_tokens = std::max<int64_t>(1, (S + 2 * cp - 1) / (2 * cp));
  Plan plan = make_plan(row, cp, shape, costs, opt);  // the zigzag ownership; its schedule is replaced below
  plan.layout = Layout::Ring;
  plan.num_waves = cp - 1;
  const std::vector<int64_t>& bounds = plan.chunk_bounds;
  for (int r = 0; r < cp; ++r) {
    RankPlan& rp = plan.ranks[static_cast<size_t>(r)];
    rp.stages.assign(static_cast<size_t>(cp), Stage{});
    for (Stage& st : rp.stages) {
      st.recv.assign(static_cast<size_t>(cp), {});
      st.send.assign(static_cast<size_t>(cp), {});
    }
  }
  // wave w: rank r receives everything rank (r - 1 - w) mod cp owns
  for (int r = 0; r < cp; ++r) {
    for (int w = 0; w + 1 < cp; ++w) {
      const int p = ((r - 1 - w) % cp + cp) % cp;
      plan.ranks[static_cast<size_t>(r)].stages[static_cast<size_t>(w) + 1].recv[static_cast<size_t>(p)] =
          plan.ranks[static_cast<size_t>(p)].owned;
      plan.ranks[static_cast<size_t>(p)].stages[static_cast<size_t>(w) + 1].send[static_cast<size_t>(r)] =
          plan.ranks[static_cast<size_t>(p)].owned;
    }
  }
  // Each visible pair computed by its query's owner, in the stage where its key's owner's KV arrives.
  auto owner_of = [&](int64_t t) {
    const auto it = std::upper_bound(bounds.begin(), bounds.end(), t);
    return plan.chunk_owner[static_cast<size_t>(it - bounds.begin() - 1)];
  };
  for (const Slice& s : split_slices(row_slices(row, window), bounds)) {
    const int q = owner_of(s.q_begin), k = owner_of(s.k_begin);
    const int stage = q == k ? 0 : ((q - k - 1) % cp + cp) % cp + 1;
    Stage& st = plan.ranks[static_cast<size_t>(q)].stages[static_cast<size_t>(stage)];
    st.slices.push_back(s);
    st.pairs += s.area();
  }
  const Prediction pred = simulate_plan(plan, shape, costs);
  for (int r = 0; r < cp; ++r) {
    plan.ranks[static_cast<size_t>(r)].predicted_forward_ms = pred.forward_ms[static_cast<size_t>(r)];
    plan.ranks[static_cast<size_t>(r)].predicted_backward_ms = pred.backward_ms[static_cast<size_t>(r)];
  }
  plan.predicted_makespan_ms = pred.makespan_ms;
  validate_plan(plan, row, window, cp);
  return plan;
}

}  // namespace treecp
