// treecp bench cp: the weak-scaling table of dense attention CP. Per rank count (a prefix of the world's
// ranks) and preset (base tokens per rank x CP): forward, backward and forward+backward, each the median
// over steps of the slowest rank; exposed communication (the same plan with every exchange skipped, subtracted);
// bytes moved; peak allocated and reserved memory; planning time and, for varied5k (16 distinct trees, one per
// step, each planned on a host thread while the previous one runs), how much of it lookahead hid; predicted
// beside measured. Beside treecp's searched plan, the ring baseline (plan/baselines.hpp) in the same run.
// GPU ranks with --device cuda (NCCL), CPU ranks over MPI with --device cpu (small rows: a check that runs in CI).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <sstream>

#include "checks.hpp"
#include "command.hpp"
#include "core/error.hpp"
#include "core/json.hpp"
#include "core/random.hpp"
#include "launcher.hpp"
#include "plan/baselines.hpp"
#include "plan/cost.hpp"
#include "plan/planner.hpp"
#include "runtime/cpu_backend.hpp"
#include "runtime/dense_attention.hpp"
#include "runtime/lookahead.hpp"
#include "tree/presets.hpp"
#include "tree/row.hpp"
#include "viz/scaling_svg.hpp"

#ifdef TREECP_HAVE_MPI
#include "comm/mpi_communicator.hpp"
#endif
#if defined(TREECP_HAVE_CUDA) && defined(TREECP_HAVE_NCCL)
#include "comm/nccl_communicator.hpp"
#include "kernels/cuda/memory.hpp"
#include "runtime/cuda_backend.hpp"
#ifdef TREECP_HAVE_MPI
#include "comm/nccl_mpi.hpp"
#endif
#define TREECP_BENCH_GPU 1
#endif

namespace treecp::cli {
namespace {

using Clock = std::chrono::steady_clock;
double ms_since(Clock::time_point t0) { return std::chrono::duration<double, std::milli>(Clock::now() - t0).count(); }

struct BenchConfig {
  std::vector<int> cps;
  std::vector<std::string> presets;
  int reps = 10, trees = 16;
  int64_t scale = 1;
  AttentionShape shape{32, 4, 128, 128};  // --hq, --hkv, --d, --dv (= d unless given); no window
  double warm_s = 0.5;
  bool ring = true, links = true;
  std::string rows_dir, json_path, svg_path, costs_path;
};

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

// What one (cp, preset, method) measured, on rank 0 of that cp.
struct Record {
  int cp = 1;
  std::string preset, method;
  int64_t tokens = 0, pairs = 0;
  int waves = 0;
  double fwd_ms = 0, bwd_ms = 0, total_ms = 0, total_no_comm_ms = 0;
  double predicted_fwd_ms = 0, predicted_bwd_ms = 0, predicted_ms = 0;
  double bytes_per_step = 0, peak_mib = 0, reserved_mib = 0;
  double planning_ms = 0, planning_exposed_ms = -1;  // -1: no lookahead (one tree)
  std::vector<double> series_ms;                     // per step (varied trees)
  json::Value detail;                                // plan, per-stage and per-rank measurements (rank 0)
};

// An all-to-all of `bytes_per_peer` from every rank to every other, timed until it has landed everywhere.
struct LinkRecord {
  int ranks = 2;
  int64_t bytes_per_peer = 0;
  double ms = 0;
};

// ---- backends: the CPU ranks (float) and the GPU ranks, behind one small adapter each

struct CpuEnv {
  using Backend = CpuBackend<float>;
  Backend be;
  Communicator& comm;
  explicit CpuEnv(Communicator& c) : comm(c) {}
  Backend::Act input(uint64_t seed, const std::vector<TokenRange>& owned, int64_t width) {
    Backend::Act a;
    for (const TokenRange& r : owned)
      for (int64_t i = r.begin * width; i < r.end * width; ++i)
        a.push_back(static_cast<float>(uniform_at(seed, static_cast<uint64_t>(i))));
    return a;
  }
  Backend::Stat stat(int64_t n) { return be.alloc_stat(n); }
  Backend::Grad grad(int64_t n) { return be.alloc_grad(n); }
  Backend::Act act(int64_t n) { return be.alloc_act(n); }
  void sync() {}
  double peak_mib() const { return static_cast<double>(be.peak_bytes()) / (1 << 20); }
  double reserved_mib() const { return peak_mib(); }
};

#ifdef TREECP_BENCH_GPU
struct GpuEnv {
  using Backend = CudaBackend;
  Backend be;
  NcclCommunicator& comm;
  explicit GpuEnv(NcclCommunicator& c) : comm(c) { comm.set_compute_stream(be.stream()); }
  Backend::Act input(uint64_t seed, const std::vector<TokenRange>& owned, int64_t width) {
    int64_t rows = 0;
    for (const TokenRange& r : owned) rows += r.size();
    Backend::Act a = be.alloc_act(rows * width);
    int64_t at = 0;
    for (const TokenRange& r : owned) {
      cuda::fill_uniform(a.data() + at * width, r.size() * width, seed, static_cast<uint64_t>(r.begin * width),
                              be.stream());
      at += r.size();
    }
    return a;
  }
  Backend::Stat stat(int64_t n) {
    Backend::Stat s = be.alloc_stat(n);
    if (n > 0) cuda::check_cuda(cudaMemsetAsync(s.data(), 0, static_cast<size_t>(n) * 4, be.stream()), "bench: zero");
    return s;
  }
  Backend::Grad grad(int64_t n) { return be.alloc_grad(n); }
  Backend::Act act(int64_t n) { return be.alloc_act(n); }
  void sync() { comm.synchronize(); }
  double peak_mib() const { return static_cast<double>(be.peak_bytes()) / (1 << 20); }
  double reserved_mib() { return static_cast<double>(be.pool().reserved_bytes()) / (1 << 20); }
};
#endif

// Per-step figures of this rank: forward, backward, forward+backward ms.
struct Steps {
  std::vector<double> fwd, bwd;
  RankTraffic traffic;
  std::map<std::string, std::vector<double>> stage_ms;  // per runtime span name ("fwd wave 2"), per step
};

template <class Env>
class Bench {
 public:
  Bench(Env& env, const BenchConfig& cfg, const CostModel& costs) : env_(env), cfg_(cfg), costs_(costs) {}

