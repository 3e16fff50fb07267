#include "kernels/cpu/attention.hpp"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <numeric>
#include <string_view>

#include "core/error.hpp"
#include "kernels/cpu/tile.hpp"
#include "kernels/cpu/tiles.hpp"

namespace treecp::cpu {
namespace {

// Merges a partial result (acc / l, m + log l) into the running (o, lse) of one row and head.
template <class T>
void merge_into(T* o, T* lse, const T* acc, T m, T l, int dv) {
  const T part_lse = m + std::log(l);
  if (*lse == kNegInf<T>) {
    const T inv = T(1) / l;
    for (int i = 0; i < dv; ++i) o[i] = acc[i] * inv;
    *lse = part_lse;
    return;
  }
  const T mx = std::max(*lse, part_lse);
  const T a = std::exp(*lse - mx), b = std::exp(part_lse - mx);
  const T inv = T(1) / (a + b);
  const T wa = a * inv, wb = b * inv / l;
  for (int i = 0; i < dv; ++i) o[i] = wa * o[i] + wb * acc[i];
  *lse = mx + std::log(a + b);
}

// Tiles of a slice: per KV head, blocks of query rows, each row a (query, head) pair of the group in
// query-major order, r = (q - qb) * G + hh. Scratch buffers are reused across slices of one call.
template <class T>
struct Workspace {
  int64_t block_q = 0;  // queries per block
  std::vector<T> qp, dop, kt, vt, s, p, ds, acc, m, l, lse, delta, dqp;

