#include "plan/planner.hpp"

#include "plan/memory.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <numeric>

#include "core/error.hpp"
#include "tree/row.hpp"
#include "tree/slice.hpp"

namespace treecp {

namespace {

// Estimated single-GPU ms of a chunk's own work (its attention pairs plus its token-local work): the
// weight the balancing layouts and the search use to rank chunks before the simulator prices them.
std::vector<double> chunk_estimates(const WorkMatrix& w, const CostModel& c) {
  std::vector<double> est(w.num_chunks());
  for (int32_t i = 0; i < w.num_chunks(); ++i) {
    est[i] = own_work_ms(c, static_cast<double>(w.q_weight[i]), static_cast<double>(w.chunk_tokens(i)));
  }
  return est;
}

// Group of chunk c when `total` is cut into `groups` equal parts of a prefix-summed weight: the part
// holding the chunk's midpoint, so a chunk goes where most of it lies.
int32_t group_of(double before, double self, double total, int64_t groups) {
  if (total <= 0.0) return 0;
  const auto g = static_cast<int64_t>((before + self / 2.0) * static_cast<double>(groups) / total);
  return static_cast<int32_t>(std::clamp<int64_t>(g, 0, groups - 1));
}

int32_t fold(int32_t group, int cp) { return group < cp ? group : 2 * cp - 1 - group; }

}  // namespace

std::vector<int32_t> contiguous_owner(const WorkMatrix& w, int cp) {
  std::vector<int32_t> owner(w.num_chunks());
  for (int32_t i = 0; i < w.num_chunks(); ++i) {
    owner[i] = group_of(static_cast<double>(w.bounds[i]), static_cast<double>(w.chunk_tokens(i)),
                        static_cast<double>(w.tokens()), cp);
  }
  return owner;
}

std::vector<int32_t> zigzag_owner(const WorkMatrix& w, int cp) {
  std::vector<int32_t> owner(w.num_chunks());
  for (int32_t i = 0; i < w.num_chunks(); ++i) {
    owner[i] = fold(group_of(static_cast<double>(w.bounds[i]), static_cast<double>(w.chunk_tokens(i)),
                             static_cast<double>(w.tokens()), 2 * static_cast<int64_t>(cp)),
                    cp);
  }
  return owner;
}

std::vector<int32_t> balanced_owner(const WorkMatrix& w, const CostModel& c, int cp) {
  const std::vector<double> est = chunk_estimates(w, c);
  const double total = std::accumulate(est.begin(), est.end(), 0.0);
  std::vector<int32_t> owner(w.num_chunks());
  double before = 0.0;
  for (int32_t i = 0; i < w.num_chunks(); ++i) {
    owner[i] = group_of(before, est[i], total, cp);
    before += est[i];
  }
  return owner;
}

std::vector<int32_t> perdoc_owner(const Row& row, const WorkMatrix& w, int cp, int64_t min_piece) {
  const int64_t pieces = 2 * static_cast<int64_t>(cp);
  std::vector<int32_t> owner(w.num_chunks());
  std::vector<int64_t> tokens(cp, 0);
  for (int32_t i = 0; i < w.num_chunks(); ++i) {
    const int32_t root = row.root(row.segment_of(w.bounds[i]));
    const int64_t begin = row.start(root), len = row.subtree_token_end(root) - begin;
    if (len >= pieces * min_piece && w.bounds[i + 1] <= begin + len) {
      // Piece p of a folded family is [begin + p * len / pieces, begin + (p + 1) * len / pieces).
      owner[i] = fold(group_of(static_cast<double>(w.bounds[i] - begin), static_cast<double>(w.chunk_tokens(i)),
                               static_cast<double>(len), pieces),
                      cp);
    } else {
      owner[i] = static_cast<int32_t>(std::min_element(tokens.begin(), tokens.end()) - tokens.begin());
    }
    tokens[owner[i]] += w.chunk_tokens(i);
  }
  return owner;
}

std::vector<int32_t> family_owner(const Row& row, const WorkMatrix& w, const CostModel& c, int cp, bool split) {
  const int32_t n = w.num_chunks();
  const std::vector<double> est = chunk_estimates(w, c);
  const double share = std::accumulate(est.begin(), est.end(), 0.0) / cp;
  std::vector<int64_t> family_starts;
  for (int32_t r : row.roots()) family_starts.push_back(row.start(r));
  // Blocks: runs of chunks no family boundary separates. A block costlier than a rank's share is cut
  // into equal-cost contiguous pieces; pieces then go, costliest first, to the least loaded rank.
  struct Piece {
    int32_t first, last;
    double cost;
  };
  std::vector<Piece> pieces;
  for (int32_t b = 0; b < n;) {
    int32_t e = b + 1;
    while (e < n && !std::binary_search(family_starts.begin(), family_starts.end(), w.bounds[e])) ++e;
    const double cost = std::accumulate(est.begin() + b, est.begin() + e, 0.0);
    const int64_t parts = split && share > 0.0 && cost > share ? static_cast<int64_t>(std::ceil(cost / share)) : 1;
    double before = 0.0;
    int32_t start = b, current = 0;
    for (int32_t i = b; i < e; ++i) {
      const int32_t g = group_of(before, est[i], cost, parts);
      if (g != current && i > start) {
        pieces.push_back({start, i - 1, 0.0});
        start = i;
      }
      current = g;
      before += est[i];
    }
    pieces.push_back({start, e - 1, 0.0});
    b = e;
  }
  for (Piece& p : pieces) p.cost = std::accumulate(est.begin() + p.first, est.begin() + p.last + 1, 0.0);
  std::stable_sort(pieces.begin(), pieces.end(), [](const Piece& a, const Piece& b) { return a.cost > b.cost; });
  std::vector<double> load(cp, 0.0);
  std::vector<int32_t> owner(n, 0);
  for (const Piece& p : pieces) {
    const auto r = static_cast<int32_t>(std::min_element(load.begin(), load.end()) - load.begin());
    load[r] += p.cost;
    for (int32_t i = p.first; i <= p.last; ++i) owner[i] = r;
  }
  return owner;
}

// ---- evaluation

Evaluator::Evaluator(const WorkMatrix& w, const CostModel& c, const AttentionShape& shape, int cp)
    : w_(w), c_(c), shape_(shape), cp_(cp), n_(w.num_chunks()), links_(c, cp) {
  require(cp >= 1, "cp must be >= 1, got ", cp);
  need_.assign(n_, 0);
  need_compute_.assign(n_, 0);
  wave_.assign(n_, -1);
  loads_.resize(cp);
}

int32_t Evaluator::wave_of(int rank, int32_t k) const {
  const auto first = fetch_.begin() + fetch_start_[rank], last = fetch_.begin() + fetch_start_[rank + 1];
  const auto it = std::lower_bound(first, last, k, [](const Fetch& f, int32_t x) { return f.chunk < x; });
  return it != last && it->chunk == k ? it->wave : -1;
}

Evaluator::Result Evaluator::evaluate(const std::vector<int32_t>& owner, int waves) {
  require(static_cast<int32_t>(owner.size()) == n_, "evaluate: ", owner.size(), " owners for ", n_, " chunks");
  require(waves >= 0 && waves <= 32, "evaluate: waves must be in [0, 32], got ", waves);
  const int cp = cp_;
  Result res;
  traffic_.assign(waves, WaveTraffic(static_cast<size_t>(cp) * cp, 0));
  for (RankLoad& l : loads_) {
    l = RankLoad{};
    l.waves.assign(waves, StageLoad{});
  }
  // Chunks grouped by owner (counting sort); owned tokens and ranges (runs of consecutive chunks).
  by_rank_start_.assign(static_cast<size_t>(cp) + 1, 0);
  for (int32_t i = 0; i < n_; ++i) {
    const int32_t r = owner[i];
    require(r >= 0 && r < cp, "evaluate: chunk ", i, " owned by rank ", r, ", expected [0, ", cp, ")");
    by_rank_start_[r + 1]++;
    loads_[r].owned_tokens += w_.chunk_tokens(i);
    if (i == 0 || owner[i - 1] != r) loads_[r].local.ranges++;
  }
  for (int r = 0; r < cp; ++r) by_rank_start_[r + 1] += by_rank_start_[r];
  by_rank_.resize(n_);
  {
    std::vector<int64_t> fill(by_rank_start_.begin(), by_rank_start_.end() - 1);
    for (int32_t i = 0; i < n_; ++i) by_rank_[fill[owner[i]]++] = i;
  }
  fetch_.clear();
  fetch_start_.assign(static_cast<size_t>(cp) + 1, 0);
  recv_tokens_.assign(std::max(waves, 1), 0);
  // One rank at a time, with scratch of one entry per chunk: need_[k] = pairs its queries have with
  // remote key chunk k, wave_[k] = the wave that brings k.
  for (int r = 0; r < cp; ++r) {
    RankLoad& l = loads_[r];
    l.local.query_tokens = l.owned_tokens;
    touched_.clear();
    int64_t remote = 0;
    for (int64_t x = by_rank_start_[r]; x < by_rank_start_[r + 1]; ++x) {
      const int32_t i = by_rank_[x];
      for (int64_t e = w_.row_start[i]; e < w_.row_start[i + 1]; ++e) {
        const int32_t k = w_.col[e];
        if (owner[k] == r) {
          l.local.pairs += w_.pairs[e];
          l.local.compute_pairs += w_.compute[e];
          continue;
        }
        if (need_[k] == 0) touched_.push_back(k);
        need_[k] += w_.pairs[e];
        need_compute_[k] += w_.compute[e];
        remote += w_.pairs[e];
      }
    }
    if (remote > 0 && waves == 0) {
      for (int32_t k : touched_) need_[k] = need_compute_[k] = 0;
      res.valid = false;
      res.fits_memory = false;
      res.prediction.makespan_ms = 1e300;
      return res;
    }
    // Row order of the needed chunks: sort a few, or scan every chunk when most are needed.
    if (touched_.size() * 16 > static_cast<size_t>(n_)) {
      touched_.clear();
      for (int32_t k = 0; k < n_; ++k) {
        if (need_[k] > 0) touched_.push_back(k);
      }
    } else {
      std::sort(touched_.begin(), touched_.end());
    }
    // Waves take the needed key chunks in row order, cut where the remote pairs pass w / waves of the
    // total, so every wave has about the same compute and neighbouring chunks share a range.
    std::fill(recv_tokens_.begin(), recv_tokens_.end(), 0);
    int64_t before = 0;
    for (int32_t k : touched_) {
      const int32_t wave =
          group_of(static_cast<double>(before), static_cast<double>(need_[k]), static_cast<double>(remote), waves);
      before += need_[k];
      wave_[k] = wave;
      fetch_.push_back({k, wave});
      StageLoad& s = l.waves[wave];
      s.pairs += need_[k];
      s.compute_pairs += need_compute_[k];
      const int32_t src = owner[k];
      // A new range unless the previous key chunk came from the same owner in the same wave.
      if (k == 0 || wave_[k - 1] != wave || owner[k - 1] != src) s.ranges++;
      traffic_[wave][static_cast<size_t>(src) * cp + r] += w_.chunk_tokens(k);
      recv_tokens_[wave] += w_.chunk_tokens(k);
    }
    fetch_start_[r + 1] = static_cast<int64_t>(fetch_.size());
    // Query tokens each wave merges: the owned query chunks with pairs against that wave's keys.
    for (int64_t x = by_rank_start_[r]; waves > 0 && x < by_rank_start_[r + 1]; ++x) {
      const int32_t i = by_rank_[x];
      uint32_t hit = 0;  // bit w: this chunk has pairs in wave w
      for (int64_t e = w_.row_start[i]; e < w_.row_start[i + 1]; ++e) {
        const int32_t wave = wave_[w_.col[e]];
        if (wave >= 0 && owner[w_.col[e]] != r) hit |= 1u << wave;
      }
      for (int wave = 0; hit != 0; ++wave, hit >>= 1) {
        if (hit & 1u) l.waves[wave].query_tokens += w_.chunk_tokens(i);
      }
    }
    for (int32_t k : touched_) {
      need_[k] = need_compute_[k] = 0;
      wave_[k] = -1;
    }
  }
  // Memory per rank, with the received KV kept for the backward and fetched again; the choice, then its price.
  int64_t peak_keep = 0, peak_refetch = 0;
  for (int r = 0; r < cp; ++r) {
    RuntimeMemoryInput in = runtime_memory_input(shape_, c_, loads_[r].owned_tokens);
    for (int wave = 0; wave < waves; ++wave) {
      int64_t fetched = 0, sent = 0;
      for (int p = 0; p < cp; ++p) {
        fetched += traffic_[wave][static_cast<size_t>(p) * cp + r];
        sent += traffic_[wave][static_cast<size_t>(r) * cp + p];
      }
      in.fetched_rows.push_back(fetched);
      in.sent_rows.push_back(sent);
    }
    const int64_t act = loads_[r].owned_tokens * c_.activation_bytes_per_token;
    in.refetch = false;
    peak_keep = std::max(peak_keep, act + attention_runtime_memory(in).peak_bytes());
    in.refetch = true;
    peak_refetch = std::max(peak_refetch, act + attention_runtime_memory(in).peak_bytes());
  }
  auto fits = [&](int64_t peak) { return c_.memory_limit_bytes_per_rank <= 0 || peak <= c_.memory_limit_bytes_per_rank; };
  res.refetch_backward = kv_mode_ == 2 || (kv_mode_ == 0 && !fits(peak_keep) && waves > 0);
  res.peak_memory_bytes = res.refetch_backward ? peak_refetch : peak_keep;
  res.fits_memory = fits(res.peak_memory_bytes);
  res.prediction = simulate(c_, links_, shape_, loads_, traffic_, res.refetch_backward);
  return res;
}

void Evaluator::set_backward_kv(const std::string& mode) {
  require(mode == "auto" || mode == "keep" || mode == "refetch", "backward_kv must be auto, keep or refetch, got '",
          mode, "'");
  kv_mode_ = mode == "auto" ? 0 : mode == "keep" ? 1 : 2;
}

// ---- the Plan

Plan build_plan(const std::vector<Slice>& row_slices, int64_t window, Evaluator& evaluator,
                const std::vector<int32_t>& owner, int waves, Layout layout) {
  const Evaluator::Result res = evaluator.evaluate(owner, waves);
  require(res.valid, "build_plan: remote key/value data is needed but the plan has no waves");
  const WorkMatrix& w = evaluator.work();
  const int cp = evaluator.cp();
  const int32_t n = w.num_chunks();
  Plan plan;
  plan.layout = layout;
  plan.cp = cp;
  plan.tokens = w.tokens();
  plan.window = window;
  plan.chunk_bounds = w.bounds;
  plan.chunk_owner = owner;
  plan.num_waves = waves;
  plan.refetch_backward = res.refetch_backward;
  plan.visible_pairs = w.total_pairs;
  plan.ranks.resize(cp);
  auto append = [](std::vector<TokenRange>& v, int64_t b, int64_t e) {
    if (!v.empty() && v.back().end == b) {
      v.back().end = e;
    } else {
      v.push_back({b, e});
    }
  };
  for (int r = 0; r < cp; ++r) {
    RankPlan& rp = plan.ranks[r];
    rp.stages.resize(static_cast<size_t>(waves) + 1);
    for (Stage& s : rp.stages) {
      s.recv.assign(cp, {});
      s.send.assign(cp, {});
    }
    rp.predicted_forward_ms = res.prediction.forward_ms[r];
    rp.predicted_backward_ms = res.prediction.backward_ms[r];
  }
  for (int32_t i = 0; i < n; ++i) append(plan.ranks[owner[i]].owned, w.bounds[i], w.bounds[i + 1]);
  for (int r = 0; r < cp; ++r) {
    for (const Evaluator::Fetch& f : evaluator.fetches(r)) {
      const int64_t b = w.bounds[f.chunk], e = w.bounds[f.chunk + 1];
      append(plan.ranks[r].stages[f.wave + 1].recv[owner[f.chunk]], b, e);
      append(plan.ranks[owner[f.chunk]].stages[f.wave + 1].send[r], b, e);
    }
  }
  // Slices: each row slice cut where the query owner changes (q-runs, bucketed by owner) and, for
  // that owner, where the key chunk's class (stage, owner) changes, so a stage slice reads keys from
  // one owned or received range.
  struct Run {
    int32_t slice, first, last;  // query chunks [first, last] of one owner
  };
  std::vector<std::vector<Run>> runs(cp);
  int32_t hint = 0;
  for (size_t x = 0; x < row_slices.size(); ++x) {
    const Slice& s = row_slices[x];
    if (s.empty()) continue;
    if (s.q_begin < w.bounds[hint] || s.q_begin >= w.bounds[hint + 1]) hint = chunk_of(w.bounds, s.q_begin);
    const int32_t q1 = s.q_end <= w.bounds[hint + 1] ? hint : chunk_of(w.bounds, s.q_end - 1);
    for (int32_t qa = hint; qa <= q1;) {
      int32_t qb = qa;
      while (qb + 1 <= q1 && owner[qb + 1] == owner[qa]) ++qb;
      runs[owner[qa]].push_back({static_cast<int32_t>(x), qa, qb});
      qa = qb + 1;
    }
  }
  // Class of key chunk k for rank r: 0 owned, (wave + 1) * cp + owner when fetched, -1 otherwise.
  std::vector<int64_t> fetched(n, -1);
  for (int r = 0; r < cp; ++r) {
    for (const Evaluator::Fetch& f : evaluator.fetches(r)) {
      fetched[f.chunk] = (static_cast<int64_t>(f.wave) + 1) * cp + owner[f.chunk];
    }
    auto key_class = [&](int32_t k) -> int64_t { return owner[k] == r ? 0 : fetched[k]; };
    for (const Run& run : runs[r]) {
      const Slice& s = row_slices[run.slice];
      // Keys the run's queries can see: q - diag_max < k <= q - diag_min, inside the slice.
      const int64_t qa = std::max(s.q_begin, w.bounds[run.first]), qb = std::min(s.q_end, w.bounds[run.last + 1]);
      const int64_t lo = std::max(s.k_begin, qa - s.diag_max + 1), hi = std::min(s.k_end, qb - s.diag_min);
      if (hi <= lo) continue;
      const int32_t k0 = chunk_of(w.bounds, lo), k1 = chunk_of(w.bounds, hi - 1);
      for (int32_t ka = k0; ka <= k1;) {
        const int64_t cls = key_class(ka);
        int32_t kb = ka;
        while (kb + 1 <= k1 && key_class(kb + 1) == cls) ++kb;
        const Slice piece = cut_slice(s, qa, qb, w.bounds[ka], w.bounds[kb + 1]);
        if (!piece.empty()) {
          if (cls < 0) fail("build_plan: internal error: slice ", to_string(piece), " has no stage on rank ", r);
          Stage& st = plan.ranks[r].stages[cls == 0 ? 0 : cls / cp];
          st.slices.push_back(piece);
          st.pairs += piece.area();
        }
        ka = kb + 1;
      }
    }
    for (const Evaluator::Fetch& f : evaluator.fetches(r)) fetched[f.chunk] = -1;
  }
  plan.predicted_makespan_ms = res.prediction.makespan_ms;
  return plan;
}

// The loads and traffic a Plan implies, from its slices and ranges.
void plan_loads(const Plan& plan, const AttentionShape& shape, const CostModel& costs, std::vector<RankLoad>& loads,
                std::vector<WaveTraffic>& traffic) {
  const int cp = plan.cp;
  require(cp >= 1 && static_cast<int>(plan.ranks.size()) == cp, "simulate_plan: plan has ", plan.ranks.size(),
          " ranks for cp = ", cp);
  const std::vector<int64_t>& bounds = plan.chunk_bounds;
  const size_t waves = static_cast<size_t>(plan.num_waves);
  loads.assign(cp, RankLoad{});
  traffic.assign(waves, WaveTraffic(static_cast<size_t>(cp) * cp, 0));
  std::vector<int32_t> stamp(bounds.size(), -1);  // last stage that counted a query chunk
  const TileTokens tile = tile_tokens(costs.kernel_tiles, shape.group());
  int32_t stage_id = 0;
  for (int r = 0; r < cp; ++r) {
    const RankPlan& rp = plan.ranks[r];
    require(rp.stages.size() == waves + 1, "simulate_plan: rank ", r, " has ", rp.stages.size(), " stages");
    RankLoad& l = loads[r];
    l.owned_tokens = rp.owned_tokens();
    auto computed = [&tile](const Stage& st) {
      int64_t sum = 0;
      for (const Slice& sl : st.slices) sum += tile_padded_area(sl, tile.query, tile.key);
      return sum;
    };
    l.local.pairs = rp.stages[0].pairs;
    l.local.compute_pairs = computed(rp.stages[0]);
    l.local.query_tokens = l.owned_tokens;
    l.local.ranges = static_cast<int64_t>(rp.owned.size());
    l.waves.resize(waves);
    for (size_t w = 0; w < waves; ++w) {
      const Stage& st = rp.stages[w + 1];
      StageLoad& s = l.waves[w];
      s.pairs = st.pairs;
      s.compute_pairs = computed(st);
      for (size_t p = 0; p < st.recv.size(); ++p) {
        s.ranges += static_cast<int64_t>(st.recv[p].size());
        for (const TokenRange& t : st.recv[p]) traffic[w][p * cp + r] += t.size();
      }
      ++stage_id;
      for (const Slice& sl : st.slices) {
        for (int32_t c = chunk_of(bounds, sl.q_begin), last = chunk_of(bounds, sl.q_end - 1); c <= last; ++c) {
          if (stamp[c] == stage_id) continue;
          stamp[c] = stage_id;
          s.query_tokens += bounds[c + 1] - bounds[c];
        }
      }
    }
  }
}

Prediction simulate_plan(const Plan& plan, const AttentionShape& shape, const CostModel& costs) {
  std::vector<RankLoad> loads;
  std::vector<WaveTraffic> traffic;
  plan_loads(plan, shape, costs, loads, traffic);
  return simulate(costs, Links(costs, plan.cp), shape, loads, traffic, plan.refetch_backward);
}

Timeline simulate_plan_timeline(const Plan& plan, const AttentionShape& shape, const CostModel& costs) {
  std::vector<RankLoad> loads;
  std::vector<WaveTraffic> traffic;
  plan_loads(plan, shape, costs, loads, traffic);
  return simulate_timeline(costs, Links(costs, plan.cp), shape, loads, traffic, plan.refetch_backward);
}

// ---- the search

namespace {

struct Candidate {
  std::vector<int32_t> owner;
  int waves = 0;
  Evaluator::Result result;
};

// Feasible first, then the faster makespan.
bool better(const Evaluator::Result& a, const Evaluator::Result& b) {
  if (a.valid != b.valid) return a.valid;
  if (a.fits_memory != b.fits_memory) return a.fits_memory;
  if (!a.fits_memory && a.peak_memory_bytes != b.peak_memory_bytes) return a.peak_memory_bytes < b.peak_memory_bytes;
  return a.prediction.makespan_ms < b.prediction.makespan_ms;
}

class Search {
 public:
  Search(Evaluator& ev, const PlanOptions& o, int& evaluations) : ev_(ev), o_(o), evaluations_(evaluations) {}

