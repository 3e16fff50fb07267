#include "kernels/cpu/mamba2.hpp"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/error.hpp"
#include "kernels/cpu/tile.hpp"

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

// out[c][r] = in[r][c] for an r x c block.
template <class T>
void transpose(int rows, int cols, const T* in, T* out) {
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < cols; ++c) out[static_cast<size_t>(c) * rows + r] = in[static_cast<size_t>(r) * cols + c];
}

// One chunk of one head, prepared independently of its incoming state. Every product below is a
// GEMM on the shared register tile (kernels/cpu/tile.hpp); token rows are read in place with their
// strides (x: H·P, B and C: G·N). Workspaces keep their capacity from chunk to chunk.
template <class T>
struct Chunk {
  int c = 0, N = 0, P = 0;
  int64_t xs = 0, bs = 0;  // row strides of x and of B, C
  const T *X = nullptr, *Bp = nullptr, *Cp = nullptr;
  std::vector<T> l;      // [c] A Σ_{k≤i} dt_k
  std::vector<T> el;     // [c] e^{l_i}
  std::vector<T> ed;     // [c] e^{l_last - l_j}
  std::vector<T> ew;     // [c] e^{l_last - l_j} dt_j: token j's weight in the chunk's end state
  std::vector<T> dtv;    // [c] dt_j
  std::vector<T> Bt;     // [N][c] the chunk's B, transposed
  std::vector<T> G;      // [c][c] C_i·B_j
  std::vector<T> decay;  // [c][c] lower: e^{l_i - l_j}
  std::vector<T> Sw;     // [c][c] lower: e^{l_i - l_j} dt_j (C_i·B_j), the intra-chunk mixing; 0 above
  std::vector<T> Ce;     // [c][N] e^{l_i} C_i: how token i reads the incoming state
  std::vector<T> Wb;     // [c][N] ew_j B_j: how token j writes the outgoing state

  TREECP_TILE_INLINE void prepare_decays(const HeadView<T>& hv, int64_t t, int len) {
    c = len;
    N = hv.p.state_dim;
    P = hv.p.head_dim;
    xs = int64_t{hv.p.heads} * P;
    bs = int64_t{hv.p.groups} * N;
    X = hv.x(t);
    Bp = hv.B(t);
    Cp = hv.C(t);
    for (auto* v : {&l, &el, &ed, &ew, &dtv}) v->resize(static_cast<size_t>(c));
    const T A = hv.A();
    T acc = 0;
    for (int i = 0; i < c; ++i) {
      dtv[i] = hv.dt(t + i);
      acc += A * dtv[i];
      l[i] = acc;
    }
    for (int i = 0; i < c; ++i) {
      el[i] = std::exp(l[i]);
      ed[i] = std::exp(l[c - 1] - l[i]);
      ew[i] = ed[i] * dtv[i];
    }
  }

  TREECP_TILE_INLINE void prepare_read() {
    Ce.resize(static_cast<size_t>(c) * N);
    for (int i = 0; i < c; ++i)
      for (int n = 0; n < N; ++n) Ce[static_cast<size_t>(i) * N + n] = el[i] * Cp[i * bs + n];
  }

  TREECP_TILE_INLINE void prepare_write() {
    Wb.resize(static_cast<size_t>(c) * N);
    for (int j = 0; j < c; ++j)
      for (int n = 0; n < N; ++n) Wb[static_cast<size_t>(j) * N + n] = ew[j] * Bp[j * bs + n];
  }

