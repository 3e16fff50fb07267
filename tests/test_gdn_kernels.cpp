// GDN / KDA kernels on the CPU: chunked UT/WY form against the token recurrence, summaries and
// their algebra, and every gradient against finite differences in double.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "common/gdn.hpp"
#include "kernels/cpu/gdn.hpp"

namespace treecp {
namespace {

using testing::max_error;
using testing::randn;
using testing::Rng;

// Random inputs shaped like a real layer (common/gdn.hpp): L2-normalised q and k, beta in (0, 1),
// log-decays in (-0.5, 0).
struct Inputs {
  int64_t S;
  int H, dk, dv;
  GdnGate gate;
  std::vector<double> q, k, v, g, beta;
  Inputs(int64_t S_, int H_, int dk_, int dv_, GdnGate gate_, Rng& rng) : S(S_), H(H_), dk(dk_), dv(dv_), gate(gate_) {
    testing::GdnData d = testing::random_gdn_data(S, H, dk, dv, gate, rng);
    q = std::move(d.q);
    k = std::move(d.k);
    v = std::move(d.v);
    g = std::move(d.g);
    beta = std::move(d.beta);
  }
  template <class T>
  struct Typed {
    std::vector<T> q, k, v, g, beta;
  };
  template <class T>
  Typed<T> as() const {
    auto cv = [](const std::vector<double>& x) { return std::vector<T>(x.begin(), x.end()); };
    return {cv(q), cv(k), cv(v), cv(g), cv(beta)};
  }
  template <class T>
  GdnParams<T> params(const Typed<T>& t, int chunk, double scale = 0.7) const {
    GdnParams<T> p;
    p.q = t.q.data(); p.k = t.k.data(); p.v = t.v.data(); p.g = t.g.data(); p.beta = t.beta.data();
    p.tokens = S; p.shape = GdnShape{H, dk, dv, gate, scale, chunk};
    return p;
  }
};

template <class T>
std::vector<double> widen(const std::vector<T>& x) { return std::vector<double>(x.begin(), x.end()); }

// Forward over all heads from per-head initial states; returns y and final states.
template <class T>
void run_forward(const GdnParams<T>& p, bool chunked, int64_t t0, int64_t t1, std::vector<T>& states, std::vector<T>& y) {
  const size_t sz = static_cast<size_t>(p.shape.dk) * p.shape.dv;
  for (int h = 0; h < p.shape.heads; ++h) {
    if (chunked) gdn_chunked_forward(p, h, t0, t1, states.data() + h * sz, y.data());
    else gdn_recurrent_forward(p, h, t0, t1, states.data() + h * sz, y.data());
  }
}

class GdnKernel : public ::testing::TestWithParam<GdnGate> {};

TEST_P(GdnKernel, ChunkedEqualsRecurrentDouble) {
  TREECP_SEED_TRACE;
  Rng rng = testing::test_rng(100);
  for (int64_t S : {1, 5, 64, 130}) {
    for (int chunk : {1, 7, 16, 64}) {
      Inputs in(S, 2, 8, 6, GetParam(), rng);
      auto t = in.as<double>();
      auto p = in.params(t, chunk);
      std::vector<double> s_rec = randn(2 * 8 * 6, rng, 0.3), s_chk = s_rec;
      std::vector<double> y_rec(S * 2 * 6), y_chk(S * 2 * 6);
      run_forward(p, false, 0, S, s_rec, y_rec);
      run_forward(p, true, 0, S, s_chk, y_chk);
      EXPECT_LT(max_error(y_rec, y_chk), 1e-12) << "S " << S << " chunk " << chunk;
      EXPECT_LT(max_error(s_rec, s_chk), 1e-12) << "S " << S << " chunk " << chunk;
    }
  }
}

TEST_P(GdnKernel, ChunkedFloatWithinFloatRecurrenceError) {
  const int64_t S = 200;
  TREECP_SEED_TRACE;
  Rng rng = testing::test_rng(77);
  Inputs in(S, 2, 16, 8, GetParam(), rng);
  auto td = in.as<double>();
  auto tf = in.as<float>();
  auto pd = in.params(td, 64);
  auto pf = in.params(tf, 64);
  std::vector<double> s_ref(2 * 16 * 8, 0.0), y_ref(S * 2 * 8);
  run_forward(pd, false, 0, S, s_ref, y_ref);
  std::vector<float> s_rec(2 * 16 * 8, 0.f), s_chk = s_rec, y_rec(S * 2 * 8), y_chk(S * 2 * 8);
  run_forward(pf, false, 0, S, s_rec, y_rec);
  run_forward(pf, true, 0, S, s_chk, y_chk);
  const double err_rec = max_error(widen(y_rec), y_ref);
  const double err_chk = max_error(widen(y_chk), y_ref);
  EXPECT_LE(err_chk, 4 * err_rec + 1e-5) << "recurrent float error " << err_rec;
  EXPECT_GT(max_error(y_ref, std::vector<double>(y_ref.size(), 0.0)), 0.1);  // not a vacuous comparison
}

TEST_P(GdnKernel, SummaryIsTheAffineMapOfTheRun) {
  const int64_t S = 150;
  const int dk = 8, dv = 5;
  TREECP_SEED_TRACE;
  Rng rng = testing::test_rng(9);
  Inputs in(S, 1, dk, dv, GetParam(), rng);
  auto t = in.as<double>();
  auto p = in.params(t, 32);
  std::vector<double> M(dk * dk), E(dk * dv);
  gdn_chunked_summary(p, 0, 10, 140, M.data(), E.data());
  for (int trial = 0; trial < 2; ++trial) {
    std::vector<double> s = randn(dk * dv, rng), y(S * dv), expect(dk * dv);
    gdn_apply(dk, dv, M.data(), E.data(), s.data(), expect.data());
    gdn_recurrent_forward(p, 0, 10, 140, s.data(), static_cast<double*>(nullptr));
    EXPECT_LT(max_error(s, expect), 1e-12);
  }
  // Composition: summary(a..c) = summary(b..c) ∘ summary(a..b); associativity over three parts.
  std::vector<double> M1(dk * dk), E1(dk * dv), M2 = M1, E2 = E1, M3 = M1, E3 = E1, Mc = M1, Ec = E1;
  gdn_chunked_summary(p, 0, 10, 33, M1.data(), E1.data());
  gdn_chunked_summary(p, 0, 33, 34, M2.data(), E2.data());
  gdn_chunked_summary(p, 0, 34, 140, M3.data(), E3.data());
  std::vector<double> Ml = M1, El = E1, Mr = M1, Er = E1;
  gdn_compose(dk, dv, M2.data(), E2.data(), M1.data(), E1.data(), Ml.data(), El.data());
  gdn_compose(dk, dv, M3.data(), E3.data(), Ml.data(), El.data(), Ml.data(), El.data());
  gdn_compose(dk, dv, M3.data(), E3.data(), M2.data(), E2.data(), Mr.data(), Er.data());
  gdn_compose(dk, dv, Mr.data(), Er.data(), M1.data(), E1.data(), Mr.data(), Er.data());
  EXPECT_LT(max_error(Ml, M), 1e-12);
  EXPECT_LT(max_error(El, E), 1e-12);
  EXPECT_LT(max_error(Mr, M), 1e-12);
  EXPECT_LT(max_error(Er, E), 1e-12);
}

// Loss J = Σ y·wy + Σ S_out·ws; gradients by both backward forms and by central differences.
TEST_P(GdnKernel, GradientsMatchFiniteDifferences) {
  const int64_t S = 23;
  const int H = 2, dk = 4, dv = 3;
  TREECP_SEED_TRACE;
  Rng rng = testing::test_rng(1234);
  Inputs in(S, H, dk, dv, GetParam(), rng);
  const size_t sz = static_cast<size_t>(dk) * dv;
  const std::vector<double> s_in = randn(H * sz, rng, 0.5);
  const std::vector<double> wy = randn(S * H * dv, rng), ws = randn(H * sz, rng);
  auto loss = [&](Inputs& x, const std::vector<double>& s0) {
    auto t = x.as<double>();
    auto p = x.params(t, 5);
    std::vector<double> s = s0, y(S * H * dv);
    run_forward(p, false, 0, S, s, y);
    double j = 0;
    for (size_t i = 0; i < y.size(); ++i) j += y[i] * wy[i];
    for (size_t i = 0; i < s.size(); ++i) j += s[i] * ws[i];
    return j;
  };
  auto t = in.as<double>();
  auto p = in.params(t, 5);
  struct G { std::vector<double> dq, dk, dv, dg, dbeta, ds; };
  auto grads = [&](bool chunked) {
    G g{std::vector<double>(t.q.size()), std::vector<double>(t.k.size()), std::vector<double>(t.v.size()),
        std::vector<double>(t.g.size()), std::vector<double>(t.beta.size()), ws};
    GdnGrads<double> gp{g.dq.data(), g.dk.data(), g.dv.data(), g.dg.data(), g.dbeta.data()};
    for (int h = 0; h < H; ++h) {
      if (chunked) gdn_chunked_backward(p, h, 0, S, s_in.data() + h * sz, wy.data(), g.ds.data() + h * sz, gp);
      else gdn_recurrent_backward(p, h, 0, S, s_in.data() + h * sz, wy.data(), g.ds.data() + h * sz, gp);
    }
    return g;
  };
  const G rec = grads(false), chk = grads(true);
  const double eps = 1e-6;
  auto fd_check = [&](std::vector<double> Inputs::*field, const std::vector<double>& analytic, const char* name) {
    for (size_t i = 0; i < analytic.size(); ++i) {
      Inputs xp = in, xm = in;
      (xp.*field)[i] += eps;
      (xm.*field)[i] -= eps;
      const double fd = (loss(xp, s_in) - loss(xm, s_in)) / (2 * eps);
      ASSERT_NEAR(analytic[i], fd, 1e-7 * (1 + std::abs(fd))) << name << "[" << i << "]";
    }
  };
  fd_check(&Inputs::q, rec.dq, "dq");
  fd_check(&Inputs::k, rec.dk, "dk");
  fd_check(&Inputs::v, rec.dv, "dv");
  fd_check(&Inputs::g, rec.dg, "dg");
  fd_check(&Inputs::beta, rec.dbeta, "dbeta");
  for (size_t i = 0; i < s_in.size(); ++i) {
    std::vector<double> sp = s_in, sm = s_in;
    sp[i] += eps;
    sm[i] -= eps;
    const double fd = (loss(in, sp) - loss(in, sm)) / (2 * eps);
    ASSERT_NEAR(rec.ds[i], fd, 1e-7 * (1 + std::abs(fd))) << "dS_in[" << i << "]";
  }
  EXPECT_LT(max_error(chk.dq, rec.dq), 1e-11);
  EXPECT_LT(max_error(chk.dk, rec.dk), 1e-11);
  EXPECT_LT(max_error(chk.dv, rec.dv), 1e-11);
  EXPECT_LT(max_error(chk.dg, rec.dg), 1e-11);
  EXPECT_LT(max_error(chk.dbeta, rec.dbeta), 1e-11);
  EXPECT_LT(max_error(chk.ds, rec.ds), 1e-11);
}

TEST_P(GdnKernel, StateOnlyBackwardMatchesFull) {
  const int64_t S = 40;
  TREECP_SEED_TRACE;
  Rng rng = testing::test_rng(3);
  Inputs in(S, 1, 6, 4, GetParam(), rng);
  auto t = in.as<double>();
  auto p = in.params(t, 16);
  const std::vector<double> s_in = randn(24, rng), dy = randn(S * 4, rng), ds_out = randn(24, rng);
  std::vector<double> a = ds_out, b = ds_out, dq(t.q.size());
  gdn_chunked_backward(p, 0, 0, S, s_in.data(), dy.data(), a.data(), GdnGrads<double>{});
  gdn_chunked_backward(p, 0, 0, S, s_in.data(), dy.data(), b.data(), GdnGrads<double>{dq.data()});
  EXPECT_LT(max_error(a, b), 1e-13);
}

// The layer's q/k normalisation: unit vectors out, its backward against central differences.
TEST(GdnKernelNorm, L2NormUnitRowsAndFiniteDifferences) {
  TREECP_SEED_TRACE;
  Rng rng = testing::test_rng(21);
  const int64_t groups = 5;
  const int dim = 6;
  const std::vector<double> x = randn(groups * dim, rng, 2.0), w = randn(groups * dim, rng);
  std::vector<double> y(x.size()), dx(x.size(), 0.0);
  l2norm_forward(x.data(), groups, dim, y.data());
  for (int64_t g = 0; g < groups; ++g) {
    double n = 0;
    for (int i = 0; i < dim; ++i) n += y[g * dim + i] * y[g * dim + i];
    EXPECT_NEAR(n, 1.0, 1e-6);
  }
  l2norm_backward(x.data(), w.data(), groups, dim, dx.data());
  auto loss = [&](const std::vector<double>& xx) {
    std::vector<double> yy(xx.size());
    l2norm_forward(xx.data(), groups, dim, yy.data());
    double j = 0;
    for (size_t i = 0; i < yy.size(); ++i) j += yy[i] * w[i];
    return j;
  };
  const double eps = 1e-6;
  for (size_t i = 0; i < x.size(); ++i) {
    std::vector<double> xp = x, xm = x;
    xp[i] += eps;
    xm[i] -= eps;
    EXPECT_NEAR(dx[i], (loss(xp) - loss(xm)) / (2 * eps), 1e-7) << "dx[" << i << "]";
  }
}

INSTANTIATE_TEST_SUITE_P(Gates, GdnKernel, ::testing::Values(GdnGate::Scalar, GdnGate::PerChannel),
                         [](const auto& info) { return info.param == GdnGate::Scalar ? "GDN" : "KDA"; });

}  // namespace
}  // namespace treecp
