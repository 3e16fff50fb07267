// Times the CPU attention reference (slice forward with LSE, staged backward) on 4,096-token rows,
// Hq = 8, D = Dv = 64, one core. Issue 3 asks for forward + backward in a few seconds.
// Check first (float against double on the same inputs), then time; FLOPs on useful work from one
// formula (DESIGN.md): forward 4 A D Hq for A visible pairs, backward 2.5x forward.
// Usage: bench_attention_cpu [hkv] [reps]   (defaults: 2, 3); TREECP_CPU_ISA=baseline times the SSE2 copy.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/attention.hpp"
#include "runtime/reference.hpp"
#include "tree/accounting.hpp"
#include "tree/row.hpp"
#include "tree/slice.hpp"

namespace {

using namespace treecp;
using namespace treecp::cpu;

double forward_flops(int64_t pairs, int d, int hq) { return 4.0 * static_cast<double>(pairs) * d * hq; }
constexpr double kBackwardFlopsPerForward = 2.5;

struct Case {
  std::string name;
  Row row;
  int64_t window;
};

template <class T>
struct Timing {
  double fwd_ms = 1e30, bwd_ms = 1e30;
};

template <class T>
Timing<T> time_case(const Case& c, int hq, int hkv, int d, int reps, const std::vector<double>& q64,
                    const std::vector<double>& k64, const std::vector<double>& v64, const std::vector<double>& do64) {
  const int64_t S = c.row.tokens();
  const std::vector<T> q(q64.begin(), q64.end()), k(k64.begin(), k64.end()), v(v64.begin(), v64.end()),
      dout(do64.begin(), do64.end());
  const std::vector<Slice> slices = row_slices(c.row, c.window);
  const AttentionShape sh{hq, hkv, d, d, c.window};
  std::vector<T> o(q.size()), lse(static_cast<size_t>(S * hq)), dq(q.size()), dk(k.size()), dv(v.size());
  Timing<T> t;
  for (int r = 0; r < reps; ++r) {
    auto t0 = std::chrono::steady_clock::now();
    attention_forward(AttnForwardArgs<T>{sh, S, S, dense_view(q.data(), hq, d), dense_view(k.data(), hkv, d),
                                         dense_view(v.data(), hkv, d), dense_view(o.data(), hq, d),
                                         dense_view(lse.data(), hq, 1)},
                      slices);
    auto t1 = std::chrono::steady_clock::now();
    std::fill(dq.begin(), dq.end(), T(0));
    std::fill(dk.begin(), dk.end(), T(0));
    std::fill(dv.begin(), dv.end(), T(0));
    attention_backward(
        AttnBackwardArgs<T>{sh, S, S, dense_view(q.data(), hq, d), dense_view(k.data(), hkv, d),
                            dense_view(v.data(), hkv, d), dense_view<const T>(o.data(), hq, d),
                            dense_view<const T>(lse.data(), hq, 1), dense_view(dout.data(), hq, d), {},
                            dense_view(dq.data(), hq, d), dense_view(dk.data(), hkv, d),
                            dense_view(dv.data(), hkv, d)},
        slices);
    auto t2 = std::chrono::steady_clock::now();
    t.fwd_ms = std::min(t.fwd_ms, std::chrono::duration<double, std::milli>(t1 - t0).count());
    t.bwd_ms = std::min(t.bwd_ms, std::chrono::duration<double, std::milli>(t2 - t1).count());
  }
  return t;
}

template <class T>
AttentionResult<T> run_reference(const Case& c, int hq, int hkv, int d, const std::vector<double>& q,
                                 const std::vector<double>& k, const std::vector<double>& v,
                                 const std::vector<double>& dout) {
  const std::vector<T> qt(q.begin(), q.end()), kt(k.begin(), k.end()), vt(v.begin(), v.end()),
      dt(dout.begin(), dout.end());
  AttentionInputs<T> p;
  p.q = qt.data();
  p.k = kt.data();
  p.v = vt.data();
  p.dout = dt.data();
  return attention_reference(c.row, AttentionShape{hq, hkv, d, d, c.window}, p);
}

template <class A, class B>
double max_abs_diff(const std::vector<A>& a, const std::vector<B>& b) {
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) m = std::max(m, std::abs(static_cast<double>(a[i]) - static_cast<double>(b[i])));
  return m;
}

}  // namespace

