// The Mamba-2 tests' own part of tests/common (single process and MPI): random layer inputs, the
// one-process tree reference built on the token recurrence in double, the flattened per-trajectory
// run, and the tolerance rule. Seeds, random trees and errors come from common/common.hpp, row
// slicing from runtime/row_map.hpp (rows_of).
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "kernels/cpu/mamba2.hpp"
#include "common/common.hpp"
#include "runtime/row_map.hpp"
#include "tree/row.hpp"

namespace treecp::testing {

// Mamba-2 inputs for a whole row (double), shaped like a real layer: dt > 0 (after softplus), A < 0,
// B and C scaled so that C·B stays O(1).
struct Mamba2Data {
  int64_t S = 0;
  int H = 0, P = 0, G = 0, N = 0;
  bool with_d = true;
  std::vector<double> x, dt, A, B, C, D, dy;
  int heads_per_group() const { return H / G; }
};

// `salt` salts the run's seed (common/common.hpp: TREECP_TEST_SEED=N replays a run).
inline Mamba2Data random_mamba2_data(int64_t S, int H, int P, int G, int N, bool with_d, uint64_t salt) {
  Mamba2Data d;
  d.S = S; d.H = H; d.P = P; d.G = G; d.N = N; d.with_d = with_d;
  Rng rng = test_rng(salt);
  std::normal_distribution<double> n01(0.0, 1.0);
  std::uniform_real_distribution<double> u01(0.0, 1.0);
  auto normal = [&](std::vector<double>& v, size_t n, double sd) {
    v.resize(n);
    for (auto& e : v) e = sd * n01(rng);
  };
  normal(d.x, static_cast<size_t>(S * H * P), 1.0);
  d.dt.resize(static_cast<size_t>(S * H));
  for (auto& e : d.dt) e = 0.02 + 0.5 * u01(rng);
  d.A.resize(static_cast<size_t>(H));
  for (auto& e : d.A) e = -(0.1 + 1.5 * u01(rng));
  normal(d.B, static_cast<size_t>(S * G * N), 1.0 / std::sqrt(static_cast<double>(N)));
  normal(d.C, static_cast<size_t>(S * G * N), 1.0);
  if (with_d) normal(d.D, static_cast<size_t>(H), 1.0);
  normal(d.dy, static_cast<size_t>(S * H * P), 1.0);
  return d;
}

// Typed copies of the rows a rank holds (all heads) and their Params.
template <class T>
struct Mamba2Buffers {
  std::vector<T> x, dt, A, B, C, D, dy;
  int64_t tokens = 0;
  Mamba2Params<T> params(const Mamba2Data& d, int chunk) const {
    Mamba2Params<T> p;
    p.x = x.data(); p.dt = dt.data(); p.A = A.data(); p.B = B.data(); p.C = C.data();
    p.D = d.with_d ? D.data() : nullptr;
    p.tokens = tokens; p.heads = d.H; p.head_dim = d.P; p.groups = d.G; p.state_dim = d.N;
    p.heads_per_group = d.heads_per_group(); p.chunk = chunk;
    return p;
  }
};

template <class T>
Mamba2Buffers<T> mamba2_buffers(const Mamba2Data& d, const std::vector<TokenRange>& ranges) {
  Mamba2Buffers<T> b;
  b.x = rows_of<T>(d.x, d.H * d.P, ranges);
  b.dt = rows_of<T>(d.dt, d.H, ranges);
  b.B = rows_of<T>(d.B, d.G * d.N, ranges);
  b.C = rows_of<T>(d.C, d.G * d.N, ranges);
  b.dy = rows_of<T>(d.dy, d.H * d.P, ranges);
  b.A.assign(d.A.begin(), d.A.end());
  b.D.assign(d.D.begin(), d.D.end());
  for (const TokenRange& r : ranges) b.tokens += r.size();
  return b;
}

struct Mamba2Result {
  std::vector<double> y, dx, ddt, dA, dB, dC, dD;
};

inline Mamba2Result zero_result(const Mamba2Data& d) {
  Mamba2Result r;
  r.y.assign(d.x.size(), 0.0); r.dx.assign(d.x.size(), 0.0); r.ddt.assign(d.dt.size(), 0.0);
  r.dA.assign(d.A.size(), 0.0); r.dB.assign(d.B.size(), 0.0); r.dC.assign(d.C.size(), 0.0);
  r.dD.assign(static_cast<size_t>(d.H), 0.0);
  return r;
}

// The tree by the token recurrence in one process (in double: the exact reference; in float: the
// same-precision reference of the tolerance rule): each segment starts from its parent's final state
// (zero for a root); the backward sums the children's incoming-state gradients.
template <class T = double>
Mamba2Result mamba2_tree_reference(const Row& row, const Mamba2Data& d) {
  const auto buf = mamba2_buffers<T>(d, {{0, d.S}});
  const Mamba2Params<T> p = buf.params(d, 1);
  const int64_t ssz = static_cast<int64_t>(d.N) * d.P, state = d.H * ssz;
  const int32_t n = row.num_segments();
  std::vector<std::vector<T>> s_in(static_cast<size_t>(n)), s_out(static_cast<size_t>(n));
  std::vector<T> y(d.x.size()), dx(d.x.size(), T(0)), ddt(d.dt.size(), T(0)), dA(d.A.size(), T(0)),
      dB(d.B.size(), T(0)), dC(d.C.size(), T(0)), dD(static_cast<size_t>(d.H), T(0));
  for (int32_t s = 0; s < n; ++s) {
    const int32_t par = row.parent(s);
    s_in[s] = par < 0 ? std::vector<T>(static_cast<size_t>(state), T(0)) : s_out[par];
    s_out[s] = s_in[s];
    for (int h = 0; h < d.H; ++h)
      mamba2_recurrent_forward(p, h, row.start(s), row.end(s), s_out[s].data() + h * ssz, y.data());
  }
  Mamba2Grads<T> g{dx.data(), ddt.data(), dA.data(), dB.data(), dC.data(), d.with_d ? dD.data() : nullptr};
  std::vector<std::vector<T>> ds(static_cast<size_t>(n), std::vector<T>(static_cast<size_t>(state), T(0)));
  for (int32_t s = n - 1; s >= 0; --s) {
    for (int h = 0; h < d.H; ++h)
      mamba2_recurrent_backward(p, h, row.start(s), row.end(s), s_in[s].data() + h * ssz, buf.dy.data(),
                                ds[s].data() + h * ssz, g);
    const int32_t par = row.parent(s);
    if (par >= 0)
      for (int64_t i = 0; i < state; ++i) ds[par][i] += ds[s][i];
  }
  auto w = [](const std::vector<T>& v) { return std::vector<double>(v.begin(), v.end()); };
  return {w(y), w(dx), w(ddt), w(dA), w(dB), w(dC), w(dD)};
}

// The same layer run trajectory by trajectory: every root-to-leaf path gathered into a plain
// sequence from a zero state (double recurrence). A token's output is taken from the first
// trajectory through it, and its dy is given to that trajectory alone, so the per-trajectory
// gradients summed over all copies of an input are the packed row's gradients.
inline Mamba2Result mamba2_flattened_reference(const Row& row, const Mamba2Data& d) {
  Mamba2Result r = zero_result(d);
  std::vector<uint8_t> seen(static_cast<size_t>(d.S), 0);
  const int64_t ssz = static_cast<int64_t>(d.N) * d.P;
  for (int32_t leaf : row.leaves()) {
    std::vector<TokenRange> path;
    for (int32_t a : row.ancestor_chain(leaf)) path.push_back({row.start(a), row.end(a)});
    Mamba2Buffers<double> b = mamba2_buffers<double>(d, path);
    std::vector<int64_t> token;  // physical id of each path position
    for (const TokenRange& t : path)
      for (int64_t i = t.begin; i < t.end; ++i) token.push_back(i);
    const int64_t L = static_cast<int64_t>(token.size());
    for (int64_t i = 0; i < L; ++i)
      if (seen[token[i]]) std::fill(b.dy.begin() + i * d.H * d.P, b.dy.begin() + (i + 1) * d.H * d.P, 0.0);
    const Mamba2Params<double> p = b.params(d, 1);
    std::vector<double> y(static_cast<size_t>(L * d.H * d.P)), dx(y.size(), 0.0),
        ddt(static_cast<size_t>(L * d.H), 0.0), dB(static_cast<size_t>(L * d.G * d.N), 0.0), dC(dB.size(), 0.0);
    Mamba2Grads<double> g{dx.data(), ddt.data(), r.dA.data(), dB.data(), dC.data(), d.with_d ? r.dD.data() : nullptr};
    for (int h = 0; h < d.H; ++h) {
      std::vector<double> S(static_cast<size_t>(ssz), 0.0), dS(static_cast<size_t>(ssz), 0.0);
      const std::vector<double> zero(static_cast<size_t>(ssz), 0.0);
      mamba2_recurrent_forward(p, h, 0, L, S.data(), y.data());
      mamba2_recurrent_backward(p, h, 0, L, zero.data(), b.dy.data(), dS.data(), g);
    }
    auto scatter = [&](const std::vector<double>& src, std::vector<double>& dst, int64_t w, bool add) {
      for (int64_t i = 0; i < L; ++i)
        for (int64_t k = 0; k < w; ++k) {
          double& e = dst[token[i] * w + k];
          e = add ? e + src[i * w + k] : (seen[token[i]] ? e : src[i * w + k]);
        }
    };
    scatter(y, r.y, d.H * d.P, false);
    scatter(dx, r.dx, d.H * d.P, true);
    scatter(ddt, r.ddt, d.H, true);
    scatter(dB, r.dB, d.G * d.N, true);
    scatter(dC, r.dC, d.G * d.N, true);
    for (int64_t t : token) seen[t] = 1;
  }
  return r;
}

// Every element of base.*field against central differences of loss(inputs) (a double).
template <class Loss>
void expect_finite_differences(const Mamba2Data& base, std::vector<double> Mamba2Data::*field,
                               const std::vector<double>& analytic, Loss loss, const char* name) {
  const double eps = 1e-6;
  ASSERT_EQ(analytic.size(), (base.*field).size()) << name;
  for (size_t i = 0; i < analytic.size(); ++i) {
    Mamba2Data xp = base, xm = base;
    (xp.*field)[i] += eps;
    (xm.*field)[i] -= eps;
    const double fd = (loss(xp) - loss(xm)) / (2 * eps);
    ASSERT_NEAR(analytic[i], fd, 1e-7 * (1 + std::abs(fd))) << name << "[" << i << "]";
  }
}

inline double max_abs_diff(const std::vector<double>& a, const std::vector<double>& b) { return max_error(a, b); }

template <class T>
std::vector<double> widen(const std::vector<T>& x) {
  return std::vector<double>(x.begin(), x.end());
}

// The numerics rule: |got - exact| ≤ k × |same-precision reference - exact| + atol × (1 + max|exact|).
inline double tolerance(double reference_error, const std::vector<double>& exact, double k = 4, double atol = 1e-6) {
  return k * reference_error + atol * (1 + max_abs(exact));
}

}  // namespace treecp::testing
