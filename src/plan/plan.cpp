#include "plan/plan.hpp"

#include <algorithm>
#include <tuple>

#include "core/error.hpp"
#include "plan/work.hpp"
#include "tree/row.hpp"
#include "tree/slice.hpp"

namespace treecp {

const char* layout_name(Layout layout) {
  switch (layout) {
    case Layout::Contiguous: return "contiguous";
    case Layout::Zigzag: return "zigzag";
    case Layout::Perdoc: return "perdoc";
    case Layout::Family: return "family";
    case Layout::Searched: return "searched";
    case Layout::Ring: return "ring";
  }
  return "?";
}

const std::vector<std::string>& layout_names() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> out;
    for (Layout l : kLayouts) out.emplace_back(layout_name(l));
    return out;
  }();
  return names;
}

Layout parse_layout(std::string_view name) {
  for (Layout l : kLayouts) {
    if (name == layout_name(l)) return l;
  }
  if (name == layout_name(Layout::Ring)) return Layout::Ring;
  fail("unknown layout '", name, "' (expected contiguous, zigzag, perdoc, family or searched)");
}

int64_t RankPlan::owned_tokens() const { return tokens_of(owned); }

Ownership plan_ownership(const Plan& plan) {
  Ownership out;
  out.reserve(plan.ranks.size());
  for (const RankPlan& rp : plan.ranks) out.push_back(rp.owned);
  return out;
}

int64_t RankPlan::pairs() const {
  int64_t n = 0;
  for (const Stage& s : stages) n += s.pairs;
  return n;
}

// ---- validation

namespace {

// Index of the range of sorted, disjoint `v` that contains [b, e), or -1.
int64_t containing_range(const std::vector<TokenRange>& v, int64_t b, int64_t e) {
  auto it = std::upper_bound(v.begin(), v.end(), b, [](int64_t x, const TokenRange& r) { return x < r.begin; });
  if (it == v.begin()) return -1;
  --it;
  return b >= it->begin && e <= it->end ? it - v.begin() : -1;
}

std::string range_text(int64_t b, int64_t e) { return detail::concat("[", b, ", ", e, ")"); }

void check_ranges(const std::vector<TokenRange>& v, const std::string& what) {
  for (size_t i = 0; i < v.size(); ++i) {
    if (!(v[i].begin < v[i].end)) fail("plan: ", what, ": empty or reversed range ", range_text(v[i].begin, v[i].end));
    if (!(i == 0 || v[i - 1].end <= v[i].begin))
      fail("plan: ", what, ": ranges ", range_text(v[i - 1].begin, v[i - 1].end), " and ",
           range_text(v[i].begin, v[i].end), " overlap or are out of order (a range is fetched at most once)");
  }
}

}  // namespace

