// `treecp run --device cuda`: dense attention CP on GPU ranks through the CUDA backend and NCCL, checked
// against the CPU double reference of the same bf16 inputs (down-scaled rows) or against one GPU running
// the whole row (--full), with per-rank predicted and measured times, bytes and device memory.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <memory>

#include "core/error.hpp"
#include "core/json.hpp"
#include "gpu.hpp"
#include "run_report.hpp"
#include "runtime/cpu_backend.hpp"
#include "core/trace.hpp"
#include "runtime/redistribute.hpp"
#include "runtime/span_gather.hpp"
#include "viz/schedule.hpp"
#include "tree/accounting.hpp"

#if defined(TREECP_HAVE_CUDA) && defined(TREECP_HAVE_NCCL)
#include "comm/nccl_communicator.hpp"
#include "core/random.hpp"
#include "kernels/cpu/attention.hpp"
#include "runtime/reference.hpp"
#include "runtime/cuda_backend.hpp"
#include "runtime/dense_attention.hpp"
#ifdef TREECP_HAVE_MPI
#include "comm/mpi_communicator.hpp"
#include "comm/nccl_mpi.hpp"
#endif
#define TREECP_GPU_CLI 1
#endif

namespace treecp::cli {

#ifndef TREECP_GPU_CLI

bool gpu_support() { return false; }

int run_on_gpus(Communicator&, const Row&, const CostModel&, const PlanOptions&, const GpuRunConfig&) {
  fail("--device cuda: this treecp was built without CUDA and NCCL (install the CUDA toolkit with NCCL and rebuild)");
}

#else

bool gpu_support() { return true; }

std::unique_ptr<NcclCommunicator> gpu_communicator(Communicator& world, double timeout_s) {
  NcclOptions opt;
  opt.timeout_s = timeout_s;
  int devices = 0;
  const cudaError_t st = cudaGetDeviceCount(&devices);
  if (world.size() == 1) {
    require(st == cudaSuccess && devices > 0, "--device cuda: no CUDA device (",
            st == cudaSuccess ? "none found" : cudaGetErrorString(st), ")");
    return std::make_unique<NcclCommunicator>(make_nccl_unique_id(), 0, 1, 0, opt);
  }
#ifdef TREECP_HAVE_MPI
  auto* mpi = dynamic_cast<MpiCommunicator*>(&world);
  require(mpi != nullptr, "--device cuda with several ranks needs the processes started by mpirun");
  return make_nccl_communicator(mpi->comm(), opt);
#else
  fail("--device cuda with several ranks needs MPI to start them");
#endif
}

namespace {

// Norm-wise relative error, NaN as infinity, equal values (-inf LSE) skipped.
double rel_error(const std::vector<double>& a, const std::vector<double>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < b.size(); ++i) {
    if (std::isnan(a[i])) return INFINITY;
    if (a[i] == b[i]) continue;
    num += (a[i] - b[i]) * (a[i] - b[i]);
    den += b[i] * b[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct Outputs {
  std::vector<double> o, lse, dq, dk, dv, dsink;
};

// Inputs of the run: element i of tensor t is uniform_at(seed + t, i) rounded to bf16 or fp16 (--dtype) in the packed
// row.
constexpr uint64_t kQ = 1, kK = 2, kV = 3, kDy = 4, kSink = 5;

// One CP forward + backward of `row` on the ranks of `nccl`, inputs made on the device by each rank for its
// loader shard and moved to the plan's ownership; results downloaded for the owned rows. `times` gets the
// per-step measured forward and backward ms of this rank when given.
Outputs run_cp(NcclCommunicator& nccl, CudaBackend& be, const Row& row, const Plan& plan, const GpuRunConfig& cfg,
               DenseAttentionOptions opt, int reps, std::vector<double>* fwd_ms, std::vector<double>* bwd_ms,
               RankTraffic* traffic, std::vector<StageSpan>* spans = nullptr) {
  const int me = nccl.rank(), n = nccl.size();
  const int64_t S = row.tokens();
  const int64_t qw = cfg.shape.q_width(), kw = cfg.shape.k_width(), vw = cfg.shape.v_width(), ow = cfg.shape.o_width();
  DenseAttentionCP<CudaBackend> cp(plan, row, cfg.shape, nccl, be, opt);
  const Ownership loader = contiguous_ownership(S, n), owners = plan_ownership(plan);
  const TokenRange mine = loader[static_cast<size_t>(me)].empty() ? TokenRange{} : loader[static_cast<size_t>(me)][0];
  const uint64_t s = cfg.seed * 16;
  auto input = [&](uint64_t tensor, int64_t width) {
    CudaBackend::Act shard = be.alloc_act(mine.size() * width);
    cuda::fill_uniform(shard.data(), shard.size(), s + tensor, static_cast<uint64_t>(mine.begin * width), be.stream(),
                       be.dtype());
    return redistribute(nccl, be, shard, loader, owners, width);
  };
  const CudaBackend::Act q = input(kQ, qw), k = input(kK, kw), v = input(kV, vw), dy = input(kDy, ow);
  const int64_t rows = cp.owned_rows();
  CudaBackend::Stat sink = be.alloc_stat(cfg.shape.hq), dsink = be.alloc_stat(cfg.shape.hq), lse = be.alloc_stat(rows * cfg.shape.hq);
  std::vector<float> sink_host(static_cast<size_t>(cfg.shape.hq));
  for (int h = 0; h < cfg.shape.hq; ++h)
    sink_host[static_cast<size_t>(h)] = static_cast<float>(2 * uniform_at(s + kSink, static_cast<uint64_t>(h)));
  be.upload(sink, sink_host);
  CudaBackend::Act y = be.alloc_act(rows * ow);
  CudaBackend::Grad dq = be.alloc_grad(rows * qw), dk = be.alloc_grad(rows * kw), dv = be.alloc_grad(rows * vw);
  for (int step = 0; step < reps; ++step) {
    be.zero(dsink);
    cp.forward(q, k, v, cfg.sink ? &sink : nullptr, y, lse);
    cp.backward(dy, dq, dk, dv, cfg.sink ? &dsink : nullptr);
    nccl.synchronize();
    const RankTraffic t = cp.traffic();
    if (fwd_ms) fwd_ms->push_back(t.forward_ms);
    if (bwd_ms) bwd_ms->push_back(t.backward_ms);
    if (traffic) *traffic = t;
    if (spans) *spans = cp.spans();
  }
  nccl.all_reduce_sum(dsink.data(), cfg.shape.hq, CommType::F32);  // a replicated weight: the caller reduces it
  nccl.synchronize();
  Outputs out;
  auto widen_elems = [&](const std::vector<cuda::bf16_t>& a) {
    std::vector<double> r(a.size());
    for (size_t i = 0; i < a.size(); ++i) r[i] = cuda::bits_to_f32(a[i], be.dtype());
    return r;
  };
  auto widen = [](const std::vector<float>& a) { return std::vector<double>(a.begin(), a.end()); };
  out.o = widen_elems(be.download(y));
  out.lse = widen(be.download(lse));
  out.dq = widen(be.download(dq));
  out.dk = widen(be.download(dk));
  out.dv = widen(be.download(dv));
  out.dsink = widen(be.download(dsink));
  return out;
}

// The host values of tensor `t` for the whole row, as the device makes them.
std::vector<double> host_values(uint64_t seed, int64_t n, cuda::DType dtype) {
  std::vector<double> out(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i)
    out[static_cast<size_t>(i)] =
        cuda::bits_to_f32(cuda::f32_to_bits(static_cast<float>(uniform_at(seed, static_cast<uint64_t>(i))), dtype), dtype);
  return out;
}

enum Field { kPeak = kRunCommonFields, kReserved, kFields };  // after the common fields (run_report.hpp)

}  // namespace

int run_on_gpus(Communicator& world, const Row& row, const CostModel& costs, const PlanOptions& options,
                const GpuRunConfig& cfg) {
  const int me = world.rank(), n = world.size();
  const int64_t S = row.tokens();
  const int64_t qw = cfg.shape.q_width(), kw = cfg.shape.k_width(), vw = cfg.shape.v_width(), ow = cfg.shape.o_width();
  auto nccl = gpu_communicator(world, cfg.timeout_s);
  CudaBackend be(nullptr, cfg.dtype);
  nccl->set_compute_stream(be.stream());
  PlanReport report;
  const Plan plan = make_plan(row, n, cfg.shape, costs, options, &report);
  DenseAttentionOptions opt;  // the backward's KV as the plan chose (PlanOptions::backward_kv)
  std::vector<double> fwd, bwd;
  RankTraffic traffic;
  std::vector<StageSpan> spans;
  const Outputs mine = run_cp(*nccl, be, row, plan, cfg, opt, 2 + cfg.reps, &fwd, &bwd, &traffic, &spans);
  fwd.erase(fwd.begin(), fwd.begin() + 2);  // warm-ups
  bwd.erase(bwd.begin(), bwd.begin() + 2);

  std::vector<double> stats(kFields, 0.0), all_stats(static_cast<size_t>(kFields * n));
  const RankPlan& rp = plan.ranks[static_cast<size_t>(me)];
  stats[kTokens] = static_cast<double>(rp.owned_tokens());
  stats[kPairs] = static_cast<double>(rp.pairs());
  stats[kPredFwd] = rp.predicted_forward_ms;
  stats[kPredBwd] = rp.predicted_backward_ms;
  stats[kFwd] = median(fwd);
  stats[kBwd] = median(bwd);
  stats[kSent] = static_cast<double>(traffic.bytes_sent);
  stats[kRecv] = static_cast<double>(traffic.bytes_received);
  stats[kPeak] = static_cast<double>(be.pool().peak_allocated_bytes()) / (1 << 20);
  stats[kReserved] = static_cast<double>(be.pool().reserved_bytes()) / (1 << 20);
  world.all_gather(stats.data(), all_stats.data(), kFields, CommType::F64);
  // The last step's stages as CUDA events saw them (each rank from its own forward's start), and the plan's
  // predicted spans beside them.
  std::vector<Span> trace;
  if (!cfg.trace_path.empty()) {
    std::vector<Span> measured;
    for (const StageSpan& sp : spans) {
      const bool wait = sp.name.find(" wait ") != std::string::npos, ret = sp.name.find(" return ") != std::string::npos;
      measured.push_back({sp.name, wait ? "wait" : ret ? "return" : sp.name.find("merge") != std::string::npos ||
                                                                 sp.name.find("prep") != std::string::npos
                                                             ? "merge"
                                                             : "stage",
                          me, kMeasuredTrack, sp.begin_ms, sp.end_ms});
    }
    trace = gather_spans(world, measured, 0);
  }

  // Everything on rank 0 in packed order (host buffers over `world`).
  CpuBackend<double> host;
  const Ownership owners = plan_ownership(plan);
  Outputs cp;
  cp.o = gather_to_root(world, host, mine.o, owners, ow);
  cp.lse = gather_to_root(world, host, mine.lse, owners, cfg.shape.hq);
  cp.dq = gather_to_root(world, host, mine.dq, owners, qw);
  cp.dk = gather_to_root(world, host, mine.dk, owners, kw);
  cp.dv = gather_to_root(world, host, mine.dv, owners, vw);
  cp.dsink = mine.dsink;

  int status = 0;
  if (me == 0) {
    struct Check {
      std::string name;
      double error, bound, one_gpu;
    };
    std::vector<Check> checks;
    // The one-GPU run of the whole row (the same-precision reference), unless this run is one.
    Outputs one;
    if (n > 1) {
      NcclCommunicator solo(make_nccl_unique_id(), 0, 1, nccl->device());
      CudaBackend be1(nullptr, cfg.dtype);
      solo.set_compute_stream(be1.stream());
      const Plan p1 = make_plan(row, 1, cfg.shape, costs, options);
      one = run_cp(solo, be1, row, p1, cfg, opt, 1, nullptr, nullptr, nullptr);
    }
    const Outputs& base = n > 1 ? one : cp;
    // The bounds are bf16's (unit roundoff 2^-8), scaled for fp16's 2^-11.
    const double u = cfg.dtype == cuda::DType::kF16 ? 0x1p-11 / 0x1p-8 : 1.0;
    if (cfg.full) {
      auto check = [&](const char* name, const std::vector<double>& got, const std::vector<double>& ref) {
        checks.push_back({name, rel_error(got, ref), 1e-2 * u, 0.0});
      };
      check("o", cp.o, base.o);
      check("lse", cp.lse, base.lse);
      check("dq", cp.dq, base.dq);
      check("dk", cp.dk, base.dk);
      check("dv", cp.dv, base.dv);
      if (cfg.sink) check("dsink", cp.dsink, base.dsink);
    } else {
      const uint64_t s = cfg.seed * 16;
      const auto fq = host_values(s + kQ, S * qw, cfg.dtype), fk = host_values(s + kK, S * kw, cfg.dtype),
                 fv = host_values(s + kV, S * vw, cfg.dtype), fdy = host_values(s + kDy, S * ow, cfg.dtype);
      std::vector<double> sink(static_cast<size_t>(cfg.shape.hq));
      for (int h = 0; h < cfg.shape.hq; ++h)
        sink[static_cast<size_t>(h)] =
            static_cast<double>(static_cast<float>(2 * uniform_at(s + kSink, static_cast<uint64_t>(h))));
      AttentionInputs<double> prob;
      prob.q = fq.data(), prob.k = fk.data(), prob.v = fv.data(), prob.dout = fdy.data();
      prob.sink = cfg.sink ? sink.data() : nullptr;
      const auto ref = attention_reference(row, cfg.shape, prob);
      // bf16 storage: one GPU within 1e-2 (norm-wise); CP within twice what one GPU differs plus 2e-3 (its
      // stage partials are rounded to bf16 once more before the merge); times u for fp16.
      auto check = [&](const char* name, const std::vector<double>& got, const std::vector<double>& got1,
                       const std::vector<double>& oracle) {
        const double e1 = rel_error(got1, oracle);
        checks.push_back({name, rel_error(got, oracle), n > 1 ? std::min(2 * e1 + 2e-3 * u, 1e-2 * u) : 1e-2 * u, e1});
      };
      check("o", cp.o, base.o, ref.o);
      check("lse", cp.lse, base.lse, ref.lse);
      check("dq", cp.dq, base.dq, ref.dq);
      check("dk", cp.dk, base.dk, ref.dk);
      check("dv", cp.dv, base.dv, ref.dv);
      if (cfg.sink) check("dsink", cp.dsink, base.dsink, ref.dsink);
    }
    for (const Check& c : checks) status = c.error <= c.bound ? status : 3;
    if (status == 0 && !cfg.trace_path.empty()) {
      const auto predicted = viz::predicted_spans(simulate_plan_timeline(plan, cfg.shape, costs));
      trace.insert(trace.end(), predicted.begin(), predicted.end());
      write_chrome_trace(trace, cfg.trace_path);
    }

    int dev = 0;
    cudaGetDevice(&dev);
    cudaDeviceProp prop{};
    cudaGetDeviceProperties(&prop, dev);
    const RowStats st = row_stats(row, cfg.shape.window);
    if (cfg.json) {
      json::Value out = json::Value::object();
      out.set("source", cfg.source);
      out.set("device", std::string(prop.name));
      out.set("ranks", n);
      out.set("dtype", std::string(cuda::dtype_name(cfg.dtype)));
      out.set("tokens", S);
      out.set("visible_pairs", st.visible_pairs);
      out.set("layout", std::string(layout_name(plan.layout)));
      out.set("waves", plan.num_waves);
      out.set("predicted_makespan_ms", plan.predicted_makespan_ms);
      out.set("planning_ms", report.planning_ms);
      out.set("reference", cfg.full ? "one GPU" : "CPU double");
      json::Value ranks = json::Value::array();
      for (int r = 0; r < n; ++r) {
        const double* f = &all_stats[static_cast<size_t>(r * kFields)];
        json::Value rv = rank_record_json(f);
        rv.set("peak_allocated_mib", f[kPeak]);
        rv.set("reserved_mib", f[kReserved]);
        ranks.push_back(rv);
      }
      out.set("per_rank", ranks);
      json::Value errs, bounds;
      checks_json(checks, errs, bounds);
      out.set("rel_error", errs);
      out.set("error_bound", bounds);
      out.set("ok", status == 0);
      std::cout << json::dump(out, 2) << "\n";
    } else {
      std::printf("treecp run: %s, %d GPU ranks (%s), %s\n", cfg.source.c_str(), n, prop.name,
                  cuda::dtype_name(cfg.dtype));
      std::printf("row: %lld tokens, %lld segments, depth %d, %lld visible pairs%s\n", static_cast<long long>(S),
                  static_cast<long long>(st.segments), st.depth, static_cast<long long>(st.visible_pairs),
                  cfg.shape.window > 0 ? (" (window " + std::to_string(cfg.shape.window) + ")").c_str() : "");
      std::printf("attention: Hq %d, Hkv %d, D %d, Dv %d%s; backward KV %s\n", cfg.shape.hq, cfg.shape.hkv, cfg.shape.d,
                  cfg.shape.dv, cfg.sink ? ", learned sink" : "", plan.refetch_backward ? "fetched again" : "kept");
      std::printf("plan: %s, %zu chunks, %d waves, predicted makespan %.3f ms, planned in %.2f ms (costs %s)\n",
                  layout_name(plan.layout), plan.chunk_owner.size(), plan.num_waves, plan.predicted_makespan_ms,
                  report.planning_ms, cfg.costs_path.c_str());
      std::printf("\n%4s %9s %12s %9s %9s %9s %9s %12s %12s %9s %9s\n", "rank", "tokens", "pairs", "pred_fwd", "fwd_ms",
                  "pred_bwd", "bwd_ms", "bytes_out", "bytes_in", "peak_MiB", "rsvd_MiB");
      for (int r = 0; r < n; ++r) {
        const double* f = &all_stats[static_cast<size_t>(r * kFields)];
        std::printf("%4d %9.0f %12.0f %9.3f %9.3f %9.3f %9.3f %12.0f %12.0f %9.1f %9.1f\n", r, f[kTokens], f[kPairs],
                    f[kPredFwd], f[kFwd], f[kPredBwd], f[kBwd], f[kSent], f[kRecv], f[kPeak], f[kReserved]);
      }
      std::printf("(measured: median of %d steps after 2 warm-ups, CUDA events on each rank's stream)\n", cfg.reps);
      std::printf("rank 0 stages of the last step (ms from the forward's start):");
      for (const StageSpan& sp : spans) std::printf("  %s %.3f-%.3f", sp.name.c_str(), sp.begin_ms, sp.end_ms);
      std::printf("\n");
      std::printf("relative error (norm-wise) vs %s (bound%s):\n ", cfg.full ? "one GPU" : "the CPU double reference",
                  cfg.full || n == 1 ? "" : "; one GPU's own error");
      for (const Check& c : checks) {
        if (cfg.full || n == 1) std::printf("  %s %.2e (%.1e)", c.name.c_str(), c.error, c.bound);
        else std::printf("  %s %.2e (%.1e; %.2e)", c.name.c_str(), c.error, c.bound, c.one_gpu);
      }
      std::printf("\n%s\n", status == 0 ? "OK: every output and gradient matches" : "MISMATCH");
      if (status == 0 && !cfg.trace_path.empty())
        std::printf("trace: %s (%zu spans; open in https://ui.perfetto.dev or chrome://tracing)\n",
                    cfg.trace_path.c_str(), trace.size());
    }
  }
  int64_t verdict = status;
  world.all_reduce_sum(&verdict, 1, CommType::I64);
  return verdict == 0 ? 0 : 3;
}

#endif

}  // namespace treecp::cli