  template <class Isa>
  TREECP_TILE_INLINE void prepare_mixing() {
    const size_t cc = static_cast<size_t>(c) * c;
    Bt.resize(static_cast<size_t>(N) * c);
    for (int j = 0; j < c; ++j)
      for (int n = 0; n < N; ++n) Bt[static_cast<size_t>(n) * c + j] = Bp[j * bs + n];
    G.assign(cc, T(0));
    cpu::gemm_acc<Isa>(c, c, N, Cp, bs, 1, Bt.data(), c, G.data(), c);  // G[i][j] = Σ_n C_i[n] B_j[n]
    decay.assign(cc, T(0));
    Sw.assign(cc, T(0));
    for (int i = 0; i < c; ++i)
      for (int j = 0; j <= i; ++j) {
        const size_t ij = static_cast<size_t>(i) * c + j;
        decay[ij] = std::exp(l[i] - l[j]);
        Sw[ij] = decay[ij] * dtv[j] * G[ij];
      }
  }
};

// H <- e^{l_last} H + Σ_j ew_j B_j ⊗ x_j (the end state of the chunk from H = its start state).
template <class Isa, class T>
TREECP_TILE_INLINE void chunk_advance(Chunk<T>& ch, T* S) {
  const T e = ch.el[ch.c - 1];
  for (int64_t i = 0; i < int64_t{ch.N} * ch.P; ++i) S[i] *= e;
  ch.prepare_write();
  // S[n][p] += Σ_j Wb[j][n] x_j[p]
  cpu::gemm_acc<Isa>(ch.N, ch.P, ch.c, ch.Wb.data(), 1, ch.N, ch.X, ch.xs, S, ch.P);
}

template <class Isa, class T>
TREECP_TILE_INLINE void forward_run(const Mamba2Params<T>& p, int h, int64_t t0, int64_t t1, T* S, T* y) {
  const HeadView<T> hv(p, h);
  const int P = p.head_dim;
  Chunk<T> ch;
  std::vector<T> Y;
  for (int64_t t = t0; t < t1; t += p.chunk) {
    const int c = static_cast<int>(std::min<int64_t>(p.chunk, t1 - t));
    ch.prepare_decays(hv, t, c);
    if (y) {
      ch.template prepare_mixing<Isa>();
      ch.prepare_read();
      Y.assign(static_cast<size_t>(c) * P, T(0));
      cpu::gemm_acc<Isa>(c, P, c, ch.Sw.data(), c, 1, ch.X, ch.xs, Y.data(), P);     // Σ_j Sw_ij x_j
      cpu::gemm_acc<Isa>(c, P, ch.N, ch.Ce.data(), ch.N, 1, S, P, Y.data(), P);     // e^{l_i} H_0 C_i
      const T D = hv.D();
      for (int i = 0; i < c; ++i) {
        const T* xi = ch.X + i * ch.xs;
        T* yi = y + hv.x_at(t + i);
        for (int q = 0; q < P; ++q) yi[q] = Y[static_cast<size_t>(i) * P + q] + D * xi[q];
      }
    }
    chunk_advance<Isa>(ch, S);
  }
}

// Workspaces of the chunked backward, reused across its chunks.
template <class T>
struct BackwardWork {
  std::vector<T> g0, S0t, gS1t, xt, dM, dG, dl, ddt, dxc, dBc, dCc, U, V, tmp;
};

