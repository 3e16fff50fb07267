// runtime/: executes plans on one rank, one class per layer kind, generic over a Backend and a
// Communicator; moves activations between ownerships; the one-process references.
//
// The CPU Backend of the runtime (runtime/backend.hpp) over kernels/cpu: host vectors, float or double;
// attention, GDN/KDA and the short convolution.
#pragma once

#include <algorithm>
#include <cstring>
#include <vector>

#include "comm/communicator.hpp"
#include "core/error.hpp"
#include "kernels/cpu/attention.hpp"
#include "kernels/cpu/conv1d.hpp"
#include "kernels/cpu/gdn.hpp"
#include "runtime/backend.hpp"

namespace treecp {

template <class T>
class CpuBackend {
 public:
  using Real = T;
  using Buffer = std::vector<T>;
  static constexpr CommType comm_type = sizeof(T) == 8 ? CommType::F64 : CommType::F32;

  Buffer alloc(int64_t n) { return Buffer(static_cast<size_t>(n), T(0)); }
  T* data(Buffer& b) { return b.data(); }
  const T* data(const Buffer& b) const { return b.data(); }
  int64_t size(const Buffer& b) const { return static_cast<int64_t>(b.size()); }
  void zero(Buffer& b) { std::fill(b.begin(), b.end(), T(0)); }

  void copy_rows(const Buffer& src, const std::vector<RowCopy>& copies, int64_t width, Buffer& dst) {
    for (const RowCopy& c : copies) {
      check(src, c.src_row, c.rows, width, "copy_rows source");
      check(dst, c.dst_row, c.rows, width, "copy_rows destination");
      if (c.rows > 0) std::memmove(dst.data() + c.dst_row * width, src.data() + c.src_row * width,
                                   static_cast<size_t>(c.rows * width) * sizeof(T));
    }
  }
  void add_rows(const Buffer& src, const std::vector<RowCopy>& copies, int64_t width, Buffer& dst) {
    for (const RowCopy& c : copies) {
      check(src, c.src_row, c.rows, width, "add_rows source");
      check(dst, c.dst_row, c.rows, width, "add_rows destination");
      const T* s = src.data() + c.src_row * width;
      T* d = dst.data() + c.dst_row * width;
      for (int64_t i = 0; i < c.rows * width; ++i) d[i] += s[i];
    }
  }

  void attention_forward(const AttentionShape& sh, const Buffer& q, int64_t q_rows, const Buffer& k, const Buffer& v,
                         int64_t kv_rows, const std::vector<Slice>& slices, Buffer& o, Buffer& lse) {
    cpu::AttnForwardArgs<T> a;
    a.shape = sh;
    a.q_rows = q_rows;
    a.kv_rows = kv_rows;
    a.q = cpu::dense_view<const T>(q.data(), sh.hq, sh.d);
    a.k = cpu::dense_view<const T>(k.data(), sh.hkv, sh.d);
    a.v = cpu::dense_view<const T>(v.data(), sh.hkv, sh.dv);
    a.o = cpu::dense_view<T>(o.data(), sh.hq, sh.dv);
    a.lse = cpu::dense_view<T>(lse.data(), sh.hq, 1);
    cpu::attention_forward(a, slices);
  }

  void merge(Buffer& o_acc, Buffer& lse_acc, const Buffer& o, const Buffer& lse, int64_t rows, int hq, int dv) {
    const Buffer o_prev = o_acc, lse_prev = lse_acc;
    const cpu::HeadView<const T> op[2] = {cpu::dense_view<const T>(o_prev.data(), hq, dv),
                                          cpu::dense_view<const T>(o.data(), hq, dv)};
    const cpu::HeadView<const T> lp[2] = {cpu::dense_view<const T>(lse_prev.data(), hq, 1),
                                          cpu::dense_view<const T>(lse.data(), hq, 1)};
    cpu::MergeArgs<T> m;
    m.rows = rows;
    m.heads = hq;
    m.dv = dv;
    m.parts = 2;
    m.o_parts = op;
    m.lse_parts = lp;
    m.o = cpu::dense_view<T>(o_acc.data(), hq, dv);
    m.lse = cpu::dense_view<T>(lse_acc.data(), hq, 1);
    cpu::merge_forward(m);
  }