  // The owner with the best wave count among the options'.
  Candidate best_waves(std::vector<int32_t> owner) {
    Candidate best;
    best.owner = std::move(owner);
    // No rank needs remote KV: zero waves, no collectives at all.
    best.result = eval(best.owner, 0);
    if (best.result.valid) return best;
    bool first = true;
    for (int waves : wave_counts()) {
      const Evaluator::Result r = eval(best.owner, waves);
      if (first || better(r, best.result)) {
        best.waves = waves;
        best.result = r;
        first = false;
      }
    }
    return best;
  }

  // Moves (or swaps) work off the slowest rank while the search objective improves by the minimum
  // gain, within the step and evaluation budgets, then re-picks the wave count; returns the best
  // makespan seen. Each step prices a handful of candidates: the rank's boundary chunks to their
  // neighbours' owners or the fastest ranks, its heaviest chunks to the fastest ranks or to the rank
  // owning most of their keys, chunk swaps with the fastest rank, and whole-run (family) moves and
  // swaps with the fastest rank sized to about half their gap.
  Candidate refine(Candidate cur, const std::vector<double>& est, int& moves) {
    const int cp = ev_.cp();
    const int32_t n = static_cast<int32_t>(cur.owner.size());
    if (cp < 2 || n < 2) return cur;
    const int budget_end = evaluations_ + o_.search_evaluations;
    Candidate best_seen = cur;
    for (int step = 0; step < o_.search_steps && evaluations_ < budget_end; ++step) {
      const Prediction& p = cur.result.prediction;
      std::vector<double> total(cp);
      for (int r = 0; r < cp; ++r) total[r] = p.forward_ms[r] + p.backward_ms[r];
      const int slow = p.slowest_rank;
      std::vector<int> by_speed(cp);
      std::iota(by_speed.begin(), by_speed.end(), 0);
      std::sort(by_speed.begin(), by_speed.end(), [&](int a, int b) { return total[a] < total[b]; });
      // Candidate chunks: the slowest rank's boundary chunks and its heaviest chunks, costliest first.
      std::vector<int32_t> mine, boundary;
      for (int32_t i = 0; i < n; ++i) {
        if (cur.owner[i] != slow) continue;
        mine.push_back(i);
        if ((i > 0 && cur.owner[i - 1] != slow) || (i + 1 < n && cur.owner[i + 1] != slow)) boundary.push_back(i);
      }
      if (mine.size() < 2) break;
      auto heavier = [&](int32_t a, int32_t b) { return est[a] > est[b]; };
      std::sort(boundary.begin(), boundary.end(), heavier);
      std::partial_sort(mine.begin(), mine.begin() + std::min<size_t>(3, mine.size()), mine.end(), heavier);
      // A move gives chunks [first, last] to `dst`; a swap also gives [back_first, back_last] (chunks
      // of dst) to the slowest rank.
      struct Move {
        int32_t first, last;
        int dst;
        int32_t back_first, back_last;
        bool operator==(const Move&) const = default;
      };
      std::vector<Move> moves_to_try;
      auto add_range = [&](Move m) {
        if (m.dst == slow || std::find(moves_to_try.begin(), moves_to_try.end(), m) != moves_to_try.end()) return;
        moves_to_try.push_back(m);
      };
      auto add = [&](int32_t chunk, int dst, int32_t back = -1) { add_range({chunk, chunk, dst, back, back}); };
      for (size_t b = 0; b < std::min<size_t>(4, boundary.size()); ++b) {
        const int32_t i = boundary[b];
        if (i > 0) add(i, cur.owner[i - 1]);
        if (i + 1 < n) add(i, cur.owner[i + 1]);
        add(i, by_speed[0]);
      }
      for (size_t h = 0; h < std::min<size_t>(3, mine.size()); ++h) {
        add(mine[h], by_speed[0]);
        if (cp > 2) add(mine[h], by_speed[1]);
      }
      // Affinity: the rank owning most of the keys a candidate reads (its queries would become local).
      const WorkMatrix& w = ev_.work();
      std::vector<int64_t> reads(cp);
      const auto few = [](const std::vector<int32_t>& v, size_t k) {
        return std::vector<int32_t>(v.begin(), v.begin() + static_cast<ptrdiff_t>(std::min(k, v.size())));
      };
      std::vector<int32_t> affine = few(boundary, 4);
      for (int32_t i : few(mine, 3)) affine.push_back(i);
      for (int32_t i : affine) {
        std::fill(reads.begin(), reads.end(), 0);
        for (int64_t e = w.row_start[i]; e < w.row_start[i + 1]; ++e) reads[cur.owner[w.col[e]]] += w.pairs[e];
        reads[slow] = 0;
        const auto top = static_cast<int>(std::max_element(reads.begin(), reads.end()) - reads.begin());
        if (reads[top] > 0) add(i, top);
      }
      // Swaps with the fastest rank: a candidate for each of its three heaviest lighter chunks.
      std::vector<int32_t> theirs;
      for (int32_t i = 0; i < n; ++i) {
        if (cur.owner[i] == by_speed[0]) theirs.push_back(i);
      }
      std::sort(theirs.begin(), theirs.end(), heavier);
      for (size_t h = 0; h < std::min<size_t>(2, mine.size()); ++h) {
        int added = 0;
        for (int32_t b : theirs) {
          if (est[b] >= est[mine[h]] || added == 3) continue;
          add(mine[h], by_speed[0], b);
          ++added;
        }
      }
      // Whole runs (maximal same-owner chunk ranges, e.g. whole families) between the slowest and the
      // fastest rank: moves and swaps whose cost difference is closest to half their gap, so that
      // family placements can be rebalanced without splitting a family.
      const int fast = by_speed[0];
      const double gap = total[slow] - total[fast];
      struct Run {
        int32_t first, last;
        double cost;
      };
      std::vector<Run> slow_runs, fast_runs;
      for (int32_t i = 0; i < n;) {
        int32_t j = i;
        double cost = est[i];
        while (j + 1 < n && cur.owner[j + 1] == cur.owner[i]) cost += est[++j];
        if (cur.owner[i] == slow) slow_runs.push_back({i, j, cost});
        if (cur.owner[i] == fast) fast_runs.push_back({i, j, cost});
        i = j + 1;
      }
      struct Option {
        double miss;  // |moved cost - gap / 2|
        Move move;
      };
      std::vector<Option> options;
      for (const Run& a : slow_runs) {
        if (slow_runs.size() < 2) break;  // never empty the slowest rank
        if (a.cost < gap) options.push_back({std::abs(a.cost - gap / 2), {a.first, a.last, fast, -1, -1}});
        for (const Run& b : fast_runs) {
          const double moved = a.cost - b.cost;
          if (moved > 0.0 && moved < gap) {
            options.push_back({std::abs(moved - gap / 2), {a.first, a.last, fast, b.first, b.last}});
          }
        }
      }
      std::partial_sort(options.begin(), options.begin() + static_cast<ptrdiff_t>(std::min<size_t>(4, options.size())),
                        options.end(), [](const Option& x, const Option& y) { return x.miss < y.miss; });
      for (size_t o = 0; o < std::min<size_t>(4, options.size()); ++o) add_range(options[o].move);
      Candidate best;
      bool found = false;
      auto steer = [](const Evaluator::Result& a, const Evaluator::Result& b) {
        if (a.valid != b.valid || a.fits_memory != b.fits_memory) return better(a, b);
        return objective(a) < objective(b);
      };
      for (const Move& m : moves_to_try) {
        if (evaluations_ >= budget_end) break;
        std::vector<int32_t> owner = cur.owner;
        for (int32_t i = m.first; i <= m.last; ++i) owner[i] = m.dst;
        for (int32_t i = m.back_first; i >= 0 && i <= m.back_last; ++i) owner[i] = slow;
        const int waves = std::max(cur.waves, 1);  // a move may create the first remote need
        const Evaluator::Result r = eval(owner, waves);
        if (!found || steer(r, best.result)) {
          best.owner = std::move(owner);
          best.waves = waves;
          best.result = r;
          found = true;
        }
      }
      const bool gains = found && steer(best.result, cur.result) &&
                         (best.result.fits_memory != cur.result.fits_memory ||
                          objective(best.result) < objective(cur.result) * (1.0 - o_.min_gain));
      if (!gains) break;
      cur = std::move(best);
      if (better(cur.result, best_seen.result)) best_seen = cur;
      ++moves;
    }
    // The wave count may have a new optimum for the moved ownership.
    Candidate rewaved = best_waves(best_seen.owner);
    return better(rewaved.result, best_seen.result) ? rewaved : best_seen;
  }

