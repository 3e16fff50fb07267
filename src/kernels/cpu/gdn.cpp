#include "kernels/cpu/gdn.hpp"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/error.hpp"
#include "kernels/cpu/bf16_product.hpp"

namespace treecp {
namespace {

// Per-token, per-head views into the token-major arrays.
template <class T>
struct HeadView {
  const GdnParams<T>& p;
  int h;
  const T* q(int64_t t) const { return p.q + (t * p.shape.heads + h) * p.shape.dk; }
  const T* k(int64_t t) const { return p.k + (t * p.shape.heads + h) * p.shape.dk; }
  const T* v(int64_t t) const { return p.v + (t * p.shape.heads + h) * p.shape.dv; }
  T beta(int64_t t) const { return p.beta[t * p.shape.heads + h]; }
  // Log-decay of channel d at token t (the scalar gate broadcasts over channels).
  T g(int64_t t, int d) const {
    return p.shape.gate == GdnGate::Scalar ? p.g[t * p.shape.heads + h] : p.g[(t * p.shape.heads + h) * p.shape.dk + d];
  }
  int64_t qk_at(int64_t t) const { return (t * p.shape.heads + h) * p.shape.dk; }
  int64_t v_at(int64_t t) const { return (t * p.shape.heads + h) * p.shape.dv; }
  int64_t g_at(int64_t t, int d) const {
    return p.shape.gate == GdnGate::Scalar ? t * p.shape.heads + h : (t * p.shape.heads + h) * p.shape.dk + d;
  }
};

template <class T>
void check_run(const GdnParams<T>& p, int h, int64_t t0, int64_t t1) {
  require(h >= 0 && h < p.shape.heads, "gdn: head ", h, " out of range [0, ", p.shape.heads, ")");
  require(0 <= t0 && t0 <= t1 && t1 <= p.tokens, "gdn: run [", t0, ", ", t1, ") outside [0, ", p.tokens, ")");
}

// One chunk of one head, prepared independently of its incoming state.
template <class T>
struct Chunk {
  int c = 0, dk = 0, dv = 0;
  bool scalar = true;
  std::vector<T> G;         // [c][dk] inclusive cumulative log-decay
  std::vector<T> eg, er;    // [c][dk]: e^{G_i}, e^{G_last - G_i}
  std::vector<T> kst, qst;  // [c][dk]: e^{G_i} ⊙ k_i, e^{G_i} ⊙ q_i
  std::vector<T> r;         // [c][dk]: e^{G_last - G_j} ⊙ k_j
  std::vector<T> egl;       // [dk]: e^{G_last}
  std::vector<T> dec;       // per-channel gates only: [c][c][dk], e^{G_i[d]-G_j[d]} for j <= i
  std::vector<T> P, C;      // [c][c]: strictly lower / lower with diagonal
  std::vector<T> U, W;      // [c][dv], [c][dk]
  std::vector<T> b;         // [c] beta

  // e^{G_i[d] - G_j[d]}, j <= i (never above 1 for non-positive gates: no overflow).
  T decay(int i, int j, int d) const {
    return scalar ? T(std::exp(G[i * dk] - G[j * dk])) : dec[(static_cast<size_t>(i) * c + j) * dk + d];
  }

