#include "plan/mamba2_plan.hpp"

#include <algorithm>

#include "core/error.hpp"
#include "core/json.hpp"
#include "plan/ownership.hpp"

namespace treecp {
namespace {

// Measured by bench_mamba2 (float, N = 128, P = 64, chunk 64, one core of the development
// container, CPU time): the backward recomputes the chunk-start states and the intra-chunk
// products; the summary is the forward without outputs; the state-only backward only carries dH.
constexpr double kBackwardPerForward = 2.5;
constexpr double kSummaryPerForward = 0.33;
constexpr double kStateOnlyBackwardPerForward = 0.7;

// One all-to-all's elements per rank, and the four exchanges of a layer (forward in and out,
// backward in and out) summed into a price.
struct Exchange {
  std::vector<int64_t> sent, recvd;
  explicit Exchange(int n) : sent(static_cast<size_t>(n), 0), recvd(static_cast<size_t>(n), 0) {}
  void move(int from, int to, int64_t elements) {
    if (from == to) return;
    sent[static_cast<size_t>(from)] += elements;
    recvd[static_cast<size_t>(to)] += elements;
  }
};

void add_exchanges(const std::vector<Exchange>& xs, int element_bytes, const GdnCostModel& m, Mamba2Price& price,
                   double& comm_ms) {
  for (const Exchange& x : xs) {
    int64_t busiest = 0;
    for (size_t r = 0; r < x.sent.size(); ++r) {
      price.bytes += x.sent[r] * element_bytes;
      busiest = std::max({busiest, x.sent[r], x.recvd[r]});
    }
    comm_ms += link_message_ms(m.link, static_cast<double>(busiest * element_bytes));
    ++price.rounds;
  }
}

// Moving the tokens from `from` to `to` and back (forward: inputs in, y out; backward: dy in,
// gradients out). Nothing is exchanged when no token changes rank.
void price_redistribution(const Ownership& from, const Ownership& to, const Mamba2Shape& s, const GdnCostModel& m,
                          Mamba2Price& price, double& comm_ms) {
  const TokenMovePrice move = price_token_move(from, to, s.input_elements(0, s.heads),
                                               static_cast<int64_t>(s.heads) * s.head_dim, s.element_bytes, m.link);
  price.bytes += move.bytes;
  price.rounds += move.rounds;
  comm_ms += move.ms;
}

}  // namespace

int64_t Mamba2Shape::input_elements(int h0, int h1) const {
  return static_cast<int64_t>(h1 - h0) * (head_dim + 1) +
         2 * static_cast<int64_t>(mamba2_groups_of(*this, h0, h1).size()) * state_dim;
}

// Per chunk of c tokens and one head: C·B ~c² N/2, the intra-chunk mix ~c² P/2, the read of the
// incoming state and the write into the outgoing one N P each per token.
double mamba2_forward_madds(const Mamba2Shape& s) {
  const double N = s.state_dim, P = s.head_dim, c = s.chunk;
  return 2.0 * N * P + c * (N + P) / 2.0;
}

double mamba2_token_madds(const Mamba2Shape& s) { return (1.0 + kBackwardPerForward) * mamba2_forward_madds(s); }

double mamba2_chain_token_extra_madds(const Mamba2Shape& s) {
  return (kSummaryPerForward + kStateOnlyBackwardPerForward) * mamba2_forward_madds(s);
}

AffinePlanCosts mamba2_plan_costs(const Mamba2Shape& s, const GdnCostModel& m) {
  AffinePlanCosts c;
  c.local_ms_per_token = mamba2_token_madds(s) * s.heads / m.madds_per_ms;
  c.chain_ms_per_token = (mamba2_token_madds(s) + mamba2_chain_token_extra_madds(s)) * s.heads / m.madds_per_ms;
  const double state = static_cast<double>(s.state_dim) * s.head_dim;
  c.state_elements = s.heads * state;
  c.summary_elements = s.heads * (1 + state);  // the decay a, then E
  c.compose_madds_per_element = 1;
  c.bytes_per_element = s.element_bytes;
  return c;
}

GdnCostModel mamba2_cost_defaults() {
  GdnCostModel m;
  m.madds_per_ms = 1e6 / 0.067;  // 0.067 ns per multiply-add
  m.link = {0.0011, 6.7e5};
  m.step_overhead_ms = 0.005;
  return m;
}

GdnCostModel load_mamba2_costs(const std::string& path) {
  return load_gdn_costs(path);
}

const char* strategy_name(Mamba2Strategy s) { return s == Mamba2Strategy::Transpose ? "transpose" : "summary"; }

std::optional<Mamba2Strategy> parse_mamba2_strategy(const std::string& name) {
  if (name == "transpose") return Mamba2Strategy::Transpose;
  if (name == "summary") return Mamba2Strategy::Summary;
  require(name == "auto", "strategy must be transpose, summary or auto; got '", name, "'");
  return std::nullopt;
}

std::vector<int32_t> mamba2_head_cuts(int heads, int ranks) {
  require(heads >= 1 && ranks >= 1, "mamba2 head cuts: heads and ranks must be >= 1, got ", heads, " and ", ranks);
  std::vector<int32_t> cuts(static_cast<size_t>(ranks) + 1);
  for (int r = 0; r <= ranks; ++r) cuts[static_cast<size_t>(r)] = static_cast<int32_t>(int64_t{heads} * r / ranks);
  return cuts;
}

GroupRange mamba2_groups_of(const Mamba2Shape& s, int h0, int h1) {
  if (h1 <= h0) return {};
  const int per = s.heads / s.groups;
  return {h0 / per, (h1 - 1) / per + 1};
}

GdnPlan mamba2_owner_aligned_plan(const Row& row, const Ownership& tokens, const std::vector<uint8_t>& chained) {
  const int n = static_cast<int>(tokens.size());
  GdnPlan plan = make_gdn_plan(row, n, chained);
  std::vector<int32_t> owner_of(static_cast<size_t>(row.tokens()), 0);
  for (int r = 0; r < n; ++r)
    for (const TokenRange& t : tokens[static_cast<size_t>(r)])
      std::fill(owner_of.begin() + t.begin, owner_of.begin() + t.end, r);
  const std::vector<int32_t> unit_of = gdn_local_units(row, chained);
  std::vector<std::vector<int64_t>> held(static_cast<size_t>(row.num_segments()));
  for (int32_t s = 0; s < row.num_segments(); ++s) {
    const int64_t b = row.start(s), e = row.end(s);
    if (!chained[s]) {
      auto& h = held[static_cast<size_t>(unit_of[s])];
      h.resize(static_cast<size_t>(n), 0);
      for (int64_t t = b; t < e; ++t) ++h[static_cast<size_t>(owner_of[t])];
      continue;
    }
    if (!std::is_sorted(owner_of.begin() + b, owner_of.begin() + e)) continue;
    auto& pieces = plan.pieces[static_cast<size_t>(s)];
    for (int r = 0; r + 1 < n; ++r) {
      const int64_t cut = std::lower_bound(owner_of.begin() + b, owner_of.begin() + e, r + 1) - owner_of.begin();
      pieces[static_cast<size_t>(r)].end = cut;
      pieces[static_cast<size_t>(r) + 1].begin = cut;
    }
  }
  for (int32_t s = 0; s < row.num_segments(); ++s) {
    if (chained[s]) continue;
    const auto& h = held[static_cast<size_t>(unit_of[s])];
    plan.owner[s] = static_cast<int32_t>(std::max_element(h.begin(), h.end()) - h.begin());
  }
  return plan;
}

Mamba2Price price_mamba2_transpose(const Row& row, const Ownership& tokens, const std::vector<int32_t>& cuts,
                                   const Mamba2Shape& s, const GdnCostModel& m) {
  const int n = static_cast<int>(tokens.size());
  require(static_cast<int>(cuts.size()) == n + 1 && cuts.front() == 0 && cuts.back() == s.heads,
          "mamba2 transpose: head cuts must be ranks + 1 points from 0 to ", s.heads);
  Mamba2Price price;
  double comm_ms = 0;
  std::vector<Exchange> xs(4, Exchange(n));
  for (int j = 0; j < n; ++j) {
    const int h0 = cuts[static_cast<size_t>(j)], h1 = cuts[static_cast<size_t>(j) + 1];
    const int64_t in = s.input_elements(h0, h1), out = static_cast<int64_t>(h1 - h0) * s.head_dim;
    for (int i = 0; i < n; ++i) {
      const int64_t t = tokens_of(tokens[static_cast<size_t>(i)]);
      xs[0].move(i, j, t * in);   // x, dt, B, C to the head owner
      xs[1].move(j, i, t * out);  // y home
      xs[2].move(i, j, t * out);  // dy to the head owner
      xs[3].move(j, i, t * in);   // dx, ddt, dB, dC home
    }
    price.work_ms = std::max(price.work_ms, static_cast<double>(row.tokens()) * (h1 - h0) * mamba2_token_madds(s) /
                                                m.madds_per_ms);
  }
  if (n > 1) add_exchanges(xs, s.element_bytes, m, price, comm_ms);
  price.steps = row.num_segments() ? row.max_depth() : 0;
  price.ms = price.work_ms + comm_ms + price.steps * m.step_overhead_ms;
  return price;
}

Mamba2Price price_mamba2_summary(const Row& row, const Ownership& tokens, GdnPlan& chains, const Mamba2Shape& s,
                                 const GdnCostModel& m) {
  const AffinePlanCosts costs = mamba2_plan_costs(s, m);
  Mamba2Price price;
  double comm_ms = 0;
  price_redistribution(tokens, gdn_ownership(row, chains), s, m, price, comm_ms);
  const double affine_ms = predict_affine_plan(row, chains, costs, m);
  price.bytes += affine_plan_bytes(row, chains, costs);
  for (double b : chains.predicted_rank_busy_ms) price.work_ms = std::max(price.work_ms, b);
  price.steps = 2 * chains.num_phases - 1;
  price.rounds += 2 * price.steps + 2 * affine_plan_scan_rounds(row, chains);
  price.ms = affine_ms + comm_ms;
  return price;
}

Mamba2Plan plan_mamba2(const Row& row, const Ownership& tokens, const Mamba2Shape& s, const GdnCostModel& m,
                       std::optional<Mamba2Strategy> force) {
  require(s.heads >= 1 && s.groups >= 1 && s.heads % s.groups == 0, "mamba2 plan: heads (", s.heads,
          ") must be a positive multiple of groups (", s.groups, ")");
  require(s.head_dim >= 1 && s.state_dim >= 1 && s.chunk >= 1 && s.element_bytes >= 1,
          "mamba2 plan: head_dim, state_dim, chunk and element_bytes must be >= 1");
  require(!tokens.empty(), "mamba2 plan: the token layout needs at least one rank");
  validate_ownership(tokens, row.tokens());
  Mamba2Plan plan;
  plan.ranks = static_cast<int>(tokens.size());
  plan.tokens = tokens;
  plan.head_cuts = mamba2_head_cuts(s.heads, plan.ranks);
  plan.transpose_price = price_mamba2_transpose(row, tokens, plan.head_cuts, s, m);
  // The chain plan that is cheapest including the move into its layout.
  plan.chains = search_affine_plan(
      row, plan.ranks, mamba2_plan_costs(s, m), m,
      [&](const GdnPlan& cand) {
        Mamba2Price p;
        double ms = 0;
        price_redistribution(tokens, gdn_ownership(row, cand), s, m, p, ms);
        return ms;
      },
      [&](const std::vector<uint8_t>& chained) {
        return std::vector<GdnPlan>{make_gdn_plan(row, plan.ranks, chained),
                                    mamba2_owner_aligned_plan(row, tokens, chained)};
      });
  plan.summary_price = price_mamba2_summary(row, tokens, plan.chains, s, m);
  plan.strategy = force ? *force
                        : plan.summary_price.ms < plan.transpose_price.ms ? Mamba2Strategy::Summary
                                                                          : Mamba2Strategy::Transpose;
  return plan;
}

}  // namespace treecp