  explicit Workspace(const AttentionShape& sh) {
    const int G = sh.group();
    block_q = std::max<int64_t>(1, kTileRows / G);
    const auto rows = static_cast<size_t>(block_q * G);
    qp.resize(rows * sh.d);
    dop.resize(rows * sh.dv);
    kt.resize(static_cast<size_t>(kKeyBlock * sh.d));
    vt.resize(static_cast<size_t>(kKeyBlock * sh.dv));
    s.resize(rows * kKeyBlock);
    p.resize(rows * kKeyBlock);
    ds.resize(rows * kKeyBlock);
    acc.resize(rows * sh.dv);
    dqp.resize(rows * sh.d);
    m.resize(rows);
    l.resize(rows);
    lse.resize(rows);
    delta.resize(rows);
  }
};

// Rows [ra, rz) of a query block [qb, qe) that see at least one key of [kb, ke) in slice s.
struct RowSpan {
  int64_t ra, rz;
};
inline RowSpan rows_touching(const Slice& s, int64_t qb, int64_t qe, int64_t kb, int64_t ke, int G) {
  // key_end(q) > kb  <=>  q >= kb + diag_min;   key_begin(q) < ke  <=>  q < ke + diag_max - 1
  const int64_t qa = std::max(qb, kb + s.diag_min), qz = std::min(qe, ke + s.diag_max - 1);
  if (qz <= qa) return {0, 0};
  return {(qa - qb) * G, (qz - qb) * G};
}

// Kt[i][j] = K[kb + j][g][i]: keys become the contiguous dimension of the score tile's B operand.
template <class T>
void pack_transposed(const HeadView<const T>& x, int g, int64_t kb, int64_t nk, int dim, T* out) {
  for (int64_t j = 0; j < nk; ++j) {
    const T* row = x.at(kb + j, g);
    for (int i = 0; i < dim; ++i) out[i * nk + j] = row[i];
  }
}

// One slice of the forward pass: per KV head and query block, S = Q K^T per key block, an online
// softmax (running max m, denominator l, unnormalised acc += P V), merged into O/LSE at the end.
template <class Isa, class T>
TREECP_TILE_INLINE void forward_slice(const AttnForwardArgs<T>& a, const Slice& s, Workspace<T>& w) {
  const AttentionShape& sh = a.shape;
  const int G = sh.group();
  const int d = sh.d, dv = sh.dv;
  const T scale = static_cast<T>(sh.softmax_scale());
  for (int g = 0; g < sh.hkv; ++g) {
    for (int64_t qb = s.q_begin; qb < s.q_end; qb += w.block_q) {
      const int64_t qe = std::min(qb + w.block_q, s.q_end);
      const int64_t rows = (qe - qb) * G;
      for (int64_t r = 0; r < rows; ++r) {
        std::copy_n(a.q.at(qb + r / G, g * G + r % G), d, w.qp.data() + r * d);
      }
      std::fill_n(w.m.data(), rows, kNegInf<T>);
      std::fill_n(w.l.data(), rows, T(0));
      std::fill_n(w.acc.data(), rows * dv, T(0));
      const int64_t k_lo = s.key_begin(qb), k_hi = s.key_end(qe - 1);
      for (int64_t kb = k_lo; kb < k_hi; kb += kKeyBlock) {
        const int64_t ke = std::min(kb + kKeyBlock, k_hi), nk = ke - kb;
        const auto [ra, rz] = rows_touching(s, qb, qe, kb, ke, G);
        if (rz <= ra) continue;
        pack_transposed(a.k, g, kb, nk, d, w.kt.data());
        std::fill(w.s.data() + ra * nk, w.s.data() + rz * nk, T(0));
        gemm_acc<Isa>(rz - ra, nk, d, w.qp.data() + ra * d, d, 1, w.kt.data(), nk, w.s.data() + ra * nk, nk);
        for (int64_t r = ra; r < rz; ++r) {
          const int64_t q = qb + r / G;
          const int64_t j0 = std::max(kb, s.key_begin(q)) - kb, j1 = std::min(ke, s.key_end(q)) - kb;
          T* sr = w.s.data() + r * nk;
          T* pr = w.p.data() + r * nk;
          std::fill(pr, pr + nk, T(0));
          if (j0 >= j1) continue;
          T mx = kNegInf<T>;
          for (int64_t j = j0; j < j1; ++j) {
            sr[j] *= scale;
            mx = std::max(mx, sr[j]);
          }
          const T m_new = std::max(w.m[r], mx);
          if (m_new > w.m[r] && w.l[r] > 0) {
            const T corr = std::exp(w.m[r] - m_new);
            w.l[r] *= corr;
            T* acc = w.acc.data() + r * dv;
            for (int i = 0; i < dv; ++i) acc[i] *= corr;
          }
          w.m[r] = m_new;
          for (int64_t j = j0; j < j1; ++j) pr[j] = sr[j] - m_new;
          exp_inplace<Isa>(pr + j0, j1 - j0);
          T sum = 0;
          for (int64_t j = j0; j < j1; ++j) sum += pr[j];
          w.l[r] += sum;
        }
        gemm_acc<Isa>(rz - ra, dv, nk, w.p.data() + ra * nk, nk, 1, a.v.at(kb, g), a.v.row_stride,
                    w.acc.data() + ra * dv, dv);
      }
      for (int64_t r = 0; r < rows; ++r) {
        if (!(w.l[r] > 0)) continue;  // no key of this slice for the row
        const int64_t q = qb + r / G;
        const int h = g * G + static_cast<int>(r % G);
        merge_into(a.o.at(q, h), a.lse.at(q, h), w.acc.data() + r * dv, w.m[r], w.l[r], dv);
      }
    }
  }
}

// One slice of the backward pass with the complete LSE and delta = dot(dO, O) - dLSE, per key block:
// P = exp(S - LSE), dS = P (dO V^T - delta) scale; dV += P^T dO, dK += dS^T Q, dQ += dS K.
template <class Isa, class T>
TREECP_TILE_INLINE void backward_slice(const AttnBackwardArgs<T>& a, const Slice& s, const std::vector<T>& delta,
                                       Workspace<T>& w) {
  const AttentionShape& sh = a.shape;
  const int G = sh.group();
  const int d = sh.d, dv = sh.dv;
  const T scale = static_cast<T>(sh.softmax_scale());
  for (int g = 0; g < sh.hkv; ++g) {
    for (int64_t qb = s.q_begin; qb < s.q_end; qb += w.block_q) {
      const int64_t qe = std::min(qb + w.block_q, s.q_end);
      const int64_t rows = (qe - qb) * G;
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t q = qb + r / G;
        const int h = g * G + static_cast<int>(r % G);
        std::copy_n(a.q.at(q, h), d, w.qp.data() + r * d);
        std::copy_n(a.dout.at(q, h), dv, w.dop.data() + r * dv);
        w.lse[r] = *a.lse.at(q, h);
        w.delta[r] = delta[static_cast<size_t>(q * sh.hq + h)];
      }
      std::fill_n(w.dqp.data(), rows * d, T(0));
      const int64_t k_lo = s.key_begin(qb), k_hi = s.key_end(qe - 1);
      for (int64_t kb = k_lo; kb < k_hi; kb += kKeyBlock) {
        const int64_t ke = std::min(kb + kKeyBlock, k_hi), nk = ke - kb;
        const auto [ra, rz] = rows_touching(s, qb, qe, kb, ke, G);
        if (rz <= ra) continue;
        pack_transposed(a.k, g, kb, nk, d, w.kt.data());
        pack_transposed(a.v, g, kb, nk, dv, w.vt.data());
        std::fill(w.s.data() + ra * nk, w.s.data() + rz * nk, T(0));
        std::fill(w.ds.data() + ra * nk, w.ds.data() + rz * nk, T(0));
        gemm_acc<Isa>(rz - ra, nk, d, w.qp.data() + ra * d, d, 1, w.kt.data(), nk, w.s.data() + ra * nk, nk);
        // ds holds dP = dO V^T until it is turned into dS below
        gemm_acc<Isa>(rz - ra, nk, dv, w.dop.data() + ra * dv, dv, 1, w.vt.data(), nk, w.ds.data() + ra * nk, nk);
        for (int64_t r = ra; r < rz; ++r) {
          const int64_t q = qb + r / G;
          const int64_t j0 = std::max(kb, s.key_begin(q)) - kb, j1 = std::min(ke, s.key_end(q)) - kb;
          const T* sr = w.s.data() + r * nk;
          T* pr = w.p.data() + r * nk;
          T* dsr = w.ds.data() + r * nk;
          const T lse = w.lse[r], dl = w.delta[r];
          std::fill(pr, pr + nk, T(0));
          // LSE = -inf with a visible key is inconsistent input; such a row contributes nothing
          if (j0 >= j1 || lse == kNegInf<T>) {
            std::fill(dsr, dsr + nk, T(0));
            continue;
          }
          for (int64_t j = j0; j < j1; ++j) pr[j] = sr[j] * scale - lse;
          exp_inplace<Isa>(pr + j0, j1 - j0);
          for (int64_t j = 0; j < nk; ++j) dsr[j] = pr[j] * (dsr[j] - dl) * scale;
        }
        const int64_t nr = rz - ra;
        gemm_acc<Isa>(nk, dv, nr, w.p.data() + ra * nk, 1, nk, w.dop.data() + ra * dv, dv, a.dv.at(kb, g),
                    a.dv.row_stride);
        gemm_acc<Isa>(nk, d, nr, w.ds.data() + ra * nk, 1, nk, w.qp.data() + ra * d, d, a.dk.at(kb, g),
                    a.dk.row_stride);
        gemm_acc<Isa>(nr, d, nk, w.ds.data() + ra * nk, nk, 1, a.k.at(kb, g), a.k.row_stride, w.dqp.data() + ra * d, d);
      }
      for (int64_t r = 0; r < rows; ++r) {
        axpy(a.dq.at(qb + r / G, g * G + static_cast<int>(r % G)), T(1), w.dqp.data() + r * d, d);
      }
    }
  }
}

template <class Isa, class T>
TREECP_TILE_INLINE void forward_slices(const AttnForwardArgs<T>& a, const std::vector<Slice>& slices, Workspace<T>& w) {
  for (const Slice& s : slices) {
    if (!s.empty()) forward_slice<Isa>(a, s, w);
  }
}
template <class Isa, class T>
TREECP_TILE_INLINE void backward_slices(const AttnBackwardArgs<T>& a, const std::vector<Slice>& slices,
                                        const std::vector<T>& delta, Workspace<T>& w) {
  for (const Slice& s : slices) {
    if (!s.empty()) backward_slice<Isa>(a, s, delta, w);
  }
}

#if TREECP_X86_DISPATCH
template <class T>
__attribute__((target("avx2,fma"))) void forward_slices_avx2(const AttnForwardArgs<T>& a,
                                                              const std::vector<Slice>& slices, Workspace<T>& w) {
  forward_slices<IsaAvx2>(a, slices, w);
}
template <class T>
__attribute__((target("avx2,fma"))) void backward_slices_avx2(const AttnBackwardArgs<T>& a,
                                                               const std::vector<Slice>& slices,
                                                               const std::vector<T>& delta, Workspace<T>& w) {
  backward_slices<IsaAvx2>(a, slices, delta, w);
}
#endif
template <class T>
void forward_slices_baseline(const AttnForwardArgs<T>& a, const std::vector<Slice>& slices, Workspace<T>& w) {
  forward_slices<IsaBaseline>(a, slices, w);
}
template <class T>
void backward_slices_baseline(const AttnBackwardArgs<T>& a, const std::vector<Slice>& slices,
                              const std::vector<T>& delta, Workspace<T>& w) {
  backward_slices<IsaBaseline>(a, slices, delta, w);
}

template <class T>
void run_forward(const AttnForwardArgs<T>& a, const std::vector<Slice>& slices, Workspace<T>& w) {
#if TREECP_X86_DISPATCH
  if (use_avx2()) return forward_slices_avx2(a, slices, w);
#endif
  forward_slices_baseline(a, slices, w);
}
template <class T>
void run_backward(const AttnBackwardArgs<T>& a, const std::vector<Slice>& slices, const std::vector<T>& delta,
                  Workspace<T>& w) {
#if TREECP_X86_DISPATCH
  if (use_avx2()) return backward_slices_avx2(a, slices, delta, w);
#endif
  backward_slices_baseline(a, slices, delta, w);
}

void require_view(const void* data, int64_t rows, const char* name) {
  require(rows == 0 || data != nullptr, "attention: ", name, " is null");
}

}  // namespace