  // What the moves steer by: the makespan plus half the mean excess over the mean rank time.
  // The excess term lets the search leave a plateau where several ranks tie for the slowest (moving
  // work off one of them does not change the makespan yet); the makespan alone picks the result.
  static double objective(const Evaluator::Result& r) {
    const Prediction& p = r.prediction;
    const size_t cp = p.forward_ms.size();
    double mean = 0.0;
    for (size_t i = 0; i < cp; ++i) mean += p.forward_ms[i] + p.backward_ms[i];
    mean /= static_cast<double>(cp);
    double excess = 0.0;
    for (size_t i = 0; i < cp; ++i) excess += std::max(0.0, p.forward_ms[i] + p.backward_ms[i] - mean);
    return p.makespan_ms + 0.5 * excess / static_cast<double>(cp);
  }

  std::vector<int> wave_counts() const {
    std::vector<int> counts;
    for (int w = 1; w <= std::max(1, o_.max_waves); ++w) counts.push_back(w);
    return counts;
  }

 private:
  Evaluator::Result eval(const std::vector<int32_t>& owner, int waves) {
    ++evaluations_;
    return ev_.evaluate(owner, waves);
  }

  Evaluator& ev_;
  const PlanOptions& o_;
  int& evaluations_;
};

}  // namespace

Plan make_plan(const Row& row, int cp, const AttentionShape& shape, const CostModel& costs, const PlanOptions& options,
               PlanReport* report) {
  const auto t0 = std::chrono::steady_clock::now();
  require(cp >= 1 && cp <= 4096, "cp must be in [1, 4096], got ", cp);
  shape.validate();
  require(options.layout != Layout::Ring, "layout 'ring' is a baseline (plan/baselines.hpp: ring_plan), not a layout "
          "the planner builds");
  require(options.chunk_tokens >= 0, "chunk size must be >= 0 (0 = choose), got ", options.chunk_tokens);
  require(options.max_waves >= 1 && options.max_waves <= 16, "max waves must be in [1, 16], got ", options.max_waves);

  const std::vector<Slice> slices = row_slices(row, shape.window);
  const int64_t chunk = options.chunk_tokens > 0 ? options.chunk_tokens : default_chunk_tokens(row.tokens(), cp);
  const TileTokens tile = tile_tokens(costs.kernel_tiles, shape.group());
  const int64_t tq = tile.query, tk = tile.key;
  const WorkMatrix common = build_work_matrix(slices, make_chunk_bounds(row, chunk), tq, tk);
  const WorkMatrix perdoc = build_work_matrix(slices, perdoc_chunk_bounds(row, cp, options.perdoc_min_piece), tq, tk);
  Evaluator ev_common(common, costs, shape, cp), ev_perdoc(perdoc, costs, shape, cp);
  ev_common.set_backward_kv(options.backward_kv);
  ev_perdoc.set_backward_kv(options.backward_kv);
  int evaluations = 0, moves = 0;
  Search on_common(ev_common, options, evaluations), on_perdoc(ev_perdoc, options, evaluations);

  // Fixed layouts, each with its best wave count; then the search from the best of them.
  const Candidate contiguous = on_common.best_waves(contiguous_owner(common, cp));
  const Candidate zigzag = on_common.best_waves(zigzag_owner(common, cp));
  const Candidate perdoc_fixed = on_perdoc.best_waves(perdoc_owner(row, perdoc, cp, options.perdoc_min_piece));
  const Candidate family = on_common.best_waves(family_owner(row, common, costs, cp));
  // Search starts on the common grid: the fixed layouts there, an equal-cost contiguous split and
  // whole families never split (no communication at all when it pays).
  const Candidate* start = &contiguous;
  for (const Candidate* c : {&zigzag, &family}) {
    if (better(c->result, start->result)) start = c;
  }
  const Candidate balanced = on_common.best_waves(balanced_owner(common, costs, cp));
  const Candidate whole = on_common.best_waves(family_owner(row, common, costs, cp, false));
  for (const Candidate* c : {&balanced, &whole}) {
    if (better(c->result, start->result)) start = c;
  }
  Candidate searched = on_common.refine(*start, chunk_estimates(common, costs), moves);
  bool searched_on_perdoc = false;
  // The finer perdoc grid is searched too when its fixed layout beats the common grid's result.
  if (better(perdoc_fixed.result, searched.result)) {
    searched = on_perdoc.refine(perdoc_fixed, chunk_estimates(perdoc, costs), moves);
    searched_on_perdoc = true;
  }

  auto candidate = [&](Layout l) -> const Candidate& {
    switch (l) {
      case Layout::Contiguous: return contiguous;
      case Layout::Zigzag: return zigzag;
      case Layout::Perdoc: return perdoc_fixed;
      case Layout::Family: return family;
      case Layout::Searched:
      case Layout::Ring: break;
    }
    return searched;
  };
  const Candidate& pick = candidate(options.layout);
  const bool pick_perdoc =
      options.layout == Layout::Perdoc || (options.layout == Layout::Searched && searched_on_perdoc);
  Plan plan =
      build_plan(slices, shape.window, pick_perdoc ? ev_perdoc : ev_common, pick.owner, pick.waves, options.layout);
  if (report != nullptr) {
    report->layouts.clear();
    for (Layout l : kLayouts) {
      const Candidate& c = candidate(l);
      LayoutResult lr;
      lr.layout = l;
      lr.num_waves = c.waves;
      lr.chunks = static_cast<int64_t>(c.owner.size());
      lr.makespan_ms = c.result.prediction.makespan_ms;
      lr.peak_memory_bytes = c.result.peak_memory_bytes;
      lr.fits_memory = c.result.fits_memory;
      lr.refetch_backward = c.result.refetch_backward;
      report->layouts.push_back(lr);
    }
    report->chunk_tokens = chunk;
    report->evaluations = evaluations;
    report->search_moves = moves;
    report->planning_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  }
  return plan;
}

Plan plan_for_ownership(const Row& row, const Plan& ownership, const AttentionShape& shape, const CostModel& costs,
                        const PlanOptions& options) {
  shape.validate();
  require(ownership.tokens == row.tokens(), "ownership: the plan is for ", ownership.tokens, " tokens, the row has ",
          row.tokens());
  require(options.max_waves >= 1 && options.max_waves <= 16, "max waves must be in [1, 16], got ", options.max_waves);
  const std::vector<Slice> slices = row_slices(row, shape.window);
  const TileTokens tile = tile_tokens(costs.kernel_tiles, shape.group());
  const WorkMatrix w = build_work_matrix(slices, ownership.chunk_bounds, tile.query, tile.key);
  Evaluator ev(w, costs, shape, ownership.cp);
  ev.set_backward_kv(options.backward_kv);
  int evaluations = 0;
  const Candidate pick = Search(ev, options, evaluations).best_waves(ownership.chunk_owner);
  return build_plan(slices, shape.window, ev, pick.owner, pick.waves, ownership.layout);
}

}  // namespace treecp