  // One plan, `reps` timed steps after `warm_s` of back-to-back steps.
  Steps run_plan(const Row& row, const Plan& plan, bool skip_transfers, double* peak, double* reserved) {
    DenseAttentionOptions opt;
    opt.skip_transfers = skip_transfers;
    DenseAttentionCP<typename Env::Backend> cp(plan, row, dims(), env_.comm, env_.be, opt);
    Buffers b = buffers(cp.owned(), 0);
    env_.be.reset_peak();
    const auto t0 = Clock::now();
    for (int warm = 0; warm < 2 || ms_since(t0) < 1000 * cfg_.warm_s; ++warm) step(cp, b);
    Steps s;
    for (int i = 0; i < cfg_.reps; ++i) {
      step(cp, b);
      const RankTraffic t = cp.traffic();
      s.fwd.push_back(t.forward_ms);
      s.bwd.push_back(t.backward_ms);
      s.traffic = t;
      for (const StageSpan& sp : cp.spans()) s.stage_ms[sp.name].push_back(sp.end_ms - sp.begin_ms);
    }
    if (peak) *peak = env_.peak_mib();
    if (reserved) *reserved = env_.reserved_mib();
    return s;
  }

  // One step per tree, each tree's plan and prepared stages built on a host thread during the previous step.
  // Returns per-step ms of this rank and the host time spent waiting for the lookahead.
  Steps run_trees(const std::vector<Row>& rows, double* planning_ms, double* exposed_ms) {
    Lookahead<typename Env::Backend> ahead(env_.comm.rank(), env_.comm.size(), costs_, PlanOptions{}, dims());
    Steps s;
    double planned = 0, waited = 0;
    ahead.submit(rows[0]);
    // warm-up on the first tree (not timed), then one timed step per tree
    for (size_t i = 0; i < rows.size(); ++i) {
      if (i + 1 < rows.size()) ahead.submit(rows[i + 1]);  // planned while this row runs
      const auto cur = ahead.next();
      if (i > 0) waited += cur.waited_ms;  // the first one has nothing to hide behind
      planned += cur.host_ms;
      DenseAttentionCP<typename Env::Backend> cp(cur.prepared, env_.comm, env_.be);
      Buffers b = buffers(cp.owned(), i);
      if (i == 0) {
        const auto t0 = Clock::now();
        for (int warm = 0; warm < 2 || ms_since(t0) < 1000 * cfg_.warm_s; ++warm) step(cp, b);
      }
      step(cp, b);
      const RankTraffic t = cp.traffic();
      s.fwd.push_back(t.forward_ms);
      s.bwd.push_back(t.backward_ms);
      s.traffic = t;
    }
    *planning_ms = planned / static_cast<double>(rows.size());
    *exposed_ms = rows.size() > 1 ? waited / static_cast<double>(rows.size() - 1) : 0.0;
    return s;
  }