  void prepare(const HeadView<T>& hv, int64_t t, int len, bool with_q) {
    c = len;
    dk = hv.p.shape.dk;
    dv = hv.p.shape.dv;
    scalar = hv.p.shape.gate == GdnGate::Scalar;
    const size_t cd = static_cast<size_t>(c) * dk;
    G.resize(cd);
    eg.resize(cd);
    er.resize(cd);
    for (int i = 0; i < c; ++i)
      for (int d = 0; d < dk; ++d) G[i * dk + d] = (i > 0 ? G[(i - 1) * dk + d] : T(0)) + hv.g(t + i, d);
    if (scalar) {
      // One exponential per token, broadcast over the channels.
      for (int i = 0; i < c; ++i) {
        const T e = std::exp(G[i * dk]), x = std::exp(G[(c - 1) * dk] - G[i * dk]);
        std::fill(eg.begin() + i * dk, eg.begin() + (i + 1) * dk, e);
        std::fill(er.begin() + i * dk, er.begin() + (i + 1) * dk, x);
      }
    } else {
      for (int i = 0; i < c; ++i)
        for (int d = 0; d < dk; ++d) {
          eg[i * dk + d] = std::exp(G[i * dk + d]);
          er[i * dk + d] = std::exp(G[(c - 1) * dk + d] - G[i * dk + d]);
        }
    }
    egl.assign(eg.begin() + (c - 1) * dk, eg.begin() + c * dk);
    kst.resize(cd);
    r.resize(cd);
    b.resize(static_cast<size_t>(c));
    for (int i = 0; i < c; ++i) {
      const T* ki = hv.k(t + i);
      b[i] = hv.beta(t + i);
      for (int d = 0; d < dk; ++d) {
        kst[i * dk + d] = eg[i * dk + d] * ki[d];
        r[i * dk + d] = er[i * dk + d] * ki[d];
      }
    }
    if (with_q) {
      qst.resize(cd);
      for (int i = 0; i < c; ++i) {
        const T* qi = hv.q(t + i);
        for (int d = 0; d < dk; ++d) qst[i * dk + d] = eg[i * dk + d] * qi[d];
      }
    }
    fill_pairs(hv, t, with_q);
    // Forward substitution with L = I + diag(β) P: row i = β_i (x_i - Σ_{j<i} P[i,j] row j).
    U.resize(static_cast<size_t>(c) * dv);
    W.resize(cd);
    for (int i = 0; i < c; ++i) {
      const T* vi = hv.v(t + i);
      T* __restrict ui = U.data() + i * dv;
      T* __restrict wi = W.data() + i * dk;
      for (int e = 0; e < dv; ++e) ui[e] = vi[e];
      for (int d = 0; d < dk; ++d) wi[d] = kst[i * dk + d];
      for (int j = 0; j < i; ++j) {
        const T pij = P[i * c + j];
        const T* __restrict uj = U.data() + j * dv;
        const T* __restrict wj = W.data() + j * dk;
        for (int e = 0; e < dv; ++e) ui[e] -= pij * uj[e];
        for (int d = 0; d < dk; ++d) wi[d] -= pij * wj[d];
      }
      for (int e = 0; e < dv; ++e) ui[e] *= b[i];
      for (int d = 0; d < dk; ++d) wi[d] *= b[i];
    }
  }