void validate_plan(const Plan& plan, const Row& row, int64_t window, int expected_cp) {
  const int cp = plan.cp;
  require(cp >= 1, "plan: cp must be >= 1, got ", cp);
  require(expected_cp <= 0 || cp == expected_cp, "plan: rank count mismatch: the plan is for cp = ", cp, " but ",
          expected_cp, " ranks execute it");
  require(static_cast<int>(plan.ranks.size()) == cp, "plan: rank count mismatch: ", plan.ranks.size(),
          " rank plans for cp = ", cp);
  require(plan.tokens == row.tokens(), "plan: row length mismatch: the plan covers ", plan.tokens,
          " tokens but the row has ", row.tokens());
  require(plan.window == window, "plan: window mismatch: the plan encodes window ", plan.window, " but the layer uses ",
          window);
  const std::vector<int64_t>& bounds = plan.chunk_bounds;
  require(bounds.size() >= 2 && bounds.front() == 0 && bounds.back() == plan.tokens,
          "plan: chunk_bounds must run from 0 to ", plan.tokens);
  for (size_t i = 1; i < bounds.size(); ++i) {
    require(bounds[i] > bounds[i - 1], "plan: chunk_bounds must increase strictly (at index ", i, ")");
  }
  const auto n = static_cast<int32_t>(bounds.size() - 1);
  require(static_cast<int32_t>(plan.chunk_owner.size()) == n, "plan: ", plan.chunk_owner.size(), " chunk owners for ",
          n, " chunks");
  for (int32_t c = 0; c < n; ++c) {
    require(plan.chunk_owner[c] >= 0 && plan.chunk_owner[c] < cp, "plan: chunk ", c, " owned by rank ",
            plan.chunk_owner[c], ", expected [0, ", cp, ")");
  }
  require(plan.num_waves >= 0, "plan: num_waves must be >= 0, got ", plan.num_waves);
  const size_t stages = static_cast<size_t>(plan.num_waves) + 1;

  // Ownership: owned ranges are exactly the merged chunks of chunk_owner.
  std::vector<std::vector<TokenRange>> owned(cp);
  for (int32_t c = 0; c < n; ++c) {
    auto& v = owned[plan.chunk_owner[c]];
    if (!v.empty() && v.back().end == bounds[c]) {
      v.back().end = bounds[c + 1];
    } else {
      v.push_back({bounds[c], bounds[c + 1]});
    }
  }
  for (int r = 0; r < cp; ++r) {
    const RankPlan& rp = plan.ranks[r];
    require(rp.owned == owned[r], "plan: rank ", r, ": owned ranges do not match chunk_owner");
    require(rp.stages.size() == stages, "plan: rank ", r, " has ", rp.stages.size(),
            " stages, expected num_waves + 1 = ", stages);
    const Stage& local = rp.stages[0];
    for (const auto* side : {&local.recv, &local.send}) {
      require(side->empty() || static_cast<int>(side->size()) == cp, "plan: rank ", r,
              " stage 0: recv/send must be empty or have cp entries");
      for (const auto& v : *side) require(v.empty(), "plan: rank ", r, " stage 0 (local) must not exchange ranges");
    }
  }
  // Exchanges: every received range lies in its sender's owned chunks and is mirrored by a send.
  for (int r = 0; r < cp; ++r) {
    for (size_t w = 1; w < stages; ++w) {
      const Stage& st = plan.ranks[r].stages[w];
      require(static_cast<int>(st.recv.size()) == cp && static_cast<int>(st.send.size()) == cp, "plan: rank ", r,
              " stage ", w, ": recv and send must have one list per rank (", cp, ")");
      for (int p = 0; p < cp; ++p) {
        const std::string where =
            "rank " + std::to_string(r) + " stage " + std::to_string(w) + " peer " + std::to_string(p);
        check_ranges(st.recv[p], where + " recv");
        check_ranges(st.send[p], where + " send");
        require(p != r || (st.recv[p].empty() && st.send[p].empty()), "plan: ", where,
                ": a rank does not exchange with itself");
        require(st.recv[p] == plan.ranks[p].stages[w].send[r], "plan: ", where, ": recv does not match rank ", p,
                "'s send to rank ", r, " in the same stage");
        for (const TokenRange& t : st.recv[p]) {
          if (!(containing_range(owned[p], t.begin, t.end) >= 0))
            fail("plan: ", where, ": received range ", range_text(t.begin, t.end), " is not owned by rank ", p);
        }
      }
    }
  }
  // Slices: queries owned, keys owned (stage 0) or received in the stage's wave; pairs add up.
  const std::vector<Slice> visible = row_slices(row, window);
  // A query segment's row slices are consecutive, their key ranges increasing: [first_slice[s], first_slice[s + 1]).
  std::vector<size_t> first_slice(static_cast<size_t>(row.num_segments()) + 1, visible.size());
  // Slices come in runs from one segment: try the previous answer before searching.
  auto segment_near = [&row](int64_t pos, int32_t& hint) {
    if (hint < 0 || pos < row.start(hint) || pos >= row.end(hint)) hint = row.segment_of(pos);
    return hint;
  };
  int32_t q_hint = -1;
  for (size_t i = visible.size(); i-- > 0;) first_slice[segment_near(visible[i].q_begin, q_hint)] = i;
  for (size_t s = static_cast<size_t>(row.num_segments()); s-- > 0;) first_slice[s] = std::min(first_slice[s], first_slice[s + 1]);
  // The row slice of query segment sq whose keys hold k, or -1.
  auto slice_holding = [&](int32_t sq, int64_t k) -> int64_t {
    const auto first = visible.begin() + static_cast<int64_t>(first_slice[sq]);
    const auto last = visible.begin() + static_cast<int64_t>(first_slice[sq + 1]);
    const auto it = std::partition_point(first, last, [k](const Slice& v) { return v.k_end <= k; });
    return it != last && it->k_begin <= k ? it - visible.begin() : -1;
  };
  // Each plan slice with the row slice holding it; the pairs the plan computes of each row slice.
  struct Part {
    int32_t row_slice, rank, stage;
    const Slice* s;
  };
  std::vector<Part> got;
  std::vector<int64_t> covered(visible.size(), 0);
  std::vector<TokenRange> received;
  for (int r = 0; r < cp; ++r) {
    for (size_t w = 0; w < stages; ++w) {
      const Stage& st = plan.ranks[r].stages[w];
      const std::string where = "rank " + std::to_string(r) + " stage " + std::to_string(w);
      received.clear();
      if (w > 0) {
        for (const auto& v : st.recv) received.insert(received.end(), v.begin(), v.end());
        std::sort(received.begin(), received.end(),
                  [](const TokenRange& a, const TokenRange& b) { return a.begin < b.begin; });
      }
      const std::vector<TokenRange>& keys = w == 0 ? owned[r] : received;
      int64_t pairs = 0;
      for (const Slice& s : st.slices) {
        if (!(!s.empty() && s.q_begin >= 0 && s.k_begin >= 0 && s.q_end <= plan.tokens && s.k_end <= plan.tokens))
          fail("plan: ", where, ": slice ", to_string(s), " is empty or outside the row");
        if (!(containing_range(owned[r], s.q_begin, s.q_end) >= 0))
          fail("plan: ", where, ": slice ", to_string(s), " has queries the rank does not own");
        if (!(containing_range(keys, s.k_begin, s.k_end) >= 0))
          fail("plan: ", where, ": slice ", to_string(s),
               w == 0 ? " has keys the rank does not own" : " has keys not received in this wave");
        const int64_t vi = slice_holding(segment_near(s.q_begin, q_hint), s.k_begin);
        // Row slices are exact (every pair inside one's rectangle and band is visible): containment suffices.
        const Slice* v = vi >= 0 ? &visible[static_cast<size_t>(vi)] : nullptr;
        if (!(v != nullptr && s.q_begin >= v->q_begin && s.q_end <= v->q_end && s.k_begin >= v->k_begin &&
              s.k_end <= v->k_end && s.diag_min >= v->diag_min && s.diag_max <= v->diag_max))
          fail("plan: ", where, ": slice ", to_string(s), " contains pairs that are not visible");
        pairs += s.area();
        covered[static_cast<size_t>(vi)] += s.area();
        got.push_back({static_cast<int32_t>(vi), r, static_cast<int32_t>(w), &s});
      }
      require(pairs == st.pairs, "plan: ", where, ": pairs is ", st.pairs, " but its slices hold ", pairs);
    }
  }
  // Coverage: every plan slice lies inside one row slice, so every visible pair is computed exactly once
  // iff no two plan slices overlap and those of each row slice add up to its area. Slices of two ranks
  // never overlap (each rank's queries are its own chunks): overlaps are looked for among one rank's
  // slices of one row slice whose key ranges meet, in time O(slices log slices) and never per chunk pair.
  // Parts grouped by row slice (a counting sort), each group ordered by rank and first key.
  std::vector<size_t> group(visible.size() + 1, 0), order(got.size());
  for (const Part& p : got) ++group[static_cast<size_t>(p.row_slice) + 1];
  for (size_t i = 0; i < visible.size(); ++i) group[i + 1] += group[i];
  {
    std::vector<size_t> fill(group.begin(), group.end() - 1);
    for (size_t x = 0; x < got.size(); ++x) order[fill[static_cast<size_t>(got[x].row_slice)]++] = x;
  }
  for (size_t i = 0; i < visible.size(); ++i) {
    const auto first = order.begin() + static_cast<int64_t>(group[i]), last = order.begin() + static_cast<int64_t>(group[i + 1]);
    std::sort(first, last, [&](size_t x, size_t y) {
      return std::tie(got[x].rank, got[x].s->k_begin) < std::tie(got[y].rank, got[y].s->k_begin);
    });
    for (auto a = first; a != last; ++a) {
      const Part& pa = got[*a];
      const Slice& x = *pa.s;
      for (auto b = a + 1; b != last && got[*b].rank == pa.rank && got[*b].s->k_begin < x.k_end; ++b) {
        const Slice& y = *got[*b].s;
        const Slice both =
            make_slice(std::max(x.q_begin, y.q_begin), std::min(x.q_end, y.q_end), std::max(x.k_begin, y.k_begin),
                       std::min(x.k_end, y.k_end), std::max(x.diag_min, y.diag_min), std::min(x.diag_max, y.diag_max));
        if (!(both.empty()))
          fail("plan: pairs of row slice ", to_string(visible[i]), " computed more than once (rank ", pa.rank,
               " stages ", pa.stage, " and ", got[*b].stage, ")");
      }
    }
  }
  int64_t total = 0;
  for (size_t i = 0; i < visible.size(); ++i) {
    const int64_t want = visible[i].area();
    if (!(covered[i] <= want)) fail("plan: pairs of row slice ", to_string(visible[i]), " computed more than once");
    if (!(covered[i] == want))
      fail("plan: missing ", want - covered[i], " visible pairs of row slice ", to_string(visible[i]));
    total += want;
  }
  require(plan.visible_pairs == total, "plan: visible_pairs is ", plan.visible_pairs, " but the row has ", total);
}