 private:
  struct Buffers {
    typename Env::Backend::Act q, k, v, dy, y;
    typename Env::Backend::Stat lse, sink, dsink;
    typename Env::Backend::Grad dq, dk, dv;
  };
  const AttentionShape& dims() const { return cfg_.shape; }
  Buffers buffers(const RowMap& owned, uint64_t seed) {
    const AttentionShape& sh = cfg_.shape;
    const int64_t rows = owned.rows(), qw = sh.q_width(), kw = sh.k_width(), vw = sh.v_width(), ow = sh.o_width();
    Buffers b;
    b.q = env_.input(16 * seed + 1, owned.ranges(), qw);
    b.k = env_.input(16 * seed + 2, owned.ranges(), kw);
    b.v = env_.input(16 * seed + 3, owned.ranges(), vw);
    b.dy = env_.input(16 * seed + 4, owned.ranges(), ow);
    b.y = env_.act(rows * ow);
    b.lse = env_.stat(rows * sh.hq);
    b.dq = env_.grad(rows * qw);
    b.dk = env_.grad(rows * kw);
    b.dv = env_.grad(rows * vw);
    return b;
  }
  void step(DenseAttentionCP<typename Env::Backend>& cp, Buffers& b) {
    cp.forward(b.q, b.k, b.v, nullptr, b.y, b.lse);
    cp.backward(b.dy, b.dq, b.dk, b.dv, nullptr);
    env_.sync();
  }