void validate_slices(int64_t q_rows, int64_t kv_rows, const std::vector<Slice>& slices) {
  for (size_t i = 0; i < slices.size(); ++i) {
    const Slice& s = slices[i];
    if (s.empty()) continue;
    require(s.q_begin >= 0 && s.q_end <= q_rows && s.k_begin >= 0 && s.k_end <= kv_rows, "attention: slice ", i, " ",
            to_string(s), " outside the buffers q[0,", q_rows, ") k[0,", kv_rows, ")");
  }
}

namespace {

// The checks forward and backward share: shape, slices inside the buffers, scale, Q/K/V/O/LSE views.
template <class Args>
void check_common_args(const Args& args, const std::vector<Slice>& slices, const char* what) {
  args.shape.validate();
  require(args.q_rows >= 0 && args.kv_rows >= 0, what, ": q_rows and kv_rows must be >= 0, got ", args.q_rows, ", ",
          args.kv_rows);
  validate_slices(args.q_rows, args.kv_rows, slices);
  require_view(args.q.data, args.q_rows, "q");
  require_view(args.k.data, args.kv_rows, "k");
  require_view(args.v.data, args.kv_rows, "v");
  require_view(args.o.data, args.q_rows, "o");
  require_view(args.lse.data, args.q_rows, "lse");
}

}  // namespace