  void sink_forward(const Buffer& o, const Buffer& lse, const Buffer& sink, int64_t rows, int hq, int dv, Buffer& y) {
    cpu::SinkArgs<T> s;
    s.rows = rows;
    s.hq = hq;
    s.dv = dv;
    s.sink = sink.data();
    s.o = cpu::dense_view<const T>(o.data(), hq, dv);
    s.lse = cpu::dense_view<const T>(lse.data(), hq, 1);
    s.y = cpu::dense_view<T>(y.data(), hq, dv);
    cpu::sink_forward(s);
  }

  void sink_backward(const Buffer& dy, const Buffer& o, const Buffer& lse, const Buffer* sink, int64_t rows, int hq,
                     int dv, Buffer& d_o, Buffer& dlse, Buffer* dsink) {
    if (sink == nullptr) {  // no sink: the output is O itself
      copy_rows(dy, {{0, 0, rows}}, int64_t{hq} * dv, d_o);
      zero(dlse);
      return;
    }
    cpu::SinkBackwardArgs<T> s;
    s.fwd.rows = rows;
    s.fwd.hq = hq;
    s.fwd.dv = dv;
    s.fwd.sink = sink->data();
    s.fwd.o = cpu::dense_view<const T>(o.data(), hq, dv);
    s.fwd.lse = cpu::dense_view<const T>(lse.data(), hq, 1);
    s.dy = cpu::dense_view<const T>(dy.data(), hq, dv);
    s.dout = cpu::dense_view<T>(d_o.data(), hq, dv);
    s.dlse = cpu::dense_view<T>(dlse.data(), hq, 1);
    s.dsink = dsink ? dsink->data() : nullptr;
    Buffer scratch;
    if (!s.dsink) {
      scratch.assign(static_cast<size_t>(hq), T(0));
      s.dsink = scratch.data();
    }
    cpu::sink_backward(s);
  }

  void attention_backward(const AttentionShape& sh, const Buffer& q, int64_t q_rows, const Buffer& k, const Buffer& v,
                          int64_t kv_rows, const Buffer& o, const Buffer& lse, const Buffer& d_o, const Buffer& dlse,
                          const std::vector<Slice>& slices, Buffer& dq, Buffer& dk, Buffer& dv) {
    cpu::AttnBackwardArgs<T> a;
    a.shape = sh;
    a.q_rows = q_rows;
    a.kv_rows = kv_rows;
    a.q = cpu::dense_view<const T>(q.data(), sh.hq, sh.d);
    a.k = cpu::dense_view<const T>(k.data(), sh.hkv, sh.d);
    a.v = cpu::dense_view<const T>(v.data(), sh.hkv, sh.dv);
    a.o = cpu::dense_view<const T>(o.data(), sh.hq, sh.dv);
    a.lse = cpu::dense_view<const T>(lse.data(), sh.hq, 1);
    a.dout = cpu::dense_view<const T>(d_o.data(), sh.hq, sh.dv);
    a.dlse = cpu::dense_view<const T>(dlse.data(), sh.hq, 1);
    a.dq = cpu::dense_view<T>(dq.data(), sh.hq, sh.d);
    a.dk = cpu::dense_view<T>(dk.data(), sh.hkv, sh.d);
    a.dv = cpu::dense_view<T>(dv.data(), sh.hkv, sh.dv);
    cpu::attention_backward(a, slices);
  }

  // ---- GDN / KDA

  void gdn_forward(const GdnShape& sh, const GdnInputs<Buffer>& in, int64_t row, int64_t rows, Buffer& state,
                   Buffer& y) {
    const GdnParams<T> p = gdn_params(sh, in);
    check(state, 0, 1, sh.state_elements(), "gdn state");
    check(y, row, rows, sh.v_width(), "gdn y");
    const int64_t ssz = int64_t{sh.dk} * sh.dv;
    for (int h = 0; h < sh.heads; ++h) gdn_chunked_forward(p, h, row, row + rows, state.data() + h * ssz, y.data());
  }

  void gdn_backward(const GdnShape& sh, const GdnInputs<Buffer>& in, int64_t row, int64_t rows, const Buffer& state_in,
                    const Buffer& dy, Buffer& dstate, const GdnGradients<Buffer>& grads) {
    const GdnParams<T> p = gdn_params(sh, in);
    check(state_in, 0, 1, sh.state_elements(), "gdn state_in");
    check(dstate, 0, 1, sh.state_elements(), "gdn dstate");
    check(dy, row, rows, sh.v_width(), "gdn dy");
    auto ptr = [&](Buffer* b, int64_t width, const char* what) -> T* {
      if (!b) return nullptr;
      check(*b, row, rows, width, what);
      return b->data();
    };
    const GdnGrads<T> g{ptr(grads.dq, sh.qk_width(), "gdn dq"), ptr(grads.dk, sh.qk_width(), "gdn dk"),
                        ptr(grads.dv, sh.v_width(), "gdn dv"), ptr(grads.dg, sh.g_width(), "gdn dg"),
                        ptr(grads.dbeta, sh.heads, "gdn dbeta")};
    const int64_t ssz = int64_t{sh.dk} * sh.dv;
    for (int h = 0; h < sh.heads; ++h)
      gdn_chunked_backward(p, h, row, row + rows, state_in.data() + h * ssz, dy.data(), dstate.data() + h * ssz, g);
  }