// ---- JSON

namespace {

json::Value ranges_json(const std::vector<TokenRange>& v) {
  json::Value a = json::Value::array();
  for (const TokenRange& r : v) {
    json::Value p = json::Value::array();
    p.push_back(r.begin);
    p.push_back(r.end);
    a.push_back(p);
  }
  return a;
}

std::vector<TokenRange> ranges_from(const json::Value& v, const std::string& what) {
  std::vector<TokenRange> out;
  for (const json::Value& p : v.as_array(what)) {
    require(p.is_array() && p.size() == 2, "plan JSON: ", what, ": each range must be [begin, end]");
    out.push_back({p[0].as_int(what), p[1].as_int(what)});
  }
  return out;
}

std::vector<std::vector<TokenRange>> per_peer_from(const json::Value& v, const std::string& what) {
  std::vector<std::vector<TokenRange>> out;
  for (const json::Value& p : v.as_array(what)) out.push_back(ranges_from(p, what));
  return out;
}

}  // namespace

json::Value plan_to_json(const Plan& plan) {
  json::Value v = json::Value::object();
  v.set("layout", std::string(layout_name(plan.layout)));
  v.set("cp", static_cast<int64_t>(plan.cp));
  v.set("tokens", plan.tokens);
  v.set("window", plan.window);
  v.set("num_waves", static_cast<int64_t>(plan.num_waves));
  v.set("visible_pairs", plan.visible_pairs);
  v.set("predicted_makespan_ms", plan.predicted_makespan_ms);
  v.set("backward_kv", plan.refetch_backward ? "refetch" : "keep");
  json::Value bounds = json::Value::array(), owners = json::Value::array();
  for (int64_t b : plan.chunk_bounds) bounds.push_back(b);
  for (int32_t o : plan.chunk_owner) owners.push_back(static_cast<int64_t>(o));
  v.set("chunk_bounds", bounds);
  v.set("chunk_owner", owners);
  json::Value ranks = json::Value::array();
  for (size_t r = 0; r < plan.ranks.size(); ++r) {
    const RankPlan& rp = plan.ranks[r];
    json::Value jr = json::Value::object();
    jr.set("rank", static_cast<int64_t>(r));
    jr.set("owned_ranges", ranges_json(rp.owned));
    jr.set("owned_tokens", rp.owned_tokens());
    jr.set("pairs", rp.pairs());
    jr.set("predicted_forward_ms", rp.predicted_forward_ms);
    jr.set("predicted_backward_ms", rp.predicted_backward_ms);
    json::Value stages = json::Value::array();
    for (size_t w = 0; w < rp.stages.size(); ++w) {
      const Stage& st = rp.stages[w];
      json::Value js = json::Value::object();
      js.set("wave", static_cast<int64_t>(w));
      js.set("pairs", st.pairs);
      std::vector<TokenRange> remote;
      for (const auto& p : st.recv) remote.insert(remote.end(), p.begin(), p.end());
      std::sort(remote.begin(), remote.end(),
                [](const TokenRange& a, const TokenRange& b) { return a.begin < b.begin; });
      js.set("remote_ranges", ranges_json(remote));
      json::Value recv = json::Value::array(), send = json::Value::array();
      for (const auto& p : st.recv) recv.push_back(ranges_json(p));
      for (const auto& p : st.send) send.push_back(ranges_json(p));
      js.set("recv", recv);
      js.set("send", send);
      json::Value slices = json::Value::array();
      for (const Slice& s : st.slices) {
        json::Value a = json::Value::array();
        for (int64_t x : {s.q_begin, s.q_end, s.k_begin, s.k_end, s.diag_min, s.diag_max}) a.push_back(x);
        slices.push_back(a);
      }
      js.set("slices", slices);
      stages.push_back(js);
    }
    jr.set("stages", stages);
    ranks.push_back(jr);
  }
  v.set("ranks", ranks);
  return v;
}

