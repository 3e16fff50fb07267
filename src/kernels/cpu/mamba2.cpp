#include "kernels/cpu/mamba2.hpp"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/error.hpp"

namespace treecp {
namespace {

// Per-token views of one head (and its group) into the token-major arrays.
template <class T>
struct HeadView {
  const Mamba2Params<T>& p;
  int h;
  int g;
  HeadView(const Mamba2Params<T>& params, int head) : p(params), h(head), g(params.group_of(head)) {}
  int64_t x_at(int64_t t) const { return (t * p.heads + h) * p.head_dim; }
  int64_t dt_at(int64_t t) const { return t * p.heads + h; }
  int64_t bc_at(int64_t t) const { return (t * p.groups + g) * p.state_dim; }
  const T* x(int64_t t) const { return p.x + x_at(t); }
  T dt(int64_t t) const { return p.dt[dt_at(t)]; }
  const T* B(int64_t t) const { return p.B + bc_at(t); }
  const T* C(int64_t t) const { return p.C + bc_at(t); }
  T A() const { return p.A[h]; }
  T D() const { return p.D ? p.D[h] : T(0); }
};

template <class T>
void check_run(const Mamba2Params<T>& p, int h, int64_t t0, int64_t t1) {
  require(h >= 0 && h < p.heads, "mamba2: head ", h, " out of range [0, ", p.heads, ")");
  require(0 <= t0 && t0 <= t1 && t1 <= p.tokens, "mamba2: run [", t0, ", ", t1, ") outside [0, ", p.tokens, ")");
}

// y[:] += a * x[:] over n values (the loop every product below reduces to).
template <class T>
inline void axpy(int n, T a, const T* __restrict x, T* __restrict y) {
  for (int i = 0; i < n; ++i) y[i] += a * x[i];
}

template <class T>
inline T dot(int n, const T* __restrict a, const T* __restrict b) {
  T s = 0;
  for (int i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// out[c][r] = in[r][c] for an r x c block.
template <class T>
void transpose(int rows, int cols, const T* in, T* out) {
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < cols; ++c) out[static_cast<size_t>(c) * rows + r] = in[static_cast<size_t>(r) * cols + c];
}

// One chunk of one head, prepared independently of its incoming state. Workspaces keep their
// capacity from chunk to chunk.
template <class T>
struct Chunk {
  int c = 0, N = 0, P = 0;
  std::vector<T> l;      // [c] A Σ_{k≤i} dt_k
  std::vector<T> el;     // [c] e^{l_i}
  std::vector<T> ed;     // [c] e^{l_last - l_j}
  std::vector<T> ew;     // [c] e^{l_last - l_j} dt_j: token j's weight in the chunk's end state
  std::vector<T> Bt;     // [N][c] the chunk's B, transposed
  std::vector<T> G;      // [c][c] lower with diagonal: C_i·B_j
  std::vector<T> decay;  // [c][c] lower: e^{l_i - l_j}
  std::vector<T> Sw;     // [c][c] lower: e^{l_i - l_j} dt_j (C_i·B_j), the intra-chunk mixing

  void prepare_decays(const HeadView<T>& hv, int64_t t, int len) {
    c = len;
    N = hv.p.state_dim;
    P = hv.p.head_dim;
    l.resize(static_cast<size_t>(c));
    el.resize(static_cast<size_t>(c));
    ed.resize(static_cast<size_t>(c));
    ew.resize(static_cast<size_t>(c));
    const T A = hv.A();
    T acc = 0;
    for (int i = 0; i < c; ++i) {
      acc += A * hv.dt(t + i);
      l[i] = acc;
    }
    for (int i = 0; i < c; ++i) {
      el[i] = std::exp(l[i]);
      ed[i] = std::exp(l[c - 1] - l[i]);
      ew[i] = ed[i] * hv.dt(t + i);
    }
  }

  void prepare_mixing(const HeadView<T>& hv, int64_t t) {
    Bt.resize(static_cast<size_t>(N) * c);
    for (int j = 0; j < c; ++j) {
      const T* bj = hv.B(t + j);
      for (int n = 0; n < N; ++n) Bt[static_cast<size_t>(n) * c + j] = bj[n];
    }
    G.assign(static_cast<size_t>(c) * c, T(0));
    decay.assign(static_cast<size_t>(c) * c, T(0));
    Sw.assign(static_cast<size_t>(c) * c, T(0));
    for (int i = 0; i < c; ++i) {
      const T* ci = hv.C(t + i);
      T* gi = G.data() + static_cast<size_t>(i) * c;
      for (int n = 0; n < N; ++n) axpy(i + 1, ci[n], Bt.data() + static_cast<size_t>(n) * c, gi);
      for (int j = 0; j <= i; ++j) {
        const T w = std::exp(l[i] - l[j]);
        decay[static_cast<size_t>(i) * c + j] = w;
        Sw[static_cast<size_t>(i) * c + j] = w * hv.dt(t + j) * gi[j];
      }
    }
  }
};

// H <- e^{l_last} H + Σ_j ew_j B_j ⊗ x_j (the end state of the chunk from H = its start state).
template <class T>
void chunk_advance(const Chunk<T>& ch, const HeadView<T>& hv, int64_t t, T* S) {
  const int c = ch.c, N = ch.N, P = ch.P;
  const T e = ch.el[c - 1];
  for (int64_t i = 0; i < static_cast<int64_t>(N) * P; ++i) S[i] *= e;
  for (int j = 0; j < c; ++j) {
    const T* xj = hv.x(t + j);
    const T* bj = hv.B(t + j);
    const T w = ch.ew[j];
    for (int n = 0; n < N; ++n) axpy(P, w * bj[n], xj, S + static_cast<int64_t>(n) * P);
  }
}

template <class T>
void forward_run(const Mamba2Params<T>& p, int h, int64_t t0, int64_t t1, T* S, T* y) {
  const HeadView<T> hv(p, h);
  const int N = p.state_dim, P = p.head_dim;
  Chunk<T> ch;
  std::vector<T> row(static_cast<size_t>(P));
  for (int64_t t = t0; t < t1; t += p.chunk) {
    const int len = static_cast<int>(std::min<int64_t>(p.chunk, t1 - t));
    ch.prepare_decays(hv, t, len);
    if (y) {
      ch.prepare_mixing(hv, t);
      const T D = hv.D();
      for (int i = 0; i < len; ++i) {
        std::fill(row.begin(), row.end(), T(0));
        const T* swi = ch.Sw.data() + static_cast<size_t>(i) * len;
        for (int j = 0; j <= i; ++j) axpy(P, swi[j], hv.x(t + j), row.data());
        const T* ci = hv.C(t + i);
        for (int n = 0; n < N; ++n) axpy(P, ch.el[i] * ci[n], S + static_cast<int64_t>(n) * P, row.data());
        const T* xi = hv.x(t + i);
        T* yi = y + hv.x_at(t + i);
        for (int q = 0; q < P; ++q) yi[q] = row[q] + D * xi[q];
      }
    }
    chunk_advance(ch, hv, t, S);
  }
}

}  // namespace

template <class T>
void mamba2_check_params(const Mamba2Params<T>& p) {
  require(p.tokens >= 0, "mamba2: tokens must be >= 0, got ", p.tokens);
  require(p.heads >= 1 && p.head_dim >= 1 && p.state_dim >= 1 && p.groups >= 1,
          "mamba2: heads, head_dim, groups and state_dim must be >= 1, got ", p.heads, ", ", p.head_dim, ", ",
          p.groups, ", ", p.state_dim);
  require(p.heads_per_group >= 1 && p.first_head >= 0, "mamba2: heads_per_group must be >= 1 and first_head >= 0");
  require(p.group_of(p.heads - 1) < p.groups, "mamba2: heads [", p.first_head, ", ", p.first_head + p.heads,
          ") read ", p.group_of(p.heads - 1) + 1, " groups, only ", p.groups, " given");
  require(p.chunk >= 1 && p.chunk <= 4096, "mamba2: chunk must be in [1, 4096], got ", p.chunk);
  require(p.A, "mamba2: A must be given");
  require(p.tokens == 0 || (p.x && p.dt && p.B && p.C), "mamba2: x, dt, B and C must be given");
}

template <class T>
void mamba2_recurrent_forward(const Mamba2Params<T>& p, int h, int64_t t0, int64_t t1, T* S, T* y) {
  check_run(p, h, t0, t1);
  const HeadView<T> hv(p, h);
  const int N = p.state_dim, P = p.head_dim;
  for (int64_t t = t0; t < t1; ++t) {
    const T dt = hv.dt(t), a = std::exp(dt * hv.A());
    const T *x = hv.x(t), *b = hv.B(t), *c = hv.C(t);
    for (int n = 0; n < N; ++n)
      for (int q = 0; q < P; ++q) S[n * P + q] = a * S[n * P + q] + dt * b[n] * x[q];
    if (!y) continue;
    T* yt = y + hv.x_at(t);
    for (int q = 0; q < P; ++q) {
      T acc = hv.D() * x[q];
      for (int n = 0; n < N; ++n) acc += S[n * P + q] * c[n];
      yt[q] = acc;
    }
  }
}

template <class T>
void mamba2_recurrent_backward(const Mamba2Params<T>& p, int h, int64_t t0, int64_t t1, const T* state_in,
                               const T* dy, T* gS, const Mamba2Grads<T>& gr) {
  check_run(p, h, t0, t1);
  const HeadView<T> hv(p, h);
  const int N = p.state_dim, P = p.head_dim;
  const size_t sz = static_cast<size_t>(N) * P;
  const int64_t n_tok = t1 - t0;
  // states[i] = the state before token t0 + i; states[n_tok] = the final one.
  std::vector<T> states((static_cast<size_t>(n_tok) + 1) * sz);
  std::copy(state_in, state_in + sz, states.begin());
  for (int64_t i = 0; i < n_tok; ++i) {
    std::copy(states.begin() + i * sz, states.begin() + (i + 1) * sz, states.begin() + (i + 1) * sz);
    mamba2_recurrent_forward(p, h, t0 + i, t0 + i + 1, states.data() + (i + 1) * sz, static_cast<T*>(nullptr));
  }
  const T A = hv.A(), D = hv.D();
  for (int64_t i = n_tok - 1; i >= 0; --i) {
    const int64_t t = t0 + i;
    const T* S = states.data() + (i + 1) * sz;
    const T* Sp = states.data() + i * sz;
    const T dt = hv.dt(t), a = std::exp(dt * A);
    const T *x = hv.x(t), *b = hv.B(t), *c = hv.C(t), *g = dy + hv.x_at(t);
    // y_t = H_t C_t + D x_t
    for (int q = 0; q < P; ++q) {
      if (gr.dx) gr.dx[hv.x_at(t) + q] += D * g[q];
      if (gr.dD) gr.dD[h] += g[q] * x[q];
    }
    for (int n = 0; n < N; ++n) {
      T dc = 0;
      for (int q = 0; q < P; ++q) {
        dc += S[n * P + q] * g[q];
        gS[n * P + q] += c[n] * g[q];
      }
      if (gr.dC) gr.dC[hv.bc_at(t) + n] += dc;
    }
    // H_t = a H_{t-1} + dt x_t B_tᵀ
    T da = 0, dwrite = 0;
    for (int n = 0; n < N; ++n) {
      T db = 0;
      for (int q = 0; q < P; ++q) {
        const T gs = gS[n * P + q];
        da += gs * Sp[n * P + q];
        dwrite += gs * b[n] * x[q];
        db += gs * x[q];
        if (gr.dx) gr.dx[hv.x_at(t) + q] += dt * b[n] * gs;
      }
      if (gr.dB) gr.dB[hv.bc_at(t) + n] += dt * db;
    }
    if (gr.ddt) gr.ddt[hv.dt_at(t)] += dwrite + da * a * A;
    if (gr.dA) gr.dA[h] += da * a * dt;
    for (size_t k = 0; k < sz; ++k) gS[k] *= a;
  }
}

template <class T>
void mamba2_chunked_forward(const Mamba2Params<T>& p, int h, int64_t t0, int64_t t1, T* S, T* y) {
  check_run(p, h, t0, t1);
  forward_run(p, h, t0, t1, S, y);
}

template <class T>
void mamba2_chunked_summary(const Mamba2Params<T>& p, int h, int64_t t0, int64_t t1, T* a, T* E) {
  check_run(p, h, t0, t1);
  const HeadView<T> hv(p, h);
  T log_a = 0;
  for (int64_t t = t0; t < t1; ++t) log_a += hv.A() * hv.dt(t);
  *a = std::exp(log_a);
  std::fill(E, E + p.state_size(), T(0));
  forward_run(p, h, t0, t1, E, static_cast<T*>(nullptr));
}

template <class T>
void mamba2_chunked_backward(const Mamba2Params<T>& p, int h, int64_t t0, int64_t t1, const T* state_in,
                             const T* dy, T* gS, const Mamba2Grads<T>& gr) {
  check_run(p, h, t0, t1);
  const HeadView<T> hv(p, h);
  const int N = p.state_dim, P = p.head_dim;
  const int64_t sz = p.state_size();
  const int64_t n_chunks = (t1 - t0 + p.chunk - 1) / p.chunk;
  // Chunk-start states, recomputed.
  std::vector<T> starts(static_cast<size_t>(n_chunks * sz));
  {
    std::vector<T> S(state_in, state_in + sz);
    Chunk<T> ch;
    for (int64_t k = 0; k < n_chunks; ++k) {
      const int64_t t = t0 + k * p.chunk;
      std::copy(S.begin(), S.end(), starts.begin() + k * sz);
      ch.prepare_decays(hv, t, static_cast<int>(std::min<int64_t>(p.chunk, t1 - t)));
      chunk_advance(ch, hv, t, S.data());
    }
  }
  const bool full = gr.any();
  const T A = hv.A(), D = hv.D();
  Chunk<T> ch;
  std::vector<T> g0(static_cast<size_t>(sz)), S0t, gS1t, xt, dM, dG, dl, dxc, dBc, dCc, u, tmp;
  for (int64_t k = n_chunks - 1; k >= 0; --k) {
    const int64_t t = t0 + k * p.chunk;
    const int c = static_cast<int>(std::min<int64_t>(p.chunk, t1 - t));
    const T* S0 = starts.data() + k * sz;
    ch.prepare_decays(hv, t, c);
    // dH_0 = e^{l_last} dH_c + Σ_i e^{l_i} C_i ⊗ dy_i
    for (int64_t i = 0; i < sz; ++i) g0[i] = ch.el[c - 1] * gS[i];
    for (int i = 0; i < c; ++i) {
      const T* ci = hv.C(t + i);
      const T* gi = dy + hv.x_at(t + i);
      for (int n = 0; n < N; ++n) axpy(P, ch.el[i] * ci[n], gi, g0.data() + static_cast<int64_t>(n) * P);
    }
    if (full) {
      ch.prepare_mixing(hv, t);
      const size_t cc = static_cast<size_t>(c) * c;
      dl.assign(static_cast<size_t>(c), T(0));
      dxc.assign(static_cast<size_t>(c) * P, T(0));
      dBc.assign(static_cast<size_t>(c) * N, T(0));
      dCc.assign(static_cast<size_t>(c) * N, T(0));
      std::vector<T> ddtc(static_cast<size_t>(c), T(0));
      T dA = 0, dD = 0;
      // dM[i][j] = dy_i · x_j (j ≤ i), through xᵀ so that every product is a row update.
      xt.resize(static_cast<size_t>(P) * c);
      for (int j = 0; j < c; ++j) {
        const T* xj = hv.x(t + j);
        for (int q = 0; q < P; ++q) xt[static_cast<size_t>(q) * c + j] = xj[q];
      }
      dM.assign(cc, T(0));
      for (int i = 0; i < c; ++i) {
        const T* gi = dy + hv.x_at(t + i);
        T* mi = dM.data() + static_cast<size_t>(i) * c;
        for (int q = 0; q < P; ++q) axpy(i + 1, gi[q], xt.data() + static_cast<size_t>(q) * c, mi);
      }
      // Intra-chunk: y_i += Σ_j Sw_ij x_j, Sw_ij = e^{l_i - l_j} dt_j G_ij.
      dG.assign(cc, T(0));
      for (int i = 0; i < c; ++i) {
        const T* gi = dy + hv.x_at(t + i);
        for (int j = 0; j <= i; ++j) {
          const size_t ij = static_cast<size_t>(i) * c + j;
          const T m = dM[ij], w = ch.decay[ij], dtj = hv.dt(t + j);
          axpy(P, ch.Sw[ij], gi, dxc.data() + static_cast<size_t>(j) * P);
          dG[ij] = m * w * dtj;
          ddtc[j] += m * w * ch.G[ij];
          const T q = m * ch.Sw[ij];
          dl[i] += q;
          dl[j] -= q;
        }
      }
      for (int i = 0; i < c; ++i) {
        const T* ci = hv.C(t + i);
        T* dci = dCc.data() + static_cast<size_t>(i) * N;
        for (int j = 0; j <= i; ++j) {
          const T g = dG[static_cast<size_t>(i) * c + j];
          axpy(N, g, hv.B(t + j), dci);
          axpy(N, g, ci, dBc.data() + static_cast<size_t>(j) * N);
        }
      }
      // From the incoming state: y_i += e^{l_i} H_0 C_i.
      S0t.resize(static_cast<size_t>(sz));
      transpose(N, P, S0, S0t.data());  // [P][N]
      tmp.resize(static_cast<size_t>(N));
      for (int i = 0; i < c; ++i) {
        const T* gi = dy + hv.x_at(t + i);
        std::fill(tmp.begin(), tmp.end(), T(0));
        for (int q = 0; q < P; ++q) axpy(N, gi[q], S0t.data() + static_cast<size_t>(q) * N, tmp.data());
        for (int n = 0; n < N; ++n) tmp[n] *= ch.el[i];
        axpy(N, T(1), tmp.data(), dCc.data() + static_cast<size_t>(i) * N);
        dl[i] += dot(N, hv.C(t + i), tmp.data());
      }
      // The skip term.
      for (int i = 0; i < c; ++i) {
        const T* gi = dy + hv.x_at(t + i);
        dD += dot(P, gi, hv.x(t + i));
        axpy(P, D, gi, dxc.data() + static_cast<size_t>(i) * P);
      }
      // Into the end state: H_c = e^{l_last} H_0 + Σ_j ew_j x_j B_jᵀ.
      dl[c - 1] += ch.el[c - 1] * dot(static_cast<int>(sz), gS, S0);
      gS1t.resize(static_cast<size_t>(sz));
      transpose(N, P, gS, gS1t.data());  // [P][N]
      u.resize(static_cast<size_t>(P));
      for (int j = 0; j < c; ++j) {
        const T* xj = hv.x(t + j);
        const T* bj = hv.B(t + j);
        std::fill(u.begin(), u.end(), T(0));
        for (int n = 0; n < N; ++n) axpy(P, bj[n], gS + static_cast<int64_t>(n) * P, u.data());
        const T w = ch.ew[j];
        axpy(P, w, u.data(), dxc.data() + static_cast<size_t>(j) * P);
        T* dbj = dBc.data() + static_cast<size_t>(j) * N;
        for (int q = 0; q < P; ++q) axpy(N, w * xj[q], gS1t.data() + static_cast<size_t>(q) * N, dbj);
        const T dw = dot(P, xj, u.data());
        ddtc[j] += dw * ch.ed[j];
        dl[c - 1] += dw * w;
        dl[j] -= dw * w;
      }
      // l_i = A Σ_{k≤i} dt_k: R_k = Σ_{i≥k} dl_i.
      T R = 0;
      for (int j = c - 1; j >= 0; --j) {
        R += dl[j];
        ddtc[j] += A * R;
        dA += hv.dt(t + j) * R;
      }
      for (int j = 0; j < c; ++j) {
        if (gr.dx) axpy(P, T(1), dxc.data() + static_cast<size_t>(j) * P, gr.dx + hv.x_at(t + j));
        if (gr.ddt) gr.ddt[hv.dt_at(t + j)] += ddtc[j];
        if (gr.dB) axpy(N, T(1), dBc.data() + static_cast<size_t>(j) * N, gr.dB + hv.bc_at(t + j));
        if (gr.dC) axpy(N, T(1), dCc.data() + static_cast<size_t>(j) * N, gr.dC + hv.bc_at(t + j));
      }
      if (gr.dA) gr.dA[h] += dA;
      if (gr.dD) gr.dD[h] += dD;
    }
    std::copy(g0.begin(), g0.end(), gS);
  }
}

#define TREECP_MAMBA2_INSTANTIATE(T)                                                                              \
  template void mamba2_check_params<T>(const Mamba2Params<T>&);                                                 \
  template void mamba2_recurrent_forward<T>(const Mamba2Params<T>&, int, int64_t, int64_t, T*, T*);             \
  template void mamba2_recurrent_backward<T>(const Mamba2Params<T>&, int, int64_t, int64_t, const T*, const T*, \
                                             T*, const Mamba2Grads<T>&);                                        \
  template void mamba2_chunked_forward<T>(const Mamba2Params<T>&, int, int64_t, int64_t, T*, T*);               \
  template void mamba2_chunked_backward<T>(const Mamba2Params<T>&, int, int64_t, int64_t, const T*, const T*,   \
                                           T*, const Mamba2Grads<T>&);                                          \
  template void mamba2_chunked_summary<T>(const Mamba2Params<T>&, int, int64_t, int64_t, T*, T*);

TREECP_MAMBA2_INSTANTIATE(float)
TREECP_MAMBA2_INSTANTIATE(double)

}  // namespace treecp