// One chunk of the backward: `S0` its start state, `gS` dL/dH_end on entry and dL/dH_0 on return.
template <class Isa, class T>
TREECP_TILE_INLINE void backward_chunk(const HeadView<T>& hv, int64_t t, int c, const T* S0, const T* dy, T* gS,
                                       const Mamba2Grads<T>& gr, Chunk<T>& ch, BackwardWork<T>& w) {
  const int N = hv.p.state_dim, P = hv.p.head_dim;
  const int64_t sz = int64_t{N} * P, xs = int64_t{hv.p.heads} * P;
  const T* gY = dy + hv.x_at(t);  // dy rows of the chunk, stride H·P
  ch.prepare_decays(hv, t, c);
  ch.prepare_read();
  // dH_0 = e^{l_last} dH_c + Σ_i e^{l_i} C_i ⊗ dy_i:  g0[n][p] += Σ_i Ce[i][n] dy_i[p]
  w.g0.resize(static_cast<size_t>(sz));
  for (int64_t i = 0; i < sz; ++i) w.g0[i] = ch.el[c - 1] * gS[i];
  cpu::gemm_acc<Isa>(N, P, c, ch.Ce.data(), 1, N, gY, xs, w.g0.data(), P);
  if (gr.any()) {
    ch.template prepare_mixing<Isa>();
    const size_t cc = static_cast<size_t>(c) * c;
    w.dl.assign(static_cast<size_t>(c), T(0));
    w.ddt.assign(static_cast<size_t>(c), T(0));
    w.dxc.assign(static_cast<size_t>(c) * P, T(0));
    w.dBc.assign(static_cast<size_t>(c) * N, T(0));
    w.dCc.assign(static_cast<size_t>(c) * N, T(0));
    // Intra-chunk, y_i += Σ_j Sw_ij x_j: dM[i][j] = dy_i · x_j; dx_j += Σ_i Sw_ij dy_i.
    w.xt.resize(static_cast<size_t>(P) * c);
    for (int j = 0; j < c; ++j)
      for (int q = 0; q < P; ++q) w.xt[static_cast<size_t>(q) * c + j] = ch.X[j * xs + q];
    w.dM.assign(cc, T(0));
    cpu::gemm_acc<Isa>(c, c, P, gY, xs, 1, w.xt.data(), c, w.dM.data(), c);
    cpu::gemm_acc<Isa>(c, P, c, ch.Sw.data(), 1, c, gY, xs, w.dxc.data(), P);
    // Sw_ij = e^{l_i - l_j} dt_j G_ij: through G to C and B, through dt_j, and through l_i, l_j.
    w.dG.assign(cc, T(0));
    for (int i = 0; i < c; ++i)
      for (int j = 0; j <= i; ++j) {
        const size_t ij = static_cast<size_t>(i) * c + j;
        const T m = w.dM[ij], dec = ch.decay[ij];
        w.dG[ij] = m * dec * ch.dtv[j];
        w.ddt[j] += m * dec * ch.G[ij];
        const T q = m * ch.Sw[ij];
        w.dl[i] += q;
        w.dl[j] -= q;
      }
    cpu::gemm_acc<Isa>(c, N, c, w.dG.data(), c, 1, ch.Bp, ch.bs, w.dCc.data(), N);  // dC_i += Σ_j dG_ij B_j
    cpu::gemm_acc<Isa>(c, N, c, w.dG.data(), 1, c, ch.Cp, ch.bs, w.dBc.data(), N);  // dB_j += Σ_i dG_ij C_i
    // From the incoming state, y_i += e^{l_i} H_0 C_i: dC_i += e^{l_i} H_0ᵀ dy_i, and through l_i.
    w.S0t.resize(static_cast<size_t>(sz));
    transpose(N, P, S0, w.S0t.data());  // [P][N]
    w.tmp.assign(static_cast<size_t>(c) * N, T(0));
    cpu::gemm_acc<Isa>(c, N, P, gY, xs, 1, w.S0t.data(), N, w.tmp.data(), N);
    for (int i = 0; i < c; ++i) {
      T* ti = w.tmp.data() + static_cast<size_t>(i) * N;
      for (int n = 0; n < N; ++n) ti[n] *= ch.el[i];
      cpu::axpy(w.dCc.data() + static_cast<size_t>(i) * N, T(1), ti, N);
      w.dl[i] += cpu::dot(ch.Cp + i * ch.bs, ti, N);
    }
    // The skip term y_i += D x_i.
    const T D = hv.D();
    T dD = 0;
    for (int i = 0; i < c; ++i) {
      const T* gi = gY + i * xs;
      dD += cpu::dot(gi, ch.X + i * xs, P);
      cpu::axpy(w.dxc.data() + static_cast<size_t>(i) * P, D, gi, P);
    }
    // Into the end state, H_c = e^{l_last} H_0 + Σ_j ew_j B_j ⊗ x_j:
    //   u_j = Σ_n B_j[n] dH_c[n][:]  (dx_j += ew_j u_j),  v_j = Σ_p x_j[p] dH_c[:][p]  (dB_j += ew_j v_j).
    w.dl[c - 1] += ch.el[c - 1] * cpu::dot(gS, S0, static_cast<int>(sz));
    w.U.assign(static_cast<size_t>(c) * P, T(0));
    cpu::gemm_acc<Isa>(c, P, N, ch.Bp, ch.bs, 1, gS, P, w.U.data(), P);
    w.gS1t.resize(static_cast<size_t>(sz));
    transpose(N, P, gS, w.gS1t.data());  // [P][N]
    w.V.assign(static_cast<size_t>(c) * N, T(0));
    cpu::gemm_acc<Isa>(c, N, P, ch.X, xs, 1, w.gS1t.data(), N, w.V.data(), N);
    for (int j = 0; j < c; ++j) {
      const T* uj = w.U.data() + static_cast<size_t>(j) * P;
      const T ewj = ch.ew[j];
      cpu::axpy(w.dxc.data() + static_cast<size_t>(j) * P, ewj, uj, P);
      cpu::axpy(w.dBc.data() + static_cast<size_t>(j) * N, ewj, w.V.data() + static_cast<size_t>(j) * N, N);
      const T dw = cpu::dot(ch.X + j * xs, uj, P);
      w.ddt[j] += dw * ch.ed[j];
      w.dl[c - 1] += dw * ewj;
      w.dl[j] -= dw * ewj;
    }
    // l_i = A Σ_{k≤i} dt_k: R_k = Σ_{i≥k} dl_i.
    const T A = hv.A();
    T R = 0, dA = 0;
    for (int j = c - 1; j >= 0; --j) {
      R += w.dl[j];
      w.ddt[j] += A * R;
      dA += ch.dtv[j] * R;
    }
    for (int j = 0; j < c; ++j) {
      if (gr.dx) cpu::axpy(gr.dx + hv.x_at(t + j), T(1), w.dxc.data() + static_cast<size_t>(j) * P, P);
      if (gr.ddt) gr.ddt[hv.dt_at(t + j)] += w.ddt[j];
      if (gr.dB) cpu::axpy(gr.dB + hv.bc_at(t + j), T(1), w.dBc.data() + static_cast<size_t>(j) * N, N);
      if (gr.dC) cpu::axpy(gr.dC + hv.bc_at(t + j), T(1), w.dCc.data() + static_cast<size_t>(j) * N, N);
    }
    if (gr.dA) gr.dA[hv.h] += dA;
    if (gr.dD) gr.dD[hv.h] += dD;
  }
  std::copy(w.g0.begin(), w.g0.end(), gS);
}

