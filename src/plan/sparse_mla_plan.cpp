#include "plan/sparse_mla_plan.hpp"

#include <algorithm>
#include <limits>

#include "core/error.hpp"
#include "tree/row.hpp"
#include "tree/slice.hpp"

namespace treecp {

const char* kv_fetch_name(KvFetch f) { return f == KvFetch::Waves ? "waves" : "selected"; }

CostModel SparseMlaCosts::default_indexer() {
  // docs/costs.md "Sparse MLA": the dense attention rates (8,192 FLOP per indexer pair is half a dense
  // pair's 16,384; top-k selection over the candidates is taken to cost the other half).
  return CostModel{};
}

CostModel SparseMlaCosts::default_sparse() {
  CostModel c;
  // 139,264 FLOP per forward pair at the dense forward's 354 TFLOP/s; backward 352,256 FLOP at 341 TFLOP/s.
  c.local_forward_pairs_per_ms = c.remote_forward_pairs_per_ms = 2.54e6;
  c.local_backward_pairs_per_ms = c.remote_backward_pairs_per_ms = 9.68e5;
  c.underfill_pairs = 0;
  c.underfill_ms = 0.0;
  // per owned token: q (H x Dqk) and o, dO (H x Dv) in bf16, ~140 KiB forward, twice that backward, at 4.0e9 B/ms
  c.token_local_forward_ms_per_token = 3.5e-5;
  c.token_local_backward_ms_per_token = 7.0e-5;
  return c;
}

namespace {

// The keys of each nested model that its price reads; the others are refused, so that a file never
// holds a value that changes nothing.
const std::vector<std::string>& indexer_keys() {
  static const std::vector<std::string> k{"local_forward_pairs_per_ms", "remote_forward_pairs_per_ms", "kernel_tiles",
                                          "stage_launch_ms", "merge_ms_per_query_token", "range_ms",
                                          "underfill_pairs", "underfill_ms", "ranks_per_node", "intra_node", "inter_node",
                                          "rank_bandwidth_bytes_per_ms", "links", "activation_bytes_per_token",
                                          "memory_limit_bytes_per_rank"};
  return k;
}
const std::vector<std::string>& sparse_keys() {
  static const std::vector<std::string> k{"local_forward_pairs_per_ms", "local_backward_pairs_per_ms", "stage_launch_ms",
                                          "range_ms", "underfill_pairs", "underfill_ms",
                                          "token_local_forward_ms_per_token", "token_local_backward_ms_per_token"};
  return k;
}

json::Value only_keys(const json::Value& v, const std::vector<std::string>& keys) {
  json::Value out = json::Value::object();
  for (const auto& [key, val] : v.as_object("costs")) {
    if (std::find(keys.begin(), keys.end(), key) != keys.end()) out.set(key, val);
  }
  return out;
}

// A nested model: the given keys over `base`'s values (missing keys keep the sparse MLA defaults).
CostModel nested_costs(const json::Value& v, const std::string& what, const std::vector<std::string>& keys,
                       const CostModel& base, bool one_local_stage) {
  json::Value merged = to_json(base);
  for (const auto& [key, val] : v.as_object("sparse mla costs." + what)) {
    if (key == "note") continue;
    require(std::find(keys.begin(), keys.end(), key) != keys.end(), "sparse mla costs: ", what, ".", key,
            key == "shape" ? " is not used: give the shape at the top level" : " is not used by its price (or unknown)");
    merged.set(key, val);
  }
  CostModel c = costs_from_json(merged);
  // the sparse call is one local stage: its remote rates are the local ones
  if (one_local_stage) {
    c.remote_forward_pairs_per_ms = c.local_forward_pairs_per_ms;
    c.remote_backward_pairs_per_ms = c.local_backward_pairs_per_ms;
  }
  return c;
}

}  // namespace

SparseMlaCosts sparse_mla_costs_from_json(const json::Value& v) {
  SparseMlaCosts c;
  for (const auto& [key, val] : v.as_object("sparse mla costs")) {
    if (key == "note" || key == "source") continue;
    if (key == "indexer") {
      c.indexer = nested_costs(val, "indexer", indexer_keys(), c.indexer, false);
    } else if (key == "sparse") {
      c.sparse = nested_costs(val, "sparse", sparse_keys(), c.sparse, true);
    } else if (key == "shape") {
      for (const auto& [sk, sv] : val.as_object("sparse mla costs.shape")) {
        int64_t* field = sk == "hi"                      ? &c.shape.hi
                         : sk == "di"                    ? &c.shape.di
                         : sk == "h"                     ? &c.shape.h
                         : sk == "dqk"                   ? &c.shape.dqk
                         : sk == "dv"                    ? &c.shape.dv
                         : sk == "bytes_per_element"     ? &c.shape.bytes_per_element
                         : sk == "dkv_bytes_per_element" ? &c.shape.dkv_bytes_per_element
                                                         : nullptr;
        require(field != nullptr, "sparse mla costs.shape: unknown key '", sk, "'");
        *field = sv.as_int("sparse mla costs.shape." + sk);
        require(*field > 0, "sparse mla costs.shape.", sk, " must be > 0");
      }
      require(c.shape.dv <= c.shape.dqk, "sparse mla costs.shape: dv (", c.shape.dv, ") must be <= dqk (", c.shape.dqk, ")");
    } else {
      fail("sparse mla costs: unknown key '", key, "'");
    }
  }
  return c;
}

SparseMlaCosts load_sparse_mla_costs(const std::string& path) {
  return sparse_mla_costs_from_json(json::parse(json::read_file(path)));
}

json::Value to_json(const SparseMlaCosts& c) {
  json::Value v = json::Value::object();
  json::Value shape = json::Value::object();
  shape.set("hi", c.shape.hi);
  shape.set("di", c.shape.di);
  shape.set("h", c.shape.h);
  shape.set("dqk", c.shape.dqk);
  shape.set("dv", c.shape.dv);
  shape.set("bytes_per_element", c.shape.bytes_per_element);
  shape.set("dkv_bytes_per_element", c.shape.dkv_bytes_per_element);
  v.set("shape", shape);
  v.set("indexer", only_keys(to_json(c.indexer), indexer_keys()));
  v.set("sparse", only_keys(to_json(c.sparse), sparse_keys()));
  return v;
}

std::vector<int64_t> sparse_pairs_per_query(const Row& row, int64_t window, int64_t topk) {
  require(topk >= 1, "top-k must be >= 1, got ", topk);
  std::vector<int64_t> n(static_cast<size_t>(row.tokens()), 0);
  for (const Slice& s : row_slices(row, window)) {
    for (int64_t q = s.q_begin; q < s.q_end; ++q) n[static_cast<size_t>(q)] += std::max<int64_t>(0, s.key_end(q) - s.key_begin(q));
  }
  for (int64_t& x : n) x = std::min(x, topk);
  return n;
}

namespace {

// The indexer's stages priced by the dense schedule as an attention layer of Hi heads of Di against one
// shared key head and no values, the wave KV carrying ki (and with Waves the kv rows too, as its "values");
// token-local work belongs to the sparse model.
AttentionShape indexer_shape(const SparseMlaCosts& c, bool kv_in_waves, int64_t window) {
  AttentionShape s;
  s.hq = static_cast<int>(c.shape.hi);
  s.hkv = 1;
  s.d = static_cast<int>(c.shape.di);
  s.dv = kv_in_waves ? static_cast<int>(c.shape.dqk) : 0;
  s.window = window;
  return s;
}

CostModel indexer_model(const SparseMlaCosts& c) {
  CostModel m = c.indexer;
  m.kv_bytes_per_element = c.shape.bytes_per_element;
  m.token_local_forward_ms_per_token = 0.0;
  m.token_local_backward_ms_per_token = 0.0;
  return m;
}

// Per query of one rank's owned tokens (in owned order): visible keys in total and per key owner.
struct Visibility {
  std::vector<int64_t> total;
  std::vector<std::vector<int64_t>> by_owner;  // [owner][local query], allocated for owners that appear
};

Visibility rank_visibility(const Plan& plan, int r) {
  const RankPlan& rp = plan.ranks[static_cast<size_t>(r)];
  std::vector<int64_t> starts;  // local index of each owned range's first token
  int64_t n = 0;
  for (const TokenRange& t : rp.owned) {
    starts.push_back(n);
    n += t.size();
  }
  Visibility v;
  v.total.assign(static_cast<size_t>(n), 0);
  v.by_owner.resize(static_cast<size_t>(plan.cp));
  for (size_t st = 0; st < rp.stages.size(); ++st) {
    const Stage& stage = rp.stages[st];
    for (const Slice& s : stage.slices) {
      if (s.empty()) continue;
      int src = r;
      for (int p = 0; st > 0 && p < plan.cp && src == r; ++p) {
        for (const TokenRange& t : stage.recv[static_cast<size_t>(p)]) {
          if (s.k_begin >= t.begin && s.k_begin < t.end) src = p;
        }
      }
      // A slice's queries lie in one owned range (build_plan cuts slices at owner runs).
      const auto it = std::upper_bound(rp.owned.begin(), rp.owned.end(), s.q_begin,
                                       [](int64_t q, const TokenRange& t) { return q < t.begin; });
      require(it != rp.owned.begin() && s.q_end <= (it - 1)->end, "price_sparse_mla: rank ", r, " stage ", st,
              " slice ", to_string(s), " has queries the rank does not own");
      const int64_t base = starts[static_cast<size_t>(it - 1 - rp.owned.begin())] - (it - 1)->begin;
      std::vector<int64_t>* by = nullptr;
      if (src != r) {
        by = &v.by_owner[static_cast<size_t>(src)];
        if (by->empty()) by->assign(static_cast<size_t>(n), 0);
      }
      for (int64_t q = s.q_begin; q < s.q_end; ++q) {
        const int64_t keys = std::max<int64_t>(0, s.key_end(q) - s.key_begin(q));
        v.total[static_cast<size_t>(base + q)] += keys;
        if (by) (*by)[static_cast<size_t>(base + q)] += keys;
      }
    }
  }
  return v;
}

}  // namespace

SparseMlaPrediction price_sparse_mla(const Plan& plan, const SparseMlaCosts& costs, int64_t topk, KvFetch fetch,
                                     bool full_index) {
  const int cp = plan.cp;
  require(cp >= 1 && static_cast<int>(plan.ranks.size()) == cp, "price_sparse_mla: plan has ", plan.ranks.size(),
          " ranks for cp = ", cp);
  require(topk >= 1, "price_sparse_mla: top-k must be >= 1, got ", topk);
  require(full_index || fetch == KvFetch::Selected,
          "price_sparse_mla: a layer that reuses ids has no indexer waves to carry KV (fetch must be selected)");
  const SparseMlaShape& sh = costs.shape;
  const bool kv_in_waves = full_index && fetch == KvFetch::Waves;
  const CostModel ix = indexer_model(costs);
  const Prediction staged = full_index ? simulate_plan(plan, indexer_shape(costs, kv_in_waves, plan.window), ix)
                                       : Prediction{};
  const Links links(costs.indexer, cp);
  SparseMlaPrediction out;
  out.fetch = fetch;
  out.full_index = full_index;
  out.ranks.resize(static_cast<size_t>(cp));
  // selected[src * cp + dst]: rows dst's sparse call reads from src, bounded for every input
  WaveTraffic selected(static_cast<size_t>(cp) * cp, 0);
  std::vector<int64_t> wave_sent(static_cast<size_t>(cp), 0);
  for (int r = 0; r < cp; ++r) {
    const RankPlan& rp = plan.ranks[static_cast<size_t>(r)];
    SparseMlaRankCost& rc = out.ranks[static_cast<size_t>(r)];
    rc.owned_tokens = rp.owned_tokens();
    rc.indexer_pairs = rp.pairs();
    const Visibility v = rank_visibility(plan, r);
    for (int64_t x : v.total) rc.sparse_pairs += std::min(x, topk);
    std::vector<int64_t> fetched(static_cast<size_t>(cp), 0);
    for (size_t st = 1; st < rp.stages.size(); ++st) {
      for (int p = 0; p < cp; ++p) {
        for (const TokenRange& t : rp.stages[st].recv[static_cast<size_t>(p)]) fetched[static_cast<size_t>(p)] += t.size();
        for (const TokenRange& t : rp.stages[st].send[static_cast<size_t>(p)]) wave_sent[static_cast<size_t>(r)] += t.size();
      }
    }
    for (int p = 0; p < cp; ++p) {
      if (full_index) rc.wave_rows += fetched[static_cast<size_t>(p)];
      if (p == r || v.by_owner[static_cast<size_t>(p)].empty()) continue;
      int64_t bound = 0;
      for (int64_t x : v.by_owner[static_cast<size_t>(p)]) bound += std::min(x, topk);
      selected[static_cast<size_t>(p) * cp + r] = std::min(bound, fetched[static_cast<size_t>(p)]);
    }
  }
  const int64_t wave_bytes = sh.ki_bytes_per_token() + (kv_in_waves ? sh.kv_bytes_per_token() : 0);
  for (int r = 0; r < cp; ++r) {
    SparseMlaRankCost& rc = out.ranks[static_cast<size_t>(r)];
    int64_t in_rows = 0, out_rows = 0, peers = 0;  // remote rows this rank reads / serves
    for (int p = 0; p < cp; ++p) {
      in_rows += selected[static_cast<size_t>(p) * cp + r];
      out_rows += selected[static_cast<size_t>(r) * cp + p];
      peers += selected[static_cast<size_t>(p) * cp + r] > 0 ? 1 : 0;
    }
    rc.selected_rows = in_rows;
    rc.indexer_ms = full_index ? staged.forward_ms[static_cast<size_t>(r)] : 0.0;
    // ids go to the owners (the mirror of the row flow); with Selected the rows come back
    rc.fetch_ms = exchange_ms(costs.indexer, links, selected, r, sh.id_bytes, false) +
                  (fetch == KvFetch::Selected ? exchange_ms(costs.indexer, links, selected, r, sh.kv_bytes_per_token(), true) : 0.0);
    const StageLoad call{rc.sparse_pairs, rc.owned_tokens, 1 + peers, 0};
    const double owned = static_cast<double>(rc.owned_tokens);
    rc.sparse_forward_ms = stage_ms(costs.sparse, call, false, Pass::Forward) + owned * costs.sparse.token_local_forward_ms_per_token;
    rc.sparse_backward_ms = stage_ms(costs.sparse, call, false, Pass::Backward) + owned * costs.sparse.token_local_backward_ms_per_token;
    rc.return_ms = exchange_ms(costs.indexer, links, selected, r, sh.dkv_bytes_per_token(), false);
    rc.forward_ms = rc.indexer_ms + rc.fetch_ms + rc.sparse_forward_ms;
    rc.backward_ms = rc.sparse_backward_ms + rc.return_ms;
    // Waves in; one id count per peer; ids out, rows in (Selected), dKV out; the mirror for what this
    // rank serves.
    const int64_t row_bytes = fetch == KvFetch::Selected ? sh.kv_bytes_per_token() : 0;
    const int64_t counts = static_cast<int64_t>(cp - 1) * sh.id_bytes;
    rc.bytes_received = rc.wave_rows * wave_bytes + counts + in_rows * row_bytes +
                        out_rows * (sh.id_bytes + sh.dkv_bytes_per_token());
    rc.bytes_sent = (full_index ? wave_sent[static_cast<size_t>(r)] : 0) * wave_bytes + counts +
                    in_rows * (sh.id_bytes + sh.dkv_bytes_per_token()) + out_rows * row_bytes;
    out.bytes_moved += rc.bytes_sent;
    const double total = rc.forward_ms + rc.backward_ms;
    if (r == 0 || total > out.makespan_ms) {
      out.makespan_ms = total;
      out.slowest_rank = r;
    }
  }
  return out;
}

SparseMlaPlan make_sparse_mla_plan(const Row& row, int cp, const SparseMlaCosts& costs,
                                   const SparseMlaPlanOptions& o) {
  require(o.topk >= 1, "top-k must be >= 1, got ", o.topk);
  require(o.fetch == "auto" || o.fetch == "waves" || o.fetch == "selected", "fetch must be auto, waves or selected; got '",
          o.fetch, "'");
  require(o.full_index || o.fetch != "waves", "a layer that reuses ids (IndexShare) cannot take KV from indexer waves");
  // The dense search steers by the indexer's stages plus the row's average sparse work per owned token.
  const std::vector<int64_t> per_query = sparse_pairs_per_query(row, o.window, o.topk);
  int64_t sparse_total = 0;
  for (int64_t x : per_query) sparse_total += x;
  const double per_token = row.tokens() > 0 ? static_cast<double>(sparse_total) / static_cast<double>(row.tokens()) : 0.0;
  CostModel steer = indexer_model(costs);
  const AttentionShape steer_shape = indexer_shape(costs, o.full_index && o.fetch != "selected", o.window);
  if (!o.full_index) {  // no indexer stages and nothing in waves: ownership balances the sparse work alone
    steer.local_forward_pairs_per_ms = steer.remote_forward_pairs_per_ms = std::numeric_limits<double>::max();
    steer.kv_bytes_per_element = 0;
  }
  // the indexer has no backward pass
  steer.local_backward_pairs_per_ms = steer.remote_backward_pairs_per_ms = std::numeric_limits<double>::max();
  steer.dkv_bytes_per_element = 0;
  steer.token_local_forward_ms_per_token = per_token / costs.sparse.local_forward_pairs_per_ms + costs.sparse.token_local_forward_ms_per_token;
  steer.token_local_backward_ms_per_token = per_token / costs.sparse.local_backward_pairs_per_ms + costs.sparse.token_local_backward_ms_per_token;

  std::vector<Layout> layouts = {o.plan.layout};
  if (o.plan.layout == Layout::Searched) layouts.assign(std::begin(kLayouts), std::end(kLayouts));
  SparseMlaPlan best;
  bool have = false;
  for (Layout layout : layouts) {
    PlanOptions po = o.plan;
    po.layout = layout;
    SparseMlaPlan cand;
    cand.plan = make_plan(row, cp, steer_shape, steer, po);
    cand.topk = o.topk;
    if (o.full_index) {
      const SparseMlaPrediction waves = price_sparse_mla(cand.plan, costs, o.topk, KvFetch::Waves, true);
      const SparseMlaPrediction sel = price_sparse_mla(cand.plan, costs, o.topk, KvFetch::Selected, true);
      // auto: the mode that moves fewer bytes; on a tie the waves, which overlap the indexer
      const bool take_selected = o.fetch == "selected" || (o.fetch == "auto" && sel.bytes_moved < waves.bytes_moved);
      cand.fetch = take_selected ? KvFetch::Selected : KvFetch::Waves;
      cand.prediction = take_selected ? sel : waves;
      cand.other = take_selected ? waves : sel;
    } else {
      cand.fetch = KvFetch::Selected;
      cand.prediction = cand.other = price_sparse_mla(cand.plan, costs, o.topk, KvFetch::Selected, false);
    }
    cand.plan.predicted_makespan_ms = cand.prediction.makespan_ms;
    for (int r = 0; r < cp; ++r) {
      cand.plan.ranks[static_cast<size_t>(r)].predicted_forward_ms = cand.prediction.ranks[static_cast<size_t>(r)].forward_ms;
      cand.plan.ranks[static_cast<size_t>(r)].predicted_backward_ms = cand.prediction.ranks[static_cast<size_t>(r)].backward_ms;
    }
    if (!have || cand.prediction.makespan_ms < best.prediction.makespan_ms) {
      best = std::move(cand);
      have = true;
    }
  }
  return best;
}

}  // namespace treecp