Plan plan_from_json(const json::Value& v) {
  Plan plan;
  plan.layout = parse_layout(v.at("layout", "plan").as_string("plan.layout"));
  const int64_t cp = v.at("cp", "plan").as_int("plan.cp");
  require(cp >= 1 && cp <= 1 << 20, "plan JSON: cp must be >= 1, got ", cp);
  plan.cp = static_cast<int>(cp);
  plan.tokens = v.at("tokens", "plan").as_int("plan.tokens");
  plan.window = v.at("window", "plan").as_int("plan.window");
  const int64_t waves = v.at("num_waves", "plan").as_int("plan.num_waves");
  require(waves >= 0 && waves <= 1 << 20, "plan JSON: num_waves must be >= 0, got ", waves);
  plan.num_waves = static_cast<int>(waves);
  if (const json::Value* kv = v.find("backward_kv")) {
    const std::string& mode = kv->as_string("plan.backward_kv");
    require(mode == "keep" || mode == "refetch", "plan JSON: backward_kv must be keep or refetch, got '", mode, "'");
    plan.refetch_backward = mode == "refetch";
  }
  plan.visible_pairs = v.at("visible_pairs", "plan").as_int("plan.visible_pairs");
  plan.predicted_makespan_ms = v.at("predicted_makespan_ms", "plan").as_double("plan.predicted_makespan_ms");
  for (const json::Value& b : v.at("chunk_bounds", "plan").as_array("plan.chunk_bounds")) {
    plan.chunk_bounds.push_back(b.as_int("plan.chunk_bounds[]"));
  }
  for (const json::Value& o : v.at("chunk_owner", "plan").as_array("plan.chunk_owner")) {
    const int64_t r = o.as_int("plan.chunk_owner[]");
    require(r >= -1 && r < (int64_t{1} << 31), "plan JSON: chunk_owner out of range: ", r);
    plan.chunk_owner.push_back(static_cast<int32_t>(r));
  }
  for (const json::Value& jr : v.at("ranks", "plan").as_array("plan.ranks")) {
    RankPlan rp;
    rp.owned = ranges_from(jr.at("owned_ranges", "plan.ranks[]"), "plan.ranks[].owned_ranges");
    rp.predicted_forward_ms = jr.at("predicted_forward_ms", "plan.ranks[]").as_double("predicted_forward_ms");
    rp.predicted_backward_ms = jr.at("predicted_backward_ms", "plan.ranks[]").as_double("predicted_backward_ms");
    for (const json::Value& js : jr.at("stages", "plan.ranks[]").as_array("plan.ranks[].stages")) {
      Stage st;
      st.pairs = js.at("pairs", "plan stage").as_int("stage.pairs");
      st.recv = per_peer_from(js.at("recv", "plan stage"), "stage.recv");
      st.send = per_peer_from(js.at("send", "plan stage"), "stage.send");
      for (const json::Value& s : js.at("slices", "plan stage").as_array("stage.slices")) {
        require(s.is_array() && s.size() == 6,
                "plan JSON: a slice must be [q_begin, q_end, k_begin, k_end, diag_min, diag_max]");
        st.slices.push_back({s[0].as_int("slice"), s[1].as_int("slice"), s[2].as_int("slice"), s[3].as_int("slice"),
                             s[4].as_int("slice"), s[5].as_int("slice")});
      }
      rp.stages.push_back(std::move(st));
    }
    plan.ranks.push_back(std::move(rp));
  }
  return plan;
}

Plan plan_from_json_text(std::string_view text) { return plan_from_json(json::parse(text)); }

}  // namespace treecp