template <class Isa, class T>
TREECP_TILE_INLINE void backward_run(const Mamba2Params<T>& p, int h, int64_t t0, int64_t t1, const T* state_in,
                                     const T* dy, T* gS, const Mamba2Grads<T>& gr) {
  const HeadView<T> hv(p, h);
  const int64_t sz = p.state_size();
  const int64_t n_chunks = (t1 - t0 + p.chunk - 1) / p.chunk;
  Chunk<T> ch;
  // Chunk-start states, recomputed.
  std::vector<T> starts(static_cast<size_t>(n_chunks * sz));
  {
    std::vector<T> S(state_in, state_in + sz);
    for (int64_t k = 0; k < n_chunks; ++k) {
      const int64_t t = t0 + k * p.chunk;
      std::copy(S.begin(), S.end(), starts.begin() + k * sz);
      ch.prepare_decays(hv, t, static_cast<int>(std::min<int64_t>(p.chunk, t1 - t)));
      chunk_advance<Isa>(ch, S.data());
    }
  }
  BackwardWork<T> w;
  for (int64_t k = n_chunks - 1; k >= 0; --k) {
    const int64_t t = t0 + k * p.chunk;
    backward_chunk<Isa>(hv, t, static_cast<int>(std::min<int64_t>(p.chunk, t1 - t)), starts.data() + k * sz, dy, gS,
                        gr, ch, w);
  }
}