template <class T>
void attention_forward(const AttnForwardArgs<T>& args, const std::vector<Slice>& slices) {
  const AttentionShape& sh = args.shape;
  check_common_args(args, slices, "attention_forward");
  for (int64_t q = 0; q < args.q_rows; ++q) {
    for (int h = 0; h < sh.hq; ++h) {
      std::fill(args.o.at(q, h), args.o.at(q, h) + sh.dv, T(0));
      *args.lse.at(q, h) = kNegInf<T>;
    }
  }
  Workspace<T> work(sh);
  run_forward(args, slices, work);
}

template <class T>
void attention_backward(const AttnBackwardArgs<T>& args, const std::vector<Slice>& slices) {
  const AttentionShape& sh = args.shape;
  check_common_args(args, slices, "attention_backward");
  require_view(args.dout.data, args.q_rows, "dout");
  require_view(args.dq.data, args.q_rows, "dq");
  require_view(args.dk.data, args.kv_rows, "dk");
  require_view(args.dv.data, args.kv_rows, "dv");
  // delta[q * hq + h] = dot(dO, O) - dLSE of the complete output
  std::vector<T> delta(static_cast<size_t>(args.q_rows * sh.hq));
  for (int64_t q = 0; q < args.q_rows; ++q) {
    for (int h = 0; h < sh.hq; ++h) {
      T dl = dot(args.dout.at(q, h), args.o.at(q, h), sh.dv);
      if (args.dlse.data) dl -= *args.dlse.at(q, h);
      delta[static_cast<size_t>(q * sh.hq + h)] = dl;
    }
  }
  Workspace<T> work(sh);
  run_backward(args, slices, delta, work);
}

