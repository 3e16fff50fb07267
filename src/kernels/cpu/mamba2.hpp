// kernels/: the local math of every layer kind: its contracts (shapes.hpp, slice.hpp) and their CPU
// (cpu/) and CUDA (cuda/) implementations. Knows no rows, plans or ranks.
//
// Mamba-2 (the SSD layer's scan) on the CPU: the token recurrence (the oracle), its chunked
// state-space-duality form (the kernel) and shard summaries. One head, one run of consecutive tokens
// per call; the runtime loops over heads and runs.
//
// Per head h with group g = h / heads_per_group, the state is H ∈ R^{P×N}, stored transposed as
// state[n][p] (n-major: the write x ⊗ B and the read H C are then rows of P contiguous values):
//   H_t = exp(dt_t A_h) H_{t-1} + dt_t x_t B_tᵀ;   y_t = H_t C_t + D_h x_t
//
// Chunked form (chunk of c tokens starting at H_0, l_i = A Σ_{k≤i} dt_k inside the chunk):
//   y_i  = Σ_{j≤i} e^{l_i - l_j} dt_j (C_i·B_j) x_j + e^{l_i} H_0 C_i + D x_i
//   H_c  = e^{l_last} H_0 + Σ_j e^{l_last - l_j} dt_j x_j B_jᵀ
// Every exponent is ≤ 0 (dt > 0, A < 0): nothing overflows.
//
// A run is affine in its incoming state with a SCALAR map per head: H_out = a H_in + E,
// a = exp(A Σ dt). Written as the 1 x (N·P) row of the GDN algebra (M = [a], E = the state),
// summaries compose and apply with gdn_compose / gdn_apply (dk = 1, dv = N·P).
#pragma once

#include <cstdint>

namespace treecp {

// Token-major arrays of the tokens held here: x[t][h][p] = x[(t * heads + h) * head_dim + p].
// A head shard (the heads [first_head, first_head + heads) of a wider layer) holds the groups its
// heads read: local group 0 is global group first_head / heads_per_group.
template <class T>
struct Mamba2Params {
  const T* x = nullptr;   // [S, H, P]
  const T* dt = nullptr;  // [S, H], > 0 (softplus and bias already applied by the caller)
  const T* A = nullptr;   // [H], < 0
  const T* B = nullptr;   // [S, G, N]
  const T* C = nullptr;   // [S, G, N]
  const T* D = nullptr;   // [H], or null for no skip term
  int64_t tokens = 0;
  int heads = 0;            // H held here
  int head_dim = 0;         // P
  int groups = 0;           // G held here
  int state_dim = 0;        // N
  int heads_per_group = 1;  // of the whole layer
  int first_head = 0;       // global index of local head 0
  int chunk = 64;           // tokens per chunk of the chunked form

  int group_of(int h) const { return (first_head + h) / heads_per_group - first_head / heads_per_group; }
  int64_t state_size() const { return static_cast<int64_t>(state_dim) * head_dim; }
};

// Gradient arrays, same layouts as the inputs. Kernels ADD into them: dB and dC collect the heads of
// a group, dA and dD every token of a head. A null member is not computed; all null = only the state
// gradient.
template <class T>
struct Mamba2Grads {
  T* dx = nullptr;
  T* ddt = nullptr;
  T* dA = nullptr;
  T* dB = nullptr;
  T* dC = nullptr;
  T* dD = nullptr;
  bool any() const { return dx || ddt || dA || dB || dC || dD; }
};

// Checks sizes, the group mapping and chunk; names the field at fault. Values are the caller's.
template <class T>
void mamba2_check_params(const Mamba2Params<T>& p);

// ---- token recurrence (reference)
// Runs tokens [t0, t1) of head h from `state` (N x P, updated in place); writes y[t][h][:] if y.
template <class T>
void mamba2_recurrent_forward(const Mamba2Params<T>& p, int h, int64_t t0, int64_t t1, T* state, T* y);
// Backward of the above: `state_in` is the state the run started from; `dstate` holds dL/dH_out on
// entry and dL/dH_in on return.
template <class T>
void mamba2_recurrent_backward(const Mamba2Params<T>& p, int h, int64_t t0, int64_t t1, const T* state_in,
                               const T* dy, T* dstate, const Mamba2Grads<T>& grads);

// ---- chunked SSD form (chunks of p.chunk tokens starting at t0; the last may be shorter)
template <class T>
void mamba2_chunked_forward(const Mamba2Params<T>& p, int h, int64_t t0, int64_t t1, T* state, T* y);
template <class T>
void mamba2_chunked_backward(const Mamba2Params<T>& p, int h, int64_t t0, int64_t t1, const T* state_in,
                             const T* dy, T* dstate, const Mamba2Grads<T>& grads);
// The run's summary: H_out = (*a) H_in + E for any H_in; E is N x P (the run from a zero state).
template <class T>
void mamba2_chunked_summary(const Mamba2Params<T>& p, int h, int64_t t0, int64_t t1, T* a, T* E);

}  // namespace treecp
