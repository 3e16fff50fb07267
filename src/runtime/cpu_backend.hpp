// runtime/: executes plans on one rank, one class per layer kind, generic over a Backend and a
// Communicator; moves activations between ownerships; the one-process references.
//
// The CPU Backend of the runtime (runtime/backend.hpp) over kernels/cpu: host vectors, float or double, one
// element type for every buffer kind; attention, sparse MLA, the affine-state recurrences (GDN/KDA) and the
// short convolution. Operations run at once, so the protocol's stream order is program
// order. A meter counts the bytes of the buffers this backend allocated and has not been given back, so
// tests can hold the runtime's real peak against the planner's prediction (plan/memory.hpp).
#pragma once

#include <algorithm>
#include <chrono>
#include <cstring>
#include <type_traits>
#include <vector>

#include "comm/communicator.hpp"
#include "core/error.hpp"
#include "kernels/cpu/attention.hpp"
#include "kernels/cpu/conv1d.hpp"
#include "kernels/cpu/gdn.hpp"
#include "kernels/cpu/sparse_mla.hpp"
#include "runtime/backend.hpp"

namespace treecp {

template <class T>
class CpuBackend {
 public:
  using Real = T;
  using Elem = T;
  using GradElem = T;
  using Buffer = std::vector<T>;
  using Act = Buffer;
  using Stat = Buffer;
  using Grad = Buffer;
  using HostGeometry = std::vector<Slice>;
  using Geometry = std::vector<Slice>;
  using CopyList = std::vector<RowCopy>;
  using IndexBuffer = std::vector<int64_t>;
  struct Mark {
    std::chrono::steady_clock::time_point at{};
  };
  // int64 buffers (ids) travel as integers; float and double as themselves
  static constexpr CommType comm_type = std::is_integral_v<T> ? CommType::I64 : sizeof(T) == 8 ? CommType::F64 : CommType::F32;
  static constexpr CommType act_comm_type = comm_type;
  static constexpr CommType grad_comm_type = comm_type;

  // ---- memory
  Buffer alloc(int64_t n) {
    require(n >= 0, "CpuBackend: cannot allocate ", n, " elements");
    live_ += n * static_cast<int64_t>(sizeof(T));
    peak_ = std::max(peak_, live_);
    return Buffer(static_cast<size_t>(n), T(0));
  }
  Buffer alloc_act(int64_t n) { return alloc(n); }
  Buffer alloc_stat(int64_t n) { return alloc(n); }
  Buffer alloc_grad(int64_t n) { return alloc(n); }
  // Gives a buffer back (only buffers from alloc are counted; an empty one is a no-op).
  void release(Buffer& b) {
    live_ -= static_cast<int64_t>(b.size() * sizeof(T));
    Buffer().swap(b);
  }
  int64_t live_bytes() const { return live_; }
  int64_t peak_bytes() const { return peak_; }
  void reset_peak() { peak_ = live_; }

  T* data(Buffer& b) { return b.data(); }
  const T* data(const Buffer& b) const { return b.data(); }
  int64_t size(const Buffer& b) const { return static_cast<int64_t>(b.size()); }
  void zero(Buffer& b) { std::fill(b.begin(), b.end(), T(0)); }

  // ---- geometry and copy lists: on the CPU the slices and copies themselves
  static HostGeometry prepare_geometry(const std::vector<Slice>& slices, int64_t, int64_t, const AttentionShape&) {
    return slices;
  }
  Geometry upload(const HostGeometry& g) { return g; }
  CopyList upload(const std::vector<RowCopy>& c) { return c; }

