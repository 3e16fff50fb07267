// kernels/: the local math of every layer kind: its contracts (shapes.hpp, slice.hpp) and their CPU
// (cpu/) and CUDA (cuda/) implementations. Knows no rows, plans or ranks.
//
// Causal depthwise conv1d on the CPU over tokens linked by their logical predecessor, so that a packed
// prefix tree (a child continues its parent's tail, not its storage neighbour) and halo rows received
// from other ranks need no padding or copies:
//   z_t[c] = bias[c] + Σ_{i=0}^{K-1} w[c][K-1-i] x_{pred^i(t)}[c],   y_t = z_t or silu(z_t)
// where pred^0(t) = t, pred^{i+1}(t) = prev[pred^i(t)], and a missing predecessor contributes 0.
#pragma once

#include <cstdint>

#include "kernels/shapes.hpp"

namespace treecp {

template <class T>
struct Conv1dParams {
  const T* x = nullptr;          // [rows, channels]: the outputs' own rows first, then any halo rows
  const int64_t* prev = nullptr;  // [rows]: row of the logical predecessor, -1 where there is none
  const T* weight = nullptr;     // [channels, width]; the last tap multiplies the token itself
  const T* bias = nullptr;       // [channels] or null
  int64_t rows = 0;              // rows of x (outputs + halo)
  int64_t out_rows = 0;          // outputs are rows [0, out_rows)
  ConvShape shape;               // channels, width, SiLU
};

template <class T>
void conv1d_check_params(const Conv1dParams<T>& p);

// y: [out_rows, channels].
template <class T>
void conv1d_forward(const Conv1dParams<T>& p, T* y);

// Adds into dx ([rows, channels], halo rows included), dweight ([channels, width]) and dbias
// ([channels], may be null).
template <class T>
void conv1d_backward(const Conv1dParams<T>& p, const T* dy, T* dx, T* dweight, T* dbias);

}  // namespace treecp
