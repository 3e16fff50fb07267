// GDN/KDA on the CPU: checks the chunked kernel against the token recurrence, then times it; under
// mpirun also times the communicator and compares the planner's predicted forward+backward time
// with the measured one on alternative plans (the test of the cost model). Prints a table; not a test.
//
//   bench_gdn [--heads H] [--dk D] [--dv D] [--tokens S] [--chunk C] [--kda] [--reps R]
//   mpirun -np 4 bench_gdn ...           (adds the communicator and the CP plan table)
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "bench_args.hpp"
#include "comm/communicator.hpp"
#ifdef TREECP_HAVE_MPI
#include "comm/mpi_communicator.hpp"
#endif
#include "kernels/cpu/gdn.hpp"
#include "runtime/cpu_backend.hpp"
#include "runtime/gdn_cp.hpp"
#include "plan/gdn_plan.hpp"
#include "tree/presets.hpp"

namespace {

using namespace treecp;
using Clock = std::chrono::steady_clock;

struct Opts {
  int heads = 4, dk = 64, dv = 64, chunk = 64, reps = 3;
  int64_t tokens = 4096;
  bool kda = false;
};

double ms_since(Clock::time_point t0) { return std::chrono::duration<double, std::milli>(Clock::now() - t0).count(); }

GdnShape shape_of(const Opts& o) {
  return {o.heads, o.dk, o.dv, o.kda ? GdnGate::PerChannel : GdnGate::Scalar, 1.0 / std::sqrt(double(o.dk)), o.chunk};
}

struct Data {
  std::vector<float> q, k, v, g, beta, dy;
  GdnParams<float> params(const Opts& o, int64_t S) const {
    GdnParams<float> p;
    p.q = q.data(); p.k = k.data(); p.v = v.data(); p.g = g.data(); p.beta = beta.data();
    p.tokens = S; p.shape = shape_of(o);
    return p;
  }
};

Data make_data(const Opts& o, int64_t S, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> n01(0.f, 1.f);
  std::uniform_real_distribution<float> u01(0.f, 1.f);
  Data d;
  auto unit = [&](std::vector<float>& x, int w) {
    x.resize(static_cast<size_t>(S * o.heads * w));
    for (auto& e : x) e = n01(rng);
    for (int64_t r = 0; r < S * o.heads; ++r) {
      float n = 0;
      for (int i = 0; i < w; ++i) n += x[r * w + i] * x[r * w + i];
      for (int i = 0; i < w; ++i) x[r * w + i] /= std::sqrt(n);
    }
  };
  unit(d.q, o.dk);
  unit(d.k, o.dk);
  d.v.resize(static_cast<size_t>(S * o.heads * o.dv));
  for (auto& e : d.v) e = n01(rng);
  d.dy = d.v;
  for (auto& e : d.dy) e = n01(rng);
  d.g.resize(static_cast<size_t>(S * o.heads * (o.kda ? o.dk : 1)));
  for (auto& e : d.g) e = -0.3f * u01(rng);
  d.beta.resize(static_cast<size_t>(S * o.heads));
  for (auto& e : d.beta) e = u01(rng);
  return d;
}

// Single-process kernel table; returns the calibrated multiply-adds per ms of the chunked form.
double kernel_table(const Opts& o) {
  const int64_t S = o.tokens;
  const Data d = make_data(o, S, 1);
  const GdnParams<float> p = d.params(o, S);
  const int64_t ssz = static_cast<int64_t>(o.dk) * o.dv;
  // Check first: chunked against the recurrence on a prefix.
  const int64_t Sc = std::min<int64_t>(S, 512);
  std::vector<float> y1(static_cast<size_t>(S * o.heads * o.dv)), y2(y1.size()), st(static_cast<size_t>(o.heads * ssz));
  for (int h = 0; h < o.heads; ++h) gdn_recurrent_forward(p, h, 0, Sc, st.data() + h * ssz, y1.data());
  std::fill(st.begin(), st.end(), 0.f);
  for (int h = 0; h < o.heads; ++h) gdn_chunked_forward(p, h, 0, Sc, st.data() + h * ssz, y2.data());
  double err = 0, mag = 0;
  for (int64_t i = 0; i < Sc * o.heads * o.dv; ++i) {
    err = std::max(err, static_cast<double>(std::abs(y1[i] - y2[i])));
    mag = std::max(mag, static_cast<double>(std::abs(y1[i])));
  }
  auto best = [&](auto&& fn) {
    double b = 1e30;
    for (int r = 0; r < o.reps; ++r) {
      const auto t0 = Clock::now();
      fn();
      b = std::min(b, ms_since(t0));
    }
    return b;
  };
  const double rec_ms = best([&] {
    std::fill(st.begin(), st.end(), 0.f);
    for (int h = 0; h < o.heads; ++h) gdn_recurrent_forward(p, h, 0, S, st.data() + h * ssz, y1.data());
  });
  const double fwd_ms = best([&] {
    std::fill(st.begin(), st.end(), 0.f);
    for (int h = 0; h < o.heads; ++h) gdn_chunked_forward(p, h, 0, S, st.data() + h * ssz, y2.data());
  });
  std::vector<float> dq(d.q.size()), dk(d.k.size()), dv(d.v.size()), dg(d.g.size()), db(d.beta.size()),
      s0(static_cast<size_t>(o.heads * ssz), 0.f), ds(s0.size());
  const double bwd_ms = best([&] {
    std::fill(ds.begin(), ds.end(), 0.f);
    for (int h = 0; h < o.heads; ++h)
      gdn_chunked_backward(p, h, 0, S, s0.data() + h * ssz, d.dy.data(), ds.data() + h * ssz,
                           GdnGrads<float>{dq.data(), dk.data(), dv.data(), dg.data(), db.data()});
  });
  const double state_ms = best([&] {
    std::fill(ds.begin(), ds.end(), 0.f);
    for (int h = 0; h < o.heads; ++h)
      gdn_chunked_backward(p, h, 0, S, s0.data() + h * ssz, d.dy.data(), ds.data() + h * ssz, GdnGrads<float>{});
  });
  std::vector<float> M(static_cast<size_t>(o.dk * o.dk)), E(static_cast<size_t>(ssz));
  const double sum_ms = best([&] {
    for (int h = 0; h < o.heads; ++h) gdn_chunked_summary(p, h, 0, S, M.data(), E.data());
  });
  const GdnShape shape = shape_of(o);
  const double madds = gdn_token_madds(shape) * static_cast<double>(S) * o.heads;
  const double ns_per_madd = (fwd_ms + bwd_ms) * 1e6 / madds;
  std::printf("kernel (%s, float): S %lld, H %d, dk %d, dv %d, chunk %d\n", o.kda ? "KDA" : "GDN",
              static_cast<long long>(S), o.heads, o.dk, o.dv, o.chunk);
  std::printf("  check: chunked vs recurrent max |diff| %.2e (max |y| %.2f) over %lld tokens\n", err, mag,
              static_cast<long long>(Sc));
  std::printf("  %-22s %10.3f ms  %8.1f us/token\n", "recurrent forward", rec_ms, rec_ms * 1e3 / S);
  std::printf("  %-22s %10.3f ms  %8.1f us/token\n", "chunked forward", fwd_ms, fwd_ms * 1e3 / S);
  std::printf("  %-22s %10.3f ms  %8.1f us/token\n", "chunked backward", bwd_ms, bwd_ms * 1e3 / S);
  std::printf("  %-22s %10.3f ms  %8.1f us/token\n", "state-only backward", state_ms, state_ms * 1e3 / S);
  std::printf("  %-22s %10.3f ms  %8.1f us/token\n", "shard summary (M, E)", sum_ms, sum_ms * 1e3 / S);
  std::printf("  ratios to the forward: backward %.2f, state-only backward %.2f, summary %.2f\n", bwd_ms / fwd_ms,
              state_ms / fwd_ms, sum_ms / fwd_ms);
  std::printf("  model: %.3g multiply-adds fwd+bwd -> %.3f ns per multiply-add (%.2f GFLOP/s)\n", madds, ns_per_madd,
              2.0 / ns_per_madd);
  return 1e6 / ns_per_madd;
}

// Communicator latency (small all-to-all ring) and bandwidth (large pairwise messages).
void comm_table(Communicator& comm, double* latency_us, double* bw) {
  const int n = comm.size(), me = comm.rank();
  std::vector<int64_t> sc(n, 0), sd(n, 0), rc(n, 0), rd(n, 0);
  std::vector<float> s(1 << 22, 1.f), r(1 << 22, 0.f);
  auto round = [&](int64_t count) {
    std::fill(sc.begin(), sc.end(), 0);
    std::fill(rc.begin(), rc.end(), 0);
    sc[(me + 1) % n] = count;
    rc[(me + n - 1) % n] = count;
    comm.all_to_all_v(s.data(), sc, sd, r.data(), rc, rd, treecp::CommType::F32);
  };
  for (int i = 0; i < 20; ++i) round(16);
  comm.barrier();
  auto t0 = Clock::now();
  const int iters = 200;
  for (int i = 0; i < iters; ++i) round(16);
  comm.barrier();
  *latency_us = ms_since(t0) * 1e3 / iters;
  t0 = Clock::now();
  for (int i = 0; i < 5; ++i) round(1 << 22);
  comm.barrier();
  *bw = 5.0 * (4 << 22) / (ms_since(t0) * 1e-3);
  if (me == 0)
    std::printf("communicator (%d ranks): all-to-all round %.1f us, %.2f GB/s per rank pair (16 MiB)\n", n, *latency_us,
                *bw / 1e9);
}

// Predicted vs measured forward+backward on alternative plans of a few rows.
void plan_table(Communicator& comm, const Opts& o, const GdnCostModel& model) {
  const int N = comm.size(), me = comm.rank();
  const GdnShape shape = shape_of(o);
  const int64_t per = o.tokens;  // tokens per rank
  struct RowCase { const char* name; Row row; };
  std::vector<Segment> fam, dom, chain;
  chain.push_back({-1, per * N});
  for (int64_t used = 0; used < per * N;) {
    const int32_t root = static_cast<int32_t>(fam.size());
    const int64_t r = std::min<int64_t>(per / 4, per * N - used);
    fam.push_back({-1, r});
    used += r;
    for (int c = 0; c < 4 && used < per * N; ++c) {
      const int64_t l = std::min<int64_t>(per / 16, per * N - used);
      fam.push_back({root, l});
      used += l;
    }
  }
  dom.push_back({-1, per * N / 2});
  for (int c = 0; c < 8; ++c) dom.push_back({0, per * N / 16});
  // Packed documents (roots only), long and short mixed: the row the three layouts of attention are for.
  std::vector<Segment> docs;
  const int64_t doc_parts[] = {12, 2, 5, 1, 8, 3};  // sixteenths of a rank's tokens
  for (int64_t used = 0, i = 0; used < per * N; ++i) {
    const int64_t l = std::min<int64_t>(std::max<int64_t>(1, per * doc_parts[i % 6] / 16), per * N - used);
    docs.push_back({-1, l});
    used += l;
  }
  const RowCase rows[] = {{"one chain", Row(chain)}, {"families", Row(fam)}, {"dominant", Row(dom)},
                          {"packed", Row(docs)}};
  {
    // Planning time on a large deep row (the planner runs once per row, ahead of the layers).
    const Row big = make_preset("deep", N);
    const auto t0 = Clock::now();
    const GdnPlan p = plan_gdn(big, N, GdnShape{}, model);
    if (me == 0)
      std::printf("planning a %lld-token, %d-segment row for %d ranks: %.2f ms, %d chained\n",
                  static_cast<long long>(big.tokens()), big.num_segments(), N, ms_since(t0), p.chained_segments());
  }
  if (me == 0) {
    std::printf("CP plans on %d ranks (%lld tokens per rank): predicted vs measured forward+backward\n", N,
                static_cast<long long>(per));
    std::printf("  %-10s %-11s %8s %12s %12s %14s %16s\n", "row", "plan", "chained", "predicted_ms", "measured_ms",
                "max|y-y_1proc|", "move_from_zz_ms");
  }
  for (const RowCase& rc : rows) {
    const Row& row = rc.row;
    const Data d = make_data(o, row.tokens(), 2);
    // Check first: the one-process result (every segment local) on this rank.
    std::vector<float> y_ref(d.v.size());
    {
      auto self = make_self_communicator();
      const GdnPlan one = make_gdn_plan(row, 1, std::vector<uint8_t>(static_cast<size_t>(row.num_segments()), 0));
      CpuBackend<float> be;
      GdnCP<CpuBackend<float>> cp(one, row, shape, *self, be);
      cp.forward(d.q, d.k, d.v, d.g, d.beta, y_ref);
    }
    std::vector<uint8_t> none(static_cast<size_t>(row.num_segments()), 0), longest = none;
    longest[0] = 1;
    struct Alt { std::string name; GdnPlan plan; };
    std::vector<Alt> alts = {{"planner", plan_gdn(row, N, shape, model)},
                             {"local", make_gdn_plan(row, N, none)},
                             {"chain-1st", make_gdn_plan(row, N, longest)}};
    // Moving the layer's tokens in from (and back to) an attention layer in zigzag, float activations.
    const Ownership zigzag = gdn_ownership(row, gdn_layout_plan(row, N, GdnLayout::Zigzag));
    if (std::string(rc.name) == "packed") {
      for (GdnLayout l : {GdnLayout::Contiguous, GdnLayout::Zigzag, GdnLayout::DocZigzag})
        alts.push_back({gdn_layout_name(l), gdn_layout_plan(row, N, l)});
      GdnPlanOptions att;
      att.attention = zigzag;
      alts.push_back({"searched-zz", plan_gdn(row, N, shape, model, att)});
    }
    for (Alt& a : alts) {
      gdn_predict(row, a.plan, shape, model);
      const auto ranges = gdn_rank_ranges(row, a.plan, me);
      auto take = [&](const std::vector<float>& full, int64_t w) { return rows_of<float>(full, w, ranges); };
      Data l{take(d.q, shape.qk_width()), take(d.k, shape.qk_width()), take(d.v, shape.v_width()),
             take(d.g, shape.g_width()), take(d.beta, o.heads), take(d.dy, shape.v_width())};
      CpuBackend<float> be;
      GdnCP<CpuBackend<float>> cp(a.plan, row, shape, comm, be);
      double best = 1e30, err = 0;
      for (int r = 0; r < o.reps; ++r) {
        std::vector<float> y(l.v.size()), dq(l.q.size()), dk(l.k.size()), dv(l.v.size()), dg(l.g.size()),
            db(l.beta.size());
        comm.barrier();
        const auto t0 = Clock::now();
        cp.forward(l.q, l.k, l.v, l.g, l.beta, y);
        cp.backward(l.dy, dq, dk, dv, dg, db);
        comm.barrier();
        best = std::min(best, ms_since(t0));
        int64_t at = 0;
        const int64_t w = static_cast<int64_t>(o.heads) * o.dv;
        for (const TokenRange& t : ranges)
          for (int64_t i = t.begin * w; i < t.end * w; ++i, ++at)
            err = std::max(err, static_cast<double>(std::abs(y[at] - y_ref[i])));
      }
      comm.all_reduce_sum(&err, 1, treecp::CommType::F64);  // a bound over ranks is enough for a report
      if (me == 0)
        std::printf("  %-10s %-11s %8d %12.2f %12.2f %14.2e %16.2f\n", rc.name, a.name.c_str(),
                    a.plan.chained_segments(), a.plan.predicted_ms, best, err,
                    gdn_move_price(row, a.plan, zigzag, shape, model, sizeof(float)).ms);
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
#ifdef TREECP_HAVE_MPI
  treecp::MpiSession session(&argc, &argv);
#endif
  Opts o;
  treecp::bench::BenchArgs args("bench_gdn", argc, argv);
  while (args.next()) {
    const std::string& a = args.name();
    if (a == "--heads") o.heads = args.int32_value();
    else if (a == "--dk") o.dk = args.int32_value();
    else if (a == "--dv") o.dv = args.int32_value();
    else if (a == "--tokens") o.tokens = args.int_value();
    else if (a == "--chunk") o.chunk = args.int32_value();
    else if (a == "--reps") o.reps = args.int32_value();
    else if (a == "--kda") o.kda = true;
    else
      args.unknown();
  }
#ifdef TREECP_HAVE_MPI
  treecp::MpiCommunicator comm;
#else
  auto self = treecp::make_self_communicator();
  treecp::Communicator& comm = *self;
#endif
  GdnCostModel model;
  double rate = 0;
  if (comm.rank() == 0) rate = kernel_table(o);
  comm.all_reduce_sum(&rate, 1, treecp::CommType::F64);
  model.madds_per_ms = rate;
  if (comm.size() > 1) {
    double lat = 0, bw = 0;
    comm_table(comm, &lat, &bw);
    double v[2] = {lat, bw};
    comm.all_reduce_sum(v, 2, treecp::CommType::F64);
    model.link.latency_ms = v[0] / comm.size() * 1e-3;
    model.link.bandwidth_bytes_per_ms = v[1] / comm.size() * 1e-3;
    if (comm.rank() == 0) std::printf("calibrated model: %s\n", json::dump(to_json(model)).c_str());
    plan_table(comm, o, model);
  }
  return 0;
}