  // ---- row moves
  void copy_rows(const Buffer& src, const std::vector<RowCopy>& copies, int64_t width, Buffer& dst) {
    for (const RowCopy& c : copies) {
      check(src, c.src_row, c.rows, width, 0, width, "copy_rows source");
      check(dst, c.dst_row, c.rows, width, 0, width, "copy_rows destination");
      if (c.rows > 0)
        std::memmove(dst.data() + c.dst_row * width, src.data() + c.src_row * width,
                     static_cast<size_t>(c.rows * width) * sizeof(T));
    }
  }
  void pack_rows(const Buffer& src, int64_t src_width, const CopyList& copies, Buffer& dst, int64_t dst_width,
                 int64_t dst_col) {
    for (const RowCopy& c : copies) {
      check(src, c.src_row, c.rows, src_width, 0, src_width, "pack_rows source");
      check(dst, c.dst_row, c.rows, dst_width, dst_col, src_width, "pack_rows destination");
      for (int64_t i = 0; i < c.rows; ++i)
        std::memcpy(dst.data() + (c.dst_row + i) * dst_width + dst_col, src.data() + (c.src_row + i) * src_width,
                    static_cast<size_t>(src_width) * sizeof(T));
    }
  }
  void add_rows(const Buffer& src, int64_t src_width, int64_t src_col, int64_t cols, const CopyList& copies,
                Buffer& dst) {
    for (const RowCopy& c : copies) {
      check(src, c.src_row, c.rows, src_width, src_col, cols, "add_rows source");
      check(dst, c.dst_row, c.rows, cols, 0, cols, "add_rows destination");
      for (int64_t i = 0; i < c.rows; ++i) {
        const T* s = src.data() + (c.src_row + i) * src_width + src_col;
        T* d = dst.data() + (c.dst_row + i) * cols;
        for (int64_t j = 0; j < cols; ++j) d[j] += s[j];
      }
    }
  }

  // ---- attention
  void attention_forward(const AttentionShape& sh, const Geometry& slices, const Buffer& q, const KvView<T>& kv,
                         Buffer& o, Buffer& lse) {
    cpu::AttnForwardArgs<T> a;
    a.shape = sh;
    a.q_rows = rows_of(q, sh.q_width());
    a.kv_rows = kv.rows;
    a.q = cpu::dense_view<const T>(q.data(), sh.hq, sh.d);
    a.k = cpu::HeadView<const T>{kv.k, kv.k_row_stride, sh.d};
    a.v = cpu::HeadView<const T>{kv.v, kv.v_row_stride, sh.dv};
    a.o = cpu::dense_view<T>(o.data(), sh.hq, sh.dv);
    a.lse = cpu::dense_view<T>(lse.data(), sh.hq, 1);
    cpu::attention_forward(a, slices);
  }

  void merge_sink_forward(const AttentionShape& sh, int64_t rows, const std::vector<const Buffer*>& o_parts,
                          const std::vector<const Buffer*>& lse_parts, const Buffer* sink, Buffer& y, Buffer* o_merged,
                          Buffer& lse) {
    require(!o_parts.empty() && o_parts.size() == lse_parts.size(), "merge_sink_forward: ", o_parts.size(),
            " output parts and ", lse_parts.size(), " LSE parts");
    const int hq = sh.hq, dv = sh.dv;
    // Merged pre-sink output: where the caller keeps it, else y itself (the sink then scales in place).
    Buffer& o = sink && o_merged ? *o_merged : y;
    if (o_parts.size() == 1) {
      copy_rows(*o_parts[0], {{0, 0, rows}}, int64_t{hq} * dv, o);
      copy_rows(*lse_parts[0], {{0, 0, rows}}, hq, lse);
    } else {
      std::vector<cpu::HeadView<const T>> op, lp;
      for (size_t i = 0; i < o_parts.size(); ++i) {
        op.push_back(cpu::dense_view<const T>(o_parts[i]->data(), hq, dv));
        lp.push_back(cpu::dense_view<const T>(lse_parts[i]->data(), hq, 1));
      }
      cpu::MergeArgs<T> m;
      m.rows = rows;
      m.heads = hq;
      m.dv = dv;
      m.parts = static_cast<int>(o_parts.size());
      m.o_parts = op.data();
      m.lse_parts = lp.data();
      m.o = cpu::dense_view<T>(o.data(), hq, dv);
      m.lse = cpu::dense_view<T>(lse.data(), hq, 1);
      cpu::merge_forward(m);
    }
    if (!sink) return;
    cpu::SinkArgs<T> s;
    s.rows = rows;
    s.hq = hq;
    s.dv = dv;
    s.sink = sink->data();
    s.o = cpu::dense_view<const T>(o.data(), hq, dv);
    s.lse = cpu::dense_view<const T>(lse.data(), hq, 1);
    s.y = cpu::dense_view<T>(y.data(), hq, dv);
    cpu::sink_forward(s);
  }