  void gdn_summary(const GdnShape& sh, const GdnInputs<Buffer>& in, int64_t row, int64_t rows, Buffer& maps,
                   int64_t item) {
    check(maps, item, 1, sh.map_elements(), "gdn maps");
    const int dk = sh.dk;
    const int64_t blk = sh.map_block();
    T* m = maps.data() + item * sh.map_elements();
    std::fill(m, m + sh.map_elements(), T(0));
    if (rows == 0) {  // no tokens here: the identity map
      for (int h = 0; h < sh.heads; ++h)
        for (int d = 0; d < dk; ++d) m[h * blk + d * dk + d] = T(1);
      return;
    }
    const GdnParams<T> p = gdn_params(sh, in);
    for (int h = 0; h < sh.heads; ++h) gdn_chunked_summary(p, h, row, row + rows, m + h * blk, m + h * blk + dk * dk);
  }

  void gdn_compose(const GdnShape& sh, int64_t items, Buffer& later, const Buffer& earlier) {
    check(later, 0, items, sh.map_elements(), "gdn compose later");
    check(earlier, 0, items, sh.map_elements(), "gdn compose earlier");
    const int dk = sh.dk, dv = sh.dv;
    for (int64_t i = 0; i < items * sh.heads; ++i) {
      T* a = later.data() + i * sh.map_block();
      const T* e = earlier.data() + i * sh.map_block();
      treecp::gdn_compose(dk, dv, a, a + dk * dk, e, e + dk * dk, a, a + dk * dk);
    }
  }

  void gdn_seed(const GdnShape& sh, Buffer& maps, int64_t item, const Buffer* state) {
    check(maps, item, 1, sh.map_elements(), "gdn seed maps");
    const int dk = sh.dk, dv = sh.dv;
    const int64_t ssz = int64_t{dk} * dv;
    std::vector<T> out(static_cast<size_t>(ssz));
    for (int h = 0; h < sh.heads; ++h) {
      T* A = maps.data() + item * sh.map_elements() + h * sh.map_block();
      T* B = A + dk * dk;
      if (state) {
        gdn_apply(dk, dv, A, B, state->data() + h * ssz, out.data());
        std::copy(out.begin(), out.end(), B);
      }
      std::fill(A, A + dk * dk, T(0));
    }
  }

  void gdn_adjoint(const GdnShape& sh, const Buffer& map, const Buffer& a, const Buffer* g, Buffer& maps,
                   int64_t item) {
    check(map, 0, 1, sh.map_elements(), "gdn adjoint map");
    check(a, 0, 1, sh.state_elements(), "gdn adjoint a");
    check(maps, item, 1, sh.map_elements(), "gdn adjoint maps");
    const int dk = sh.dk, dv = sh.dv;
    const int64_t ssz = int64_t{dk} * dv;
    for (int h = 0; h < sh.heads; ++h) {
      const T* m = map.data() + h * sh.map_block();
      T* A = maps.data() + item * sh.map_elements() + h * sh.map_block();
      T* B = A + dk * dk;
      if (g) {
        gdn_apply_transposed(dk, dv, m, a.data() + h * ssz, g->data() + h * ssz, B);
        std::fill(A, A + dk * dk, T(0));
      } else {
        for (int r = 0; r < dk; ++r)
          for (int c = 0; c < dk; ++c) A[r * dk + c] = m[c * dk + r];
        std::copy(a.data() + h * ssz, a.data() + (h + 1) * ssz, B);
      }
    }
  }

  void gdn_map_state(const GdnShape& sh, const Buffer& maps, int64_t item, Buffer& state) {
    check(maps, item, 1, sh.map_elements(), "gdn map_state maps");
    check(state, 0, 1, sh.state_elements(), "gdn map_state state");
    const int64_t ssz = int64_t{sh.dk} * sh.dv;
    for (int h = 0; h < sh.heads; ++h) {
      const T* E = maps.data() + item * sh.map_elements() + h * sh.map_block() + sh.dk * sh.dk;
      std::copy(E, E + ssz, state.data() + h * ssz);
    }
  }

