// Mamba-2 on the CPU: checks the chunked kernel against the token recurrence, then times the tree
// executor forward and backward on one core (by default the layer shape of the issue: S = 40,960,
// H = 64, P = 64, G = 8, N = 128), with the pass ratios the planner's madd model uses; then prints
// the bytes each CP strategy moves, and its prediction, for the workload presets at CP 2-8. Under
// mpirun it also runs both strategies on down-scaled presets: measured against predicted time, and
// the bytes counted on the wire against the planner's count. Prints tables; not a test.
//
//   bench_mamba2 [--tokens S] [--heads H] [--p P] [--groups G] [--n N] [--chunk C] [--reps R]
//                [--preset NAME] [--double] [--no-kernel] [--no-bytes] [--scale K]
//   mpirun -np 4 bench_mamba2 --no-kernel --no-bytes --heads 8 --p 16 --n 32 --scale 64
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <random>
#include <string>
#include <vector>

#include "bench_args.hpp"
#include "comm/communicator.hpp"
#include "comm/counting_communicator.hpp"
#ifdef TREECP_HAVE_MPI
#include "comm/mpi_communicator.hpp"
#endif
#include "kernels/cpu/mamba2.hpp"
#include "plan/planner.hpp"
#include "runtime/cpu_backend.hpp"
#include "runtime/mamba2_cp.hpp"
#include "plan/mamba2_plan.hpp"
#include "runtime/mamba2_tree.hpp"
#include "tree/presets.hpp"