  // P (keys against keys, j < i) and, with q, C (queries against keys, j <= i); per-channel gates
  // keep their pairwise decays for the backward.
  void fill_pairs(const HeadView<T>& hv, int64_t t, bool with_q) {
    P.assign(static_cast<size_t>(c) * c, T(0));
    if (with_q) C.assign(static_cast<size_t>(c) * c, T(0));
    if (!scalar) dec.resize(static_cast<size_t>(c) * c * dk);
    for (int i = 0; i < c; ++i) {
      const T* __restrict ki = hv.k(t + i);
      const T* __restrict qi = hv.q(t + i);
      const T* __restrict gi = G.data() + i * dk;
      for (int j = 0; j <= i; ++j) {
        if (j == i && !with_q) break;
        const T* __restrict kj = hv.k(t + j);
        T pk = 0, pq = 0;
        if (scalar) {
          for (int d = 0; d < dk; ++d) pk += ki[d] * kj[d];
          if (with_q)
            for (int d = 0; d < dk; ++d) pq += qi[d] * kj[d];
          const T e = std::exp(gi[0] - G[j * dk]);
          pk *= e;
          pq *= e;
        } else {
          T* __restrict dij = dec.data() + (static_cast<size_t>(i) * c + j) * dk;
          const T* __restrict gj = G.data() + j * dk;
          for (int d = 0; d < dk; ++d) dij[d] = std::exp(gi[d] - gj[d]);
          for (int d = 0; d < dk; ++d) pk += ki[d] * kj[d] * dij[d];
          if (with_q)
            for (int d = 0; d < dk; ++d) pq += qi[d] * kj[d] * dij[d];
        }
        if (j < i) P[i * c + j] = pk;
        if (with_q) C[i * c + j] = pq;
      }
    }
  }
};

// D = U - W S  ([c][dv]).
template <class T>
void chunk_delta(const Chunk<T>& ch, const T* S, std::vector<T>& D) {
  const int c = ch.c, dk = ch.dk, dv = ch.dv;
  D.assign(ch.U.begin(), ch.U.end());
  for (int i = 0; i < c; ++i)
    for (int d = 0; d < dk; ++d) {
      const T w = ch.W[i * dk + d];
      if (w == T(0)) continue;
      for (int e = 0; e < dv; ++e) D[i * dv + e] -= w * S[d * dv + e];
    }
}

// S <- diag(e^{G_last}) S + Rᵀ D.
template <class T>
void chunk_advance(const Chunk<T>& ch, const std::vector<T>& D, T* S) {
  const int c = ch.c, dk = ch.dk, dv = ch.dv;
  for (int d = 0; d < dk; ++d) {
    T* row = S + d * dv;
    for (int e = 0; e < dv; ++e) row[e] *= ch.egl[d];
    for (int j = 0; j < c; ++j) {
      const T rj = ch.r[j * dk + d];
      if (rj == T(0)) continue;
      for (int e = 0; e < dv; ++e) row[e] += rj * D[j * dv + e];
    }
  }
}

// Y = scale ((e^G ⊙ Q) S + C D), written to y[t + i][h][:].
template <class T>
void chunk_output(const Chunk<T>& ch, const HeadView<T>& hv, int64_t t, const T* S, const std::vector<T>& D, T* y) {
  const int c = ch.c, dk = ch.dk, dv = ch.dv;
  std::vector<T> row(static_cast<size_t>(dv));
  for (int i = 0; i < c; ++i) {
    std::fill(row.begin(), row.end(), T(0));
    for (int d = 0; d < dk; ++d) {
      const T qd = ch.qst[i * dk + d];
      if (qd == T(0)) continue;
      for (int e = 0; e < dv; ++e) row[e] += qd * S[d * dv + e];
    }
    for (int j = 0; j <= i; ++j) {
      const T cij = ch.C[i * c + j];
      for (int e = 0; e < dv; ++e) row[e] += cij * D[j * dv + e];
    }
    T* yi = y + hv.v_at(t + i);
    for (int e = 0; e < dv; ++e) yi[e] = hv.p.scale() * row[e];
  }
}

}  // namespace

template <class T>
void gdn_check_params(const GdnParams<T>& p) {
  p.shape.validate();
  require(p.tokens >= 0, "gdn: tokens must be >= 0, got ", p.tokens);
  require(p.tokens == 0 || (p.q && p.k && p.v && p.g && p.beta), "gdn: q, k, v, g and beta must be given");
}

template <class T>
void gdn_recurrent_forward(const GdnParams<T>& p, int h, int64_t t0, int64_t t1, T* S, T* y) {
  check_run(p, h, t0, t1);
  const HeadView<T> hv{p, h};
  const int dk = p.shape.dk, dv = p.shape.dv;
  std::vector<T> pred(static_cast<size_t>(dv));
  for (int64_t t = t0; t < t1; ++t) {
    const T* k = hv.k(t);
    const T* v = hv.v(t);
    const T b = hv.beta(t);
    for (int d = 0; d < dk; ++d) {
      const T a = std::exp(hv.g(t, d));
      for (int e = 0; e < dv; ++e) S[d * dv + e] *= a;
    }
    std::fill(pred.begin(), pred.end(), T(0));
    for (int d = 0; d < dk; ++d)
      for (int e = 0; e < dv; ++e) pred[e] += S[d * dv + e] * k[d];
    for (int e = 0; e < dv; ++e) pred[e] = b * (v[e] - pred[e]);  // delta
    for (int d = 0; d < dk; ++d)
      for (int e = 0; e < dv; ++e) S[d * dv + e] += k[d] * pred[e];
    if (y) {
      const T* q = hv.q(t);
      T* yt = y + hv.v_at(t);
      for (int e = 0; e < dv; ++e) {
        T acc = 0;
        for (int d = 0; d < dk; ++d) acc += S[d * dv + e] * q[d];
        yt[e] = p.scale() * acc;
      }
    }
  }
}

template <class T>
void gdn_recurrent_backward(const GdnParams<T>& p, int h, int64_t t0, int64_t t1, const T* state_in, const T* dy,
                            T* dS, const GdnGrads<T>& gr) {
  check_run(p, h, t0, t1);
  const HeadView<T> hv{p, h};
  const int dk = p.shape.dk, dv = p.shape.dv;
  const size_t sz = static_cast<size_t>(dk) * dv;
  const int64_t n = t1 - t0;
  // states[i] = state before token t0 + i; states[n] = final.
  std::vector<T> states(static_cast<size_t>(n + 1) * sz);
  std::copy(state_in, state_in + sz, states.begin());
  for (int64_t i = 0; i < n; ++i) {
    std::copy(states.begin() + i * sz, states.begin() + (i + 1) * sz, states.begin() + (i + 1) * sz);
    gdn_recurrent_forward(p, h, t0 + i, t0 + i + 1, states.data() + (i + 1) * sz, static_cast<T*>(nullptr));
  }
  std::vector<T> Sp(sz), ddelta(static_cast<size_t>(dv)), dpred(static_cast<size_t>(dv)), pred(static_cast<size_t>(dv));
  std::vector<T> a(static_cast<size_t>(dk));
  for (int64_t i = n - 1; i >= 0; --i) {
    const int64_t t = t0 + i;
    const T* S0 = states.data() + i * sz;
    const T* S1 = states.data() + (i + 1) * sz;
    const T* q = hv.q(t);
    const T* k = hv.k(t);
    const T* v = hv.v(t);
    const T b = hv.beta(t);
    const T* dyt = dy + hv.v_at(t);
    for (int d = 0; d < dk; ++d) a[d] = std::exp(hv.g(t, d));
    for (int d = 0; d < dk; ++d)
      for (int e = 0; e < dv; ++e) Sp[d * dv + e] = a[d] * S0[d * dv + e];
    std::fill(pred.begin(), pred.end(), T(0));
    for (int d = 0; d < dk; ++d)
      for (int e = 0; e < dv; ++e) pred[e] += Sp[d * dv + e] * k[d];
    // y = scale S1ᵀ q
    if (gr.dq) {
      for (int d = 0; d < dk; ++d) {
        T acc = 0;
        for (int e = 0; e < dv; ++e) acc += S1[d * dv + e] * dyt[e];
        gr.dq[hv.qk_at(t) + d] += p.scale() * acc;
      }
    }
    for (int d = 0; d < dk; ++d)
      for (int e = 0; e < dv; ++e) dS[d * dv + e] += p.scale() * q[d] * dyt[e];
    // S1 = Sp + k δᵀ
    std::fill(ddelta.begin(), ddelta.end(), T(0));
    for (int d = 0; d < dk; ++d)
      for (int e = 0; e < dv; ++e) ddelta[e] += dS[d * dv + e] * k[d];
    T dbeta = 0;
    for (int e = 0; e < dv; ++e) {
      const T delta = b * (v[e] - pred[e]);
      dbeta += ddelta[e] * (v[e] - pred[e]);
      dpred[e] = -b * ddelta[e];
      if (gr.dv) gr.dv[hv.v_at(t) + e] += b * ddelta[e];
      if (gr.dk)
        for (int d = 0; d < dk; ++d) gr.dk[hv.qk_at(t) + d] += dS[d * dv + e] * delta;
    }
    if (gr.dbeta) gr.dbeta[t * p.shape.heads + h] += dbeta;
    // δ = β (v - Spᵀ k): dSp += k dpredᵀ, dk += Sp dpred
    for (int d = 0; d < dk; ++d) {
      T acc = 0;
      for (int e = 0; e < dv; ++e) {
        acc += Sp[d * dv + e] * dpred[e];
        dS[d * dv + e] += k[d] * dpred[e];
      }
      if (gr.dk) gr.dk[hv.qk_at(t) + d] += acc;
    }
    // Sp = diag(a) S0
    for (int d = 0; d < dk; ++d) {
      T da = 0;
      for (int e = 0; e < dv; ++e) {
        da += dS[d * dv + e] * S0[d * dv + e];
        dS[d * dv + e] *= a[d];
      }
      if (gr.dg) gr.dg[hv.g_at(t, d)] += da * a[d];
    }
  }
}

template <class T>
void gdn_chunked_forward(const GdnParams<T>& p, int h, int64_t t0, int64_t t1, T* S, T* y) {
  check_run(p, h, t0, t1);
  const HeadView<T> hv{p, h};
  Chunk<T> ch;
  std::vector<T> D;
  for (int64_t t = t0; t < t1; t += p.shape.chunk) {
    const int len = static_cast<int>(std::min<int64_t>(p.shape.chunk, t1 - t));
    ch.prepare(hv, t, len, y != nullptr);
    chunk_delta(ch, S, D);
    if (y) chunk_output(ch, hv, t, S, D, y);
    chunk_advance(ch, D, S);
  }
}

template <class T>
void gdn_chunked_summary(const GdnParams<T>& p, int h, int64_t t0, int64_t t1, T* M, T* E) {
  check_run(p, h, t0, t1);
  const HeadView<T> hv{p, h};
  const int dk = p.shape.dk, dv = p.shape.dv;
  std::fill(M, M + static_cast<size_t>(dk) * dk, T(0));
  for (int d = 0; d < dk; ++d) M[d * dk + d] = 1;
  std::fill(E, E + static_cast<size_t>(dk) * dv, T(0));
  Chunk<T> ch;
  std::vector<T> WM;
  std::vector<T> D;
  for (int64_t t = t0; t < t1; t += p.shape.chunk) {
    const int len = static_cast<int>(std::min<int64_t>(p.shape.chunk, t1 - t));
    ch.prepare(hv, t, len, false);
    // The running map (M, E) is the state S = M S_in + E: advance both parts through the chunk,
    // the linear part with U = 0 (D_M = -W M) and the affine part as usual (D_E = U - W E).
    WM.assign(static_cast<size_t>(len) * dk, T(0));
    for (int i = 0; i < len; ++i)
      for (int d = 0; d < dk; ++d) {
        const T w = ch.W[i * dk + d];
        if (w == T(0)) continue;
        for (int f = 0; f < dk; ++f) WM[i * dk + f] -= w * M[d * dk + f];
      }
    chunk_delta(ch, E, D);
    for (int d = 0; d < dk; ++d) {
      T* mrow = M + d * dk;
      T* erow = E + d * dv;
      for (int f = 0; f < dk; ++f) mrow[f] *= ch.egl[d];
      for (int e = 0; e < dv; ++e) erow[e] *= ch.egl[d];
      for (int j = 0; j < len; ++j) {
        const T rj = ch.r[j * dk + d];
        if (rj == T(0)) continue;
        for (int f = 0; f < dk; ++f) mrow[f] += rj * WM[j * dk + f];
        for (int e = 0; e < dv; ++e) erow[e] += rj * D[j * dv + e];
      }
    }
  }
}

template <class T>
void gdn_chunked_backward(const GdnParams<T>& p, int h, int64_t t0, int64_t t1, const T* state_in, const T* dy,
                          T* dS, const GdnGrads<T>& gr) {
  check_run(p, h, t0, t1);
  const HeadView<T> hv{p, h};
  const int dk = p.shape.dk, dv = p.shape.dv;
  const size_t sz = static_cast<size_t>(dk) * dv;
  const int64_t nchunks = (t1 - t0 + p.shape.chunk - 1) / p.shape.chunk;
  // Chunk-start states, recomputed (the forward keeps none).
  std::vector<T> starts(static_cast<size_t>(nchunks) * sz);
  {
    std::vector<T> S(state_in, state_in + sz);
    for (int64_t c = 0; c < nchunks; ++c) {
      std::copy(S.begin(), S.end(), starts.begin() + c * sz);
      const int64_t t = t0 + c * p.shape.chunk;
      gdn_chunked_forward(p, h, t, std::min(t1, t + p.shape.chunk), S.data(), static_cast<T*>(nullptr));
    }
  }
  const bool params = gr.any();
  Chunk<T> ch;
  std::vector<T> D, dD, dW, dX, dZ, dG, dSe(sz), dP, dC, tmp;
  for (int64_t c = nchunks - 1; c >= 0; --c) {
    const int64_t t = t0 + c * p.shape.chunk;
    const int n = static_cast<int>(std::min<int64_t>(p.shape.chunk, t1 - t));
    const T* S0 = starts.data() + c * sz;
    ch.prepare(hv, t, n, true);
    chunk_delta(ch, S0, D);
    std::copy(dS, dS + sz, dSe.begin());
    // dD = scale Cᵀ dY + R dS_end
    dD.assign(static_cast<size_t>(n) * dv, T(0));
    for (int j = 0; j < n; ++j) {
      T* row = dD.data() + j * dv;
      for (int i = j; i < n; ++i) {
        const T cij = p.scale() * ch.C[i * n + j];
        const T* dyi = dy + hv.v_at(t + i);
        for (int e = 0; e < dv; ++e) row[e] += cij * dyi[e];
      }
      for (int d = 0; d < dk; ++d) {
        const T rj = ch.r[j * dk + d];
        for (int e = 0; e < dv; ++e) row[e] += rj * dSe[d * dv + e];
      }
    }
    // dS_start = diag(e^{G_last}) dS_end + scale Qstᵀ dY - Wᵀ dD
    for (int d = 0; d < dk; ++d)
      for (int e = 0; e < dv; ++e) dS[d * dv + e] = ch.egl[d] * dSe[d * dv + e];
    for (int i = 0; i < n; ++i) {
      const T* dyi = dy + hv.v_at(t + i);
      for (int d = 0; d < dk; ++d) {
        const T qd = p.scale() * ch.qst[i * dk + d];
        const T wd = ch.W[i * dk + d];
        for (int e = 0; e < dv; ++e) dS[d * dv + e] += qd * dyi[e] - wd * dD[i * dv + e];
      }
    }
    if (!params) continue;

    dG.assign(static_cast<size_t>(n) * dk, T(0));  // dL/dG_i[d]
    std::vector<T>& dKst = tmp;
    dKst.assign(static_cast<size_t>(n) * dk, T(0));
    // dQst_i = scale S0 dY_i -> dq, dG;   dR_j = dS_end D_j -> dk, dG
    for (int i = 0; i < n; ++i) {
      const T* dyi = dy + hv.v_at(t + i);
      const T* qi = hv.q(t + i);
      const T* ki = hv.k(t + i);
      for (int d = 0; d < dk; ++d) {
        T dq = 0, dr = 0;
        for (int e = 0; e < dv; ++e) {
          dq += S0[d * dv + e] * dyi[e];
          dr += dSe[d * dv + e] * D[i * dv + e];
        }
        dq *= p.scale();
        const T eg = ch.eg[i * dk + d];
        if (gr.dq) gr.dq[hv.qk_at(t + i) + d] += eg * dq;
        dG[i * dk + d] += dq * eg * qi[d];
        const T er = ch.er[i * dk + d];
        if (gr.dk) gr.dk[hv.qk_at(t + i) + d] += er * dr;
        const T rr = dr * er * ki[d];
        dG[(n - 1) * dk + d] += rr;
        dG[i * dk + d] -= rr;
      }
    }
    // The decay of S_start: dG_last[d] += Σ_e dS_end[d,e] e^{G_last[d]} S0[d,e]
    for (int d = 0; d < dk; ++d) {
      T acc = 0;
      for (int e = 0; e < dv; ++e) acc += dSe[d * dv + e] * S0[d * dv + e];
      dG[(n - 1) * dk + d] += acc * ch.egl[d];
    }
    // dC[i,j] = scale dY_i · D_j (j <= i)
    dC.assign(static_cast<size_t>(n) * n, T(0));
    for (int i = 0; i < n; ++i) {
      const T* dyi = dy + hv.v_at(t + i);
      for (int j = 0; j <= i; ++j) {
        T acc = 0;
        for (int e = 0; e < dv; ++e) acc += dyi[e] * D[j * dv + e];
        dC[i * n + j] = p.scale() * acc;
      }
    }
    // dU = dD, dW = -dD S0ᵀ; then Lᵀ dX = dU, Lᵀ dZ = dW by back substitution
    // (Lᵀ[j,i] = β_i P[i,j] for i > j).
    dW.assign(static_cast<size_t>(n) * dk, T(0));
    for (int i = 0; i < n; ++i)
      for (int d = 0; d < dk; ++d) {
        T acc = 0;
        for (int e = 0; e < dv; ++e) acc += dD[i * dv + e] * S0[d * dv + e];
        dW[i * dk + d] = -acc;
      }
    dX = dD;
    dZ = dW;
    for (int j = n - 1; j >= 0; --j) {
      for (int i = j + 1; i < n; ++i) {
        const T lij = ch.b[i] * ch.P[i * n + j];
        if (lij == T(0)) continue;
        for (int e = 0; e < dv; ++e) dX[j * dv + e] -= lij * dX[i * dv + e];
        for (int d = 0; d < dk; ++d) dZ[j * dk + d] -= lij * dZ[i * dk + d];
      }
    }
    // dL[i,j] = -(dX_i·U_j + dZ_i·W_j) for j < i; L = I + diag(β) P
    dP.assign(static_cast<size_t>(n) * n, T(0));
    std::vector<T> dbeta(static_cast<size_t>(n), T(0));
    for (int i = 0; i < n; ++i)
      for (int j = 0; j < i; ++j) {
        T acc = 0;
        for (int e = 0; e < dv; ++e) acc += dX[i * dv + e] * ch.U[j * dv + e];
        for (int d = 0; d < dk; ++d) acc += dZ[i * dk + d] * ch.W[j * dk + d];
        const T dl = -acc;
        dP[i * n + j] = ch.b[i] * dl;
        dbeta[i] += dl * ch.P[i * n + j];
      }
    // X = diag(β) V, Z = diag(β) Kst
    for (int i = 0; i < n; ++i) {
      const T* vi = hv.v(t + i);
      const T* ki = hv.k(t + i);
      for (int e = 0; e < dv; ++e) {
        dbeta[i] += dX[i * dv + e] * vi[e];
        if (gr.dv) gr.dv[hv.v_at(t + i) + e] += ch.b[i] * dX[i * dv + e];
      }
      for (int d = 0; d < dk; ++d) {
        dbeta[i] += dZ[i * dk + d] * ch.kst[i * dk + d];
        const T dkst = ch.b[i] * dZ[i * dk + d];
        const T eg = ch.eg[i * dk + d];
        if (gr.dk) gr.dk[hv.qk_at(t + i) + d] += eg * dkst;
        dG[i * dk + d] += dkst * eg * ki[d];
      }
      if (gr.dbeta) gr.dbeta[(t + i) * p.shape.heads + h] += dbeta[i];
    }
    // P[i,j] and C[i,j] = Σ_d x_i[d] k_j[d] e^{G_i[d]-G_j[d]}
    for (int i = 0; i < n; ++i) {
      const T* qi = hv.q(t + i);
      const T* ki = hv.k(t + i);
      for (int j = 0; j <= i; ++j) {
        const T dp = j < i ? dP[i * n + j] : T(0);
        const T dc = dC[i * n + j];
        if (dp == T(0) && dc == T(0)) continue;
        const T* kj = hv.k(t + j);
        const T ex_scalar = ch.scalar ? ch.decay(i, j, 0) : T(0);
        for (int d = 0; d < dk; ++d) {
          const T ex = ch.scalar ? ex_scalar : ch.decay(i, j, d);
          const T tp = dp * ex, tc = dc * ex;
          if (gr.dk) {
            gr.dk[hv.qk_at(t + i) + d] += tp * kj[d];
            gr.dk[hv.qk_at(t + j) + d] += tp * ki[d] + tc * qi[d];
          }
          if (gr.dq) gr.dq[hv.qk_at(t + i) + d] += tc * kj[d];
          const T dg = (tp * ki[d] + tc * qi[d]) * kj[d];
          dG[i * dk + d] += dg;
          dG[j * dk + d] -= dg;
        }
      }
    }
    // G_i = Σ_{s<=i} g_s: dg_s = Σ_{i>=s} dG_i (a scalar gate sums its channels)
    if (gr.dg) {
      for (int d = 0; d < dk; ++d) {
        T acc = 0;
        for (int i = n - 1; i >= 0; --i) {
          acc += dG[i * dk + d];
          gr.dg[hv.g_at(t + i, d)] += acc;
        }
      }
    }
  }
}

template <class T>
void gdn_compose(int dk, int dv, const T* MB, const T* EB, const T* MA, const T* EA, T* M, T* E) {
  std::vector<T> m(static_cast<size_t>(dk) * dk, T(0)), e(EB, EB + static_cast<size_t>(dk) * dv);
  for (int i = 0; i < dk; ++i)
    for (int l = 0; l < dk; ++l) {
      const T b = MB[i * dk + l];
      if (b == T(0)) continue;
      for (int j = 0; j < dk; ++j) m[i * dk + j] += b * MA[l * dk + j];
      for (int j = 0; j < dv; ++j) e[i * dv + j] += b * EA[l * dv + j];
    }
  std::copy(m.begin(), m.end(), M);
  std::copy(e.begin(), e.end(), E);
}

template <class T>
void gdn_apply(int dk, int dv, const T* M, const T* E, const T* s, T* out) {
  for (int i = 0; i < dk; ++i) {
    T* row = out + i * dv;
    std::copy(E + i * dv, E + (i + 1) * dv, row);
    for (int l = 0; l < dk; ++l) {
      const T m = M[i * dk + l];
      if (m == T(0)) continue;
      for (int j = 0; j < dv; ++j) row[j] += m * s[l * dv + j];
    }
  }
}

template <class T>
void gdn_apply_transposed(int dk, int dv, const T* M, const T* a, const T* ds, T* out) {
  std::copy(a, a + static_cast<size_t>(dk) * dv, out);
  for (int l = 0; l < dk; ++l)
    for (int i = 0; i < dk; ++i) {
      const T m = M[l * dk + i];  // (Mᵀ)[i][l]
      if (m == T(0)) continue;
      for (int j = 0; j < dv; ++j) out[i * dv + j] += m * ds[l * dv + j];
    }
}

template <class T>
void l2norm_forward(const T* x, int64_t groups, int dim, T* y) {
  for (int64_t g = 0; g < groups; ++g) {
    const T* xi = x + g * dim;
    T ss = 0;
    for (int i = 0; i < dim; ++i) ss += xi[i] * xi[i];
    const T inv = T(1) / std::sqrt(ss + static_cast<T>(kL2NormEps));
    for (int i = 0; i < dim; ++i) y[g * dim + i] = xi[i] * inv;
  }
}

template <class T>
void l2norm_backward(const T* x, const T* dy, int64_t groups, int dim, T* dx) {
  for (int64_t g = 0; g < groups; ++g) {
    const T* xi = x + g * dim;
    const T* gi = dy + g * dim;
    T ss = 0, xg = 0;
    for (int i = 0; i < dim; ++i) {
      ss += xi[i] * xi[i];
      xg += xi[i] * gi[i];
    }
    const T inv = T(1) / std::sqrt(ss + static_cast<T>(kL2NormEps));
    // y = x inv: dJ/dx = inv (dy - y (y·dy)) = inv dy - x inv³ (x·dy)
    const T c = xg * inv * inv * inv;
    for (int i = 0; i < dim; ++i) dx[g * dim + i] += inv * gi[i] - c * xi[i];
  }
}

#define TREECP_GDN_INSTANTIATE(T)                                                                             \
  template void gdn_check_params<T>(const GdnParams<T>&);                                                   \
  template void gdn_recurrent_forward<T>(const GdnParams<T>&, int, int64_t, int64_t, T*, T*);               \
  template void gdn_recurrent_backward<T>(const GdnParams<T>&, int, int64_t, int64_t, const T*, const T*, T*, \
                                          const GdnGrads<T>&);                                              \
  template void gdn_chunked_forward<T>(const GdnParams<T>&, int, int64_t, int64_t, T*, T*);                 \
  template void gdn_chunked_backward<T>(const GdnParams<T>&, int, int64_t, int64_t, const T*, const T*, T*,   \
                                        const GdnGrads<T>&);                                                \
  template void gdn_chunked_summary<T>(const GdnParams<T>&, int, int64_t, int64_t, T*, T*);                 \
  template void gdn_compose<T>(int, int, const T*, const T*, const T*, const T*, T*, T*);                   \
  template void gdn_apply<T>(int, int, const T*, const T*, const T*, T*);                                   \
  template void gdn_apply_transposed<T>(int, int, const T*, const T*, const T*, T*);                       \
  template void l2norm_forward<T>(const T*, int64_t, int, T*);                                               \
  template void l2norm_backward<T>(const T*, const T*, int64_t, int, T*);

TREECP_GDN_INSTANTIATE(float)
TREECP_GDN_INSTANTIATE(double)
TREECP_GDN_INSTANTIATE(Bf16Product)  // the error model of the CUDA kernels' bf16 tensor-core path

}  // namespace treecp
