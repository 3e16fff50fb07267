#include "kernels/cpu/conv1d.hpp"

#include <cmath>
#include <vector>

#include "core/error.hpp"

namespace treecp {
namespace {

// taps[i] = row of pred^i(t) (or -1), i = 0 .. width-1.
void walk(const int64_t* prev, int64_t t, int width, int64_t* taps) {
  int64_t r = t;
  for (int i = 0; i < width; ++i) {
    taps[i] = r;
    if (r >= 0) r = prev[r];
  }
}

template <class T>
T sigmoid(T z) {
  return T(1) / (T(1) + std::exp(-z));
}

}  // namespace

template <class T>
void conv1d_check_params(const Conv1dParams<T>& p) {
  p.shape.validate();
  require(p.rows >= p.out_rows && p.out_rows >= 0, "conv1d: rows (", p.rows, ") must be >= out_rows (", p.out_rows,
          ") >= 0");
  require(p.rows == 0 || (p.x && p.prev && p.weight), "conv1d: x, prev and weight must be given");
  for (int64_t r = 0; r < p.rows; ++r)
    require(p.prev[r] >= -1 && p.prev[r] < p.rows, "conv1d: prev[", r, "] = ", p.prev[r], " out of range");
}

template <class T>
void conv1d_forward(const Conv1dParams<T>& p, T* y) {
  const int C = p.shape.channels, K = p.shape.width;
  std::vector<int64_t> taps(static_cast<size_t>(K));
  for (int64_t t = 0; t < p.out_rows; ++t) {
    walk(p.prev, t, K, taps.data());
    T* yt = y + t * C;
    for (int c = 0; c < C; ++c) yt[c] = p.bias ? p.bias[c] : T(0);
    for (int i = 0; i < K; ++i) {
      if (taps[i] < 0) break;
      const T* xr = p.x + taps[i] * C;
      for (int c = 0; c < C; ++c) yt[c] += p.weight[c * K + (K - 1 - i)] * xr[c];
    }
    if (p.shape.silu)
      for (int c = 0; c < C; ++c) yt[c] *= sigmoid(yt[c]);
  }
}

template <class T>
void conv1d_backward(const Conv1dParams<T>& p, const T* dy, T* dx, T* dweight, T* dbias) {
  const int C = p.shape.channels, K = p.shape.width;
  std::vector<int64_t> taps(static_cast<size_t>(K));
  std::vector<T> dz(static_cast<size_t>(C));
  for (int64_t t = 0; t < p.out_rows; ++t) {
    walk(p.prev, t, K, taps.data());
    const T* dyt = dy + t * C;
    if (p.shape.silu) {
      // Recompute z; d silu(z)/dz = s (1 + z (1 - s)).
      for (int c = 0; c < C; ++c) dz[c] = p.bias ? p.bias[c] : T(0);
      for (int i = 0; i < K && taps[i] >= 0; ++i)
        for (int c = 0; c < C; ++c) dz[c] += p.weight[c * K + (K - 1 - i)] * p.x[taps[i] * C + c];
      for (int c = 0; c < C; ++c) {
        const T s = sigmoid(dz[c]);
        dz[c] = dyt[c] * s * (T(1) + dz[c] * (T(1) - s));
      }
    } else {
      for (int c = 0; c < C; ++c) dz[c] = dyt[c];
    }
    if (dbias)
      for (int c = 0; c < C; ++c) dbias[c] += dz[c];
    for (int i = 0; i < K && taps[i] >= 0; ++i) {
      const T* xr = p.x + taps[i] * C;
      T* dxr = dx + taps[i] * C;
      for (int c = 0; c < C; ++c) {
        dxr[c] += p.weight[c * K + (K - 1 - i)] * dz[c];
        if (dweight) dweight[c * K + (K - 1 - i)] += xr[c] * dz[c];
      }
    }
  }
}

template void conv1d_check_params<float>(const Conv1dParams<float>&);
template void conv1d_check_params<double>(const Conv1dParams<double>&);
template void conv1d_forward<float>(const Conv1dParams<float>&, float*);
template void conv1d_forward<double>(const Conv1dParams<double>&, double*);
template void conv1d_backward<float>(const Conv1dParams<float>&, const float*, float*, float*, float*);
template void conv1d_backward<double>(const Conv1dParams<double>&, const double*, double*, double*, double*);

}  // namespace treecp