template <class T>
void merge_forward(const MergeArgs<T>& a) {
  require(a.rows >= 0 && a.heads > 0 && a.dv > 0, "merge: rows >= 0, heads > 0, dv > 0 expected");
  require(a.parts >= 0, "merge: parts must be >= 0");
  require(a.parts == 0 || (a.o_parts && a.lse_parts), "merge: o_parts and lse_parts are null");
  std::vector<T> w(static_cast<size_t>(a.parts));
  for (int64_t r = 0; r < a.rows; ++r) {
    for (int h = 0; h < a.heads; ++h) {
      T* o = a.o.at(r, h);
      T mx = kNegInf<T>;
      for (int p = 0; p < a.parts; ++p) mx = std::max(mx, *a.lse_parts[p].at(r, h));
      std::fill(o, o + a.dv, T(0));
      if (mx == kNegInf<T>) {  // no part saw a key
        *a.lse.at(r, h) = kNegInf<T>;
        continue;
      }
      T sum = 0;
      for (int p = 0; p < a.parts; ++p) {
        w[p] = std::exp(*a.lse_parts[p].at(r, h) - mx);
        sum += w[p];
      }
      const T inv = T(1) / sum;
      for (int p = 0; p < a.parts; ++p) {
        if (w[p] > 0) axpy(o, w[p] * inv, a.o_parts[p].at(r, h), a.dv);
      }
      *a.lse.at(r, h) = mx + std::log(sum);
    }
  }
}

template <class T>
void merge_backward(const MergeBackwardArgs<T>& a) {
  const MergeArgs<T>& f = a.fwd;
  require(f.parts == 0 || (a.dout_parts && a.dlse_parts), "merge_backward: dout_parts and dlse_parts are null");
  for (int64_t r = 0; r < f.rows; ++r) {
    for (int h = 0; h < f.heads; ++h) {
      const T lse = *f.lse.at(r, h);
      const T* o = f.o.at(r, h);
      const T* g = a.dout.at(r, h);
      const T gl = a.dlse.data ? *a.dlse.at(r, h) : T(0);
      const T go = dot(g, o, f.dv);
      for (int p = 0; p < f.parts; ++p) {
        T* dop = a.dout_parts[p].at(r, h);
        const T lp = *f.lse_parts[p].at(r, h);
        // w_r = exp(L_r - L) <= 1; zero for an empty part or an empty merged row
        const T w = (lse == kNegInf<T> || lp == kNegInf<T>) ? T(0) : std::exp(lp - lse);
        for (int i = 0; i < f.dv; ++i) dop[i] = w * g[i];
        // dot(g, o_r - o) = dot(g, o_r) - dot(g, o)
        *a.dlse_parts[p].at(r, h) = w == T(0) ? T(0) : w * (dot(g, f.o_parts[p].at(r, h), f.dv) - go + gl);
      }
    }
  }
}