namespace {

using namespace treecp;
using Clock = std::chrono::steady_clock;

struct Opts {
  int heads = 64, p = 64, groups = 8, n = 128, chunk = 64, reps = 1;
  int64_t tokens = 40960;
  int64_t scale = 64;
  std::string preset;  // empty: one sequence of `tokens`
  bool use_double = false, kernel = true, bytes = true;
};

double ms_since(Clock::time_point t0) { return std::chrono::duration<double, std::milli>(Clock::now() - t0).count(); }

template <class T>
struct Data {
  std::vector<T> x, dt, A, B, C, D, dy;
  Mamba2Params<T> params(const Opts& o, int64_t S) const {
    Mamba2Params<T> p;
    p.x = x.data(); p.dt = dt.data(); p.A = A.data(); p.B = B.data(); p.C = C.data(); p.D = D.data();
    p.tokens = S; p.heads = o.heads; p.head_dim = o.p; p.groups = o.groups; p.state_dim = o.n;
    p.heads_per_group = o.heads / o.groups; p.chunk = o.chunk;
    return p;
  }
};

template <class T>
Data<T> make_data(const Opts& o, int64_t S, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> n01(0.0, 1.0);
  std::uniform_real_distribution<double> u01(0.0, 1.0);
  Data<T> d;
  auto normal = [&](std::vector<T>& v, int64_t n, double sd) {
    v.resize(static_cast<size_t>(n));
    for (auto& e : v) e = static_cast<T>(sd * n01(rng));
  };
  normal(d.x, S * o.heads * o.p, 1.0);
  normal(d.dy, S * o.heads * o.p, 1.0);
  normal(d.B, S * o.groups * o.n, 1.0 / std::sqrt(static_cast<double>(o.n)));
  normal(d.C, S * o.groups * o.n, 1.0);
  normal(d.D, o.heads, 1.0);
  d.dt.resize(static_cast<size_t>(S * o.heads));
  for (auto& e : d.dt) e = static_cast<T>(0.02 + 0.5 * u01(rng));
  d.A.resize(static_cast<size_t>(o.heads));
  for (auto& e : d.A) e = static_cast<T>(-(0.1 + 1.5 * u01(rng)));
  return d;
}

Mamba2Shape shape_of(const Opts& o, int element_bytes) {
  return Mamba2Shape{o.heads, o.p, o.groups, o.n, element_bytes, o.chunk};
}

// This process's CPU time: on the shared 2-core machine a single-threaded kernel's CPU time is
// what one core spends, whatever else runs; wall time is printed beside it.
double cpu_ms() {
  timespec t{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return t.tv_sec * 1e3 + t.tv_nsec * 1e-6;
}

struct Timing {
  double cpu = 1e300, wall = 1e300;
};

// Best of `reps` runs, CPU and wall time.
template <class F>
Timing best_of(int reps, F&& fn) {
  Timing b;
  for (int r = 0; r < reps; ++r) {
    const double c0 = cpu_ms();
    const auto t0 = Clock::now();
    fn();
    b.wall = std::min(b.wall, ms_since(t0));
    b.cpu = std::min(b.cpu, cpu_ms() - c0);
  }
  return b;
}

// One core: check, then the tree executor forward and backward over the whole row, and the pass
// ratios (summary, state-only backward) on a few heads.
template <class T>
void kernel_table(const Opts& o) {
  const Row row = o.preset.empty() ? Row(std::vector<Segment>{{-1, o.tokens}}) : make_preset(o.preset, 1);
  const int64_t S = row.tokens();
  const Data<T> d = make_data<T>(o, S, 1);
  const Mamba2Params<T> p = d.params(o, S);
  const int64_t sz = p.state_size();
  const char* type = sizeof(T) == 8 ? "double" : "float";
  // Check first: chunked against the recurrence on a prefix of two heads.
  const int64_t Sc = std::min<int64_t>(S, 512);
  std::vector<T> y1(static_cast<size_t>(S * o.heads * o.p)), y2(y1.size()), st(static_cast<size_t>(sz));
  double err = 0, mag = 0;
  for (int h = 0; h < std::min(2, o.heads); ++h) {
    std::fill(st.begin(), st.end(), T(0));
    mamba2_recurrent_forward(p, h, 0, Sc, st.data(), y1.data());
    std::fill(st.begin(), st.end(), T(0));
    mamba2_chunked_forward(p, h, 0, Sc, st.data(), y2.data());
    for (int64_t t = 0; t < Sc; ++t)
      for (int q = 0; q < o.p; ++q) {
        const size_t i = static_cast<size_t>((t * o.heads + h) * o.p + q);
        err = std::max(err, static_cast<double>(std::abs(y1[i] - y2[i])));
        mag = std::max(mag, static_cast<double>(std::abs(y1[i])));
      }
  }
  std::printf("kernel (%s): %s, S %lld, %d segments, H %d, P %d, G %d, N %d, chunk %d, one core\n", type,
              o.preset.empty() ? "one sequence" : o.preset.c_str(), static_cast<long long>(S), row.num_segments(),
              o.heads, o.p, o.groups, o.n, o.chunk);
  std::printf("  check: chunked vs recurrent max |diff| %.2e (max |y| %.2f) over %lld tokens, 2 heads\n", err, mag,
              static_cast<long long>(Sc));
  Mamba2TreeSaved<T> saved;
  const Timing fwd = best_of(o.reps, [&] { saved = mamba2_tree_forward(row, p, y2.data()); });
  std::vector<T> dx(d.x.size()), ddt(d.dt.size()), dA(d.A.size()), dB(d.B.size()), dC(d.C.size()), dD(d.D.size());
  const Timing bwd = best_of(o.reps, [&] {
    mamba2_tree_backward(row, p, saved, d.dy.data(),
                         Mamba2Grads<T>{dx.data(), ddt.data(), dA.data(), dB.data(), dC.data(), dD.data()});
  });
  // The other passes on a few heads over the first tokens, against the forward on the same.
  const int hs = std::min(4, o.heads);
  const int64_t Ss = std::min<int64_t>(S, 8192);
  std::vector<T> a(1), E(static_cast<size_t>(sz)), s0(static_cast<size_t>(sz), T(0)), ds(static_cast<size_t>(sz));
  const Timing f_small = best_of(o.reps, [&] {
    for (int h = 0; h < hs; ++h) {
      std::fill(st.begin(), st.end(), T(0));
      mamba2_chunked_forward(p, h, 0, Ss, st.data(), y2.data());
    }
  });
  const Timing b_small = best_of(o.reps, [&] {
    for (int h = 0; h < hs; ++h) {
      std::fill(ds.begin(), ds.end(), T(0));
      mamba2_chunked_backward(p, h, 0, Ss, s0.data(), d.dy.data(), ds.data(),
                              Mamba2Grads<T>{dx.data(), ddt.data(), dA.data(), dB.data(), dC.data(), dD.data()});
    }
  });
  const Timing sum_small = best_of(o.reps, [&] {
    for (int h = 0; h < hs; ++h) mamba2_chunked_summary(p, h, 0, Ss, a.data(), E.data());
  });
  const Timing state_small = best_of(o.reps, [&] {
    for (int h = 0; h < hs; ++h) {
      std::fill(ds.begin(), ds.end(), T(0));
      mamba2_chunked_backward(p, h, 0, Ss, s0.data(), d.dy.data(), ds.data(), Mamba2Grads<T>{});
    }
  });
  const Mamba2Shape shape = shape_of(o, sizeof(T));
  const double token_heads = static_cast<double>(S) * o.heads;
  const double fwd_madds = mamba2_forward_madds(shape) * token_heads,
               all_madds = mamba2_token_madds(shape) * token_heads;
  std::printf("  %-15s CPU %10.1f ms (wall %10.1f)  %7.3f us per token-head  %6.2f GFLOP/s\n", "tree forward",
              fwd.cpu, fwd.wall, fwd.cpu * 1e3 / token_heads, 2 * fwd_madds / (fwd.cpu * 1e6));
  std::printf("  %-15s CPU %10.1f ms (wall %10.1f)  %7.3f us per token-head\n", "tree backward", bwd.cpu, bwd.wall,
              bwd.cpu * 1e3 / token_heads);
  std::printf("  CPU-time ratios to the forward on %d heads x %lld tokens: backward %.2f, summary %.2f, "
              "state-only backward %.2f\n",
              hs, static_cast<long long>(Ss), b_small.cpu / f_small.cpu, sum_small.cpu / f_small.cpu,
              state_small.cpu / f_small.cpu);
  std::printf("  model: %.3g multiply-adds forward+backward -> %.3f ns per multiply-add (CPU time)\n", all_madds,
              (fwd.cpu + bwd.cpu) * 1e6 / all_madds);
}

// What each strategy moves and is predicted to cost, presets x CP, token owners from the dense
// attention planner's searched plan (H200 coefficients: the ownership a GPU job would have).
void bytes_table(const Opts& o) {
  const Mamba2Shape shape = shape_of(o, 4);
  const GdnCostModel model = mamba2_cost_defaults();
  std::printf(
      "\nbytes moved per layer, forward + backward, summed over ranks (float on the wire), H %d, P %d, G %d, N %d;\n"
      "predicted ms with the CPU coefficients (config/mamba2_costs_cpu.json)\n",
      o.heads, o.p, o.groups, o.n);
  std::printf("  %-13s %3s %9s %12s %12s %10s %10s %7s %6s %9s\n", "preset", "CP", "tokens", "transpose_MB",
              "summary_MB", "transp_ms", "summary_ms", "chains", "moves", "choice");
  for (const char* name : {"fixed5k", "varied5k", "dominant", "longchain", "deep", "art-fixed5k", "art-long8k"}) {
    for (int cp = 2; cp <= 8; ++cp) {
      const Row row = make_preset(name, cp);
      const Ownership tokens = plan_ownership(make_plan(row, cp, AttentionShape{}, CostModel{}, PlanOptions{}));
      const Mamba2Plan plan = plan_mamba2(row, tokens, shape, model);
      std::printf(
          "  %-13s %3d %9lld %12.1f %12.1f %10.1f %10.1f %7d %6s %9s\n", name, cp, static_cast<long long>(row.tokens()),
          plan.transpose_price.bytes / 1e6, plan.summary_price.bytes / 1e6, plan.transpose_price.ms,
          plan.summary_price.ms, plan.chains.chained_segments(),
          tokens_move(tokens, gdn_ownership(row, plan.chains)) ? "yes" : "no", strategy_name(plan.strategy));
    }
  }
}

// Both strategies on down-scaled presets over the communicator: best measured forward+backward of
// `reps` against the prediction, and bytes counted against planned.
void cp_table(Communicator& world, const Opts& o) {
  const int N = world.size(), me = world.rank();
  const Mamba2Shape shape = shape_of(o, 4);
  const GdnCostModel model = mamba2_cost_defaults();
  if (me == 0) {
    std::printf(
        "\nCP on %d ranks, float, H %d, P %d, G %d, N %d, presets / %lld: predicted vs measured forward+backward\n", N,
        o.heads, o.p, o.groups, o.n, static_cast<long long>(o.scale));
    std::printf("  %-11s %7s %-9s %12s %12s %14s %14s\n", "preset", "tokens", "strategy", "predicted_ms",
                "measured_ms", "bytes_planned", "bytes_counted");
  }
  for (const char* name : {"fixed5k", "dominant", "longchain", "deep"}) {
    const Row row = scale_row(make_preset(name, N), o.scale);
    const Ownership tokens = plan_ownership(make_plan(row, N, AttentionShape{}, CostModel{}, PlanOptions{}));
    const Data<float> d = make_data<float>(o, row.tokens(), 3);
    for (Mamba2Strategy s : {Mamba2Strategy::Transpose, Mamba2Strategy::Summary}) {
      const Mamba2Plan plan = plan_mamba2(row, tokens, shape, model, s);
      const auto& mine = tokens[static_cast<size_t>(me)];
      auto take = [&](const std::vector<float>& full, int64_t w) { return rows_of<float>(full, w, mine); };
      const auto x = take(d.x, o.heads * o.p), dt = take(d.dt, o.heads), B = take(d.B, o.groups * o.n),
                 C = take(d.C, o.groups * o.n), dy = take(d.dy, o.heads * o.p);
      double best = 1e300;
      int64_t counted = 0;
      for (int r = 0; r < std::max(o.reps, 2); ++r) {
        CountingCommunicator comm(world);
        Mamba2CP<float> cp(plan, row, shape, comm);
        std::vector<float> y(x.size()), dx(x.size()), ddt(dt.size()), dB(B.size()), dC(C.size()),
            dA(static_cast<size_t>(o.heads)), dD(dA.size());
        world.barrier();
        const auto t0 = Clock::now();
        cp.forward(Mamba2Inputs<float>{x.data(), dt.data(), B.data(), C.data(), d.A.data(), d.D.data()}, y.data());
        cp.backward(dy.data(), Mamba2Grads<float>{dx.data(), ddt.data(), dA.data(), dB.data(), dC.data(), dD.data()});
        world.barrier();
        best = std::min(best, ms_since(t0));
        counted = comm.bytes_sent();
      }
      world.all_reduce_sum(&counted, 1, treecp::CommType::I64);
      if (me == 0)
        std::printf("  %-11s %7lld %-9s %12.2f %12.2f %14lld %14lld\n", name, static_cast<long long>(row.tokens()),
                    strategy_name(s), plan.price().ms, best, static_cast<long long>(plan.price().bytes),
                    static_cast<long long>(counted));
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
#ifdef TREECP_HAVE_MPI
  treecp::MpiSession session(&argc, &argv);
#endif
  Opts o;
  treecp::bench::BenchArgs args("bench_mamba2", argc, argv);
  while (args.next()) {
    const std::string& a = args.name();
    if (a == "--heads") o.heads = args.int32_value();
    else if (a == "--p") o.p = args.int32_value();
    else if (a == "--groups") o.groups = args.int32_value();
    else if (a == "--n") o.n = args.int32_value();
    else if (a == "--tokens") o.tokens = args.int_value();
    else if (a == "--chunk") o.chunk = args.int32_value();
    else if (a == "--reps") o.reps = args.int32_value();
    else if (a == "--scale") o.scale = args.int_value();
    else if (a == "--preset") o.preset = args.value();
    else if (a == "--double") o.use_double = true;
    else if (a == "--no-kernel") o.kernel = false;
    else if (a == "--no-bytes") o.bytes = false;
    else
      args.unknown();
  }
  if (o.heads % o.groups != 0) {
    std::fprintf(stderr, "bench_mamba2: --groups must divide --heads\n");
    return 2;
  }
#ifdef TREECP_HAVE_MPI
  treecp::MpiCommunicator comm;
#else
  auto self = treecp::make_self_communicator();
  treecp::Communicator& comm = *self;
#endif
  if (comm.rank() == 0) {
    if (o.kernel) o.use_double ? kernel_table<double>(o) : kernel_table<float>(o);
    if (o.bytes) bytes_table(o);
  }
  if (comm.size() > 1) cp_table(comm, o);
  return 0;
}
