#include "runtime/conv_cp.hpp"

#include <algorithm>
#include <set>

#include "core/error.hpp"
#include "runtime/row_map.hpp"

namespace treecp {
namespace {

template <class T>
constexpr CommType comm_type() {
  return sizeof(T) == 8 ? CommType::F64 : CommType::F32;
}

// The token before t on its logical path, or -1 at a root's first token.
int64_t logical_pred(const Row& row, int64_t t) {
  const int32_t s = row.segment_of(t);
  if (t > row.start(s)) return t - 1;
  const int32_t p = row.parent(s);
  return p < 0 ? -1 : row.end(p) - 1;
}

// Sorted halo tokens of one rank: predecessors within width-1 steps of its tokens that it does not hold.
std::vector<int64_t> halo_of(const Row& row, const std::vector<TokenRange>& ranges, int width) {
  const RowMap held(ranges);
  std::set<int64_t> halo;
  for (const TokenRange& r : ranges) {
    for (int32_t s = row.segment_of(r.begin); s < row.num_segments() && row.start(s) < r.end; ++s) {
      const int64_t a = std::max(r.begin, row.start(s)), b = std::min(r.end, row.end(s));
      // Deeper tokens of the run find all their predecessors inside it.
      for (int64_t t = a; t < std::min(b, a + width - 1); ++t) {
        int64_t u = t;
        for (int i = 1; i < width; ++i) {
          u = logical_pred(row, u);
          if (u < 0) break;
          if (held.find(u) < 0) halo.insert(u);
        }
      }
    }
  }
  return {halo.begin(), halo.end()};
}

}  // namespace

ConvHalo make_conv_halo(const Row& row, const Ownership& layout, int rank, int width) {
  const int n = static_cast<int>(layout.size());
  require(rank >= 0 && rank < n, "conv1d: rank ", rank, " outside the layout's ", n, " ranks");
  require(width >= 1, "conv1d: width must be >= 1, got ", width);
  ConvHalo h;
  const auto& mine = layout[static_cast<size_t>(rank)];
  const RowMap held(mine);
  h.owned_rows = held.rows();
  h.halo_tokens = halo_of(row, mine, width);
  auto row_of = [&](int64_t t) -> int64_t {
    if (t < 0) return -1;
    const int64_t o = held.find(t);
    if (o >= 0) return o;
    auto it = std::lower_bound(h.halo_tokens.begin(), h.halo_tokens.end(), t);
    if (it == h.halo_tokens.end() || *it != t) return -1;  // beyond what any output reaches
    return h.owned_rows + (it - h.halo_tokens.begin());
  };
  for (const TokenRange& r : mine)
    for (int64_t t = r.begin; t < r.end; ++t) h.prev.push_back(row_of(logical_pred(row, t)));
  for (int64_t t : h.halo_tokens) h.prev.push_back(row_of(logical_pred(row, t)));
  // Traffic: what each peer needs from this rank, and what this rank needs from each peer, both in
  // token order, so that the two sides agree without sending indices.
  h.send_rows.assign(static_cast<size_t>(n), {});
  h.recv_rows.assign(static_cast<size_t>(n), {});
  for (size_t i = 0; i < h.halo_tokens.size(); ++i)
    h.recv_rows[static_cast<size_t>(owner_of(layout, h.halo_tokens[i]))].push_back(h.owned_rows +
                                                                                   static_cast<int64_t>(i));
  for (int p = 0; p < n; ++p) {
    if (p == rank) continue;
    for (int64_t t : halo_of(row, layout[static_cast<size_t>(p)], width)) {
      const int64_t o = held.find(t);
      if (o >= 0) h.send_rows[static_cast<size_t>(p)].push_back(o);
    }
  }
  return h;
}

namespace {

// Forward halo exchange: returns [owned + halo, C] rows.
template <class T>
std::vector<T> with_halo(Communicator& comm, const ConvHalo& h, int C, const T* x_local) {
  const int n = comm.size();
  const int64_t rows = h.owned_rows + static_cast<int64_t>(h.halo_tokens.size());
  std::vector<T> x(static_cast<size_t>(rows * C));
  std::copy(x_local, x_local + h.owned_rows * C, x.begin());
  std::vector<int64_t> sc(n), sd(n), rc(n), rd(n);
  std::vector<T> sbuf, rbuf;
  int64_t rtot = 0;
  for (int p = 0; p < n; ++p) {
    sd[p] = static_cast<int64_t>(sbuf.size());
    for (int64_t r : h.send_rows[p]) sbuf.insert(sbuf.end(), x_local + r * C, x_local + (r + 1) * C);
    sc[p] = static_cast<int64_t>(sbuf.size()) - sd[p];
    rd[p] = rtot;
    rc[p] = static_cast<int64_t>(h.recv_rows[p].size()) * C;
    rtot += rc[p];
  }
  rbuf.resize(static_cast<size_t>(rtot));
  comm.all_to_all_v(sbuf.data(), sc, sd, rbuf.data(), rc, rd, comm_type<T>());
  for (int p = 0; p < n; ++p)
    for (size_t i = 0; i < h.recv_rows[p].size(); ++i)
      std::copy(rbuf.begin() + rd[p] + static_cast<int64_t>(i) * C, rbuf.begin() + rd[p] + static_cast<int64_t>(i + 1) * C,
                x.begin() + h.recv_rows[p][i] * C);
  return x;
}

template <class T>
Conv1dParams<T> params_of(const ConvHalo& h, const Conv1dArgs& a, const std::vector<T>& x, const T* weight,
                          const T* bias) {
  Conv1dParams<T> p;
  p.x = x.data();
  p.prev = h.prev.data();
  p.weight = weight;
  p.bias = bias;
  p.rows = static_cast<int64_t>(h.prev.size());
  p.out_rows = h.owned_rows;
  p.channels = a.channels;
  p.width = a.width;
  p.silu = a.silu;
  return p;
}

void check_args(const Communicator& comm, const Row& row, const Ownership& layout, const Conv1dArgs& a) {
  require(static_cast<int>(layout.size()) == comm.size(), "conv1d: layout is for ", layout.size(),
          " ranks, communicator has ", comm.size());
  require(a.channels >= 1, "conv1d: channels must be >= 1, got ", a.channels);
  require(a.width >= 1 && a.width <= 64, "conv1d: width must be in [1, 64], got ", a.width);
  validate_ownership(layout, row.tokens());
}

}  // namespace

template <class T>
void conv1d_cp_forward(Communicator& comm, const Row& row, const Ownership& layout, const Conv1dArgs& args,
                       const T* x_local, const T* weight, const T* bias, T* y_local) {
  check_args(comm, row, layout, args);
  const ConvHalo h = make_conv_halo(row, layout, comm.rank(), args.width);
  const std::vector<T> x = with_halo(comm, h, args.channels, x_local);
  const Conv1dParams<T> p = params_of(h, args, x, weight, bias);
  conv1d_check_params(p);
  conv1d_forward(p, y_local);
}

template <class T>
void conv1d_cp_backward(Communicator& comm, const Row& row, const Ownership& layout, const Conv1dArgs& args,
                        const T* x_local, const T* weight, const T* bias, const T* dy_local, T* dx_local,
                        T* dweight, T* dbias) {
  check_args(comm, row, layout, args);
  const int n = comm.size(), C = args.channels;
  const ConvHalo h = make_conv_halo(row, layout, comm.rank(), args.width);
  const std::vector<T> x = with_halo(comm, h, C, x_local);
  const Conv1dParams<T> p = params_of(h, args, x, weight, bias);
  std::vector<T> dx(x.size(), T(0)), dw(static_cast<size_t>(C * args.width), T(0)), db(static_cast<size_t>(C), T(0));
  conv1d_backward(p, dy_local, dx.data(), dw.data(), dbias ? db.data() : nullptr);
  // Halo gradients go back along the forward's routes (the mirror exchange) and are added.
  std::vector<int64_t> sc(n), sd(n), rc(n), rd(n);
  std::vector<T> sbuf, rbuf;
  int64_t rtot = 0;
  for (int q = 0; q < n; ++q) {
    sd[q] = static_cast<int64_t>(sbuf.size());
    for (int64_t r : h.recv_rows[q]) sbuf.insert(sbuf.end(), dx.begin() + r * C, dx.begin() + (r + 1) * C);
    sc[q] = static_cast<int64_t>(sbuf.size()) - sd[q];
    rd[q] = rtot;
    rc[q] = static_cast<int64_t>(h.send_rows[q].size()) * C;
    rtot += rc[q];
  }
  rbuf.resize(static_cast<size_t>(rtot));
  comm.all_to_all_v(sbuf.data(), sc, sd, rbuf.data(), rc, rd, comm_type<T>());
  for (int q = 0; q < n; ++q)
    for (size_t i = 0; i < h.send_rows[q].size(); ++i)
      for (int c = 0; c < C; ++c) dx[h.send_rows[q][i] * C + c] += rbuf[rd[q] + static_cast<int64_t>(i) * C + c];
  for (int64_t i = 0; i < h.owned_rows * C; ++i) dx_local[i] += dx[i];
  // Parameter gradients: every token contributes; sum over ranks so that all hold the same.
  comm.all_reduce_sum(dw.data(), static_cast<int64_t>(dw.size()), comm_type<T>());
  for (size_t i = 0; i < dw.size(); ++i) dweight[i] += dw[i];
  if (dbias) {
    comm.all_reduce_sum(db.data(), C, comm_type<T>());
    for (int c = 0; c < C; ++c) dbias[c] += db[c];
  }
}

template void conv1d_cp_forward<float>(Communicator&, const Row&, const Ownership&, const Conv1dArgs&, const float*,
                                       const float*, const float*, float*);
template void conv1d_cp_forward<double>(Communicator&, const Row&, const Ownership&, const Conv1dArgs&,
                                        const double*, const double*, const double*, double*);
template void conv1d_cp_backward<float>(Communicator&, const Row&, const Ownership&, const Conv1dArgs&, const float*,
                                        const float*, const float*, const float*, float*, float*, float*);
template void conv1d_cp_backward<double>(Communicator&, const Row&, const Ownership&, const Conv1dArgs&,
                                         const double*, const double*, const double*, const double*, double*,
                                         double*, double*);

}  // namespace treecp