  void l2norm_forward(const Buffer& x, int64_t groups, int dim, Buffer& y) {
    check(x, 0, groups, dim, "l2norm x");
    check(y, 0, groups, dim, "l2norm y");
    treecp::l2norm_forward(x.data(), groups, dim, y.data());
  }
  void l2norm_backward(const Buffer& x, const Buffer& dy, int64_t groups, int dim, Buffer& dx) {
    check(x, 0, groups, dim, "l2norm x");
    check(dy, 0, groups, dim, "l2norm dy");
    check(dx, 0, groups, dim, "l2norm dx");
    treecp::l2norm_backward(x.data(), dy.data(), groups, dim, dx.data());
  }

  // ---- short convolution

  void conv1d_forward(const ConvShape& sh, const Buffer& x, const std::vector<int64_t>& prev, int64_t out_rows,
                      const Buffer& weight, const Buffer* bias, Buffer& y) {
    const Conv1dParams<T> p = conv_params(sh, x, prev, out_rows, weight, bias);
    check(y, 0, out_rows, sh.channels, "conv1d y");
    treecp::conv1d_forward(p, y.data());
  }

  void conv1d_backward(const ConvShape& sh, const Buffer& x, const std::vector<int64_t>& prev, int64_t out_rows,
                       const Buffer& weight, const Buffer* bias, const Buffer& dy, Buffer& dx, Buffer& dweight,
                       Buffer* dbias) {
    const Conv1dParams<T> p = conv_params(sh, x, prev, out_rows, weight, bias);
    check(dy, 0, out_rows, sh.channels, "conv1d dy");
    check(dx, 0, p.rows, sh.channels, "conv1d dx");
    check(dweight, 0, 1, int64_t{sh.channels} * sh.width, "conv1d dweight");
    if (dbias) check(*dbias, 0, 1, sh.channels, "conv1d dbias");
    treecp::conv1d_backward(p, dy.data(), dx.data(), dweight.data(), dbias ? dbias->data() : nullptr);
  }

 private:
  // The kernel's view of a rank's GDN inputs; every array must hold the same number of tokens.
  static GdnParams<T> gdn_params(const GdnShape& sh, const GdnInputs<Buffer>& in) {
    require(in.q && in.k && in.v && in.g && in.beta, "gdn: q, k, v, g and beta must be given");
    GdnParams<T> p;
    p.shape = sh;
    p.tokens = static_cast<int64_t>(in.beta->size()) / sh.heads;
    auto take = [&](const Buffer* b, int64_t width, const char* name) {
      require(static_cast<int64_t>(b->size()) == p.tokens * width, "gdn: ", name, " holds ", b->size(),
              " elements, expected ", p.tokens, " tokens x ", width);
      return b->data();
    };
    p.beta = take(in.beta, sh.heads, "beta");
    p.q = take(in.q, sh.qk_width(), "q");
    p.k = take(in.k, sh.qk_width(), "k");
    p.v = take(in.v, sh.v_width(), "v");
    p.g = take(in.g, sh.g_width(), "g");
    gdn_check_params(p);
    return p;
  }

  static Conv1dParams<T> conv_params(const ConvShape& sh, const Buffer& x, const std::vector<int64_t>& prev,
                                     int64_t out_rows, const Buffer& weight, const Buffer* bias) {
    Conv1dParams<T> p;
    p.shape = sh;
    p.rows = static_cast<int64_t>(prev.size());
    p.out_rows = out_rows;
    check(x, 0, p.rows, sh.channels, "conv1d x");
    check(weight, 0, 1, int64_t{sh.channels} * sh.width, "conv1d weight");
    if (bias) check(*bias, 0, 1, sh.channels, "conv1d bias");
    p.x = x.data();
    p.prev = prev.data();
    p.weight = weight.data();
    p.bias = bias ? bias->data() : nullptr;
    conv1d_check_params(p);
    return p;
  }

  static void check(const Buffer& b, int64_t row, int64_t rows, int64_t width, const char* what) {
    require(row >= 0 && rows >= 0 && (row + rows) * width <= static_cast<int64_t>(b.size()), what,
            ": rows [", row, ", ", row + rows, ") of width ", width, " outside a buffer of ", b.size(), " elements");
  }
};

}  // namespace treecp
