#include "plan/gdn_plan.hpp"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "core/error.hpp"

namespace treecp {
namespace {

// Phase of every segment from the chained flags (parents precede children in DFS preorder).
std::vector<int32_t> compute_phases(const Row& row, const std::vector<uint8_t>& chained) {
  std::vector<int32_t> phase(static_cast<size_t>(row.num_segments()), 0);
  for (int32_t s = 0; s < row.num_segments(); ++s) {
    const int32_t p = row.parent(s);
    const int32_t base = p < 0 ? 0 : phase[static_cast<size_t>(p)];
    phase[static_cast<size_t>(s)] = chained[static_cast<size_t>(s)] ? base + 1 : base;
  }
  return phase;
}

}  // namespace

GdnCostModel gdn_costs_from_json(const json::Value& v) {
  GdnCostModel c;
  for (const auto& [key, val] : v.as_object("gdn costs")) {
    if (key == "madds_per_ms") {
      c.madds_per_ms = val.as_double("gdn costs.madds_per_ms");
      require(c.madds_per_ms > 0, "gdn costs.madds_per_ms must be > 0, got ", c.madds_per_ms);
    } else if (key == "link") {
      c.link = link_from_json(val, "gdn costs.link");
    } else if (key == "step_overhead_ms") {
      c.step_overhead_ms = val.as_double("gdn costs.step_overhead_ms");
      require(c.step_overhead_ms >= 0, "gdn costs.step_overhead_ms must be >= 0, got ", c.step_overhead_ms);
    } else if (key == "state_bytes_per_element") {
      c.state_bytes_per_element = val.as_int("gdn costs.state_bytes_per_element");
      require(c.state_bytes_per_element > 0, "gdn costs.state_bytes_per_element must be > 0");
    } else if (key != "note" && key != "source") {
      fail("gdn costs: unknown key '", key, "'");
    }
  }
  return c;
}

GdnCostModel load_gdn_costs(const std::string& path) { return gdn_costs_from_json(json::parse(json::read_file(path))); }

json::Value to_json(const GdnCostModel& c) {
  json::Value v = json::Value::object();
  v.set("madds_per_ms", c.madds_per_ms);
  v.set("link", to_json(c.link));
  v.set("step_overhead_ms", c.step_overhead_ms);
  v.set("state_bytes_per_element", c.state_bytes_per_element);
  return v;
}

// Per chunk of c tokens and one head, forward: cumulative gates and scaled keys ~3 c dk; P and C
// ~c² dk; the triangular solve ~c²(dk + dv)/2; D, output and state advance ~3 c dk dv.
double gdn_forward_madds(const GdnShape& s) {
  const double dk = s.dk, dv = s.dv, c = s.chunk;
  return 3.0 * dk * dv + c * (1.5 * dk + dv) + 3.0 * dk;
}

// Costs of the other passes relative to the chunked forward, measured by bench_gdn (float, GDN gates,
// dk = dv = 64, chunk 64, on the development container): the backward recomputes the chunk-start
// states and the chunk preparation; the state-only backward skips the parameter gradients; the
// summary advances a dk x (dk + dv) map instead of a dk x dv state.
constexpr double kBackwardPerForward = 4.4;
constexpr double kStateOnlyBackwardPerForward = 2.4;
constexpr double kSummaryPerForward = 2.3;

double gdn_token_madds(const GdnShape& s) { return (1.0 + kBackwardPerForward) * gdn_forward_madds(s); }

double gdn_chain_token_extra_madds(const GdnShape& s) {
  return (kSummaryPerForward + kStateOnlyBackwardPerForward) * gdn_forward_madds(s);
}

std::vector<TokenRange> gdn_rank_ranges(const Row& row, const GdnPlan& plan, int rank) {
  std::vector<TokenRange> pieces;
  for (int32_t s = 0; s < row.num_segments(); ++s) {
    if (plan.chained[s]) {
      const int64_t b = plan.cuts[s][rank], e = plan.cuts[s][rank + 1];
      if (b < e) pieces.push_back({b, e});
    } else if (plan.owner[s] == rank) {
      pieces.push_back({row.start(s), row.end(s)});
    }
  }
  // Segments are in physical order, so pieces are sorted; merge neighbours.
  std::vector<TokenRange> out;
  for (const TokenRange& r : pieces) {
    if (!out.empty() && out.back().end == r.begin) out.back().end = r.end;
    else out.push_back(r);
  }
  return out;
}

GdnSchedule gdn_schedule(const Row& row, const GdnPlan& plan) {
  GdnSchedule sc;
  sc.steps = 2 * plan.num_phases - 1;
  sc.transfers.resize(static_cast<size_t>(sc.steps));
  sc.segments.resize(static_cast<size_t>(sc.steps));
  for (int32_t s = 0; s < row.num_segments(); ++s) {
    const int st = plan.step_of(s);
    sc.segments[static_cast<size_t>(st)].push_back(s);
    const int32_t p = row.parent(s);
    if (p >= 0 && (plan.chained[s] || plan.chained[p])) {
      sc.transfers[static_cast<size_t>(st)].push_back({s, plan.holder(p), plan.starter(s)});
    }
  }
  return sc;
}

Ownership gdn_ownership(const Row& row, const GdnPlan& plan) {
  Ownership out(static_cast<size_t>(plan.ranks));
  for (int r = 0; r < plan.ranks; ++r) out[static_cast<size_t>(r)] = gdn_rank_ranges(row, plan, r);
  return out;
}

int GdnPlan::chained_segments() const {
  return static_cast<int>(std::count(chained.begin(), chained.end(), uint8_t{1}));
}

json::Value GdnPlan::to_json() const {
  json::Value v = json::Value::object();
  v.set("ranks", ranks);
  v.set("num_phases", num_phases);
  json::Value segs = json::Value::array();
  for (size_t s = 0; s < chained.size(); ++s) {
    json::Value e = json::Value::object();
    e.set("chained", chained[s] != 0);
    e.set("phase", phase[s]);
    if (chained[s]) {
      json::Value c = json::Value::array();
      for (int64_t x : cuts[s]) c.push_back(x);
      e.set("cuts", std::move(c));
    } else {
      e.set("owner", owner[s]);
    }
    segs.push_back(std::move(e));
  }
  v.set("segments", std::move(segs));
  v.set("predicted_ms", predicted_ms);
  json::Value busy = json::Value::array();
  for (double b : predicted_rank_busy_ms) busy.push_back(b);
  v.set("predicted_rank_busy_ms", std::move(busy));
  return v;
}

GdnPlan GdnPlan::from_json(const json::Value& v) {
  GdnPlan plan;
  plan.ranks = static_cast<int>(v.at("ranks", "gdn plan").as_int("ranks"));
  require(plan.ranks >= 1, "gdn plan: ranks must be >= 1, got ", plan.ranks);
  plan.num_phases = static_cast<int32_t>(v.at("num_phases", "gdn plan").as_int("num_phases"));
  for (const json::Value& e : v.at("segments", "gdn plan").as_array("segments")) {
    const bool chained = e.at("chained", "gdn plan segment").as_bool("chained");
    plan.chained.push_back(chained ? 1 : 0);
    plan.phase.push_back(static_cast<int32_t>(e.at("phase", "gdn plan segment").as_int("phase")));
    std::vector<int64_t> cuts;
    if (chained) {
      for (const json::Value& c : e.at("cuts", "gdn plan segment").as_array("cuts")) cuts.push_back(c.as_int("cut"));
      plan.owner.push_back(-1);
    } else {
      plan.owner.push_back(static_cast<int32_t>(e.at("owner", "gdn plan segment").as_int("owner")));
    }
    plan.cuts.push_back(std::move(cuts));
  }
  if (const json::Value* p = v.find("predicted_ms")) plan.predicted_ms = p->as_double("predicted_ms");
  if (const json::Value* b = v.find("predicted_rank_busy_ms"))
    for (const json::Value& x : b->as_array("predicted_rank_busy_ms"))
      plan.predicted_rank_busy_ms.push_back(x.as_double("busy"));
  return plan;
}

GdnPlan make_gdn_plan(const Row& row, int ranks, const std::vector<uint8_t>& chained) {
  require(ranks >= 1, "gdn plan: ranks must be >= 1, got ", ranks);
  const int32_t n = row.num_segments();
  require(static_cast<int32_t>(chained.size()) == n, "gdn plan: one chained flag per segment expected (", n,
          "), got ", chained.size());
  GdnPlan plan;
  plan.ranks = ranks;
  plan.chained = chained;
  for (auto& c : plan.chained) c = c ? 1 : 0;
  plan.phase = compute_phases(row, plan.chained);
  plan.num_phases = n == 0 ? 1 : *std::max_element(plan.phase.begin(), plan.phase.end()) + 1;
  plan.owner.assign(static_cast<size_t>(n), -1);
  plan.cuts.assign(static_cast<size_t>(n), {});
  const std::vector<int32_t> unit_of = gdn_local_units(row, plan.chained);
  std::vector<int64_t> unit_tokens(static_cast<size_t>(n), 0);
  for (int32_t s = 0; s < n; ++s) {
    if (plan.chained[s]) {
      auto& cuts = plan.cuts[static_cast<size_t>(s)];
      const int64_t b = row.start(s), len = row.length(s);
      for (int r = 0; r <= ranks; ++r) cuts.push_back(b + len * r / ranks);
      continue;
    }
    unit_tokens[unit_of[s]] += row.length(s);
  }
  // Longest unit first onto the least loaded rank of its phase.
  std::vector<int32_t> units;
  for (int32_t s = 0; s < n; ++s)
    if (unit_of[s] == s) units.push_back(s);
  std::stable_sort(units.begin(), units.end(), [&](int32_t a, int32_t b) { return unit_tokens[a] > unit_tokens[b]; });
  std::vector<std::vector<int64_t>> load(static_cast<size_t>(plan.num_phases),
                                         std::vector<int64_t>(static_cast<size_t>(ranks), 0));
  std::vector<int32_t> unit_owner(static_cast<size_t>(n), -1);
  for (int32_t u : units) {
    auto& l = load[static_cast<size_t>(plan.phase[u])];
    const int r = static_cast<int>(std::min_element(l.begin(), l.end()) - l.begin());
    l[static_cast<size_t>(r)] += unit_tokens[u];
    unit_owner[u] = r;
  }
  for (int32_t s = 0; s < n; ++s)
    if (!plan.chained[s]) plan.owner[s] = unit_owner[unit_of[s]];
  return plan;
}

std::vector<int32_t> gdn_local_units(const Row& row, const std::vector<uint8_t>& chained) {
  require(chained.size() == static_cast<size_t>(row.num_segments()), "gdn plan: one chained flag per segment expected (",
          row.num_segments(), "), got ", chained.size());
  // A local segment whose parent is absent or chained starts a unit.
  std::vector<int32_t> unit_of(chained.size(), -1);
  for (int32_t s = 0; s < row.num_segments(); ++s) {
    if (chained[s]) continue;
    const int32_t p = row.parent(s);
    unit_of[s] = (p < 0 || chained[p]) ? s : unit_of[p];
  }
  return unit_of;
}

void validate_gdn_plan(const Row& row, const GdnPlan& plan) {
  const size_t n = static_cast<size_t>(row.num_segments());
  require(plan.ranks >= 1, "gdn plan: ranks must be >= 1");
  require(plan.chained.size() == n && plan.owner.size() == n && plan.cuts.size() == n && plan.phase.size() == n,
          "gdn plan: per-segment arrays must have ", n, " entries");
  require(compute_phases(row, plan.chained) == plan.phase, "gdn plan: phases do not follow from the chained set");
  for (size_t s = 0; s < n; ++s) {
    const int32_t si = static_cast<int32_t>(s);
    if (plan.chained[s]) {
      const auto& c = plan.cuts[s];
      require(c.size() == static_cast<size_t>(plan.ranks) + 1 && c.front() == row.start(si) && c.back() == row.end(si),
              "gdn plan: segment ", s, ": cuts must be ranks + 1 points from its start to its end");
      for (size_t r = 0; r + 1 < c.size(); ++r)
        require(c[r] <= c[r + 1], "gdn plan: segment ", s, ": cuts must not decrease");
    } else {
      require(plan.owner[s] >= 0 && plan.owner[s] < plan.ranks, "gdn plan: segment ", s, ": owner ", plan.owner[s],
              " out of range");
      const int32_t p = row.parent(si);
      require(p < 0 || plan.chained[static_cast<size_t>(p)] || plan.owner[static_cast<size_t>(p)] == plan.owner[s],
              "gdn plan: segment ", s, " must run on its local parent's rank");
    }
  }
}

AffinePlanCosts gdn_plan_costs(const GdnShape& s, const GdnCostModel& m) {
  AffinePlanCosts c;
  c.local_ms_per_token = gdn_token_madds(s) * s.heads / m.madds_per_ms;
  c.chain_ms_per_token = (gdn_token_madds(s) + gdn_chain_token_extra_madds(s)) * s.heads / m.madds_per_ms;
  c.state_elements = static_cast<double>(s.heads) * s.dk * s.dv;
  c.summary_elements = static_cast<double>(s.heads) * s.dk * (s.dk + s.dv);
  c.compose_madds_per_element = s.dk;
  c.bytes_per_element = m.state_bytes_per_element;
  return c;
}

double predict_affine_plan(const Row& row, GdnPlan& plan, const AffinePlanCosts& c, const GdnCostModel& m) {
  const int N = plan.ranks;
  const int32_t n = row.num_segments();
  const double state_bytes = c.state_elements * static_cast<double>(c.bytes_per_element);
  const int rounds = affine_scan_rounds(N);
  const int steps = 2 * plan.num_phases - 1;  // local 0, chain 1, local 1, ...
  std::vector<std::vector<double>> busy(static_cast<size_t>(steps), std::vector<double>(static_cast<size_t>(N), 0.0));
  // Parent-state traffic per step: bytes each rank sends / receives (both directions: forward state,
  // backward gradient, so the same volume twice).
  std::vector<std::vector<double>> sent(busy), recvd(busy);
  std::vector<int> chains_in_step(static_cast<size_t>(steps), 0);
  for (int32_t s = 0; s < n; ++s) {
    const int step = plan.step_of(s);
    auto& b = busy[static_cast<size_t>(step)];
    if (plan.chained[s]) {
      ++chains_in_step[static_cast<size_t>(step)];
      for (int r = 0; r < N; ++r)
        b[r] += static_cast<double>(plan.cuts[s][r + 1] - plan.cuts[s][r]) * c.chain_ms_per_token;
    } else {
      b[plan.owner[s]] += static_cast<double>(row.length(s)) * c.local_ms_per_token;
    }
    const int32_t p = row.parent(s);
    if (p < 0) continue;
    const int dst = plan.starter(s), src = plan.holder(p);
    if (src == dst) continue;
    sent[static_cast<size_t>(step)][src] += 2 * state_bytes;
    recvd[static_cast<size_t>(step)][dst] += 2 * state_bytes;
  }
  // One message of `bytes` over the link (plan/cost.hpp's transfer term: latency + bytes / bandwidth).
  auto message_ms = [&](double bytes) { return m.link.latency_ms + bytes / m.link.bandwidth_bytes_per_ms; };
  double total = 0;
  plan.predicted_rank_busy_ms.assign(static_cast<size_t>(N), 0.0);
  for (int st = 0; st < steps; ++st) {
    double work = 0, traffic = 0;
    bool any = false;
    for (int r = 0; r < N; ++r) {
      work = std::max(work, busy[st][r]);
      traffic = std::max({traffic, sent[st][r], recvd[st][r]});
      plan.predicted_rank_busy_ms[r] += busy[st][r];
      any = any || busy[st][r] > 0;
    }
    // The state exchange: forward states and backward gradients, one round each.
    double comm = traffic > 0 ? m.link.latency_ms + message_ms(traffic) : 0;
    const int chains = chains_in_step[st];
    if (chains > 0 && rounds > 0) {
      // Forward prefix scan and backward suffix scan: each round moves every chain's summary and
      // composes it once.
      const double bytes = chains * c.summary_elements * static_cast<double>(c.bytes_per_element);
      const double compose_ms = chains * c.summary_elements * c.compose_madds_per_element / m.madds_per_ms;
      comm += 2 * rounds * (message_ms(bytes) + compose_ms);
    }
    if (any) total += work + comm + m.step_overhead_ms;
  }
  plan.predicted_ms = total;
  return total;
}

double gdn_predict(const Row& row, GdnPlan& plan, const GdnShape& shape, const GdnCostModel& m) {
  return predict_affine_plan(row, plan, gdn_plan_costs(shape, m), m);
}

int affine_scan_rounds(int ranks) {
  int r = 0;
  while ((1 << r) < ranks) ++r;
  return r;
}

int64_t affine_plan_bytes(const Row& row, const GdnPlan& plan, const AffinePlanCosts& c) {
  const int N = plan.ranks;
  const int64_t state = static_cast<int64_t>(c.state_elements) * c.bytes_per_element;
  const int64_t summary = static_cast<int64_t>(c.summary_elements) * c.bytes_per_element;
  int64_t bytes = 0;
  std::vector<int64_t> chains_in_step(static_cast<size_t>(2 * plan.num_phases - 1), 0);
  for (int32_t s = 0; s < row.num_segments(); ++s) {
    if (plan.chained[s]) ++chains_in_step[static_cast<size_t>(plan.step_of(s))];
    const int32_t p = row.parent(s);
    if (p >= 0 && (plan.chained[s] || plan.chained[p]) && plan.holder(p) != plan.starter(s))
      bytes += 2 * state;
  }
  // Round d of a scan: every position with a successor d positions on sends; forward and backward.
  int64_t sends = 0;
  for (int d = 1; d < N; d *= 2) sends += N - d;
  for (int64_t chains : chains_in_step) bytes += 2 * sends * chains * summary;
  return bytes;
}

GdnPlan search_affine_plan(const Row& row, int ranks, const AffinePlanCosts& costs, const GdnCostModel& model,
                           const std::function<double(const GdnPlan&)>& extra_ms, const GdnPlanVariants& variants) {
  const int32_t n = row.num_segments();
  std::vector<int32_t> by_length(static_cast<size_t>(n));
  std::iota(by_length.begin(), by_length.end(), 0);
  std::stable_sort(by_length.begin(), by_length.end(),
                   [&](int32_t a, int32_t b) { return row.length(a) > row.length(b); });
  auto price = [&](GdnPlan& p) { return predict_affine_plan(row, p, costs, model) + (extra_ms ? extra_ms(p) : 0.0); };
  auto plans = [&](const std::vector<uint8_t>& chained) {
    return variants ? variants(chained) : std::vector<GdnPlan>{make_gdn_plan(row, ranks, chained)};
  };
  std::vector<uint8_t> chained(static_cast<size_t>(n), 0);
  GdnPlan best;
  double best_ms = 0;
  bool have = false;
  const int kmax = ranks > 1 ? std::min<int32_t>(n, 32) : 0;
  for (int k = 0; k <= kmax; ++k) {
    if (k > 0) chained[by_length[k - 1]] = 1;
    for (GdnPlan& cand : plans(chained)) {
      const double ms = price(cand);
      if (!have || ms < best_ms) {
        best = std::move(cand);
        best_ms = ms;
        have = true;
      }
    }
  }
  return best;
}

GdnPlan plan_gdn(const Row& row, int ranks, const GdnShape& shape, const GdnCostModel& model) {
  return search_affine_plan(row, ranks, gdn_plan_costs(shape, model), model);
}

}  // namespace treecp