int main(int argc, char** argv) {
  const int hq = 8, d = 64;
  const int hkv = argc > 1 ? std::stoi(argv[1]) : 2;
  const int reps = argc > 2 ? std::stoi(argv[2]) : 3;

  std::vector<Segment> tree{{-1, 1024}};
  for (int i = 0; i < 6; ++i) tree.push_back({0, 512});
  std::vector<Segment> deep{{-1, 1024}, {0, 512}, {1, 256}, {1, 256}, {0, 512}, {4, 512}, {4, 256}, {0, 768}};
  const std::vector<Case> cases{
      {"root1024+6x512", Row(tree), 0},
      {"root1024+6x512 w512", Row(tree), 512},
      {"nested depth 3", Row(deep), 0},
      {"causal 4096", Row({{-1, 4096}}), 0},
  };

  const char* isa = std::getenv("TREECP_CPU_ISA");
  std::printf("CPU attention reference, one core: Hq %d, Hkv %d, D = Dv = %d, best of %d, instruction set %s\n", hq,
              hkv, d, reps, isa && std::string(isa) == "baseline" ? "baseline (forced)" : "best available");
  std::printf("f32_vs_f64: max |float - double| over o, dq, dk, dv on the same inputs (the check before timing)\n");
  std::printf("%-20s %6s %6s %10s %10s %10s %10s %9s %9s %11s\n", "row", "dtype", "tokens", "pairs", "fwd_ms",
              "bwd_ms", "total_ms", "fwd_GF/s", "bwd_GF/s", "f32_vs_f64");
  for (const Case& c : cases) {
    const int64_t S = c.row.tokens();
    std::mt19937_64 gen(7);
    std::normal_distribution<double> nd(0.0, 1.0);
    auto randn = [&](int64_t n) {
      std::vector<double> x(static_cast<size_t>(n));
      for (double& e : x) e = nd(gen);
      return x;
    };
    const auto q = randn(S * hq * d), k = randn(S * hkv * d), v = randn(S * hkv * d), dout = randn(S * hq * d);
    int64_t pairs = 0;
    for (const Slice& s : row_slices(c.row, c.window)) pairs += s.area();

    // Check: float against double on the same inputs (outputs and all gradients).
    const auto r64 = run_reference<double>(c, hq, hkv, d, q, k, v, dout);
    const auto r32 = run_reference<float>(c, hq, hkv, d, q, k, v, dout);
    const double err = std::max({max_abs_diff(r32.o, r64.o), max_abs_diff(r32.dq, r64.dq),
                                 max_abs_diff(r32.dk, r64.dk), max_abs_diff(r32.dv, r64.dv)});

    const double ff = forward_flops(pairs, d, hq);
      auto row_out = [&](const char* dtype, double fwd_ms, double bwd_ms, bool show_err) {
      char err_text[32] = "";
      if (show_err) std::snprintf(err_text, sizeof err_text, "%.2e", err);
      std::printf("%-20s %6s %6lld %10lld %10.1f %10.1f %10.1f %9.2f %9.2f %11s\n", c.name.c_str(), dtype,
                  static_cast<long long>(S), static_cast<long long>(pairs), fwd_ms, bwd_ms, fwd_ms + bwd_ms,
                  ff / fwd_ms * 1e-6, kBackwardFlopsPerForward * ff / bwd_ms * 1e-6, err_text);
    };
    const auto t32 = time_case<float>(c, hq, hkv, d, reps, q, k, v, dout);
    row_out("f32", t32.fwd_ms, t32.bwd_ms, true);
    const auto t64 = time_case<double>(c, hq, hkv, d, reps, q, k, v, dout);
    row_out("f64", t64.fwd_ms, t64.bwd_ms, false);
  }
  return 0;
}
