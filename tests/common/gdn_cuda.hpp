// The checks of the CUDA GDN/KDA kernels, written once for two executors: the host emulation of the kernels
// (tests/test_gdn_cuda_emulated.cpp, in the CPU suite) and the GPU (tests/cuda/test_gdn_cuda.cpp). A `Dev`
// owns memory and runs the calls:
//   template <class T> T* put(const std::vector<T>&);  template <class T> std::vector<T> get(const T*, size_t);
//   void* workspace(size_t bytes) (256-byte aligned, every byte 0xff: reads of unwritten scratch show as NaN);
//   forward(p, runs), summary(p, runs, M, E), backward(p, runs, grads), compose(...), apply(...),
//   apply_transposed(...) as in kernels/cuda/gdn.hpp; workspace_bytes(p, runs, kind) (GdnCallKind: each call gets
//   exactly its own size, so that a kernel's access past its call's carving shows).
// Oracle: kernels/cpu's token recurrence in double on the inputs rounded to the case's 16-bit type (bf16 or fp16).
// Tolerance: k x the error of the CPU chunked form in float against it, plus a small atol (plus one rounding of the
// 16-bit type, rounding(dtype), where the output is 16-bit). For
// GdnPrecision::bf16_tensor the same-precision reference is the CPU chunked form on Bf16Product (every product's
// factors rounded to bf16: kernels/cpu/bf16_product.hpp), the error model of operands rounded to bf16.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/bf16_product.hpp"
#include "kernels/cpu/gdn.hpp"
#include "kernels/cuda/gdn_device.cuh"  // bf16 conversions (host side)
#include "kernels/cuda/gdn_types.hpp"
#include "common/common.hpp"
#include "common/gdn.hpp"