// One copy of the chunked passes per instruction set, chosen at run time (cpu::use_avx2).
#if TREECP_X86_DISPATCH
template <class T>
__attribute__((target("avx2,fma"))) void forward_avx2(const Mamba2Params<T>& p, int h, int64_t t0, int64_t t1, T* S,
                                                       T* y) {
  forward_run<cpu::IsaAvx2>(p, h, t0, t1, S, y);
}
template <class T>
__attribute__((target("avx2,fma"))) void backward_avx2(const Mamba2Params<T>& p, int h, int64_t t0, int64_t t1,
                                                        const T* s_in, const T* dy, T* gS, const Mamba2Grads<T>& gr) {
  backward_run<cpu::IsaAvx2>(p, h, t0, t1, s_in, dy, gS, gr);
}
#endif
template <class T>
void forward_baseline(const Mamba2Params<T>& p, int h, int64_t t0, int64_t t1, T* S, T* y) {
  forward_run<cpu::IsaBaseline>(p, h, t0, t1, S, y);
}
template <class T>
void backward_baseline(const Mamba2Params<T>& p, int h, int64_t t0, int64_t t1, const T* s_in, const T* dy, T* gS,
                       const Mamba2Grads<T>& gr) {
  backward_run<cpu::IsaBaseline>(p, h, t0, t1, s_in, dy, gS, gr);
}

template <class T>
void chunked_forward(const Mamba2Params<T>& p, int h, int64_t t0, int64_t t1, T* S, T* y) {
#if TREECP_X86_DISPATCH
  if (cpu::use_avx2()) return forward_avx2(p, h, t0, t1, S, y);
#endif
  forward_baseline(p, h, t0, t1, S, y);
}

}  // namespace

template <class T>
void mamba2_check_params(const Mamba2Params<T>& p) {
  require(p.tokens >= 0, "mamba2: tokens must be >= 0, got ", p.tokens);
  require(p.heads >= 1 && p.head_dim >= 1 && p.state_dim >= 1 && p.groups >= 1,
          "mamba2: heads, head_dim, groups and state_dim must be >= 1, got ", p.heads, ", ", p.head_dim, ", ",
          p.groups, ", ", p.state_dim);
  require(p.state_size() <= 2147483647, "mamba2: state_dim x head_dim = ", p.state_size(),
          " elements per head's state is more than a 32-bit count");
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
  chunked_forward(p, h, t0, t1, S, y);
}

template <class T>
void mamba2_chunked_summary(const Mamba2Params<T>& p, int h, int64_t t0, int64_t t1, T* a, T* E) {
  check_run(p, h, t0, t1);
  const HeadView<T> hv(p, h);
  T log_a = 0;
  for (int64_t t = t0; t < t1; ++t) log_a += hv.A() * hv.dt(t);
  *a = std::exp(log_a);
  std::fill(E, E + p.state_size(), T(0));
  chunked_forward(p, h, t0, t1, E, static_cast<T*>(nullptr));
}

template <class T>
void mamba2_chunked_backward(const Mamba2Params<T>& p, int h, int64_t t0, int64_t t1, const T* state_in,
                             const T* dy, T* gS, const Mamba2Grads<T>& gr) {
  check_run(p, h, t0, t1);
#if TREECP_X86_DISPATCH
  if (cpu::use_avx2()) return backward_avx2(p, h, t0, t1, state_in, dy, gS, gr);
#endif
  backward_baseline(p, h, t0, t1, state_in, dy, gS, gr);
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
