// The CPU Backend of the runtime (runtime/backend.hpp) over kernels/cpu: host vectors, float or double.
#pragma once

#include <algorithm>
#include <cstring>
#include <vector>

#include "comm/communicator.hpp"
#include "core/error.hpp"
#include "kernels/cpu/attention.hpp"
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

 private:
  static void check(const Buffer& b, int64_t row, int64_t rows, int64_t width, const char* what) {
    require(row >= 0 && rows >= 0 && (row + rows) * width <= static_cast<int64_t>(b.size()), what,
            ": rows [", row, ", ", row + rows, ") of width ", width, " outside a buffer of ", b.size(), " elements");
  }
};

}  // namespace treecp