  // dstat is dJ/dLSE here (zero without a sink).
  const Buffer& merge_sink_backward(const AttentionShape& sh, int64_t rows, const Buffer& o, const Buffer& lse,
                                    const Buffer* sink, const Buffer& dy, Buffer& d_o, Buffer& dlse, Buffer* dsink) {
    const int hq = sh.hq, dv = sh.dv;
    if (sink == nullptr) {  // no sink: the output is O itself
      zero(dlse);
      return dy;
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
    Buffer scratch;
    if (dsink) {
      s.dsink = dsink->data();
    } else {
      scratch.assign(static_cast<size_t>(hq), T(0));
      s.dsink = scratch.data();
    }
    cpu::sink_backward(s);
    return d_o;
  }

  void attention_backward(const AttentionShape& sh, const Geometry& slices, const Buffer& q, const KvView<T>& kv,
                          const Buffer& o, const Buffer& lse, const Buffer& d_o, const Buffer& dlse, Buffer& dq,
                          const DkvView<T>& dkv) {
    cpu::AttnBackwardArgs<T> a;
    a.shape = sh;
    a.q_rows = rows_of(q, sh.q_width());
    a.kv_rows = kv.rows;
    a.q = cpu::dense_view<const T>(q.data(), sh.hq, sh.d);
    a.k = cpu::HeadView<const T>{kv.k, kv.k_row_stride, sh.d};
    a.v = cpu::HeadView<const T>{kv.v, kv.v_row_stride, sh.dv};
    a.o = cpu::dense_view<const T>(o.data(), sh.hq, sh.dv);
    a.lse = cpu::dense_view<const T>(lse.data(), sh.hq, 1);
    a.dout = cpu::dense_view<const T>(d_o.data(), sh.hq, sh.dv);
    a.dlse = cpu::dense_view<const T>(dlse.data(), sh.hq, 1);
    a.dq = cpu::dense_view<T>(dq.data(), sh.hq, sh.d);
    a.dk = cpu::HeadView<T>{dkv.dk, dkv.dk_row_stride, sh.d};
    a.dv = cpu::HeadView<T>{dkv.dv, dkv.dv_row_stride, sh.dv};
    cpu::attention_backward(a, slices);
  }

  // ---- sparse MLA
  IndexBuffer index_from_host(std::vector<int64_t> v) { return v; }
  std::vector<int64_t> index_to_host(const IndexBuffer& b) const { return b; }
  int64_t* index_data(IndexBuffer& b) { return b.data(); }
  const int64_t* index_data(const IndexBuffer& b) const { return b.data(); }

  void indexer_topk(const SparseMlaDims& sh, const Buffer& qi, const Buffer& w, int64_t q_rows, const Buffer& ki,
                    const IndexBuffer& key_ids, int64_t k_rows, const std::vector<Slice>& slices, Buffer& score,
                    IndexBuffer& ids) {
    cpu::IndexerArgs<T> a;
    a.shape = cpu::IndexerShape{q_rows, k_rows, sh.hi, sh.di, sh.topk};
    a.qi = cpu::dense_view<const T>(qi.data(), sh.hi, sh.di);
    a.w = cpu::dense_view<const T>(w.data(), sh.hi, 1);
    a.ki = ki.data();
    a.ki_row_stride = sh.di;
    a.key_ids = key_ids.data();
    a.score = score.data();
    a.ids = ids.data();
    cpu::indexer_topk(a, slices);
  }

  void topk_merge(Buffer& score, IndexBuffer& ids, const Buffer& part_score, const IndexBuffer& part_ids, int64_t rows,
                  int64_t topk) {
    cpu::topk_merge(cpu::TopkMergeArgs<T>{rows, topk, score.data(), ids.data(), part_score.data(), part_ids.data()});
  }

  void sparse_forward(const SparseMlaDims& sh, const Buffer& q, int64_t q_rows, const Buffer& kv, int64_t kv_rows,
                      const IndexBuffer& rows, Buffer& o, Buffer& lse) {
    cpu::SparseForwardArgs<T> a;
    a.shape = cpu::SparseShape{q_rows, kv_rows, sh.h, sh.dqk, sh.dv, sh.topk};
    a.q = cpu::dense_view<const T>(q.data(), sh.h, sh.dqk);
    a.kv = kv.data();
    a.kv_row_stride = sh.dqk;
    a.rows = rows.data();
    a.o = cpu::dense_view<T>(o.data(), sh.h, sh.dv);
    a.lse = cpu::dense_view<T>(lse.data(), sh.h, 1);
    a.scale = static_cast<T>(sh.softmax_scale());
    cpu::sparse_attention_forward(a);
  }

  void sparse_backward(const SparseMlaDims& sh, const Buffer& q, int64_t q_rows, const Buffer& kv, int64_t kv_rows,
                       const IndexBuffer& rows, const Buffer& o, const Buffer& lse, const Buffer& d_o, Buffer& dq,
                       Buffer& dkv) {
    cpu::SparseBackwardArgs<T> a;
    a.shape = cpu::SparseShape{q_rows, kv_rows, sh.h, sh.dqk, sh.dv, sh.topk};
    a.q = cpu::dense_view<const T>(q.data(), sh.h, sh.dqk);
    a.kv = kv.data();
    a.kv_row_stride = sh.dqk;
    a.rows = rows.data();
    a.o = cpu::dense_view<const T>(o.data(), sh.h, sh.dv);
    a.lse = cpu::dense_view<const T>(lse.data(), sh.h, 1);
    a.dout = cpu::dense_view<const T>(d_o.data(), sh.h, sh.dv);
    a.dq = cpu::dense_view<T>(dq.data(), sh.h, sh.dqk);
    a.dkv = dkv.data();
    a.dkv_row_stride = sh.dqk;
    a.scale = static_cast<T>(sh.softmax_scale());
    cpu::sparse_attention_backward(a);
  }

  // ---- affine-state recurrences: the summary algebra, every head of an item at once

  void affine_identity(const AffineShape& sh, Buffer& maps, int64_t item) {
    check(maps, item, 1, sh.map_elements(), 0, sh.map_elements(), "affine identity maps");
    T* m = maps.data() + item * sh.map_elements();
    std::fill(m, m + sh.map_elements(), T(0));
    for (int h = 0; h < sh.heads; ++h)
      for (int d = 0; d < sh.rows; ++d) m[h * sh.map_block() + d * sh.rows + d] = T(1);
  }

  void affine_compose(const AffineShape& sh, int64_t items, Buffer& later, const Buffer& earlier) {
    check(later, 0, items, sh.map_elements(), 0, sh.map_elements(), "affine compose later");
    check(earlier, 0, items, sh.map_elements(), 0, sh.map_elements(), "affine compose earlier");
    const int r = sh.rows, c = sh.cols;
    for (int64_t i = 0; i < items * sh.heads; ++i) {
      T* a = later.data() + i * sh.map_block();
      const T* e = earlier.data() + i * sh.map_block();
      gdn_compose(r, c, a, a + r * r, e, e + r * r, a, a + r * r);
    }
  }

  void affine_seed(const AffineShape& sh, Buffer& maps, int64_t item, const Buffer* state) {
    check(maps, item, 1, sh.map_elements(), 0, sh.map_elements(), "affine seed maps");
    if (state) check(*state, 0, 1, sh.state_elements(), 0, sh.state_elements(), "affine seed state");
    const int r = sh.rows, c = sh.cols;
    const int64_t ssz = int64_t{r} * c;
    std::vector<T> out(static_cast<size_t>(ssz));
    for (int h = 0; h < sh.heads; ++h) {
      T* A = maps.data() + item * sh.map_elements() + h * sh.map_block();
      T* B = A + r * r;
      if (state) {
        gdn_apply(r, c, A, B, state->data() + h * ssz, out.data());
        std::copy(out.begin(), out.end(), B);
      }
      std::fill(A, A + r * r, T(0));
    }
  }

  void affine_adjoint(const AffineShape& sh, const Buffer& map, const Buffer& a, const Buffer* g, Buffer& maps,
                      int64_t item) {
    check(map, 0, 1, sh.map_elements(), 0, sh.map_elements(), "affine adjoint map");
    check(a, 0, 1, sh.state_elements(), 0, sh.state_elements(), "affine adjoint a");
    check(maps, item, 1, sh.map_elements(), 0, sh.map_elements(), "affine adjoint maps");
    if (g) check(*g, 0, 1, sh.state_elements(), 0, sh.state_elements(), "affine adjoint g");
    const int r = sh.rows, c = sh.cols;
    const int64_t ssz = int64_t{r} * c;
    for (int h = 0; h < sh.heads; ++h) {
      const T* m = map.data() + h * sh.map_block();
      T* A = maps.data() + item * sh.map_elements() + h * sh.map_block();
      T* B = A + r * r;
      if (g) {
        gdn_apply_transposed(r, c, m, a.data() + h * ssz, g->data() + h * ssz, B);
        std::fill(A, A + r * r, T(0));
      } else {
        for (int i = 0; i < r; ++i)
          for (int j = 0; j < r; ++j) A[i * r + j] = m[j * r + i];
        std::copy(a.data() + h * ssz, a.data() + (h + 1) * ssz, B);
      }
    }
  }

  void affine_state(const AffineShape& sh, const Buffer& maps, int64_t item, Buffer& state) {
    check(maps, item, 1, sh.map_elements(), 0, sh.map_elements(), "affine state maps");
    check(state, 0, 1, sh.state_elements(), 0, sh.state_elements(), "affine state");
    const int64_t ssz = int64_t{sh.rows} * sh.cols;
    for (int h = 0; h < sh.heads; ++h) {
      const T* E = maps.data() + item * sh.map_elements() + h * sh.map_block() + sh.rows * sh.rows;
      std::copy(E, E + ssz, state.data() + h * ssz);
    }
  }

  // ---- GDN / KDA

  void gdn_forward(const GdnShape& sh, const GdnInputs<Buffer>& in, int64_t row, int64_t rows, Buffer& state,
                   Buffer& y) {
    const GdnParams<T> p = gdn_params(sh, in);
    const AffineShape af = sh.affine();
    check(state, 0, 1, af.state_elements(), 0, af.state_elements(), "gdn state");
    check(y, row, rows, sh.v_width(), 0, sh.v_width(), "gdn y");
    const int64_t ssz = int64_t{sh.dk} * sh.dv;
    for (int h = 0; h < sh.heads; ++h) gdn_chunked_forward(p, h, row, row + rows, state.data() + h * ssz, y.data());
  }

  void gdn_backward(const GdnShape& sh, const GdnInputs<Buffer>& in, int64_t row, int64_t rows, const Buffer& state_in,
                    const Buffer& dy, Buffer& dstate, const GdnGradients<Buffer>& grads) {
    const GdnParams<T> p = gdn_params(sh, in);
    const AffineShape af = sh.affine();
    check(state_in, 0, 1, af.state_elements(), 0, af.state_elements(), "gdn state_in");
    check(dstate, 0, 1, af.state_elements(), 0, af.state_elements(), "gdn dstate");
    check(dy, row, rows, sh.v_width(), 0, sh.v_width(), "gdn dy");
    auto ptr = [&](Buffer* b, int64_t width, const char* what) -> T* {
      if (!b) return nullptr;
      check(*b, row, rows, width, 0, width, what);
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
    const AffineShape af = sh.affine();
    check(maps, item, 1, af.map_elements(), 0, af.map_elements(), "gdn maps");
    const GdnParams<T> p = gdn_params(sh, in);
    T* m = maps.data() + item * af.map_elements();
    for (int h = 0; h < sh.heads; ++h)
      gdn_chunked_summary(p, h, row, row + rows, m + h * af.map_block(), m + h * af.map_block() + sh.dk * sh.dk);
  }

  void l2norm_forward(const Buffer& x, int64_t groups, int dim, Buffer& y) {
    check(x, 0, groups, dim, 0, dim, "l2norm x");
    check(y, 0, groups, dim, 0, dim, "l2norm y");
    treecp::l2norm_forward(x.data(), groups, dim, y.data());
  }
  void l2norm_backward(const Buffer& x, const Buffer& dy, int64_t groups, int dim, Buffer& dx) {
    check(x, 0, groups, dim, 0, dim, "l2norm x");
    check(dy, 0, groups, dim, 0, dim, "l2norm dy");
    check(dx, 0, groups, dim, 0, dim, "l2norm dx");
    treecp::l2norm_backward(x.data(), dy.data(), groups, dim, dx.data());
  }

  // ---- short convolution

  void conv1d_forward(const ConvShape& sh, const Buffer& x, const std::vector<int64_t>& prev, int64_t out_rows,
                      const Buffer& weight, const Buffer* bias, Buffer& y) {
    const Conv1dParams<T> p = conv_params(sh, x, prev, out_rows, weight, bias);
    check(y, 0, out_rows, sh.channels, 0, sh.channels, "conv1d y");
    treecp::conv1d_forward(p, y.data());
  }

  void conv1d_backward(const ConvShape& sh, const Buffer& x, const std::vector<int64_t>& prev, int64_t out_rows,
                       const Buffer& weight, const Buffer* bias, const Buffer& dy, Buffer& dx, Buffer& dweight,
                       Buffer* dbias) {
    const Conv1dParams<T> p = conv_params(sh, x, prev, out_rows, weight, bias);
    check(dy, 0, out_rows, sh.channels, 0, sh.channels, "conv1d dy");
    check(dx, 0, p.rows, sh.channels, 0, sh.channels, "conv1d dx");
    check(dweight, 0, 1, int64_t{sh.channels} * sh.width, 0, int64_t{sh.channels} * sh.width, "conv1d dweight");
    if (dbias) check(*dbias, 0, 1, sh.channels, 0, sh.channels, "conv1d dbias");
    treecp::conv1d_backward(p, dy.data(), dx.data(), dweight.data(), dbias ? dbias->data() : nullptr);
  }

  // ---- timing
  Mark make_mark() { return {}; }
  void record(Mark& m) { m.at = std::chrono::steady_clock::now(); }
  double elapsed_ms(const Mark& a, const Mark& b) const {
    return std::chrono::duration<double, std::milli>(b.at - a.at).count();
  }

 private:
  // The kernel's view of a rank's GDN inputs; every array must hold the same number of tokens.
  static GdnParams<T> gdn_params(const GdnShape& sh, const GdnInputs<Buffer>& in) {
    GdnParams<T> p;
    p.shape = sh;
    p.tokens = gdn_input_tokens(sh, in, [](const Buffer& b) { return b.size(); });
    p.beta = in.beta->data();
    p.q = in.q->data();
    p.k = in.k->data();
    p.v = in.v->data();
    p.g = in.g->data();
    gdn_check_params(p);
    return p;
  }

  static Conv1dParams<T> conv_params(const ConvShape& sh, const Buffer& x, const std::vector<int64_t>& prev,
                                     int64_t out_rows, const Buffer& weight, const Buffer* bias) {
    Conv1dParams<T> p;
    p.shape = sh;
    p.rows = static_cast<int64_t>(prev.size());
    p.out_rows = out_rows;
    check(x, 0, p.rows, sh.channels, 0, sh.channels, "conv1d x");
    check(weight, 0, 1, int64_t{sh.channels} * sh.width, 0, int64_t{sh.channels} * sh.width, "conv1d weight");
    if (bias) check(*bias, 0, 1, sh.channels, 0, sh.channels, "conv1d bias");
    p.x = x.data();
    p.prev = prev.data();
    p.weight = weight.data();
    p.bias = bias ? bias->data() : nullptr;
    conv1d_check_params(p);
    return p;
  }

  static int64_t rows_of(const Buffer& b, int64_t width) { return width > 0 ? static_cast<int64_t>(b.size()) / width : 0; }
  // Rows [row, row + rows) x columns [col, col + cols) of a buffer `width` elements wide.
  static void check(const Buffer& b, int64_t row, int64_t rows, int64_t width, int64_t col, int64_t cols,
                    const char* what) {
    require(row >= 0 && rows >= 0 && col >= 0 && col + cols <= width &&
                (rows == 0 || (row + rows) * width <= static_cast<int64_t>(b.size())),
            what, ": rows [", row, ", ", row + rows, ") x columns [", col, ", ", col + cols, ") of width ", width,
            " outside a buffer of ", b.size(), " elements");
  }
  int64_t live_ = 0, peak_ = 0;
};

}  // namespace treecp
