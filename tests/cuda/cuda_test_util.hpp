// Helpers for the GPU tests: bf16 and fp16 on the host, device buffers, random trees (common/common.hpp), a double-precision
// oracle of slice attention (brute force over Row::visible), and relative errors.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "comm/thread_communicator.hpp"
#include "common/common.hpp"
#include "kernels/cuda/attention.hpp"
#include "plan/ownership.hpp"
#include "tree/row.hpp"

namespace treecp::cuda::test {

inline uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  return static_cast<uint16_t>(u >> 16);
}
inline float from_bf16(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

template <class T>
struct DeviceBuffer {
  T* ptr = nullptr;
  size_t n = 0;
  explicit DeviceBuffer(size_t count) : n(count) { check_cuda(cudaMalloc(&ptr, std::max<size_t>(count, 1) * sizeof(T)), "test cudaMalloc"); }
  DeviceBuffer(const std::vector<T>& host) : DeviceBuffer(host.size()) { upload(host); }
  ~DeviceBuffer() { cudaFree(ptr); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  void upload(const std::vector<T>& host) {
    check_cuda(cudaMemcpy(ptr, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice), "test upload");
  }
  std::vector<T> download() const {
    std::vector<T> host(n);
    check_cuda(cudaMemcpy(host.data(), ptr, n * sizeof(T), cudaMemcpyDeviceToHost), "test download");
    return host;
  }
  // Poison: every byte 0xff (bf16 and fp32 NaN), so unwritten outputs show.
  void poison() { check_cuda(cudaMemset(ptr, 0xff, n * sizeof(T)), "test memset"); }
  void zero() { check_cuda(cudaMemset(ptr, 0, n * sizeof(T)), "test memset"); }
};

// A 16-bit element's value (bf16 by this file's converter, fp16 by kernels/cuda/dtype.hpp's, which the CPU suite
// checks on every pattern).
inline double elem_value(uint16_t bits, DType t) { return t == DType::kBf16 ? from_bf16(bits) : bits_to_f32(bits, t); }
inline uint16_t to_elem(float f, DType t) { return t == DType::kBf16 ? to_bf16(f) : f32_to_bits(f, t); }

// A random bf16 or fp16 tensor: bits for the device and the same values as doubles for the oracle.
struct Tensor {
  std::vector<uint16_t> bits;
  std::vector<double> val;
};
inline Tensor random_tensor(size_t n, std::mt19937_64& rng, double stddev = 1.0, DType dtype = DType::kBf16) {
  std::normal_distribution<float> dist(0.f, static_cast<float>(stddev));
  Tensor t;
  t.bits.resize(n);
  t.val.resize(n);
  for (size_t i = 0; i < n; ++i) {
    t.bits[i] = to_elem(dist(rng), dtype);
    t.val[i] = elem_value(t.bits[i], dtype);
  }
  return t;
}

// The rows of a full-row result that `ranges` select, scattered back from a rank's buffer into `full`.
template <class T>
void put_rows(std::vector<double>& full, const std::vector<T>& mine, int64_t width, const std::vector<TokenRange>& ranges,
              double (*conv)(T)) {
  int64_t at = 0;
  for (const TokenRange& r : ranges)
    for (int64_t t = r.begin; t < r.end; ++t, ++at)
      for (int64_t i = 0; i < width; ++i) full[static_cast<size_t>(t * width + i)] = conv(mine[static_cast<size_t>(at * width + i)]);
}

// Ranks as threads sharing device 0: exchanges land late and out of order, each part a device copy made after
// the device has finished the sender's packing, and finished before the receiver's wait() can return. (A
// device-to-device cudaMemcpy returns before the copy is done, on the legacy stream, which the backends'
// non-blocking streams do not wait for: without the second wait a receiver's next kernel could read the part
// before it lands. GdnCudaCP saw exactly that once, run 134, with another process time-slicing the GPU.)
inline ThreadCommOptions device_thread_comm(uint64_t seed) {
  ThreadCommOptions copt;
  copt.late = true;
  copt.seed = seed;
  copt.copy = [](void* dst, const void* src, size_t bytes) {
    check_cuda(cudaDeviceSynchronize(), "test copy: wait");
    check_cuda(cudaMemcpy(dst, src, bytes, cudaMemcpyDefault), "test copy");
    check_cuda(cudaDeviceSynchronize(), "test copy: landed");
  };
  return copt;
}

// A random tree (common/common.hpp) with single-token segments common; lengths in [1, max_len].
inline Row random_row(std::mt19937_64& rng, int segments, int max_len) {
  return treecp::testing::random_tree(
      rng, {.segments = segments, .max_len = max_len, .max_depth = 8, .single_token = 0.25});
}

struct Dims {
  int64_t q_rows, kv_rows;
  int hq, hkv, d;
  int dv = 0;  // columns of V and O (and g, dV); 0 = d
  int vd() const { return dv == 0 ? d : dv; }
};

// Double oracle over explicit visibility vis(q, k) in buffer coordinates.
struct OracleForward {
  std::vector<double> o, lse;  // [q_rows, hq, dv], [q_rows, hq]
};
template <class Vis>
OracleForward oracle_forward(const Dims& m, const std::vector<double>& q, const std::vector<double>& k,
                             const std::vector<double>& v, double scale, Vis&& vis) {
  OracleForward r;
  const int dv = m.vd();
  r.o.assign(m.q_rows * m.hq * dv, 0.0);
  r.lse.assign(m.q_rows * m.hq, -INFINITY);
  const int g = m.hq / m.hkv;
  std::vector<double> s(m.kv_rows);
  for (int64_t i = 0; i < m.q_rows; ++i)
    for (int h = 0; h < m.hq; ++h) {
      const int kh = h / g;
      double mx = -INFINITY;
      for (int64_t j = 0; j < m.kv_rows; ++j) {
        s[j] = -INFINITY;
        if (!vis(i, j)) continue;
        double dot = 0;
        for (int d = 0; d < m.d; ++d) dot += q[(i * m.hq + h) * m.d + d] * k[(j * m.hkv + kh) * m.d + d];
        s[j] = dot * scale;
        mx = std::max(mx, s[j]);
      }
      if (mx == -INFINITY) continue;
      double sum = 0;
      for (int64_t j = 0; j < m.kv_rows; ++j)
        if (s[j] != -INFINITY) sum += std::exp(s[j] - mx);
      const double lse = mx + std::log(sum);
      r.lse[i * m.hq + h] = lse;
      for (int64_t j = 0; j < m.kv_rows; ++j) {
        if (s[j] == -INFINITY) continue;
        const double p = std::exp(s[j] - lse);
        for (int d = 0; d < dv; ++d) r.o[(i * m.hq + h) * dv + d] += p * v[(j * m.hkv + kh) * dv + d];
      }
    }
  return r;
}

// Backward of J = sum(g * y), y = w o (w = sink weight, 1 without a sink), o the attention output.
struct OracleBackward {
  std::vector<double> dq, dk, dv, dsink;
};
template <class Vis>
OracleBackward oracle_backward(const Dims& m, const std::vector<double>& q, const std::vector<double>& k,
                               const std::vector<double>& v, const std::vector<double>& g, double scale,
                               const OracleForward& f, const std::vector<double>* sink, Vis&& vis) {
  OracleBackward r;
  r.dq.assign(q.size(), 0.0);
  r.dk.assign(k.size(), 0.0);
  r.dv.assign(v.size(), 0.0);
  r.dsink.assign(m.hq, 0.0);
  const int gs = m.hq / m.hkv;
  const int dv = m.vd();
  for (int64_t i = 0; i < m.q_rows; ++i)
    for (int h = 0; h < m.hq; ++h) {
      const double lse = f.lse[i * m.hq + h];
      if (lse == -INFINITY) continue;
      const int kh = h / gs;
      const double* oi = &f.o[(i * m.hq + h) * dv];
      const double* gi = &g[(i * m.hq + h) * dv];
      double w = 1.0;
      if (sink) w = 1.0 / (1.0 + std::exp((*sink)[h] - lse));
      double gdot = 0;
      for (int d = 0; d < dv; ++d) gdot += gi[d] * oi[d];
      const double dl = sink ? w * (1 - w) * gdot : 0.0;
      r.dsink[h] -= dl;
      const double dsum = w * gdot - dl;  // dot(dO, o) - dJ/dL with dO = w g
      for (int64_t j = 0; j < m.kv_rows; ++j) {
        if (!vis(i, j)) continue;
        const double* qi = &q[(i * m.hq + h) * m.d];
        const double* kj = &k[(j * m.hkv + kh) * m.d];
        const double* vj = &v[(j * m.hkv + kh) * dv];
        double s = 0, dp = 0;
        for (int d = 0; d < m.d; ++d) s += qi[d] * kj[d];
        for (int d = 0; d < dv; ++d) dp += w * gi[d] * vj[d];
        const double p = std::exp(s * scale - lse);
        const double ds = p * (dp - dsum);
        for (int d = 0; d < m.d; ++d) {
          r.dq[(i * m.hq + h) * m.d + d] += scale * ds * kj[d];
          r.dk[(j * m.hkv + kh) * m.d + d] += scale * ds * qi[d];
        }
        for (int d = 0; d < dv; ++d) r.dv[(j * m.hkv + kh) * dv + d] += p * w * gi[d];
      }
    }
  return r;
}

// ||a - b|| / ||b||, with NaN reported as infinity.
template <class A>
double rel_error(const std::vector<A>& a, const std::vector<double>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < b.size(); ++i) {
    const double x = static_cast<double>(a[i]);
    if (std::isnan(x)) return INFINITY;
    if (x == b[i]) continue;  // equal values, including -inf LSE of rows with no key
    num += (x - b[i]) * (x - b[i]);
    den += b[i] * b[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

inline std::vector<double> bf16_to_double(const std::vector<uint16_t>& bits) {
  std::vector<double> out(bits.size());
  for (size_t i = 0; i < bits.size(); ++i) out[i] = from_bf16(bits[i]);
  return out;
}
inline std::vector<double> elem_to_double(const std::vector<uint16_t>& bits, DType t) {
  std::vector<double> out(bits.size());
  for (size_t i = 0; i < bits.size(); ++i) out[i] = elem_value(bits[i], t);
  return out;
}

}  // namespace treecp::cuda::test
