// The GDN/KDA and conv1d tests' own part of tests/common (single process and MPI): random inputs
// shaped like a real layer, the one-process tree references (the token recurrence; conv1d by explicit
// root-to-token paths), a rank's buffers cut from whole-row arrays, and a run of GDN CP over them.
#pragma once

#include <cmath>
#include <random>
#include <vector>

#include "common/common.hpp"
#include "comm/communicator.hpp"
#include "kernels/cpu/gdn.hpp"
#include "plan/gdn_plan.hpp"
#include "runtime/cpu_backend.hpp"
#include "runtime/gdn_cp.hpp"
#include "runtime/row_map.hpp"
#include "tree/row.hpp"

namespace treecp::testing {

// GDN/KDA inputs for a whole row (double), shaped like a real layer.
struct GdnData {
  int64_t S = 0;
  int H = 0, dk = 0, dv = 0;
  GdnGate gate = GdnGate::Scalar;
  std::vector<double> q, k, v, g, beta, dy;
  int64_t g_width() const { return gate == GdnGate::Scalar ? 1 : dk; }
  GdnShape shape(double scale, int chunk = 64) const { return {H, dk, dv, gate, scale, chunk}; }
};

inline GdnData random_gdn_data(int64_t S, int H, int dk, int dv, GdnGate gate, Rng& rng) {
  GdnData d;
  d.S = S; d.H = H; d.dk = dk; d.dv = dv; d.gate = gate;
  std::normal_distribution<double> n01(0.0, 1.0);
  std::uniform_real_distribution<double> u01(0.0, 1.0);
  auto unit_rows = [&](std::vector<double>& x, int w) {
    x.resize(static_cast<size_t>(S * H * w));
    for (auto& e : x) e = n01(rng);
    for (int64_t r = 0; r < S * H; ++r) {
      double nrm = 0;
      for (int i = 0; i < w; ++i) nrm += x[r * w + i] * x[r * w + i];
      for (int i = 0; i < w; ++i) x[r * w + i] /= std::sqrt(nrm);
    }
  };
  unit_rows(d.q, dk);
  unit_rows(d.k, dk);
  d.v.resize(static_cast<size_t>(S * H * dv));
  for (auto& e : d.v) e = n01(rng);
  d.g.resize(static_cast<size_t>(S * H * d.g_width()));
  for (auto& e : d.g) e = -0.5 * u01(rng);
  d.beta.resize(static_cast<size_t>(S * H));
  for (auto& e : d.beta) e = 0.05 + 0.9 * u01(rng);
  d.dy.resize(static_cast<size_t>(S * H * dv));
  for (auto& e : d.dy) e = n01(rng);
  return d;
}

// A rank's share of the inputs (also the CPU backend's buffers: std::vector<T>).
template <class T>
struct GdnBuffers {
  std::vector<T> q, k, v, g, beta, dy;
  GdnParams<T> params(const GdnShape& shape, int64_t tokens) const {
    GdnParams<T> p;
    p.q = q.data(); p.k = k.data(); p.v = v.data(); p.g = g.data(); p.beta = beta.data();
    p.tokens = tokens; p.shape = shape;
    return p;
  }
};

template <class T>
GdnBuffers<T> gdn_buffers(const GdnData& d, const std::vector<TokenRange>& ranges) {
  return {rows_of<T>(d.q, d.H * d.dk, ranges), rows_of<T>(d.k, d.H * d.dk, ranges),
          rows_of<T>(d.v, d.H * d.dv, ranges), rows_of<T>(d.g, d.H * d.g_width(), ranges),
          rows_of<T>(d.beta, d.H, ranges), rows_of<T>(d.dy, d.H * d.dv, ranges)};
}

// GDN CP (runtime/gdn_cp.hpp) on the CPU backend over this rank's buffers, forward and backward.
template <class T>
struct GdnRun {
  std::vector<T> y, dq, dk, dv, dg, dbeta;
};
template <class T>
GdnRun<T> run_gdn_cp(Communicator& comm, const Row& row, const GdnPlan& plan, const GdnShape& shape,
                     const GdnBuffers<T>& in) {
  CpuBackend<T> be;
  GdnCP<CpuBackend<T>> cp(plan, row, shape, comm, be);
  GdnRun<T> r{std::vector<T>(in.v.size()), std::vector<T>(in.q.size()), std::vector<T>(in.k.size()),
              std::vector<T>(in.v.size()), std::vector<T>(in.g.size()), std::vector<T>(in.beta.size())};
  cp.forward(in.q, in.k, in.v, in.g, in.beta, r.y);
  cp.backward(in.dy, r.dq, r.dk, r.dv, r.dg, r.dbeta);
  return r;
}

struct GdnReference {
  std::vector<double> y, dq, dk, dv, dg, dbeta;
};

// The tree by the token recurrence in one process: each segment starts from its parent's final
// state (zero for a root); the backward sums the children's incoming-state gradients into the parent.
inline GdnReference gdn_tree_reference(const Row& row, const GdnData& d, double scale, bool backward = true) {
  GdnParams<double> p;
  p.q = d.q.data(); p.k = d.k.data(); p.v = d.v.data(); p.g = d.g.data(); p.beta = d.beta.data();
  p.tokens = d.S; p.shape = d.shape(scale);
  const int64_t ssz = static_cast<int64_t>(d.dk) * d.dv, state = d.H * ssz;
  const int32_t n = row.num_segments();
  std::vector<std::vector<double>> s_in(static_cast<size_t>(n)), s_out(static_cast<size_t>(n));
  GdnReference ref;
  ref.y.assign(d.v.size(), 0.0);
  for (int32_t s = 0; s < n; ++s) {
    const int32_t par = row.parent(s);
    s_in[s] = par < 0 ? std::vector<double>(static_cast<size_t>(state), 0.0) : s_out[par];
    s_out[s] = s_in[s];
    for (int h = 0; h < d.H; ++h) gdn_recurrent_forward(p, h, row.start(s), row.end(s), s_out[s].data() + h * ssz, ref.y.data());
  }
  if (!backward) return ref;
  ref.dq.assign(d.q.size(), 0.0); ref.dk.assign(d.k.size(), 0.0); ref.dv.assign(d.v.size(), 0.0);
  ref.dg.assign(d.g.size(), 0.0); ref.dbeta.assign(d.beta.size(), 0.0);
  GdnGrads<double> gr{ref.dq.data(), ref.dk.data(), ref.dv.data(), ref.dg.data(), ref.dbeta.data()};
  std::vector<std::vector<double>> ds(static_cast<size_t>(n), std::vector<double>(static_cast<size_t>(state), 0.0));
  for (int32_t s = n - 1; s >= 0; --s) {
    for (int h = 0; h < d.H; ++h)
      gdn_recurrent_backward(p, h, row.start(s), row.end(s), s_in[s].data() + h * ssz, d.dy.data(), ds[s].data() + h * ssz, gr);
    const int32_t par = row.parent(s);
    if (par >= 0)
      for (int64_t i = 0; i < state; ++i) ds[par][i] += ds[s][i];
  }
  return ref;
}

// Conv1d over the tree by explicit root-to-token paths: z_t = bias + Σ_i w[K-1-i] x(path[-1-i]).
struct ConvReference {
  std::vector<double> y, dx, dw, db;
};

inline ConvReference conv_tree_reference(const Row& row, const std::vector<double>& x, const std::vector<double>& w,
                                         const std::vector<double>& b, int C, int K, bool silu,
                                         const std::vector<double>& dy) {
  ConvReference ref;
  const int64_t S = row.tokens();
  ref.y.assign(static_cast<size_t>(S * C), 0.0);
  ref.dx.assign(x.size(), 0.0);
  ref.dw.assign(w.size(), 0.0);
  ref.db.assign(static_cast<size_t>(C), 0.0);
  for (int32_t s = 0; s < row.num_segments(); ++s) {
    std::vector<int64_t> path;  // tokens of the root-to-s path before s
    for (int32_t a : row.ancestor_chain(s)) {
      if (a == s) break;
      for (int64_t t = row.start(a); t < row.end(a); ++t) path.push_back(t);
    }
    for (int64_t t = row.start(s); t < row.end(s); ++t) {
      path.push_back(t);
      for (int c = 0; c < C; ++c) {
        double z = b.empty() ? 0.0 : b[c];
        for (int i = 0; i < K && i < static_cast<int>(path.size()); ++i)
          z += w[c * K + K - 1 - i] * x[path[path.size() - 1 - i] * C + c];
        const double sg = 1.0 / (1.0 + std::exp(-z));
        ref.y[t * C + c] = silu ? z * sg : z;
        const double dz = silu ? dy[t * C + c] * sg * (1 + z * (1 - sg)) : dy[t * C + c];
        ref.db[c] += dz;
        for (int i = 0; i < K && i < static_cast<int>(path.size()); ++i) {
          const int64_t u = path[path.size() - 1 - i];
          ref.dx[u * C + c] += w[c * K + K - 1 - i] * dz;
          ref.dw[c * K + K - 1 - i] += x[u * C + c] * dz;
        }
      }
    }
  }
  return ref;
}

}  // namespace treecp::testing
