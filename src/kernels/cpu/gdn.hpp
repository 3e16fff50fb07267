// kernels/: the local math of every layer kind: its contracts (shapes.hpp, slice.hpp) and their CPU
// (cpu/) and CUDA (cuda/) implementations. Knows no rows, plans or ranks.
//
// Gated DeltaNet (GDN) and Kimi Delta Attention (KDA) on the CPU: the token recurrence (the oracle),
// its chunked UT/WY form (the kernel), shard summaries and their algebra. One head, one run of
// consecutive tokens per call; the runtime loops over heads and runs.
//
// Per head, with the state S a dk x dv matrix (row-major, S[d][e]) and a = exp(g):
//   S_pre = diag(a) S;  delta = beta (v - S_preᵀ k);  S = S_pre + k deltaᵀ;  y = scale Sᵀ q
// GDN: g is a scalar per token and head (a = exp(g) I). KDA: g is a vector over the key channels.
//
// Chunked form (chunk c tokens, G_i = Σ_{t≤i} g_t inside the chunk, per key channel):
//   P[i,j] = Σ_d k_i[d] k_j[d] e^{G_i[d]-G_j[d]} (j<i),  C[i,j] = Σ_d q_i[d] k_j[d] e^{G_i[d]-G_j[d]} (j≤i)
//   L = I + diag(β) P;  L U = diag(β) V;  L W = diag(β) (e^G ⊙ K);  D = U - W S_start
//   Y = scale ((e^G ⊙ Q) S_start + C D);  S_end = diag(e^{G_last}) S_start + Rᵀ D,  R_j = e^{G_last-G_j} ⊙ k_j
//   so a chunk is the affine map S_end = M S_start + E with M = diag(e^{G_last}) - Rᵀ W, E = Rᵀ U.
#pragma once

#include <cstdint>

#include "kernels/shapes.hpp"

namespace treecp {

// Token-major arrays of one rank's tokens: q[t][h][d] = q[(t * heads + h) * dk + d].
template <class T>
struct GdnParams {
  const T* q = nullptr;     // [S, H, dk]
  const T* k = nullptr;     // [S, H, dk]
  const T* v = nullptr;     // [S, H, dv]
  const T* g = nullptr;     // [S, H] or [S, H, dk]: natural log of the decay
  const T* beta = nullptr;  // [S, H]
  int64_t tokens = 0;
  GdnShape shape;  // heads, head dims, gate kind, output scale, chunk
  T scale() const { return static_cast<T>(shape.scale); }
};

// Gradient arrays, same layouts as the inputs. Kernels ADD into them (a token's gradient is written
// by exactly one run, so zero-initialised arrays end up holding the gradient). A null member is
// not computed; all null = only the state gradient.
template <class T>
struct GdnGrads {
  T* dq = nullptr;
  T* dk = nullptr;
  T* dv = nullptr;
  T* dg = nullptr;
  T* dbeta = nullptr;
  bool any() const { return dq || dk || dv || dg || dbeta; }
};

// Checks the shape, the token count and the arrays; names the field at fault.
template <class T>
void gdn_check_params(const GdnParams<T>& p);

// ---- token recurrence (reference)
// Runs tokens [t0, t1) of head h from `state` (dk x dv, updated in place); writes y[t][h][:] if y.
template <class T>
void gdn_recurrent_forward(const GdnParams<T>& p, int h, int64_t t0, int64_t t1, T* state, T* y);
// Backward of the above: `state_in` is the state the run started from; `dstate` holds dL/dS_out on
// entry and dL/dS_in on return.
template <class T>
void gdn_recurrent_backward(const GdnParams<T>& p, int h, int64_t t0, int64_t t1, const T* state_in, const T* dy,
                            T* dstate, const GdnGrads<T>& grads);

// ---- chunked UT/WY form (chunks of p.chunk tokens starting at t0; the last may be shorter)
template <class T>
void gdn_chunked_forward(const GdnParams<T>& p, int h, int64_t t0, int64_t t1, T* state, T* y);
template <class T>
void gdn_chunked_backward(const GdnParams<T>& p, int h, int64_t t0, int64_t t1, const T* state_in, const T* dy,
                          T* dstate, const GdnGrads<T>& grads);
// The run's summary: S_out = M S_in + E for any S_in. M is dk x dk, E is dk x dv.
template <class T>
void gdn_chunked_summary(const GdnParams<T>& p, int h, int64_t t0, int64_t t1, T* M, T* E);

// ---- summary algebra on dk x dk (M) and dk x dv (E) blocks
// (M, E) <- (M_B, E_B) ∘ (M_A, E_A) = (M_B M_A, M_B E_A + E_B): A runs first. Outputs may alias B.
template <class T>
void gdn_compose(int dk, int dv, const T* MB, const T* EB, const T* MA, const T* EA, T* M, T* E);
// out = M s + E (out may not alias s).
template <class T>
void gdn_apply(int dk, int dv, const T* M, const T* E, const T* s, T* out);
// out = Mᵀ ds + a: the state gradient through a run (a = the run's own contribution).
template <class T>
void gdn_apply_transposed(int dk, int dv, const T* M, const T* a, const T* ds, T* out);

// ---- the layer's q/k normalisation (GDN and KDA layers L2-normalise q and k per head, which keeps
// the delta rule contractive: with |k| = 1 and beta in (0, 1) the state's update I - beta k kᵀ has
// eigenvalues in [1 - beta, 1])
// Every one of `groups` consecutive vectors of `dim` elements: y = x / sqrt(|x|² + kL2NormEps).
inline constexpr double kL2NormEps = 1e-6;
template <class T>
void l2norm_forward(const T* x, int64_t groups, int dim, T* y);
// Adds dJ/dx = (dy - y (y·dy)) / sqrt(|x|² + eps) for each vector.
template <class T>
void l2norm_backward(const T* x, const T* dy, int64_t groups, int dim, T* dx);

}  // namespace treecp
