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
      for (const GdnPiece& p : plan.pieces[s])
        if (p.rank == rank && p.begin < p.end) pieces.push_back({p.begin, p.end});
    } else if (plan.owner[s] == rank) {
      pieces.push_back({row.start(s), row.end(s)});
    }
  }
  // Segments are in physical order and a chain's pieces in token order, so pieces are sorted; merge
  // neighbours.
  std::vector<TokenRange> out;
  for (const TokenRange& r : pieces) {
    if (!out.empty() && out.back().end == r.begin) out.back().end = r.end;
    else out.push_back(r);
  }
  return out;
}

std::vector<GdnPiece> gdn_chain_runs(const GdnPlan& plan, int32_t s) {
  std::vector<GdnPiece> runs;
  for (const GdnPiece& p : plan.pieces[static_cast<size_t>(s)]) {
    if (!runs.empty() && runs.back().rank == p.rank) runs.back().end = p.end;
    else runs.push_back(p);
  }
  return runs;
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
  v.set("layout", gdn_layout_name(layout));
  v.set("num_phases", num_phases);
  json::Value segs = json::Value::array();
  for (size_t s = 0; s < chained.size(); ++s) {
    json::Value e = json::Value::object();
    e.set("chained", chained[s] != 0);
    e.set("phase", phase[s]);
    if (chained[s]) {
      json::Value ps = json::Value::array();
      for (const GdnPiece& p : pieces[s]) {
        json::Value one = json::Value::array();
        one.push_back(p.rank);
        one.push_back(p.begin);
        one.push_back(p.end);
        ps.push_back(std::move(one));
      }
      e.set("pieces", std::move(ps));
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
  if (const json::Value* l = v.find("layout")) plan.layout = parse_gdn_layout(l->as_string("gdn plan layout"));
  plan.num_phases = static_cast<int32_t>(v.at("num_phases", "gdn plan").as_int("num_phases"));
  for (const json::Value& e : v.at("segments", "gdn plan").as_array("segments")) {
    const size_t s = plan.chained.size();
    const bool chained = e.at("chained", "gdn plan segment").as_bool("chained");
    plan.chained.push_back(chained ? 1 : 0);
    plan.phase.push_back(static_cast<int32_t>(e.at("phase", "gdn plan segment").as_int("phase")));
    std::vector<GdnPiece> pieces;
    if (chained) {
      if (const json::Value* ps = e.find("pieces")) {
        for (const json::Value& p : ps->as_array("pieces")) {
          const auto& a = p.as_array("piece");
          require(a.size() == 3, "gdn plan: segment ", s, ": piece ", pieces.size(),
                  " must be [rank, begin, end], got ", a.size(), " numbers");
          pieces.push_back({static_cast<int32_t>(a[0].as_int("piece rank")), a[1].as_int("piece begin"),
                            a[2].as_int("piece end")});
        }
      } else {
        // The older form: ranks + 1 cut points, rank r holding [cuts[r], cuts[r+1]).
        std::vector<int64_t> cuts;
        for (const json::Value& c : e.at("cuts", "gdn plan segment").as_array("cuts")) cuts.push_back(c.as_int("cut"));
        require(cuts.size() == static_cast<size_t>(plan.ranks) + 1, "gdn plan: segment ", s,
                ": cuts must be ranks + 1 points, got ", cuts.size());
        for (int r = 0; r < plan.ranks; ++r) pieces.push_back({r, cuts[r], cuts[r + 1]});
      }
      plan.owner.push_back(-1);
    } else {
      plan.owner.push_back(static_cast<int32_t>(e.at("owner", "gdn plan segment").as_int("owner")));
    }
    plan.pieces.push_back(std::move(pieces));
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
  plan.pieces.assign(static_cast<size_t>(n), {});
  const std::vector<int32_t> unit_of = gdn_local_units(row, plan.chained);
  std::vector<int64_t> unit_tokens(static_cast<size_t>(n), 0);
  for (int32_t s = 0; s < n; ++s) {
    if (plan.chained[s]) {
      auto& pieces = plan.pieces[static_cast<size_t>(s)];
      const int64_t b = row.start(s), len = row.length(s);
      for (int r = 0; r < ranks; ++r) pieces.push_back({r, b + len * r / ranks, b + len * (r + 1) / ranks});
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
  require(plan.chained.size() == n && plan.owner.size() == n && plan.pieces.size() == n && plan.phase.size() == n,
          "gdn plan: per-segment arrays must have ", n, " entries");
  require(compute_phases(row, plan.chained) == plan.phase, "gdn plan: phases do not follow from the chained set");
  const int32_t num_phases = n == 0 ? 1 : *std::max_element(plan.phase.begin(), plan.phase.end()) + 1;
  require(plan.num_phases == num_phases, "gdn plan: num_phases is ", plan.num_phases, ", the phases need ", num_phases);
  for (size_t s = 0; s < n; ++s) {
    const int32_t si = static_cast<int32_t>(s);
    if (plan.chained[s]) {
      const auto& ps = plan.pieces[s];
      require(!ps.empty(), "gdn plan: segment ", s, ": a chained segment needs at least one piece");
      int64_t at = row.start(si);
      for (size_t i = 0; i < ps.size(); ++i) {
        require(ps[i].rank >= 0 && ps[i].rank < plan.ranks, "gdn plan: segment ", s, ": piece ", i, ": rank ",
                ps[i].rank, " out of range [0, ", plan.ranks, ")");
        require(ps[i].begin == at && ps[i].end >= ps[i].begin, "gdn plan: segment ", s, ": piece ", i, ": [",
                ps[i].begin, ", ", ps[i].end, ") must start at ", at, " and not end before it (pieces cover the ",
                "segment [", row.start(si), ", ", row.end(si), ") in token order)");
        at = ps[i].end;
      }
      require(at == row.end(si), "gdn plan: segment ", s, ": its pieces end at ", at, ", the segment at ",
              row.end(si));
    } else {
      require(plan.pieces[s].empty(), "gdn plan: segment ", s, ": a local segment has no pieces");
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

namespace {

// One round of a chain step's scan in the forward direction, per rank (round d: the run at position k
// of a chain sends its aggregate to the run at k + d; the backward mirrors it, receivers sending):
// summaries that cross to another rank, sent and received, and summaries arriving at all (each is
// composed; a rank's run may feed its own later run).
struct ScanRound {
  std::vector<int64_t> sent, received, composed_fwd, composed_bwd;
  explicit ScanRound(int ranks)
      : sent(static_cast<size_t>(ranks), 0), received(sent), composed_fwd(sent), composed_bwd(sent) {}
};

// The rounds of one chain step's scan over the runs of its chains.
std::vector<ScanRound> chain_step_rounds(const std::vector<std::vector<GdnPiece>>& runs, int ranks) {
  size_t longest = 0;
  for (const auto& r : runs) longest = std::max(longest, r.size());
  std::vector<ScanRound> rounds;
  for (size_t d = 1; d < longest; d *= 2) {
    ScanRound round(ranks);
    for (const auto& r : runs)
      for (size_t k = 0; k + d < r.size(); ++k) {
        const int from = r[k].rank, to = r[k + d].rank;
        ++round.composed_fwd[static_cast<size_t>(to)];
        ++round.composed_bwd[static_cast<size_t>(from)];
        if (from == to) continue;
        ++round.sent[static_cast<size_t>(from)];
        ++round.received[static_cast<size_t>(to)];
      }
    rounds.push_back(std::move(round));
  }
  return rounds;
}

// Per chain step (index = DAG step), the runs of its chains.
std::vector<std::vector<std::vector<GdnPiece>>> runs_by_step(const Row& row, const GdnPlan& plan) {
  std::vector<std::vector<std::vector<GdnPiece>>> out(static_cast<size_t>(2 * plan.num_phases - 1));
  for (int32_t s = 0; s < row.num_segments(); ++s)
    if (plan.chained[s]) out[static_cast<size_t>(plan.step_of(s))].push_back(gdn_chain_runs(plan, s));
  return out;
}

}  // namespace

double link_message_ms(const Link& link, double bytes) { return link.latency_ms + bytes / link.bandwidth_bytes_per_ms; }

double predict_affine_plan(const Row& row, GdnPlan& plan, const AffinePlanCosts& c, const GdnCostModel& m) {
  const int N = plan.ranks;
  const int32_t n = row.num_segments();
  const double state_bytes = c.state_elements * static_cast<double>(c.bytes_per_element);
  const double summary_bytes = c.summary_elements * static_cast<double>(c.bytes_per_element);
  const double compose_ms = c.summary_elements * c.compose_madds_per_element / m.madds_per_ms;
  const int steps = 2 * plan.num_phases - 1;  // local 0, chain 1, local 1, ...
  std::vector<std::vector<double>> busy(static_cast<size_t>(steps), std::vector<double>(static_cast<size_t>(N), 0.0));
  // Parent-state traffic per step: bytes each rank sends / receives (both directions: forward state,
  // backward gradient, so the same volume twice).
  std::vector<std::vector<double>> sent(busy), recvd(busy);
  for (int32_t s = 0; s < n; ++s) {
    const int step = plan.step_of(s);
    auto& b = busy[static_cast<size_t>(step)];
    if (plan.chained[s]) {
      for (const GdnPiece& p : plan.pieces[s]) b[p.rank] += static_cast<double>(p.size()) * c.chain_ms_per_token;
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
  const auto step_runs = runs_by_step(row, plan);
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
    double comm = traffic > 0 ? m.link.latency_ms + link_message_ms(m.link, traffic) : 0;
    // Forward prefix scan and backward suffix scan: each round moves the busiest rank's summaries and
    // composes what arrives.
    for (const ScanRound& round : chain_step_rounds(step_runs[static_cast<size_t>(st)], N)) {
      int64_t wire = 0, fwd = 0, bwd = 0;
      for (int r = 0; r < N; ++r) {
        wire = std::max({wire, round.sent[r], round.received[r]});
        fwd = std::max(fwd, round.composed_fwd[r]);
        bwd = std::max(bwd, round.composed_bwd[r]);
      }
      const double message = wire > 0 ? link_message_ms(m.link, static_cast<double>(wire) * summary_bytes) : 0;
      comm += 2 * message + static_cast<double>(fwd + bwd) * compose_ms;
    }
    if (any) total += work + comm + m.step_overhead_ms;
  }
  plan.predicted_ms = total;
  return total;
}

double gdn_predict(const Row& row, GdnPlan& plan, const GdnShape& shape, const GdnCostModel& m) {
  return predict_affine_plan(row, plan, gdn_plan_costs(shape, m), m);
}

int affine_scan_rounds(int positions) {
  int r = 0;
  while ((1 << r) < positions) ++r;
  return r;
}

int affine_plan_scan_rounds(const Row& row, const GdnPlan& plan) {
  int rounds = 0;
  for (const auto& runs : runs_by_step(row, plan)) {
    size_t longest = 0;
    for (const auto& r : runs) longest = std::max(longest, r.size());
    rounds += affine_scan_rounds(static_cast<int>(longest));
  }
  return rounds;
}

int64_t affine_plan_bytes(const Row& row, const GdnPlan& plan, const AffinePlanCosts& c) {
  const int64_t state = static_cast<int64_t>(c.state_elements) * c.bytes_per_element;
  const int64_t summary = static_cast<int64_t>(c.summary_elements) * c.bytes_per_element;
  int64_t bytes = 0;
  for (int32_t s = 0; s < row.num_segments(); ++s) {
    const int32_t p = row.parent(s);
    if (p >= 0 && (plan.chained[s] || plan.chained[p]) && plan.holder(p) != plan.starter(s))
      bytes += 2 * state;
  }
  // Every summary a scan round sends to another rank, forward and backward.
  for (const auto& runs : runs_by_step(row, plan))
    for (const ScanRound& round : chain_step_rounds(runs, plan.ranks))
      for (int64_t x : round.sent) bytes += 2 * x * summary;
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

TokenMovePrice price_token_move(const Ownership& from, const Ownership& to, int64_t in_elements,
                                int64_t out_elements, int64_t bytes_per_element, const Link& link) {
  require(from.size() == to.size(), "token move: ownerships for ", from.size(), " and ", to.size(), " ranks");
  TokenMovePrice price;
  if (!tokens_move(from, to)) return price;
  const size_t n = from.size();
  // Forward: inputs in, outputs back; backward: output gradients in, input gradients back.
  struct Exchange {
    std::vector<int64_t> sent, recvd;
  };
  std::vector<Exchange> xs(4, Exchange{std::vector<int64_t>(n, 0), std::vector<int64_t>(n, 0)});
  auto move = [&](Exchange& x, size_t src, size_t dst, int64_t elements) {
    x.sent[src] += elements;
    x.recvd[dst] += elements;
  };
  for (size_t i = 0; i < n; ++i)
    for (size_t j = 0; j < n; ++j) {
      if (i == j) continue;
      const int64_t t = tokens_of(intersect(from[i], to[j]));
      move(xs[0], i, j, t * in_elements);
      move(xs[1], j, i, t * out_elements);
      move(xs[2], i, j, t * out_elements);
      move(xs[3], j, i, t * in_elements);
    }
  for (const Exchange& x : xs) {
    int64_t busiest = 0;
    for (size_t r = 0; r < n; ++r) {
      price.bytes += x.sent[r] * bytes_per_element;
      busiest = std::max({busiest, x.sent[r], x.recvd[r]});
    }
    price.ms += link_message_ms(link, static_cast<double>(busiest * bytes_per_element));
    ++price.rounds;
  }
  return price;
}

TokenMovePrice gdn_move_price(const Row& row, const GdnPlan& plan, const Ownership& attention, const GdnShape& s,
                              const GdnCostModel& m, int64_t activation_bytes_per_element) {
  const int64_t in = 2 * s.qk_width() + s.v_width() + s.g_width() + s.heads;  // q, k, v, g, beta
  return price_token_move(attention, gdn_ownership(row, plan), in, s.v_width(), activation_bytes_per_element, m.link);
}

const char* gdn_layout_name(GdnLayout layout) {
  switch (layout) {
    case GdnLayout::Searched: return "searched";
    case GdnLayout::Contiguous: return "contiguous";
    case GdnLayout::Zigzag: return "zigzag";
    case GdnLayout::DocZigzag: return "doc-zigzag";
    case GdnLayout::Attention: return "attention";
  }
  return "?";
}

const std::vector<std::string>& gdn_layout_names() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> v;
    for (GdnLayout l : kGdnLayouts) v.emplace_back(gdn_layout_name(l));
    return v;
  }();
  return names;
}

GdnLayout parse_gdn_layout(std::string_view name) {
  for (GdnLayout l : {GdnLayout::Searched, GdnLayout::Contiguous, GdnLayout::Zigzag, GdnLayout::DocZigzag,
                      GdnLayout::Attention})
    if (name == gdn_layout_name(l)) return l;
  fail("gdn layout: unknown '", name, "' (known: searched, contiguous, zigzag, doc-zigzag, attention)");
}

GdnPlan gdn_plan_for_ownership(const Row& row, const Ownership& ownership) {
  require(!ownership.empty(), "gdn plan: the ownership needs at least one rank");
  validate_ownership(ownership, row.tokens());
  struct Held {
    int64_t begin, end;
    int32_t rank;
  };
  std::vector<Held> held;
  for (size_t r = 0; r < ownership.size(); ++r)
    for (const TokenRange& t : ownership[r]) held.push_back({t.begin, t.end, static_cast<int32_t>(r)});
  std::sort(held.begin(), held.end(), [](const Held& a, const Held& b) { return a.begin < b.begin; });
  const int32_t n = row.num_segments();
  GdnPlan plan;
  plan.ranks = static_cast<int>(ownership.size());
  plan.layout = GdnLayout::Attention;
  plan.chained.assign(static_cast<size_t>(n), 0);
  plan.owner.assign(static_cast<size_t>(n), -1);
  plan.pieces.assign(static_cast<size_t>(n), {});
  size_t h = 0;
  for (int32_t s = 0; s < n; ++s) {
    const int64_t b = row.start(s), e = row.end(s);
    while (held[h].end <= b) ++h;
    std::vector<GdnPiece> pieces;
    for (size_t i = h; i < held.size() && held[i].begin < e; ++i) {
      const GdnPiece p{held[i].rank, std::max(b, held[i].begin), std::min(e, held[i].end)};
      if (!pieces.empty() && pieces.back().rank == p.rank) pieces.back().end = p.end;
      else pieces.push_back(p);
    }
    const int32_t parent = row.parent(s);
    // Parents precede children: a local parent's owner is known here.
    const bool local = pieces.size() == 1 && (parent < 0 || plan.chained[parent] || plan.owner[parent] == pieces[0].rank);
    if (local) {
      plan.owner[s] = pieces[0].rank;
    } else {
      plan.chained[s] = 1;
      plan.pieces[s] = std::move(pieces);
    }
  }
  plan.phase = compute_phases(row, plan.chained);
  plan.num_phases = n == 0 ? 1 : *std::max_element(plan.phase.begin(), plan.phase.end()) + 1;
  return plan;
}

int64_t gdn_doc_zigzag_min_tokens(const Row& row, int ranks) {
  const int64_t pieces = 2 * int64_t{ranks};
  return std::max(pieces, (row.tokens() + pieces - 1) / pieces);
}

std::vector<GdnPiece> gdn_zigzag_pieces(const Row& row, int32_t s, int ranks) {
  const int64_t b = row.start(s), len = row.length(s), pieces = 2 * int64_t{ranks};
  std::vector<GdnPiece> out;
  for (int64_t j = 0; j < pieces; ++j) {
    // Piece j of 2R: rank j on the way out, rank 2R-1-j on the way back.
    const GdnPiece p{static_cast<int32_t>(j < ranks ? j : pieces - 1 - j), b + len * j / pieces,
                     b + len * (j + 1) / pieces};
    if (!out.empty() && out.back().rank == p.rank) out.back().end = p.end;
    else out.push_back(p);
  }
  return out;
}

namespace {

// The plan with every chain's pieces laid zigzag-wise (gdn_zigzag_pieces), its local units kept.
GdnPlan zigzag_chains(const Row& row, GdnPlan plan) {
  for (int32_t s = 0; s < row.num_segments(); ++s)
    if (plan.chained[s]) plan.pieces[s] = gdn_zigzag_pieces(row, s, plan.ranks);
  return plan;
}

// Rank r's ranges when the row is cut into `parts` near-equal pieces, piece j held by rank_of(j).
template <class RankOf>
Ownership cut_ownership(int64_t tokens, int ranks, int64_t parts, RankOf rank_of) {
  Ownership out(static_cast<size_t>(ranks));
  for (int64_t j = 0; j < parts; ++j) {
    const TokenRange t{tokens * j / parts, tokens * (j + 1) / parts};
    if (t.begin == t.end) continue;
    auto& mine = out[static_cast<size_t>(rank_of(j))];
    if (!mine.empty() && mine.back().end == t.begin) mine.back().end = t.end;
    else mine.push_back(t);
  }
  for (auto& mine : out) std::sort(mine.begin(), mine.end(), [](auto& a, auto& b) { return a.begin < b.begin; });
  return out;
}

}  // namespace

GdnPlan gdn_layout_plan(const Row& row, int ranks, GdnLayout layout) {
  require(ranks >= 1, "gdn plan: ranks must be >= 1, got ", ranks);
  const int64_t T = row.tokens(), R = ranks;
  GdnPlan plan;
  switch (layout) {
    case GdnLayout::Contiguous:
      plan = gdn_plan_for_ownership(row, cut_ownership(T, ranks, R, [](int64_t j) { return j; }));
      break;
    case GdnLayout::Zigzag:
      plan = gdn_plan_for_ownership(row, cut_ownership(T, ranks, 2 * R, [&](int64_t j) { return j < R ? j : 2 * R - 1 - j; }));
      break;
    case GdnLayout::DocZigzag: {
      const int64_t min_tokens = gdn_doc_zigzag_min_tokens(row, ranks);
      std::vector<uint8_t> chained(static_cast<size_t>(row.num_segments()), 0);
      if (ranks > 1)
        for (int32_t s = 0; s < row.num_segments(); ++s) chained[s] = row.length(s) >= min_tokens;
      plan = zigzag_chains(row, make_gdn_plan(row, ranks, chained));
      break;
    }
    default:
      fail("gdn plan: ", gdn_layout_name(layout), " is not a fixed layout (contiguous, zigzag or doc-zigzag)");
  }
  plan.layout = layout;
  return plan;
}

GdnPlan plan_gdn(const Row& row, int ranks, const GdnShape& shape, const GdnCostModel& model,
                 const GdnPlanOptions& options) {
  require(ranks >= 1, "gdn plan: ranks must be >= 1, got ", ranks);
  if (options.attention) {
    require(static_cast<int>(options.attention->size()) == ranks, "gdn plan: the attention ownership is for ",
            options.attention->size(), " ranks, the plan for ", ranks);
    validate_ownership(*options.attention, row.tokens());
  }
  require(options.activation_bytes_per_element >= 1, "gdn plan: activation_bytes_per_element must be >= 1");
  const AffinePlanCosts costs = gdn_plan_costs(shape, model);
  auto move_ms = [&](const GdnPlan& p) {
    return options.attention
               ? gdn_move_price(row, p, *options.attention, shape, model, options.activation_bytes_per_element).ms
               : 0.0;
  };
  switch (options.layout) {
    case GdnLayout::Contiguous:
    case GdnLayout::Zigzag:
    case GdnLayout::DocZigzag: {
      GdnPlan plan = gdn_layout_plan(row, ranks, options.layout);
      predict_affine_plan(row, plan, costs, model);
      return plan;
    }
    case GdnLayout::Attention: {
      require(options.attention.has_value(), "gdn plan: layout attention needs the attention ownership");
      GdnPlan plan = gdn_plan_for_ownership(row, *options.attention);
      predict_affine_plan(row, plan, costs, model);
      return plan;
    }
    case GdnLayout::Searched:
      break;
  }
  // The bounded search over chained sets, then the fixed layouts and the attention ownership; the
  // cheapest with its token moves wins, ties keep the earlier. A chain laid zigzag-wise does the same
  // work as in rank order with a longer scan: the search tries it only where attention's layout may
  // make up for that.
  GdnPlanVariants variants;
  if (options.attention)
    variants = [&](const std::vector<uint8_t>& chained) {
      GdnPlan even = make_gdn_plan(row, ranks, chained);
      GdnPlan zigzag = zigzag_chains(row, even);
      return std::vector<GdnPlan>{std::move(even), std::move(zigzag)};
    };
  GdnPlan best = search_affine_plan(row, ranks, costs, model, move_ms, variants);
  best.layout = GdnLayout::Searched;
  double best_ms = predict_affine_plan(row, best, costs, model) + move_ms(best);
  std::vector<GdnPlan> others;
  if (ranks > 1)
    for (GdnLayout l : {GdnLayout::Contiguous, GdnLayout::Zigzag, GdnLayout::DocZigzag})
      others.push_back(gdn_layout_plan(row, ranks, l));
  if (options.attention) others.push_back(gdn_plan_for_ownership(row, *options.attention));
  for (GdnPlan& cand : others) {
    const double ms = predict_affine_plan(row, cand, costs, model) + move_ms(cand);
    if (ms < best_ms) {
      best = std::move(cand);
      best_ms = ms;
    }
  }
  return best;
}

}  // namespace treecp