  Env& env_;
  const BenchConfig& cfg_;
  const CostModel& costs_;
};

// Rank 0 of `comm` gets, per step, the maximum over ranks of this rank's values.
std::vector<double> slowest(Communicator& comm, const std::vector<double>& mine) {
  const int n = comm.size();
  std::vector<double> all(mine.size() * static_cast<size_t>(n));
  comm.all_gather(mine.data(), all.data(), static_cast<int64_t>(mine.size()), CommType::F64);
  std::vector<double> out(mine.size(), 0.0);
  for (int r = 0; r < n; ++r)
    for (size_t i = 0; i < mine.size(); ++i) out[i] = std::max(out[i], all[static_cast<size_t>(r) * mine.size() + i]);
  return out;
}
double max_over(Communicator& comm, double x) { return slowest(comm, {x})[0]; }
double sum_over(Communicator& comm, double x) {
  comm.all_reduce_sum(&x, 1, CommType::F64);
  return x;
}

// The plan, and per rank its stages (the cost model's load, the measured median, the prediction) and its passes,
// gathered on rank 0: what `treecp calibrate` fits and judges.
json::Value stage_detail(Communicator& comm, const Plan& plan, const AttentionShape& shape, const CostModel& costs,
                         const Steps& s) {
  const int W = plan.num_waves, n = comm.size();
  auto med = [&](const std::string& name) {
    auto it = s.stage_ms.find(name);
    return it == s.stage_ms.end() ? 0.0 : median(it->second);
  };
  // per rank: fwd stage 0..W, bwd stage 0..W, fwd pass, bwd pass
  std::vector<double> mine;
  for (const char* pass : {"fwd", "bwd"})
    for (int st = 0; st <= W; ++st)
      mine.push_back(med(std::string(pass) + (st == 0 ? " local" : " wave " + std::to_string(st))));
  mine.push_back(median(s.fwd));
  mine.push_back(median(s.bwd));
  std::vector<double> all(mine.size() * static_cast<size_t>(n));
  comm.all_gather(mine.data(), all.data(), static_cast<int64_t>(mine.size()), CommType::F64);
  json::Value out = json::Value::object();
  if (comm.rank() != 0) return out;
  std::vector<RankLoad> loads;
  std::vector<WaveTraffic> traffic;
  plan_loads(plan, shape, costs, loads, traffic);
  json::Value stages = json::Value::array(), ranks = json::Value::array();
  for (int r = 0; r < n; ++r) {
    const double* m = &all[static_cast<size_t>(r) * mine.size()];
    double stage_sum[2] = {0, 0};
    for (int pass = 0; pass < 2; ++pass) {
      for (int st = 0; st <= W; ++st) {
        const StageLoad& l = st == 0 ? loads[static_cast<size_t>(r)].local : loads[static_cast<size_t>(r)].waves[static_cast<size_t>(st - 1)];
        const double measured = m[pass * (W + 1) + st];
        stage_sum[pass] += measured;
        if (l.pairs <= 0) continue;
        json::Value v = json::Value::object();
        v.set("rank", r);
        v.set("pass", pass == 0 ? "forward" : "backward");
        v.set("stage", st);
        v.set("pairs", l.pairs);
        v.set("compute_pairs", l.compute_pairs);
        v.set("query_tokens", l.query_tokens);
        v.set("ranges", l.ranges);
        v.set("measured_ms", measured);
        v.set("predicted_ms", stage_ms(costs, l, st > 0, pass == 0 ? Pass::Forward : Pass::Backward));
        stages.push_back(v);
      }
    }
    json::Value rv = json::Value::object();
    rv.set("rank", r);
    rv.set("owned_tokens", loads[static_cast<size_t>(r)].owned_tokens);
    rv.set("forward_ms", m[2 * (W + 1)]);
    rv.set("backward_ms", m[2 * (W + 1) + 1]);
    rv.set("forward_stages_ms", stage_sum[0]);
    rv.set("backward_stages_ms", stage_sum[1]);
    rv.set("predicted_forward_ms", plan.ranks[static_cast<size_t>(r)].predicted_forward_ms);
    rv.set("predicted_backward_ms", plan.ranks[static_cast<size_t>(r)].predicted_backward_ms);
    ranks.push_back(rv);
  }
  out.set("plan", plan_to_json(plan));
  out.set("stages", stages);
  out.set("ranks", ranks);
  return out;
}

// Every record of one rank count; rank 0 of `env.comm` holds them.
template <class Env>
std::vector<Record> bench_cp(Env& env, const BenchConfig& cfg, const CostModel& costs) {
  Communicator& comm = env.comm;
  const int cp = comm.size();
  Bench<Env> bench(env, cfg, costs);
  std::vector<Record> out;
  auto fill = [&](Record& r, const Steps& s) {
    std::vector<double> tot(s.fwd.size());
    for (size_t i = 0; i < tot.size(); ++i) tot[i] = s.fwd[i] + s.bwd[i];
    const auto f = slowest(comm, s.fwd), b = slowest(comm, s.bwd), t = slowest(comm, tot);
    r.fwd_ms = median(f);
    r.bwd_ms = median(b);
    r.total_ms = median(t);
    r.bytes_per_step = sum_over(comm, static_cast<double>(s.traffic.bytes_sent));
    return t;
  };
  for (const std::string& preset : cfg.presets) {
    const bool trees = preset == "varied5k" && cfg.trees > 1;
    std::vector<Row> rows;
    for (int i = 0; i < (trees ? cfg.trees : 1); ++i)
      rows.push_back(cfg.scale > 1 ? scale_row(make_preset(preset, cp, static_cast<uint64_t>(i)), cfg.scale)
                                   : make_preset(preset, cp, static_cast<uint64_t>(i)));
    if (!cfg.rows_dir.empty() && cp == 1 && comm.rank() == 0) {
      std::filesystem::create_directories(cfg.rows_dir);
      std::ofstream(cfg.rows_dir + "/" + preset + ".json") << row_to_json(rows[0]);
    }
    std::vector<std::pair<std::string, Plan>> methods;
    const auto p0 = Clock::now();
    PlanReport report;
    methods.push_back({"treecp", make_plan(rows[0], cp, cfg.shape, costs, PlanOptions{}, &report)});
    const double planning_ms = ms_since(p0);
    if (cfg.ring && cp > 1) methods.push_back({"ring", ring_plan(rows[0], cp, cfg.shape, costs)});
    for (auto& [method, plan] : methods) {
      Record r;
      r.cp = cp;
      r.preset = preset;
      r.method = method;
      r.tokens = rows[0].tokens();
      r.pairs = plan.visible_pairs;
      r.waves = plan.num_waves;
      double peak = 0, reserved = 0;
      const Steps with = bench.run_plan(rows[0], plan, false, &peak, &reserved);
      fill(r, with);
      r.detail = stage_detail(comm, plan, cfg.shape, costs, with);
      r.peak_mib = max_over(comm, peak);
      r.reserved_mib = max_over(comm, reserved);
      Record tmp;
      fill(tmp, bench.run_plan(rows[0], plan, true, nullptr, nullptr));
      r.total_no_comm_ms = tmp.total_ms;
      r.predicted_ms = plan.predicted_makespan_ms;
      for (const RankPlan& rp : plan.ranks) {
        r.predicted_fwd_ms = std::max(r.predicted_fwd_ms, rp.predicted_forward_ms);
        r.predicted_bwd_ms = std::max(r.predicted_bwd_ms, rp.predicted_backward_ms);
      }
      r.planning_ms = method == "treecp" ? max_over(comm, planning_ms) : 0.0;
      if (trees && method == "treecp") {
        double planned = 0, exposed = 0;
        Record series;
        r.series_ms = fill(series, bench.run_trees(rows, &planned, &exposed));
        r.planning_ms = max_over(comm, planned);
        r.planning_exposed_ms = max_over(comm, exposed);
        r.fwd_ms = series.fwd_ms, r.bwd_ms = series.bwd_ms, r.total_ms = series.total_ms;
      }
      out.push_back(r);
    }
  }
  return out;
}

// All-to-alls of growing size on the ranks of `env`: the link figures `treecp calibrate` fits.
template <class Env>
std::vector<LinkRecord> probe_links(Env& env, const std::vector<int64_t>& sizes, int reps) {
  Communicator& comm = env.comm;
  const int n = comm.size();
  std::vector<LinkRecord> out;
  if (n < 2) return out;
  const int64_t es = static_cast<int64_t>(comm_type_size(Env::Backend::act_comm_type));
  for (int64_t bytes : sizes) {
    const int64_t count = bytes / es;
    auto send = env.be.alloc_act(count * n), recv = env.be.alloc_act(count * n);
    std::vector<int64_t> counts(static_cast<size_t>(n), count), displs(static_cast<size_t>(n));
    for (int p = 0; p < n; ++p) displs[static_cast<size_t>(p)] = count * p;
    counts[static_cast<size_t>(comm.rank())] = 0;  // what the peers send, not the self copy
    std::vector<double> ms;
    for (int rep = 0; rep < reps + 1; ++rep) {
      env.sync();
      comm.barrier();
      const auto t0 = Clock::now();
      comm.start_all_to_all_v(env.be.data(send), counts, displs, env.be.data(recv), counts, displs,
                              Env::Backend::act_comm_type)->wait();
      env.sync();
      const double t = max_over(comm, ms_since(t0));
      if (rep > 0) ms.push_back(t);  // the first call sets up connections
    }
    env.be.release(send);
    env.be.release(recv);
    out.push_back({n, count * es, median(ms)});
  }
  return out;
}

json::Value to_json(const Record& r) {
  json::Value v = json::Value::object();
  v.set("cp", r.cp);
  v.set("preset", r.preset);
  v.set("method", r.method);
  v.set("tokens", r.tokens);
  v.set("visible_pairs", r.pairs);
  v.set("waves", r.waves);
  v.set("forward_ms", r.fwd_ms);
  v.set("backward_ms", r.bwd_ms);
  v.set("forward_backward_ms", r.total_ms);
  v.set("forward_backward_no_comm_ms", r.total_no_comm_ms);
  v.set("exposed_comm_ms", r.total_ms - r.total_no_comm_ms);
  v.set("predicted_forward_ms", r.predicted_fwd_ms);
  v.set("predicted_backward_ms", r.predicted_bwd_ms);
  v.set("predicted_makespan_ms", r.predicted_ms);
  v.set("bytes_per_step", r.bytes_per_step);
  v.set("peak_allocated_mib", r.peak_mib);
  v.set("reserved_mib", r.reserved_mib);
  v.set("planning_ms", r.planning_ms);
  if (r.planning_exposed_ms >= 0) v.set("planning_exposed_ms", r.planning_exposed_ms);
  json::Value series = json::Value::array();
  for (double x : r.series_ms) series.push_back(x);
  if (!r.series_ms.empty()) v.set("per_step_ms", series);
  if (r.detail.is_object())
    for (const auto& [key, val] : r.detail.as_object("detail")) v.set(key, val);
  return v;
}

void print_table(const std::vector<Record>& all, const std::string& machine) {
  std::printf("treecp bench cp: %s; forward, backward, forward+backward = median over steps of the slowest rank\n",
              machine.c_str());
  std::printf("\n| cp | preset | method | tokens | waves | fwd ms | bwd ms | fwd+bwd ms | vs CP1 | exposed comm ms | "
              "predicted ms | MB moved | peak / reserved MiB | planning ms (exposed) |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (const Record& r : all) {
    double base = 0;
    for (const Record& o : all)
      if (o.cp == 1 && o.preset == r.preset && o.method == "treecp") base = o.total_ms;
    char plan[64] = "";
    if (r.method == "treecp") {
      if (r.planning_exposed_ms >= 0) std::snprintf(plan, sizeof plan, "%.2f (%.2f)", r.planning_ms, r.planning_exposed_ms);
      else std::snprintf(plan, sizeof plan, "%.2f", r.planning_ms);
    }
    std::printf("| %d | %s | %s | %lld | %d | %.3f | %.3f | %.3f | %s | %.3f | %.3f | %.1f | %.0f / %.0f | %s |\n", r.cp,
                r.preset.c_str(), r.method.c_str(), static_cast<long long>(r.tokens), r.waves, r.fwd_ms, r.bwd_ms,
                r.total_ms, base > 0 ? (std::to_string(r.total_ms / base).substr(0, 5)).c_str() : "-",
                r.total_ms - r.total_no_comm_ms, r.predicted_ms, r.bytes_per_step / 1e6, r.peak_mib, r.reserved_mib,
                plan);
  }
  for (const Record& r : all) {
    if (r.series_ms.empty()) continue;
    std::printf("\nper-step forward+backward ms, %s cp %d (%zu trees):", r.preset.c_str(), r.cp, r.series_ms.size());
    for (double x : r.series_ms) std::printf(" %.3f", x);
    std::printf("\n");
  }
}

std::vector<std::string> split_list(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream in(s);
  for (std::string x; std::getline(in, x, ',');)
    if (!x.empty()) out.push_back(x);
  return out;
}

int bench_cp_main(const std::vector<std::string>& argv) {
  Args args(argv);
  // --cp here lists the rank counts measured, so it is no spelling of --ranks.
  args.value("--device").value("--ranks").value("--timeout").value("--cp").value("--presets").value("--reps").value("--trees")
      .value("--scale").value("--hq").value("--hkv").value("--d").value("--dv").value("--costs").value("--rows")
      .value("--json")
      .value("--svg").value("--warm").flag("--no-ring").flag("--no-links");
  args.parse();
  const std::string device = args.get_or("--device", "cuda");
  require(device == "cpu" || device == "cuda", "--device must be cpu or cuda, got '", device, "'");
  const bool gpu = device == "cuda";
#ifndef TREECP_BENCH_GPU
  require(!gpu, "--device cuda: this treecp was built without CUDA and NCCL (try --device cpu)");
#endif
  const RankOptions rank_opts = rank_options(args, 1);
  const int64_t ranks = rank_opts.count;
  BenchConfig cfg;
  const std::string cp_list = args.get_or("--cp", std::to_string(ranks));
  for (const std::string& c : split_list(cp_list)) {
    char* end = nullptr;
    const long v = std::strtol(c.c_str(), &end, 10);
    require(end && *end == '\0' && v >= 1 && v <= ranks, "--cp: each entry must be a rank count in [1, --ranks ",
            ranks, "], got '", c, "'");
    require(cfg.cps.empty() || v > cfg.cps.back(), "--cp must be increasing, got ", cp_list);
    cfg.cps.push_back(static_cast<int>(v));
  }
  cfg.presets = split_list(args.get_or("--presets", "fixed5k,varied5k,dominant,longchain,art-fixed5k,art-varied5k"));
  for (const std::string& p : cfg.presets) make_preset(p, 1, 0);  // refuses an unknown name here
  cfg.reps = static_cast<int>(args.get_int_or("--reps", gpu ? 10 : 2));
  cfg.trees = static_cast<int>(args.get_int_or("--trees", 16));
  cfg.scale = args.get_int_or("--scale", gpu ? 1 : 64);
  cfg.shape.hq = static_cast<int>(args.get_int_or("--hq", gpu ? 32 : 4));
  cfg.shape.hkv = static_cast<int>(args.get_int_or("--hkv", gpu ? 4 : 2));
  cfg.shape.d = static_cast<int>(args.get_int_or("--d", gpu ? 128 : 32));
  cfg.shape.dv = static_cast<int>(args.get_int_or("--dv", cfg.shape.d));
  cfg.warm_s = args.get_double_or("--warm", gpu ? 0.5 : 0.0);
  cfg.ring = !args.get_flag("--no-ring");
  cfg.links = !args.get_flag("--no-links");
  require(cfg.reps >= 1 && cfg.reps <= 10000, "--reps must be in [1, 10000]");
  require(cfg.trees >= 1 && cfg.trees <= 1000, "--trees must be in [1, 1000]");
  require(cfg.scale >= 1, "--scale must be >= 1");
  require(cfg.shape.hq >= 1 && cfg.shape.hkv >= 1 && cfg.shape.hq % cfg.shape.hkv == 0,
          "--hq must be a positive multiple of --hkv");
  require(cfg.shape.d >= 1 && cfg.shape.d <= 512, "--d must be in [1, 512]");
  require(cfg.shape.dv >= 1 && cfg.shape.dv <= 512, "--dv must be in [1, 512]");
  if (gpu) require_gpu_attention_dims(cfg.shape.d, cfg.shape.dv);
  require(cfg.warm_s >= 0 && cfg.warm_s <= 60, "--warm must be in [0, 60] seconds");
  cfg.rows_dir = args.get_or("--rows", "");
  cfg.json_path = args.get_or("--json", "");
  cfg.svg_path = args.get_or("--svg", "");
  if (!cfg.json_path.empty()) check_output_file(cfg.json_path);
  if (!cfg.svg_path.empty()) check_output_file(cfg.svg_path);
  cfg.costs_path = args.get_or(
      "--costs", config_file(gpu ? "costs_h200.json" : "costs_cpu.json"));
  const CostModel costs = load_costs(cfg.costs_path);
  if (!started_under_mpi() && ranks > 1) return run_under_mpirun("bench cp", rank_opts, argv);

  RankGroup group(rank_opts);
  return group.run([&](Communicator& world) {
    std::vector<Record> all;
    std::vector<LinkRecord> links;
    std::string machine = gpu ? "GPU ranks" : "CPU ranks (float)";
    for (int cp : cfg.cps) {
      // The first cp ranks measure; the others wait at the barrier below.
      std::unique_ptr<Communicator> sub_cpu;
      Communicator* sub = nullptr;
#ifdef TREECP_HAVE_MPI
      MPI_Comm split = MPI_COMM_NULL;
      if (auto* mpi = dynamic_cast<MpiCommunicator*>(&world)) {
        MPI_Comm_split(mpi->comm(), world.rank() < cp ? 0 : MPI_UNDEFINED, world.rank(), &split);
        if (split != MPI_COMM_NULL && !gpu) sub_cpu = std::make_unique<MpiCommunicator>(split);
      }
#endif
      if (world.size() == 1 && !gpu) sub_cpu = make_self_communicator();
      sub = sub_cpu.get();
      std::vector<Record> mine;
      std::vector<LinkRecord> links_mine;
      if (world.rank() < cp) {
        if (gpu) {
#ifdef TREECP_BENCH_GPU
          std::unique_ptr<NcclCommunicator> nccl;
#ifdef TREECP_HAVE_MPI
          if (split != MPI_COMM_NULL) nccl = make_nccl_communicator(split);
#endif
          if (!nccl) nccl = std::make_unique<NcclCommunicator>(make_nccl_unique_id(), 0, 1, 0);
          GpuEnv env(*nccl);
          cudaDeviceProp prop{};
          cudaGetDeviceProperties(&prop, nccl->device());
          machine = std::string(prop.name) + " x " + std::to_string(world.size()) + " (NCCL)";
          mine = bench_cp(env, cfg, costs);
          if (cfg.links) links_mine = probe_links(env, {1 << 20, 4 << 20, 16 << 20, 64 << 20, 256 << 20}, 5);
#endif
        } else {
          CpuEnv env(*sub);
          mine = bench_cp(env, cfg, costs);
          if (cfg.links) links_mine = probe_links(env, {16 << 10, 128 << 10, 1 << 20}, 3);
        }
      }
#ifdef TREECP_HAVE_MPI
      sub_cpu.reset();
      if (split != MPI_COMM_NULL) MPI_Comm_free(&split);
#endif
      world.barrier();
      if (world.rank() == 0) {
        all.insert(all.end(), mine.begin(), mine.end());
        links.insert(links.end(), links_mine.begin(), links_mine.end());
      }
    }
    if (world.rank() == 0) {
      print_table(all, machine);
      for (const LinkRecord& l : links)
        std::printf("all-to-all, %d ranks, %lld bytes to every peer: %.3f ms (%.1f GB/s into each rank)\n", l.ranks,
                    static_cast<long long>(l.bytes_per_peer), l.ms,
                    static_cast<double>(l.bytes_per_peer) * (l.ranks - 1) / l.ms / 1e6);
      if (!cfg.json_path.empty()) {
        json::Value doc = json::Value::object(), arr = json::Value::array(), larr = json::Value::array();
        for (const Record& r : all) arr.push_back(to_json(r));
        for (const LinkRecord& l : links) {
          json::Value v = json::Value::object();
          v.set("ranks", l.ranks);
          v.set("bytes_per_peer", l.bytes_per_peer);
          v.set("ms", l.ms);
          larr.push_back(v);
        }
        doc.set("machine", machine);
        doc.set("costs", cfg.costs_path);
        // The layer every plan was made and priced for (treecp calibrate re-prices them at it).
        json::Value shape = json::Value::object();
        shape.set("hq", cfg.shape.hq);
        shape.set("hkv", cfg.shape.hkv);
        shape.set("d", cfg.shape.d);
        shape.set("dv", cfg.shape.dv);
        doc.set("shape", shape);
        doc.set("records", arr);
        doc.set("links", larr);
        write_output(cfg.json_path, json::dump(doc, 1) + "\n");
      }
      if (!cfg.svg_path.empty()) {
        std::vector<viz::ScalingSeries> series;
        for (const Record& r : all) {
          auto it = std::find_if(series.begin(), series.end(),
                                 [&](const viz::ScalingSeries& s) { return s.preset == r.preset && s.method == r.method; });
          if (it == series.end()) {
            series.push_back({r.preset, r.method, {}});
            it = series.end() - 1;
          }
          it->points.push_back({r.cp, r.total_ms});
        }
        write_output(cfg.svg_path, viz::weak_scaling_svg(series, "forward+backward, slowest rank (" + machine + ")"));
      }
    }
    return 0;
  });
}

const Register kBenchCp("bench cp",
                        "[--device cuda|cpu] [--ranks N] [--timeout S] [--cp 1,2,...] [--presets a,b] [--reps N] "
                        "[--trees N] [--scale S] [--hq H] [--hkv H] [--d D] [--dv D] [--warm S] [--costs FILE] "
                        "[--json FILE] "
                        "[--svg FILE] [--rows DIR] [--no-ring] [--no-links]",
                        "weak-scaling table of dense attention CP (treecp's plan and the ring baseline in the same run)",
                        bench_cp_main);

}  // namespace
}  // namespace treecp::cli
