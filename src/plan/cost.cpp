#include "plan/cost.hpp"

#include <algorithm>
#include <functional>
#include <map>

#include "core/error.hpp"
#include "kernels/cpu/tiles.hpp"
#include "kernels/cuda/tiles.hpp"

namespace treecp {

const char* kernel_tiles_name(KernelTiles t) {
  switch (t) {
    case KernelTiles::Exact: return "exact";
    case KernelTiles::Cpu: return "cpu";
    case KernelTiles::Cuda: return "cuda";
  }
  return "?";
}

TileTokens tile_tokens(KernelTiles t, int64_t group) {
  require(group >= 1, "tile_tokens: group must be >= 1, got ", group);
  switch (t) {
    case KernelTiles::Exact: return {};
    case KernelTiles::Cpu: return {std::max<int64_t>(1, cpu::kTileRows / group), cpu::kKeyBlock};
    case KernelTiles::Cuda: return {std::max<int64_t>(1, cuda::kFwdBlockRows / group), cuda::kFwdBlockKeys};
  }
  return {};
}

Link CostModel::link(int src, int dst) const {
  for (const LinkOverride& o : links) {
    if (o.src == src && o.dst == dst) return o.link;
  }
  const int per_node = std::max(1, ranks_per_node);
  return src / per_node == dst / per_node ? intra_node : inter_node;
}

json::Value to_json(const Link& l) {
  json::Value v = json::Value::object();
  v.set("latency_ms", l.latency_ms);
  v.set("bandwidth_bytes_per_ms", l.bandwidth_bytes_per_ms);
  return v;
}

Link link_from_json(const json::Value& v, const std::string& what) {
  Link l;
  for (const auto& [key, val] : v.as_object(what)) {
    if (key == "latency_ms") {
      l.latency_ms = val.as_double(what + ".latency_ms");
    } else if (key == "bandwidth_bytes_per_ms") {
      l.bandwidth_bytes_per_ms = val.as_double(what + ".bandwidth_bytes_per_ms");
    } else if (key != "src" && key != "dst" && key != "note") {
      fail("costs: unknown key '", key, "' in ", what);
    }
  }
  require(l.latency_ms >= 0.0, "costs: ", what, ".latency_ms must be >= 0");
  require(l.bandwidth_bytes_per_ms > 0.0, "costs: ", what, ".bandwidth_bytes_per_ms must be > 0");
  return l;
}

CostModel costs_from_json(const json::Value& v) {
  CostModel c;
  // One table of the scalar coefficients: name, pointer, whether it must be strictly positive.
  struct Scalar {
    const char* name;
    double* value;
    bool positive;
  };
  const Scalar scalars[] = {
      {"local_forward_pairs_per_ms", &c.local_forward_pairs_per_ms, true},
      {"remote_forward_pairs_per_ms", &c.remote_forward_pairs_per_ms, true},
      {"local_backward_pairs_per_ms", &c.local_backward_pairs_per_ms, true},
      {"remote_backward_pairs_per_ms", &c.remote_backward_pairs_per_ms, true},
      {"stage_launch_ms", &c.stage_launch_ms, false},
      {"merge_ms_per_query_token", &c.merge_ms_per_query_token, false},
      {"range_ms", &c.range_ms, false},
      {"underfill_ms", &c.underfill_ms, false},
      {"token_local_forward_ms_per_token", &c.token_local_forward_ms_per_token, false},
      {"token_local_backward_ms_per_token", &c.token_local_backward_ms_per_token, false},
      {"rank_bandwidth_bytes_per_ms", &c.rank_bandwidth_bytes_per_ms, true},
  };
  struct Integer {
    const char* name;
    int64_t* value;
  };
  const Integer integers[] = {
      {"underfill_pairs", &c.underfill_pairs},
      {"activation_bytes_per_token", &c.activation_bytes_per_token},
      {"memory_limit_bytes_per_rank", &c.memory_limit_bytes_per_rank},
      {"kv_bytes_per_element", &c.kv_bytes_per_element},
      {"dkv_bytes_per_element", &c.dkv_bytes_per_element},
  };
  for (const auto& [key, val] : v.as_object("costs")) {
    bool done = false;
    for (const Scalar& s : scalars) {
      if (key == s.name) {
        *s.value = val.as_double(std::string("costs.") + s.name);
        require(s.positive ? *s.value > 0.0 : *s.value >= 0.0, "costs.", s.name, " must be ",
                s.positive ? "> 0" : ">= 0", ", got ", *s.value);
        done = true;
      }
    }
    for (const Integer& s : integers) {
      if (key == s.name) {
        *s.value = val.as_int(std::string("costs.") + s.name);
        require(*s.value >= 0 || key == "memory_limit_bytes_per_rank", "costs.", s.name, " must be >= 0");
        require(*s.value > 0 || (key != "kv_bytes_per_element" && key != "dkv_bytes_per_element"), "costs.", s.name,
                " must be > 0");
        done = true;
      }
    }
    if (done || key == "note" || key == "source") continue;
    if (key == "kernel_tiles") {
      const std::string t = val.as_string("costs.kernel_tiles");
      bool known = false;
      for (KernelTiles k : {KernelTiles::Exact, KernelTiles::Cpu, KernelTiles::Cuda}) {
        if (t == kernel_tiles_name(k)) c.kernel_tiles = k, known = true;
      }
      require(known, "costs.kernel_tiles must be exact, cpu or cuda, got '", t, "'");
    } else if (key == "ranks_per_node") {
      const int64_t n = val.as_int("costs.ranks_per_node");
      require(n >= 1 && n <= 1 << 20, "costs.ranks_per_node must be >= 1, got ", n);
      c.ranks_per_node = static_cast<int>(n);
    } else if (key == "intra_node") {
      c.intra_node = link_from_json(val, "costs.intra_node");
    } else if (key == "inter_node") {
      c.inter_node = link_from_json(val, "costs.inter_node");
    } else if (key == "links") {
      c.links.clear();
      for (const json::Value& l : val.as_array("costs.links")) {
        LinkOverride o;
        o.src = static_cast<int>(l.at("src", "costs.links[]").as_int("costs.links[].src"));
        o.dst = static_cast<int>(l.at("dst", "costs.links[]").as_int("costs.links[].dst"));
        require(o.src >= 0 && o.dst >= 0, "costs.links[]: src and dst must be >= 0");
        o.link = link_from_json(l, "costs.links[]");
        c.links.push_back(o);
      }
    } else {
      fail("costs: unknown key '", key, "'");
    }
  }
  return c;
}

CostModel load_costs(const std::string& path) { return costs_from_json(json::parse(json::read_file(path))); }

json::Value to_json(const CostModel& c) {
  json::Value v = json::Value::object();
  v.set("kv_bytes_per_element", c.kv_bytes_per_element);
  v.set("dkv_bytes_per_element", c.dkv_bytes_per_element);
  v.set("local_forward_pairs_per_ms", c.local_forward_pairs_per_ms);
  v.set("remote_forward_pairs_per_ms", c.remote_forward_pairs_per_ms);
  v.set("local_backward_pairs_per_ms", c.local_backward_pairs_per_ms);
  v.set("remote_backward_pairs_per_ms", c.remote_backward_pairs_per_ms);
  v.set("kernel_tiles", std::string(kernel_tiles_name(c.kernel_tiles)));
  v.set("stage_launch_ms", c.stage_launch_ms);
  v.set("merge_ms_per_query_token", c.merge_ms_per_query_token);
  v.set("range_ms", c.range_ms);
  v.set("underfill_pairs", c.underfill_pairs);
  v.set("underfill_ms", c.underfill_ms);
  v.set("token_local_forward_ms_per_token", c.token_local_forward_ms_per_token);
  v.set("token_local_backward_ms_per_token", c.token_local_backward_ms_per_token);
  v.set("ranks_per_node", static_cast<int64_t>(c.ranks_per_node));
  v.set("intra_node", to_json(c.intra_node));
  v.set("inter_node", to_json(c.inter_node));
  v.set("rank_bandwidth_bytes_per_ms", c.rank_bandwidth_bytes_per_ms);
  json::Value links = json::Value::array();
  for (const LinkOverride& o : c.links) {
    json::Value l = to_json(o.link);
    l.set("src", static_cast<int64_t>(o.src));
    l.set("dst", static_cast<int64_t>(o.dst));
    links.push_back(l);
  }
  v.set("links", links);
  v.set("activation_bytes_per_token", c.activation_bytes_per_token);
  v.set("memory_limit_bytes_per_rank", c.memory_limit_bytes_per_rank);
  return v;
}

double pairs_ms(const CostModel& c, double pairs, bool remote, Pass pass) {
  const double throughput = pass == Pass::Forward
                                ? (remote ? c.remote_forward_pairs_per_ms : c.local_forward_pairs_per_ms)
                                : (remote ? c.remote_backward_pairs_per_ms : c.local_backward_pairs_per_ms);
  return pairs / throughput;
}

double token_local_ms(const CostModel& c, double tokens, Pass pass) {
  return tokens * (pass == Pass::Forward ? c.token_local_forward_ms_per_token : c.token_local_backward_ms_per_token);
}

double own_work_ms(const CostModel& c, double pairs, double tokens) {
  return pairs * (1.0 / c.local_forward_pairs_per_ms + 1.0 / c.local_backward_pairs_per_ms) +
         tokens * (c.token_local_forward_ms_per_token + c.token_local_backward_ms_per_token);
}

double stage_ms(const CostModel& c, const StageLoad& s, bool remote, Pass pass) {
  if (s.pairs <= 0) return 0.0;
  // The kernel computes whole tiles: price the padded pairs when they are known.
  const int64_t computed = std::max(s.pairs, s.compute_pairs);
  double ms = c.stage_launch_ms + pairs_ms(c, static_cast<double>(computed), remote, pass) +
              c.range_ms * static_cast<double>(s.ranges);
  // The local stage writes the accumulators; every remote stage merges into them.
  if (remote) ms += c.merge_ms_per_query_token * static_cast<double>(s.query_tokens);
  if (c.underfill_pairs > 0 && s.pairs < c.underfill_pairs) {
    ms += c.underfill_ms * (1.0 - static_cast<double>(s.pairs) / static_cast<double>(c.underfill_pairs));
  }
  return ms;
}

Links::Links(const CostModel& c, int cp) : cp_(cp), table_(static_cast<size_t>(cp) * cp) {
  for (int s = 0; s < cp; ++s) {
    for (int d = 0; d < cp; ++d) table_[static_cast<size_t>(s) * cp + d] = c.link(s, d);
  }
}

namespace {

// One wave's exchange with the per-rank totals of the forward flow precomputed (tokens). inbound: the
// forward KV fetch into `rank`; otherwise the mirror: `rank` returns dK/dV of what it received.
double exchange_with_totals(const CostModel& c, const Links& links, const WaveTraffic& t, const int64_t* out_tokens,
                            const int64_t* in_tokens, int rank, int64_t bytes_per_token, bool inbound) {
  const int cp = links.cp();
  const double b = static_cast<double>(bytes_per_token);
  double worst = 0.0;
  for (int peer = 0; peer < cp; ++peer) {
    if (peer == rank) continue;
    // Forward flow peer -> rank; the return flows rank -> peer over the reverse link.
    const int64_t tokens = t[static_cast<size_t>(peer) * cp + rank];
    if (tokens <= 0) continue;
    const Link& l = inbound ? links.at(peer, rank) : links.at(rank, peer);
    // Sender and receiver totals: forward, peer sends out_tokens[peer] and rank receives in_tokens[rank];
    // mirrored, rank sends in_tokens[rank] and peer receives out_tokens[peer]. Same two numbers.
    const double wire = std::max({static_cast<double>(tokens) * b / l.bandwidth_bytes_per_ms,
                                  static_cast<double>(out_tokens[peer]) * b / c.rank_bandwidth_bytes_per_ms,
                                  static_cast<double>(in_tokens[rank]) * b / c.rank_bandwidth_bytes_per_ms});
    worst = std::max(worst, l.latency_ms + wire);
  }
  return worst;
}

void totals(const WaveTraffic& t, int cp, std::vector<int64_t>& out, std::vector<int64_t>& in) {
  out.assign(cp, 0);
  in.assign(cp, 0);
  for (int s = 0; s < cp; ++s) {
    for (int d = 0; d < cp; ++d) {
      const int64_t v = s == d ? 0 : t[static_cast<size_t>(s) * cp + d];
      out[s] += v;
      in[d] += v;
    }
  }
}

}  // namespace

double exchange_ms(const CostModel& c, const Links& links, const WaveTraffic& traffic, int rank,
                   int64_t bytes_per_token, bool inbound) {
  std::vector<int64_t> out, in;
  totals(traffic, links.cp(), out, in);
  return exchange_with_totals(c, links, traffic, out.data(), in.data(), rank, bytes_per_token, inbound);
}

bool is_transfer(SpanKind kind) { return kind == SpanKind::Fetch || kind == SpanKind::Return; }

namespace {

// The simulator. With `spans` it also records the schedule it computes; the numbers are the same either way.
Prediction simulate_into(const CostModel& c, const Links& links, const AttentionShape& shape,
                         const std::vector<RankLoad>& loads, const std::vector<WaveTraffic>& waves, bool refetch,
                         std::vector<ScheduleSpan>* spans) {
  const int cp = links.cp();
  require(static_cast<int>(loads.size()) == cp, "simulate: ", loads.size(), " rank loads for cp = ", cp);
  const size_t num_waves = waves.size();
  std::vector<int64_t> out(num_waves * cp), in(num_waves * cp);
  {
    std::vector<int64_t> o, i;
    for (size_t w = 0; w < num_waves; ++w) {
      totals(waves[w], cp, o, i);
      std::copy(o.begin(), o.end(), out.begin() + static_cast<ptrdiff_t>(w * cp));
      std::copy(i.begin(), i.end(), in.begin() + static_cast<ptrdiff_t>(w * cp));
    }
  }
  const int64_t kv_bytes = c.kv_bytes_per_token(shape), dkv_bytes = c.dkv_bytes_per_token(shape);
  Prediction p;
  p.forward_ms.assign(cp, 0.0);
  p.backward_ms.assign(cp, 0.0);
  for (int r = 0; r < cp; ++r) {
    const RankLoad& load = loads[r];
    require(load.waves.size() == num_waves, "simulate: rank ", r, " has ", load.waves.size(), " waves, expected ",
            num_waves);
    auto fetch = [&](size_t w, int64_t bytes, bool inbound) {
      return exchange_with_totals(c, links, waves[w], out.data() + w * cp, in.data() + w * cp, r, bytes, inbound);
    };
    // Spans are placed at `offset` + the simulator's clock; empty ones are left out.
    double offset = 0.0;
    auto record = [&](SpanKind kind, Pass pass, int wave, double begin, double end) {
      if (spans != nullptr && end > begin) spans->push_back({kind, pass, r, wave, offset + begin, offset + end});
    };
    const double owned = static_cast<double>(load.owned_tokens);
    const double local_forward = token_local_ms(c, owned, Pass::Forward);
    const double local_backward = token_local_ms(c, owned, Pass::Backward);
    // Forward: the token-local work (the projections that make K and V) first; then the local stage
    // while wave 0 arrives; each wave starts when both its KV and the GPU are free, and issues the
    // next wave's fetch as it starts.
    record(SpanKind::TokenLocal, Pass::Forward, -1, 0.0, local_forward);
    offset = local_forward;
    double compute_done = stage_ms(c, load.local, false, Pass::Forward);
    double fetch_ready = num_waves > 0 ? fetch(0, kv_bytes, true) : 0.0;
    record(SpanKind::LocalStage, Pass::Forward, -1, 0.0, compute_done);
    record(SpanKind::Fetch, Pass::Forward, 0, 0.0, fetch_ready);
    for (size_t w = 0; w < num_waves; ++w) {
      const double start = std::max(compute_done, fetch_ready);
      record(SpanKind::Wait, Pass::Forward, static_cast<int>(w), compute_done, start);
      fetch_ready = start + (w + 1 < num_waves ? fetch(w + 1, kv_bytes, true) : 0.0);
      compute_done = start + stage_ms(c, load.waves[w], true, Pass::Forward);
      record(SpanKind::Fetch, Pass::Forward, static_cast<int>(w + 1), start, fetch_ready);
      record(SpanKind::RemoteStage, Pass::Forward, static_cast<int>(w), start, compute_done);
    }
    p.forward_ms[r] = local_forward + compute_done;
    // Backward: remote waves in reverse, each returning its dK/dV as soon as it is computed; local
    // last; the token-local work (the projections' gradients) once every dK/dV is back. Fetching the KV
    // again, a wave starts when its KV has landed too, and issues the next one's fetch as it starts.
    offset = p.forward_ms[r];
    double compute = 0.0, returned = 0.0;
    double refetched = refetch && num_waves > 0 ? fetch(num_waves - 1, kv_bytes, true) : 0.0;
    if (refetch && num_waves > 0) record(SpanKind::Fetch, Pass::Backward, static_cast<int>(num_waves - 1), 0.0, refetched);
    for (size_t w = num_waves; w-- > 0;) {
      if (refetch) {
        const double start = std::max(compute, refetched);
        record(SpanKind::Wait, Pass::Backward, static_cast<int>(w), compute, start);
        compute = start;
        refetched = start + (w > 0 ? fetch(w - 1, kv_bytes, true) : 0.0);
        if (w > 0) record(SpanKind::Fetch, Pass::Backward, static_cast<int>(w - 1), start, refetched);
      }
      const double begin = compute;
      compute += stage_ms(c, load.waves[w], true, Pass::Backward);
      record(SpanKind::RemoteStage, Pass::Backward, static_cast<int>(w), begin, compute);
      const double ret = fetch(w, dkv_bytes, false);
      if (ret > 0.0) {
        returned = std::max(returned, compute + ret);
        record(SpanKind::Return, Pass::Backward, static_cast<int>(w), compute, compute + ret);
      }
    }
    const double local_begin = compute;
    compute += stage_ms(c, load.local, false, Pass::Backward);
    record(SpanKind::LocalStage, Pass::Backward, -1, local_begin, compute);
    const double attention_done = std::max(compute, returned);
    record(SpanKind::Wait, Pass::Backward, -1, compute, attention_done);
    p.backward_ms[r] = local_backward + attention_done;
    record(SpanKind::TokenLocal, Pass::Backward, -1, attention_done, p.backward_ms[r]);
    const double total = p.forward_ms[r] + p.backward_ms[r];
    if (r == 0 || total > p.makespan_ms) {
      p.makespan_ms = total;
      p.slowest_rank = r;
    }
  }
  return p;
}

}  // namespace

Prediction simulate(const CostModel& c, const Links& links, const AttentionShape& shape,
                    const std::vector<RankLoad>& loads, const std::vector<WaveTraffic>& waves,
                    bool refetch_backward) {
  return simulate_into(c, links, shape, loads, waves, refetch_backward, nullptr);
}

Timeline simulate_timeline(const CostModel& c, const Links& links, const AttentionShape& shape,
                           const std::vector<RankLoad>& loads, const std::vector<WaveTraffic>& waves,
                           bool refetch_backward) {
  Timeline t;
  t.prediction = simulate_into(c, links, shape, loads, waves, refetch_backward, &t.spans);
  return t;
}

}  // namespace treecp