namespace treecp::cuda::gdn_test {

// The device may sum in another order than the CPU float reference. Against the bf16 model (which rounds a superset of
// the device's operands) the emulated bf16 path's forward outputs come out 2-20x below it (the scans keep their state
// in fp32) and its gradients at 0.1-2.5x (90 cases; the scalar gate's dg, a sum over channels that cancels, and
// dbeta are the noisiest): the same factor serves.
constexpr double kErrFactor = 8;
constexpr double kAtol = 1e-6;        // normwise relative, for outputs the float reference gets almost exact
const double kBf16Rounding = std::ldexp(1.0, -8);  // relative rounding of a bf16 output (8-bit significand)
const double kF16Rounding = std::ldexp(1.0, -11);  // of an fp16 output (11-bit significand)
inline double rounding(DType t) { return t == DType::kF16 ? kF16Rounding : kBf16Rounding; }

// Prints each checked error beside the same-precision reference's and the tolerance (the GPU run's log shows margins).
inline void expect_within(const char* what, double err, double ref_err, double tol) {
  std::printf("    %-28s error %.3g   same-precision reference %.3g   tolerance %.3g\n", what, err, ref_err, tol);
  EXPECT_LE(err, tol) << what << " (same-precision reference: " << ref_err << ")";
}

// ||a - b|| / ||b|| (NaN counts as infinite).
template <class A>
double rel_err(const std::vector<A>& a, const std::vector<double>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < b.size(); ++i) {
    const double x = static_cast<double>(a[i]);
    if (std::isnan(x)) return INFINITY;
    num += (x - b[i]) * (x - b[i]);
    den += b[i] * b[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

// An array rounded to a 16-bit type (bf16 by default, or fp16) and its values.
struct Bf16Array {
  std::vector<uint16_t> bits;
  std::vector<double> val;  // the rounded values
  explicit Bf16Array(const std::vector<double>& x, DType t = DType::kBf16) : bits(x.size()), val(x.size()) {
    for (size_t i = 0; i < x.size(); ++i) {
      bits[i] = f32_to_bits(static_cast<float>(x[i]), t);
      val[i] = bits_to_f32(bits[i], t);
    }
  }
};
// The values of 16-bit patterns of type t.
inline std::vector<double> values16(const std::vector<uint16_t>& bits, DType t) {
  std::vector<double> out(bits.size());
  for (size_t i = 0; i < bits.size(); ++i) out[i] = bits_to_f32(bits[i], t);
  return out;
}
inline const char* dtype_label(DType t) { return t == DType::kF16 ? "fp16" : "bf16"; }

inline std::vector<double> random_values(size_t n, std::mt19937_64& rng, double sd) {
  std::normal_distribution<double> d(0.0, sd);
  std::vector<double> x(n);
  for (auto& e : x) e = d(rng);
  return x;
}

struct Case {
  int64_t S;
  int H, dk, dv;
  GdnGate gate;
  float scale;
  std::vector<GdnCudaRun> runs;
  int slots;
  Bf16Array q, k, v, g, beta, dy;
  std::vector<double> state_in, d_state_out;  // fp32 values [slots, H, dk, dv]
  int32_t scan_columns = 0;                   // GdnCudaParams::scan_columns
  bool tensor_cores = false;                  // GdnCudaParams::tensor_cores
  GdnPrecision precision = GdnPrecision::fp32;  // GdnCudaParams::precision
  bool split_forward = false;                   // GdnCudaParams::split_forward
  bool fla_split = false;                       // GdnCudaParams::fla_split (with precision bf16_tensor_scans)
  DType dtype = DType::kBf16;                   // GdnCudaParams::dtype: the inputs' (and 16-bit y's) type
  bool bf16() const { return precision != GdnPrecision::fp32; }
  // The FLA-like split (forward and backward) at `columns` state columns (0 = the default), on its precision.
  Case& fla(int32_t columns = 0) {
    precision = GdnPrecision::bf16_tensor_scans;
    fla_split = true;
    scan_columns = columns;
    return *this;
  }
  // v and dy times 2^v_exp, the initial states times 2^s_exp: exact (the rounded values only change exponent while
  // they stay normal and finite in the 16-bit type, which the caller's exponents keep).
  void scale_values(int v_exp, int s_exp) {
    auto times = [&](const Bf16Array& a, int e) {
      std::vector<double> x = a.val;
      for (auto& v : x) v = std::ldexp(v, e);
      return Bf16Array(x, dtype);
    };
    v = times(v, v_exp);
    dy = times(dy, v_exp);
    for (auto& x : state_in) x = std::ldexp(x, s_exp);
  }
  int64_t ssz() const { return static_cast<int64_t>(dk) * dv; }

  Case(int64_t S_, int H_, int dk_, int dv_, GdnGate gate_, std::vector<GdnCudaRun> runs_, int slots_, uint64_t seed,
       DType dtype_ = DType::kBf16)
      : Case(random_data(S_, H_, dk_, dv_, gate_, seed), std::move(runs_), slots_, seed, dtype_) {}
  // The run's seed (common/common.hpp) salted by the case's: fresh inputs every run, replayable.
  static testing::GdnData random_data(int64_t S, int H, int dk, int dv, GdnGate gate, uint64_t salt) {
    testing::Rng rng = testing::test_rng(salt);
    return testing::random_gdn_data(S, H, dk, dv, gate, rng);
  }
  // `dtype`: the inputs rounded to it (the oracle takes the rounded values).
  Case(const testing::GdnData& d, std::vector<GdnCudaRun> runs_, int slots_, uint64_t seed, DType dtype_ = DType::kBf16)
      : S(d.S), H(d.H), dk(d.dk), dv(d.dv), gate(d.gate), scale(static_cast<float>(1.0 / std::sqrt(d.dk))),
        runs(std::move(runs_)), slots(slots_), q(d.q, dtype_), k(d.k, dtype_), v(d.v, dtype_), g(d.g, dtype_),
        beta(d.beta, dtype_), dy(d.dy, dtype_), dtype(dtype_) {
    std::mt19937_64 rng(seed ^ 0x5eedu);
    auto fp32 = [](std::vector<double> x) {
      for (auto& e : x) e = static_cast<float>(e);
      return x;
    };
    state_in = fp32(random_values(static_cast<size_t>(slots) * H * ssz(), rng, 0.5));
    d_state_out = fp32(random_values(static_cast<size_t>(slots) * H * ssz(), rng, 0.5));
  }

  template <class T>
  struct Host {
    std::vector<T> q, k, v, g, beta, dy;
  };
  template <class T>
  Host<T> host() const {
    auto cv = [](const std::vector<double>& x) { return std::vector<T>(x.begin(), x.end()); };
    return {cv(q.val), cv(k.val), cv(v.val), cv(g.val), cv(beta.val), cv(dy.val)};
  }
  template <class T>
  GdnParams<T> cpu_params(const Host<T>& h) const {
    GdnParams<T> p;
    p.q = h.q.data(); p.k = h.k.data(); p.v = h.v.data(); p.g = h.g.data(); p.beta = h.beta.data();
    p.tokens = S; p.shape = GdnShape{H, dk, dv, gate, scale, 64};
    return p;
  }
};

// The CPU reference of every run: recurrent (double) or chunked (float).
struct Reference {
  std::vector<double> y, state_out, dq, dk, dv, dg, dbeta, d_state_in;
};
template <class T>
Reference cpu_reference(const Case& c, bool chunked, bool backward) {
  const auto h = c.host<T>();
  const GdnParams<T> p = c.cpu_params(h);
  const int64_t ssz = c.ssz();
  std::vector<T> y(c.v.val.size(), T(0)), so(c.state_in.size(), T(0)), dsi(c.state_in.size(), T(0));
  std::vector<T> dq(c.q.val.size(), T(0)), dk(c.k.val.size(), T(0)), dv(c.v.val.size(), T(0)), dg(c.g.val.size(), T(0)),
      db(c.beta.val.size(), T(0));
  const GdnGrads<T> gr{dq.data(), dk.data(), dv.data(), dg.data(), db.data()};
  for (const GdnCudaRun& r : c.runs)
    for (int hd = 0; hd < c.H; ++hd) {
      std::vector<T> s0(static_cast<size_t>(ssz), T(0));
      if (r.in_slot >= 0)
        for (int64_t i = 0; i < ssz; ++i) s0[i] = static_cast<T>(c.state_in[(r.in_slot * c.H + hd) * ssz + i]);
      std::vector<T> s = s0;
      if (chunked)
        gdn_chunked_forward(p, hd, r.t0, r.t1, s.data(), y.data());
      else
        gdn_recurrent_forward(p, hd, r.t0, r.t1, s.data(), y.data());
      if (r.out_slot >= 0) std::copy(s.begin(), s.end(), so.begin() + (r.out_slot * c.H + hd) * ssz);
      if (!backward) continue;
      std::vector<T> ds(static_cast<size_t>(ssz), T(0));
      if (r.out_slot >= 0)
        for (int64_t i = 0; i < ssz; ++i) ds[i] = static_cast<T>(c.d_state_out[(r.out_slot * c.H + hd) * ssz + i]);
      if (chunked)
        gdn_chunked_backward(p, hd, r.t0, r.t1, s0.data(), h.dy.data(), ds.data(), gr);
      else
        gdn_recurrent_backward(p, hd, r.t0, r.t1, s0.data(), h.dy.data(), ds.data(), gr);
      if (r.in_slot >= 0) std::copy(ds.begin(), ds.end(), dsi.begin() + (r.in_slot * c.H + hd) * ssz);
    }
  auto wd = [](const std::vector<T>& x) { return std::vector<double>(x.begin(), x.end()); };
  return {wd(y), wd(so), wd(dq), wd(dk), wd(dv), wd(dg), wd(db), wd(dsi)};
}

// The reference of the device's precision (the tolerances' scale): float, or the bf16 model.
inline Reference same_precision_reference(const Case& c, bool backward) {
  return c.bf16() ? cpu_reference<Bf16Product>(c, true, backward) : cpu_reference<float>(c, true, backward);
}

// The parameters' shapes, precision and dtype without any memory (for workspace_bytes and its checks).
inline GdnCudaParams device_params_shape(const Case& c) {
  GdnCudaParams p;
  p.tokens = c.S; p.heads = c.H; p.dk = c.dk; p.dv = c.dv; p.gate = c.gate; p.scale = c.scale;
  p.scan_columns = c.scan_columns;
  p.tensor_cores = c.tensor_cores;
  p.precision = c.precision;
  p.split_forward = c.split_forward;
  p.fla_split = c.fla_split;
  p.dtype = c.dtype;
  return p;
}

template <class Dev>
GdnCudaParams device_params(Dev& dev, const Case& c, GdnCallKind kind) {
  GdnCudaParams p = device_params_shape(c);
  p.q = dev.put(c.q.bits); p.k = dev.put(c.k.bits); p.v = dev.put(c.v.bits);
  p.g = dev.put(c.g.bits); p.beta = dev.put(c.beta.bits);
  p.state_in = dev.put(std::vector<float>(c.state_in.begin(), c.state_in.end()));
  p.workspace_bytes = dev.workspace_bytes(p, c.runs, kind);
  p.workspace = dev.workspace(p.workspace_bytes);
  return p;
}

// Tokens no run covers.
inline std::vector<bool> uncovered(const Case& c) {
  std::vector<bool> out(static_cast<size_t>(c.S), true);
  for (const GdnCudaRun& r : c.runs)
    for (int64_t t = r.t0; t < r.t1; ++t) out[t] = false;
  return out;
}

template <class Dev>
void check_forward(Dev& dev, const Case& c, bool y_f32) {
  const Reference ref = cpu_reference<double>(c, false, false), f32 = same_precision_reference(c, false);
  GdnCudaParams p = device_params(dev, c, GdnCallKind::forward);
  const size_t ny = c.v.val.size();
  constexpr float kSentinel = 12288.f;  // exact in bf16 and fp16 (3 x 2^12)
  void* y = y_f32 ? static_cast<void*>(dev.put(std::vector<float>(ny, kSentinel)))
                  : static_cast<void*>(dev.put(std::vector<uint16_t>(ny, f32_to_bits(kSentinel, c.dtype))));
  p.y = y;
  p.y_f32 = y_f32;
  float* so = dev.put(std::vector<float>(c.state_in.size(), kSentinel));
  p.state_out = so;
  dev.forward(p, c.runs);
  std::vector<double> yd(ny);
  if (y_f32) {
    const auto h = dev.get(static_cast<const float*>(y), ny);
    yd.assign(h.begin(), h.end());
  } else {
    yd = values16(dev.get(static_cast<const uint16_t*>(y), ny), c.dtype);
  }
  // Untouched outside the runs; there the oracle holds 0, so compare the runs' tokens only.
  const std::vector<bool> out = uncovered(c);
  std::vector<double> y_runs = yd, y_ref = ref.y, y_f32ref = f32.y;
  for (int64_t t = 0; t < c.S; ++t)
    for (int64_t i = t * c.H * c.dv; i < (t + 1) * c.H * c.dv; ++i)
      if (out[t]) {
        EXPECT_EQ(yd[i], kSentinel) << "y of token " << t << " (outside every run) was written";
        y_runs[i] = y_ref[i] = y_f32ref[i] = 0;
      }
  const double e32 = rel_err(y_f32ref, y_ref);
  const double tol_y = kErrFactor * e32 + kAtol + (y_f32 ? 0.0 : rounding(c.dtype));
  expect_within(y_f32 ? "y (fp32)" : c.dtype == DType::kF16 ? "y (fp16)" : "y (bf16)", rel_err(y_runs, y_ref), e32, tol_y);
  // Final states where an out_slot is given, untouched elsewhere.
  const auto sod = dev.get(so, c.state_in.size());
  std::vector<bool> written(static_cast<size_t>(c.slots), false);
  for (const GdnCudaRun& r : c.runs)
    if (r.out_slot >= 0) written[r.out_slot] = true;
  std::vector<double> s_dev(sod.begin(), sod.end()), s_ref = ref.state_out, s_f32 = f32.state_out;
  for (int s = 0; s < c.slots; ++s)
    if (!written[s])
      for (int64_t i = s * c.H * c.ssz(); i < (s + 1) * c.H * c.ssz(); ++i) {
        EXPECT_EQ(sod[i], kSentinel) << "state_out slot " << s << " was written";
        s_dev[i] = s_ref[i] = s_f32[i] = 0;
      }
  const double es = rel_err(s_f32, s_ref);
  expect_within("final states", rel_err(s_dev, s_ref), es, kErrFactor * es + kAtol);
}

// dy_offset: a 16-bit dy starts that many elements past the allocation's (16-byte aligned) start: 1 puts it 2 bytes
// past a 4-byte boundary (the kernels that copy it asynchronously fall back to element loads), 2 on a 4-byte
// boundary 4 bytes past a 16-byte one (cp.async still, by gdn_stage_rows' generic loop in 4-byte units).
template <class Dev>
void check_backward(Dev& dev, const Case& c, bool dy_f32, int dy_offset = 0, bool kept = false) {
  const Reference ref = cpu_reference<double>(c, false, true), f32 = same_precision_reference(c, true);
  GdnCudaParams p = device_params(dev, c, GdnCallKind::backward);
  p.y_f32 = dy_f32;
  if (kept) {
    // The forward keeps its arrays for the backward (GdnCudaParams::keep_forward) in the backward's workspace, which
    // is then its own size; its y is not wanted (the scan saves the arrays anyway).
    p.keep_forward = true;
    EXPECT_EQ(dev.workspace_bytes(p, c.runs, GdnCallKind::forward), p.workspace_bytes)
        << "a kept forward carves the backward's workspace";
    GdnCudaParams f = p;
    f.y = nullptr;
    f.y_f32 = false;
    f.state_out = dev.put(std::vector<float>(c.state_in.size(), 0.f));
    dev.forward(f, c.runs);
  }
  GdnCudaGrads g;
  if (dy_f32) {
    g.dy = dev.put(std::vector<float>(c.dy.val.begin(), c.dy.val.end()));
  } else if (dy_offset > 0) {
    std::vector<uint16_t> shifted(c.dy.bits.size() + dy_offset, 0);
    std::copy(c.dy.bits.begin(), c.dy.bits.end(), shifted.begin() + dy_offset);
    g.dy = dev.put(shifted) + dy_offset;
  } else {
    g.dy = dev.put(c.dy.bits);
  }
  g.d_state_out = dev.put(std::vector<float>(c.d_state_out.begin(), c.d_state_out.end()));
  // Gradients are added into: start from random values and compare the difference (small ones, so that the
  // fp32 rounding of base + gradient stays far below the tolerance; an overwrite still fails by ~1e-2 / |grad|).
  std::mt19937_64 rng(c.S * 7919 + c.dk);
  auto base = [&](size_t n) {
    const auto x = random_values(n, rng, 1e-2);
    return std::vector<float>(x.begin(), x.end());
  };
  const auto bq = base(c.q.val.size()), bk = base(c.k.val.size()), bv = base(c.v.val.size()),
             bg = base(c.g.val.size()), bb = base(c.beta.val.size());
  g.dq = dev.put(bq); g.dk = dev.put(bk); g.dv = dev.put(bv); g.dg = dev.put(bg); g.dbeta = dev.put(bb);
  g.d_state_in = dev.put(std::vector<float>(c.state_in.size(), 0.f));
  dev.backward(p, c.runs, g);
  auto diff = [&](const float* d, const std::vector<float>& b) {
    const auto h = dev.get(d, b.size());
    std::vector<double> out(b.size());
    for (size_t i = 0; i < b.size(); ++i) out[i] = static_cast<double>(h[i]) - b[i];
    return out;
  };
  struct Item {
    const char* name;
    std::vector<double> dev, ref, f32;
  };
  std::vector<Item> items = {{"dq", diff(g.dq, bq), ref.dq, f32.dq}, {"dk", diff(g.dk, bk), ref.dk, f32.dk},
                             {"dv", diff(g.dv, bv), ref.dv, f32.dv}, {"dg", diff(g.dg, bg), ref.dg, f32.dg},
                             {"dbeta", diff(g.dbeta, bb), ref.dbeta, f32.dbeta}};
  const auto dsi = dev.get(g.d_state_in, c.state_in.size());
  items.push_back({"d_state_in", std::vector<double>(dsi.begin(), dsi.end()), ref.d_state_in, f32.d_state_in});
  for (const Item& it : items) {
    const double e32 = rel_err(it.f32, it.ref);
    expect_within(it.name, rel_err(it.dev, it.ref), e32, kErrFactor * e32 + kAtol);
  }
}

template <class Dev>
void check_summary(Dev& dev, const Case& c) {
  const auto hd = c.host<double>();
  const GdnParams<double> pd = c.cpu_params(hd);
  const int64_t mk = static_cast<int64_t>(c.dk) * c.dk, ssz = c.ssz();
  GdnCudaParams p = device_params(dev, c, GdnCallKind::summary);
  const size_t nm = static_cast<size_t>(c.slots) * c.H * mk, ne = static_cast<size_t>(c.slots) * c.H * ssz;
  float* M = dev.put(std::vector<float>(nm, 0.f));
  float* E = dev.put(std::vector<float>(ne, 0.f));
  dev.summary(p, c.runs, M, E);
  const auto Md = dev.get(M, nm), Ed = dev.get(E, ne);
  std::vector<double> mr(nm, 0), er(ne, 0), mf(nm, 0), ef(ne, 0);
  // The chunked summary on the device's precision (float, or the bf16 model) into mf, ef.
  auto same_precision = [&](auto zero) {
    using T = decltype(zero);
    const auto ht = c.host<T>();
    const GdnParams<T> pt = c.cpu_params(ht);
    for (const GdnCudaRun& r : c.runs) {
      if (r.out_slot < 0) continue;
      for (int h = 0; h < c.H; ++h) {
        const int64_t om = (r.out_slot * c.H + h) * mk, oe = (r.out_slot * c.H + h) * ssz;
        std::vector<T> m(static_cast<size_t>(mk)), e(static_cast<size_t>(ssz));
        gdn_chunked_summary(pt, h, r.t0, r.t1, m.data(), e.data());
        std::copy(m.begin(), m.end(), mf.begin() + om);
        std::copy(e.begin(), e.end(), ef.begin() + oe);
      }
    }
  };
  if (c.bf16())
    same_precision(Bf16Product());
  else
    same_precision(0.f);
  for (const GdnCudaRun& r : c.runs) {
    if (r.out_slot < 0) continue;
    for (int h = 0; h < c.H; ++h)
      gdn_chunked_summary(pd, h, r.t0, r.t1, mr.data() + (r.out_slot * c.H + h) * mk, er.data() + (r.out_slot * c.H + h) * ssz);
  }
  const double em = rel_err(mf, mr), ee = rel_err(ef, er);
  expect_within("summary M", rel_err(Md, mr), em, kErrFactor * em + kAtol);
  expect_within("summary E", rel_err(Ed, er), ee, kErrFactor * ee + kAtol);
  // apply(M, E) to the runs' initial states = the forward's final states from them
  std::vector<float> s(ne, 0.f);
  std::vector<GdnCudaRun> from_state = c.runs;
  for (GdnCudaRun& r : from_state) r.in_slot = r.out_slot;  // start from state_in[out_slot]
  for (const GdnCudaRun& r : c.runs)
    if (r.out_slot >= 0)
      for (int64_t i = 0; i < c.H * ssz; ++i) s[r.out_slot * c.H * ssz + i] = static_cast<float>(c.state_in[r.out_slot * c.H * ssz + i]);
  float* out = dev.put(std::vector<float>(ne, 0.f));
  dev.apply(static_cast<int64_t>(c.slots) * c.H, c.dk, c.dv, M, E, dev.put(s), out);
  p.state_out = dev.put(std::vector<float>(ne, 0.f));
  p.workspace_bytes = dev.workspace_bytes(p, from_state, GdnCallKind::forward);  // the forward's own carving
  p.workspace = dev.workspace(p.workspace_bytes);
  dev.forward(p, from_state);
  const auto applied = dev.get(out, ne), final_states = dev.get(p.state_out, ne);
  Case from = c;
  from.runs = from_state;
  const Reference ref = cpu_reference<double>(from, false, false), f32 = same_precision_reference(from, false);
  const double es = rel_err(f32.state_out, ref.state_out);
  expect_within("apply(M,E,s) vs recurrence", rel_err(applied, ref.state_out), es, kErrFactor * es + kAtol);
  expect_within("apply(M,E,s) vs forward", rel_err(applied, std::vector<double>(final_states.begin(), final_states.end())),
                es, kErrFactor * es + kAtol);
}

// Compose's associativity and both applies against the CPU algebra in double, outputs aliasing their B.
template <class Dev>
void check_algebra(Dev& dev, int dk, int dv, int64_t count, uint64_t seed) {
  std::mt19937_64 rng(seed);
  const size_t nm = static_cast<size_t>(count) * dk * dk, ne = static_cast<size_t>(count) * dk * dv;
  auto f32 = [](std::vector<double> x) {
    for (auto& e : x) e = static_cast<float>(e);
    return x;
  };
  const double msd = 1.0 / std::sqrt(dk);  // products of a few stay of norm ~1
  std::vector<double> M[3], E[3];
  for (int i = 0; i < 3; ++i) {
    M[i] = f32(random_values(nm, rng, msd));
    E[i] = f32(random_values(ne, rng, 1.0));
  }
  auto fl = [](const std::vector<double>& x) { return std::vector<float>(x.begin(), x.end()); };
  // CPU, double and float: (C ∘ B) ∘ A
  auto cpu = [&](auto zero) {
    using T = decltype(zero);
    std::vector<T> m[3], e[3];
    for (int i = 0; i < 3; ++i) {
      m[i].assign(M[i].begin(), M[i].end());
      e[i].assign(E[i].begin(), E[i].end());
    }
    std::vector<T> mbc(nm), ebc(ne), m3(nm), e3(ne);
    for (int64_t b = 0; b < count; ++b) {
      const size_t om = b * dk * dk, oe = b * dk * dv;
      gdn_compose(dk, dv, m[2].data() + om, e[2].data() + oe, m[1].data() + om, e[1].data() + oe, mbc.data() + om, ebc.data() + oe);
      gdn_compose(dk, dv, mbc.data() + om, ebc.data() + oe, m[0].data() + om, e[0].data() + oe, m3.data() + om, e3.data() + oe);
    }
    return std::make_pair(std::vector<double>(m3.begin(), m3.end()), std::vector<double>(e3.begin(), e3.end()));
  };
  const auto ref = cpu(0.0), r32 = cpu(0.f);
  const double em = rel_err(r32.first, ref.first), ee = rel_err(r32.second, ref.second);
  // Device, both bracketings; each compose writes over its B (M = MB, E = EB aliasing).
  float* dM[3];
  float* dE[3];
  auto upload_all = [&] {
    for (int i = 0; i < 3; ++i) {
      dM[i] = dev.put(fl(M[i]));
      dE[i] = dev.put(fl(E[i]));
    }
  };
  upload_all();  // C ∘ (B ∘ A): B <- B ∘ A, C <- C ∘ B
  dev.compose(count, dk, dv, dM[1], dE[1], dM[0], dE[0], dM[1], dE[1]);
  dev.compose(count, dk, dv, dM[2], dE[2], dM[1], dE[1], dM[2], dE[2]);
  const auto m_right = dev.get(dM[2], nm), e_right = dev.get(dE[2], ne);
  upload_all();  // (C ∘ B) ∘ A: C <- C ∘ B, C <- C ∘ A
  dev.compose(count, dk, dv, dM[2], dE[2], dM[1], dE[1], dM[2], dE[2]);
  dev.compose(count, dk, dv, dM[2], dE[2], dM[0], dE[0], dM[2], dE[2]);
  const auto m_left = dev.get(dM[2], nm), e_left = dev.get(dE[2], ne);
  expect_within("compose C(BA): M", rel_err(m_right, ref.first), em, kErrFactor * em + kAtol);
  expect_within("compose C(BA): E", rel_err(e_right, ref.second), ee, kErrFactor * ee + kAtol);
  expect_within("compose (CB)A: M", rel_err(m_left, ref.first), em, kErrFactor * em + kAtol);
  expect_within("compose (CB)A: E", rel_err(e_left, ref.second), ee, kErrFactor * ee + kAtol);
  // apply and apply_transposed: out = M s + E, out = Mᵀ s + E, out aliasing E
  const std::vector<double> s = f32(random_values(ne, rng, 1.0));
  std::vector<double> ap(ne), at(ne);
  std::vector<float> ap32(ne), at32(ne);
  const auto m32 = fl(M[0]), e32v = fl(E[0]), s32 = fl(s);
  for (int64_t b = 0; b < count; ++b) {
    const size_t om = b * dk * dk, oe = b * dk * dv;
    gdn_apply(dk, dv, M[0].data() + om, E[0].data() + oe, s.data() + oe, ap.data() + oe);
    gdn_apply_transposed(dk, dv, M[0].data() + om, E[0].data() + oe, s.data() + oe, at.data() + oe);
    gdn_apply(dk, dv, m32.data() + om, e32v.data() + oe, s32.data() + oe, ap32.data() + oe);
    gdn_apply_transposed(dk, dv, m32.data() + om, e32v.data() + oe, s32.data() + oe, at32.data() + oe);
  }
  upload_all();
  float* ds = dev.put(s32);
  dev.apply(count, dk, dv, dM[0], dE[0], ds, dE[0]);
  const auto ap_dev = dev.get(dE[0], ne);
  dE[1] = dev.put(e32v);
  dev.apply_transposed(count, dk, dv, dM[0], dE[1], ds, dE[1]);
  const auto at_dev = dev.get(dE[1], ne);
  const double ea = rel_err(ap32, ap), et = rel_err(at32, at);
  expect_within("apply", rel_err(ap_dev, ap), ea, kErrFactor * ea + kAtol);
  expect_within("apply_transposed", rel_err(at_dev, at), et, kErrFactor * et + kAtol);
}

// A parameterised test's gate and head dims, and its name (gdn_dk64_dv64, kda_dk48_dv80, ...).
struct Shape {
  GdnGate gate;
  int dk, dv;
};
inline std::string shape_name(const ::testing::TestParamInfo<Shape>& info) {
  return std::string(info.param.gate == GdnGate::Scalar ? "gdn" : "kda") + "_dk" + std::to_string(info.param.dk) + "_dv" +
         std::to_string(info.param.dv);
}
// The shapes both suites run: dk 64 and 128 with both gates, and dk != dv with partial 32-column tiles.
inline auto all_shapes() {
  return ::testing::Values(Shape{GdnGate::Scalar, 64, 64}, Shape{GdnGate::PerChannel, 64, 64},
                           Shape{GdnGate::Scalar, 128, 128}, Shape{GdnGate::PerChannel, 128, 128},
                           Shape{GdnGate::PerChannel, 48, 80});
}

// The runs of the tests: a single token, lengths below, at and above one chunk and not multiples of 64, with
// and without initial states, an empty run passing its state through, and tokens no run covers.
inline std::vector<GdnCudaRun> ragged_runs(int64_t scale) {
  const int64_t a = 1, b = a + 37, c = b + 64, d = c + 131 * scale, e = d + 3;
  return {{0, a, 0, 0}, {a, b, -1, 1}, {b, c, 1, -1}, {c, d, -1, 2}, {d, d, 2, 3}, {e, e + 70 * scale, 3, -1}};
}
inline int64_t ragged_tokens(int64_t scale) { return ragged_runs(scale).back().t1 + 5; }

// fp16 activations (GdnCudaParams::dtype kF16) on the fp32 products, written once for both suites: both gates, a
// ragged shape off the vector paths (dk 37, dv 21), 16-bit and fp32 y / dy, the summary; 3xTF32 products with 16
// scan columns; the split forward; and large values (v and dy x 2^8, initial states x 2^15: states past fp16's
// largest finite value 65504, y in the thousands, still finite in fp16), which pass only if no intermediate of the
// fp16 path is an fp16 value. Tolerances as for bf16,
// with fp16's rounding 2^-11 on the 16-bit outputs. bf16 products on fp16 activations are refused by name.
template <class Dev>
void check_fp16(Dev& dev) {
  struct S3 {
    GdnGate gate;
    int dk, dv;
  };
  uint64_t seed = 70;
  for (const S3 s : {S3{GdnGate::Scalar, 64, 64}, S3{GdnGate::PerChannel, 48, 80}, S3{GdnGate::PerChannel, 37, 21}}) {
    std::printf("  fp16 %s dk %d dv %d\n", s.gate == GdnGate::Scalar ? "gdn" : "kda", s.dk, s.dv);
    const Case c(ragged_tokens(1), 2, s.dk, s.dv, s.gate, ragged_runs(1), 4, ++seed, DType::kF16);
    check_forward(dev, c, /*y_f32=*/false);
    check_forward(dev, c, /*y_f32=*/true);
    check_backward(dev, c, /*dy_f32=*/false);
    check_backward(dev, c, /*dy_f32=*/true);
    check_summary(dev, c);
  }
  std::printf("  fp16 3xTF32 products, 16 scan columns (kda dk 40 dv 72)\n");
  Case t(ragged_tokens(1), 1, 40, 72, GdnGate::PerChannel, ragged_runs(1), 4, ++seed, DType::kF16);
  t.tensor_cores = true;
  t.scan_columns = 16;
  check_forward(dev, t, /*y_f32=*/false);
  check_backward(dev, t, /*dy_f32=*/false);
  check_summary(dev, t);
  std::printf("  fp16 split forward (gdn dk 64 dv 64)\n");
  Case f(ragged_tokens(1), 1, 64, 64, GdnGate::Scalar, ragged_runs(1), 4, ++seed, DType::kF16);
  f.split_forward = true;
  check_forward(dev, f, /*y_f32=*/false);
  std::printf("  fp16 large values (kda dk 64 dv 64)\n");
  Case big(ragged_tokens(1), 1, 64, 64, GdnGate::PerChannel, ragged_runs(1), 4, ++seed, DType::kF16);
  big.scale_values(8, 15);
  const Reference r = cpu_reference<double>(big, false, false);
  double ymax = 0, smax = 0;
  for (const double y : r.y) ymax = std::max(ymax, std::abs(y));
  for (const double x : r.state_out) smax = std::max(smax, std::abs(x));
  std::printf("    max |y| %.4g, max |final state| %.4g (fp16's largest finite 65504)\n", ymax, smax);
  EXPECT_GT(ymax, 1000.0) << "the case must have large outputs";
  EXPECT_GT(smax, 65504.0) << "the case's states must exceed fp16's range";
  EXPECT_LT(ymax, 32768.0) << "y must stay finite in fp16 (with room for the device's rounding)";
  check_forward(dev, big, /*y_f32=*/false);
  check_backward(dev, big, /*dy_f32=*/false);
  check_summary(dev, big);
  for (const GdnPrecision pr : {GdnPrecision::bf16_tensor, GdnPrecision::bf16_tensor_scans}) {
    Case b(ragged_tokens(1), 1, 64, 64, GdnGate::Scalar, ragged_runs(1), 4, 5, DType::kF16);
    b.precision = pr;
    try {
      dev.workspace_bytes(device_params_shape(b), b.runs, GdnCallKind::forward);
      ADD_FAILURE() << "fp16 with a bf16 precision accepted";
    } catch (const Error& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find(pr == GdnPrecision::bf16_tensor ? "bf16_tensor" : "bf16_tensor_scans"), std::string::npos) << m;
      EXPECT_NE(m.find("fp16"), std::string::npos) << m;
    }
  }
}

}  // namespace treecp::cuda::gdn_test
