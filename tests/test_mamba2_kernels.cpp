// Mamba-2 kernels on the CPU: the chunked SSD form against the token recurrence (double: 1e-12;
// float: within the float recurrence's own error), summaries and their composition, head shards,
// and every gradient (dx, ddt, dA, dB, dC, dD and the incoming state's) against central differences.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <string>
#include <tuple>
#include <vector>

#include "core/error.hpp"
#include "kernels/cpu/gdn.hpp"
#include "kernels/cpu/mamba2.hpp"
#include "common/mamba2.hpp"

namespace treecp {
namespace {

using testing::Mamba2Data;
using testing::max_abs_diff;
using testing::widen;

// Forward over all heads of [t0, t1) from per-head states (updated); writes y.
template <class T>
void run_heads(const Mamba2Params<T>& p, bool chunked, int64_t t0, int64_t t1, std::vector<T>& states,
               std::vector<T>& y) {
  const int64_t sz = p.state_size();
  for (int h = 0; h < p.heads; ++h) {
    if (chunked) mamba2_chunked_forward(p, h, t0, t1, states.data() + h * sz, y.data());
    else mamba2_recurrent_forward(p, h, t0, t1, states.data() + h * sz, y.data());
  }
}

std::vector<double> random_vec(size_t n, uint64_t seed, double sd = 1.0) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> n01(0.0, sd);
  std::vector<double> x(n);
  for (auto& e : x) e = n01(rng);
  return x;
}

// Both copies of the chunked kernel: the one chosen at run time (AVX2 + FMA where the CPU has
// them) and the SSE2 baseline.
class Mamba2Isa : public ::testing::TestWithParam<const char*> {
 protected:
  void SetUp() override {
    if (std::string(GetParam()) == "baseline") ::setenv("TREECP_CPU_ISA", "baseline", 1);
  }
  void TearDown() override { ::unsetenv("TREECP_CPU_ISA"); }
};

// Small dimensions (the GEMM's scalar edges) and wider ones (its full register tiles, 4 rows x 8
// or 16 columns).
struct Dims {
  int H, P, G, N;
};
const Dims kDims[] = {{4, 6, 2, 5}, {2, 24, 1, 20}};

TEST_P(Mamba2Isa, ChunkedEqualsRecurrentDouble) {
  for (const Dims& dm : kDims)
    for (int64_t S : {1, 5, 64, 131}) {
      for (int chunk : {1, 7, 16, 64}) {
        for (bool with_d : {false, true}) {
          const Mamba2Data d = testing::random_mamba2_data(S, dm.H, dm.P, dm.G, dm.N, with_d, 100 + S * 7 + chunk);
          const auto b = testing::mamba2_buffers<double>(d, {{0, S}});
          const auto p = b.params(d, chunk);
          std::vector<double> s_rec = random_vec(static_cast<size_t>(dm.H * dm.N * dm.P), 5, 0.3), s_chk = s_rec;
          std::vector<double> y_rec(d.x.size()), y_chk(d.x.size());
          run_heads(p, false, 0, S, s_rec, y_rec);
          run_heads(p, true, 0, S, s_chk, y_chk);
          EXPECT_LT(max_abs_diff(y_rec, y_chk), 1e-12 * (1 + testing::max_abs(y_rec)))
              << "S " << S << " chunk " << chunk;
          EXPECT_LT(max_abs_diff(s_rec, s_chk), 1e-12 * (1 + testing::max_abs(s_rec)))
              << "S " << S << " chunk " << chunk;
          EXPECT_GT(testing::max_abs(y_rec), 0.1);  // not a comparison of zeros
        }
      }
    }
}

TEST_P(Mamba2Isa, ChunkedFloatWithinFloatRecurrenceError) {
  const int64_t S = 300;
  const Mamba2Data d = testing::random_mamba2_data(S, 4, 16, 2, 32, true, 77);
  const auto bd = testing::mamba2_buffers<double>(d, {{0, S}});
  const auto bf = testing::mamba2_buffers<float>(d, {{0, S}});
  std::vector<double> s_ref(static_cast<size_t>(4 * 16 * 32), 0.0), y_ref(d.x.size());
  run_heads(bd.params(d, 64), false, 0, S, s_ref, y_ref);
  std::vector<float> s_rec(s_ref.size(), 0.f), s_chk = s_rec, y_rec(d.x.size()), y_chk(d.x.size());
  run_heads(bf.params(d, 64), false, 0, S, s_rec, y_rec);
  run_heads(bf.params(d, 64), true, 0, S, s_chk, y_chk);
  const double err_rec = max_abs_diff(widen(y_rec), y_ref);
  EXPECT_LE(max_abs_diff(widen(y_chk), y_ref), testing::tolerance(err_rec, y_ref))
      << "recurrent float error " << err_rec;
  EXPECT_LE(max_abs_diff(widen(s_chk), s_ref), testing::tolerance(max_abs_diff(widen(s_rec), s_ref), s_ref));
}

// A head shard (heads [first_head, first_head + heads) with only the groups they read) computes what
// the full layer computes for those heads.
TEST(Mamba2Kernel, HeadShardEqualsFullLayer) {
  const int64_t S = 40;
  const int H = 6, G = 3, P = 4, N = 5;  // two heads per group
  const Mamba2Data d = testing::random_mamba2_data(S, H, P, G, N, true, 3);
  const auto full = testing::mamba2_buffers<double>(d, {{0, S}});
  const auto pf = full.params(d, 8);
  std::vector<double> s_full(static_cast<size_t>(H * N * P), 0.0), y_full(d.x.size());
  run_heads(pf, true, 0, S, s_full, y_full);
  const int h0 = 1, h1 = 4;  // groups 0..1
  const int g0 = h0 / 2, g1 = (h1 - 1) / 2 + 1;
  std::vector<double> x, dt, B, C;
  for (int64_t t = 0; t < S; ++t) {
    x.insert(x.end(), d.x.begin() + (t * H + h0) * P, d.x.begin() + (t * H + h1) * P);
    dt.insert(dt.end(), d.dt.begin() + t * H + h0, d.dt.begin() + t * H + h1);
    B.insert(B.end(), d.B.begin() + (t * G + g0) * N, d.B.begin() + (t * G + g1) * N);
    C.insert(C.end(), d.C.begin() + (t * G + g0) * N, d.C.begin() + (t * G + g1) * N);
  }
  Mamba2Params<double> ps = pf;
  ps.x = x.data(); ps.dt = dt.data(); ps.B = B.data(); ps.C = C.data();
  ps.A = d.A.data() + h0; ps.D = d.D.data() + h0;
  ps.heads = h1 - h0; ps.groups = g1 - g0; ps.first_head = h0;
  mamba2_check_params(ps);
  std::vector<double> s(static_cast<size_t>((h1 - h0) * N * P), 0.0), y(x.size());
  run_heads(ps, true, 0, S, s, y);
  double err = 0;
  for (int64_t t = 0; t < S; ++t)
    for (int h = h0; h < h1; ++h)
      for (int q = 0; q < P; ++q)
        err = std::max(err, std::abs(y[(t * (h1 - h0) + h - h0) * P + q] - y_full[(t * H + h) * P + q]));
  EXPECT_LT(err, 1e-14);
  ps.groups = 1;  // heads 2 and 3 read group 1: refused
  EXPECT_THROW(mamba2_check_params(ps), Error);
}

TEST(Mamba2Kernel, SummaryIsTheAffineMapOfTheRun) {
  const int64_t S = 150;
  const int P = 4, N = 6;
  const Mamba2Data d = testing::random_mamba2_data(S, 1, P, 1, N, true, 9);
  const auto b = testing::mamba2_buffers<double>(d, {{0, S}});
  const auto p = b.params(d, 32);
  const int sz = N * P;
  double a = 0;
  std::vector<double> E(sz);
  mamba2_chunked_summary(p, 0, 10, 140, &a, E.data());
  EXPECT_GT(a, 0.0);
  EXPECT_LT(a, 1.0);
  for (uint64_t seed : {1, 2}) {
    std::vector<double> s = random_vec(sz, seed), expect(sz);
    gdn_apply(1, sz, &a, E.data(), s.data(), expect.data());
    mamba2_recurrent_forward(p, 0, 10, 140, s.data(), static_cast<double*>(nullptr));
    EXPECT_LT(max_abs_diff(s, expect), 1e-12);
  }
  // Composition with the GDN algebra at dk = 1: summary(a..c) = summary(b..c) ∘ summary(a..b).
  double a1 = 0, a2 = 0, ac = 0;
  std::vector<double> E1(sz), E2(sz), Ec(sz);
  mamba2_chunked_summary(p, 0, 10, 33, &a1, E1.data());
  mamba2_chunked_summary(p, 0, 33, 140, &a2, E2.data());
  gdn_compose(1, sz, &a2, E2.data(), &a1, E1.data(), &ac, Ec.data());
  EXPECT_NEAR(ac, a, 1e-14);
  EXPECT_LT(max_abs_diff(Ec, E), 1e-12);
}

// Loss J = Σ y·wy + Σ H_out·ws over a run that starts from a random state; every gradient of both
// backward forms against central differences of the recurrence.
TEST(Mamba2Kernel, GradientsMatchFiniteDifferences) {
  const int64_t S = 19;
  const int H = 4, P = 3, G = 2, N = 4;
  const Mamba2Data base = testing::random_mamba2_data(S, H, P, G, N, true, 1234);
  const int64_t sz = static_cast<int64_t>(N) * P;
  const std::vector<double> s_in = random_vec(static_cast<size_t>(H * sz), 11, 0.5);
  const std::vector<double> ws = random_vec(static_cast<size_t>(H * sz), 13);
  auto loss = [&](const Mamba2Data& d, const std::vector<double>& s0) {
    const auto b = testing::mamba2_buffers<double>(d, {{0, S}});
    std::vector<double> s = s0, y(d.x.size());
    run_heads(b.params(d, 5), false, 0, S, s, y);
    double j = 0;
    for (size_t i = 0; i < y.size(); ++i) j += y[i] * d.dy[i];
    for (size_t i = 0; i < s.size(); ++i) j += s[i] * ws[i];
    return j;
  };
  auto grads = [&](bool chunked) {
    const auto b = testing::mamba2_buffers<double>(base, {{0, S}});
    const auto p = b.params(base, 5);
    testing::Mamba2Result r = testing::zero_result(base);
    std::vector<double> ds = ws;
    Mamba2Grads<double> g{r.dx.data(), r.ddt.data(), r.dA.data(), r.dB.data(), r.dC.data(), r.dD.data()};
    for (int h = 0; h < H; ++h) {
      if (chunked) mamba2_chunked_backward(p, h, 0, S, s_in.data() + h * sz, base.dy.data(), ds.data() + h * sz, g);
      else mamba2_recurrent_backward(p, h, 0, S, s_in.data() + h * sz, base.dy.data(), ds.data() + h * sz, g);
    }
    r.y = ds;  // the incoming state's gradient rides in y
    return r;
  };
  const testing::Mamba2Result rec = grads(false), chk = grads(true);
  auto fd_check = [&](std::vector<double> Mamba2Data::*field, const std::vector<double>& analytic, const char* name) {
    testing::expect_finite_differences(base, field, analytic, [&](const Mamba2Data& x) { return loss(x, s_in); }, name);
  };
  const double eps = 1e-6;
  fd_check(&Mamba2Data::x, rec.dx, "dx");
  fd_check(&Mamba2Data::dt, rec.ddt, "ddt");
  fd_check(&Mamba2Data::A, rec.dA, "dA");
  fd_check(&Mamba2Data::B, rec.dB, "dB");
  fd_check(&Mamba2Data::C, rec.dC, "dC");
  fd_check(&Mamba2Data::D, rec.dD, "dD");
  for (size_t i = 0; i < s_in.size(); ++i) {
    std::vector<double> sp = s_in, sm = s_in;
    sp[i] += eps;
    sm[i] -= eps;
    const double fd = (loss(base, sp) - loss(base, sm)) / (2 * eps);
    ASSERT_NEAR(rec.y[i], fd, 1e-7 * (1 + std::abs(fd))) << "dH_in[" << i << "]";
  }
  for (auto [a, b, name] : {std::tuple{&rec.dx, &chk.dx, "dx"}, {&rec.ddt, &chk.ddt, "ddt"}, {&rec.dA, &chk.dA, "dA"},
                            {&rec.dB, &chk.dB, "dB"}, {&rec.dC, &chk.dC, "dC"}, {&rec.dD, &chk.dD, "dD"},
                            {&rec.y, &chk.y, "dH_in"}})
    EXPECT_LT(max_abs_diff(*a, *b), 1e-12 * (1 + testing::max_abs(*a))) << name;
}

// Chunked backward against the recurrence at several chunk sizes, longer runs.
TEST_P(Mamba2Isa, ChunkedBackwardEqualsRecurrentBackward) {
  for (const Dims& dm : kDims) {
    const int64_t S = 97;
    const Mamba2Data d = testing::random_mamba2_data(S, dm.H, dm.P, dm.G, dm.N, true, 21);
    const auto b = testing::mamba2_buffers<double>(d, {{0, S}});
    const int64_t sz = int64_t{dm.N} * dm.P;
    const std::vector<double> s_in = random_vec(static_cast<size_t>(dm.H * sz), 2, 0.4),
                              ds_out = random_vec(s_in.size(), 3);
    auto run = [&](bool chunked, int chunk) {
      const auto p = b.params(d, chunk);
      testing::Mamba2Result r = testing::zero_result(d);
      r.y = ds_out;
      Mamba2Grads<double> g{r.dx.data(), r.ddt.data(), r.dA.data(), r.dB.data(), r.dC.data(), r.dD.data()};
      for (int h = 0; h < dm.H; ++h) {
        if (chunked) mamba2_chunked_backward(p, h, 3, S, s_in.data() + h * sz, d.dy.data(), r.y.data() + h * sz, g);
        else mamba2_recurrent_backward(p, h, 3, S, s_in.data() + h * sz, d.dy.data(), r.y.data() + h * sz, g);
      }
      return r;
    };
    const auto rec = run(false, 1);
    for (int chunk : {1, 8, 30, 64}) {
      const auto chk = run(true, chunk);
      for (auto [a, c, name] : {std::tuple{&rec.dx, &chk.dx, "dx"},
                                {&rec.ddt, &chk.ddt, "ddt"},
                                {&rec.dA, &chk.dA, "dA"},
                                {&rec.dB, &chk.dB, "dB"},
                                {&rec.dC, &chk.dC, "dC"},
                                {&rec.dD, &chk.dD, "dD"},
                                {&rec.y, &chk.y, "dH_in"}})
        EXPECT_LT(max_abs_diff(*a, *c), 1e-12 * (1 + testing::max_abs(*a)))
            << name << " chunk " << chunk << " P " << dm.P;
    }
  }
}

TEST(Mamba2Kernel, StateOnlyBackwardMatchesFull) {
  const int64_t S = 40;
  const Mamba2Data d = testing::random_mamba2_data(S, 1, 4, 1, 6, true, 3);
  const auto b = testing::mamba2_buffers<double>(d, {{0, S}});
  const auto p = b.params(d, 16);
  const std::vector<double> s_in = random_vec(24, 4), ds_out = random_vec(24, 6);
  std::vector<double> a = ds_out, c = ds_out, dx(d.x.size());
  mamba2_chunked_backward(p, 0, 0, S, s_in.data(), d.dy.data(), a.data(), Mamba2Grads<double>{});
  mamba2_chunked_backward(p, 0, 0, S, s_in.data(), d.dy.data(), c.data(), Mamba2Grads<double>{dx.data()});
  EXPECT_LT(max_abs_diff(a, c), 1e-13);
  EXPECT_GT(testing::max_abs(dx), 0.0);
}

TEST(Mamba2Kernel, RefusesBadParams) {
  const Mamba2Data d = testing::random_mamba2_data(4, 2, 3, 1, 2, false, 1);
  const auto b = testing::mamba2_buffers<double>(d, {{0, 4}});
  auto p = b.params(d, 4);
  mamba2_check_params(p);
  auto bad = p;
  bad.chunk = 0;
  EXPECT_THROW(mamba2_check_params(bad), Error);
  bad = p;
  bad.A = nullptr;
  EXPECT_THROW(mamba2_check_params(bad), Error);
  std::vector<double> s(6, 0.0), y(d.x.size());
  EXPECT_THROW(mamba2_chunked_forward(p, 2, 0, 4, s.data(), y.data()), Error);
  EXPECT_THROW(mamba2_chunked_forward(p, 0, 0, 5, s.data(), y.data()), Error);
}

INSTANTIATE_TEST_SUITE_P(Copies, Mamba2Isa, ::testing::Values("default", "baseline"),
                         [](const auto& info) { return std::string(info.param); });

}  // namespace
}  // namespace treecp