namespace {
// Token weight w = exp(L - logaddexp(L, a)) and 1 - w, both from the maximum-subtracted form so that
// neither loses precision by cancellation. L = -inf gives w = 0 (the sink takes all mass, o = 0).
template <class T>
void sink_weights(T lse, T sink, T& w, T& one_minus_w) {
  if (lse == kNegInf<T>) {
    w = 0;
    one_minus_w = 1;
    return;
  }
  if (sink == kNegInf<T>) {
    w = 1;
    one_minus_w = 0;
    return;
  }
  const T mx = std::max(lse, sink);
  const T a = std::exp(lse - mx), b = std::exp(sink - mx);
  w = a / (a + b);
  one_minus_w = b / (a + b);
}

template <class T>
void check_sink(const SinkArgs<T>& a) {
  require(a.rows >= 0 && a.hq > 0 && a.dv > 0, "sink: rows >= 0, hq > 0, dv > 0 expected");
  require(a.sink != nullptr, "sink: sink logits are null");
  for (int h = 0; h < a.hq; ++h) {
    require(!std::isnan(a.sink[h]) && a.sink[h] != std::numeric_limits<T>::infinity(), "sink: logit of head ", h,
            " must be finite or -inf, got ", a.sink[h]);
  }
}
}  // namespace

template <class T>
void sink_forward(const SinkArgs<T>& a) {
  check_sink(a);
  for (int64_t r = 0; r < a.rows; ++r) {
    for (int h = 0; h < a.hq; ++h) {
      T w, wc;
      sink_weights(*a.lse.at(r, h), a.sink[h], w, wc);
      const T* o = a.o.at(r, h);
      T* y = a.y.at(r, h);
      for (int i = 0; i < a.dv; ++i) y[i] = w * o[i];
    }
  }
}

template <class T>
void sink_backward(const SinkBackwardArgs<T>& a) {
  const SinkArgs<T>& f = a.fwd;
  check_sink(f);
  // dJ/da sums over every row of the call: accumulated in double so that a float run loses no more
  // than one rounding per head to it
  std::vector<double> dsink(static_cast<size_t>(f.hq), 0.0);
  for (int64_t r = 0; r < f.rows; ++r) {
    for (int h = 0; h < f.hq; ++h) {
      T w, wc;
      sink_weights(*f.lse.at(r, h), f.sink[h], w, wc);
      const T* o = f.o.at(r, h);
      const T* g = a.dy.at(r, h);
      T* dout = a.dout.at(r, h);
      for (int i = 0; i < f.dv; ++i) dout[i] = w * g[i];
      const T c = w * wc * dot(g, o, f.dv);
      *a.dlse.at(r, h) = c;
      dsink[static_cast<size_t>(h)] += static_cast<double>(c);
    }
  }
  if (a.dsink) {
    for (int h = 0; h < f.hq; ++h) a.dsink[h] -= static_cast<T>(dsink[static_cast<size_t>(h)]);
  }
}

#define TREECP_INSTANTIATE(T)                                                                     \
  template void attention_forward<T>(const AttnForwardArgs<T>&, const std::vector<Slice>&);      \
  template void attention_backward<T>(const AttnBackwardArgs<T>&, const std::vector<Slice>&);    \
  template void merge_forward<T>(const MergeArgs<T>&);                                            \
  template void merge_backward<T>(const MergeBackwardArgs<T>&);                                   \
  template void sink_forward<T>(const SinkArgs<T>&);                                              \
  template void sink_backward<T>(const SinkBackwardArgs<T>&);

TREECP_INSTANTIATE(float)
TREECP_INSTANTIATE(double)
#undef TREECP_INSTANTIATE

}  // namespace treecp::cpu
