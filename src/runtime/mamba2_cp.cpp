#include "runtime/mamba2_cp.hpp"

#include <algorithm>

#include "core/error.hpp"
#include "runtime/cpu_backend.hpp"
#include "runtime/redistribute.hpp"
#include "runtime/row_map.hpp"

namespace treecp {
namespace {

// Per-token arrays of `heads` heads and `groups` groups: x [.][heads][P], dt [.][heads],
// B and C [.][groups][N]. A null array is skipped (a gradient the caller does not want).
template <class T>
struct Columns {
  T* x = nullptr;
  T* dt = nullptr;
  T* B = nullptr;
  T* C = nullptr;
  int heads = 0, groups = 0;
};

// The record a token carries: x of heads [h0, h0 + nh), with `full` also their dt and B, C of
// groups [g0, g0 + ng):  [x (nh P) | dt (nh) | B (ng N) | C (ng N)].
struct RecordShape {
  int h0 = 0, nh = 0, g0 = 0, ng = 0;
  bool full = true;
  int64_t size(int P, int N) const { return int64_t{nh} * P + (full ? nh + 2 * int64_t{ng} * N : 0); }
};

enum class Io { Assign, Add };

// Applies f(offset into the arrays' field, record offset, length, field) to each part of row r's record.
template <class C, class F>
void for_parts(const C& cols, int64_t r, const RecordShape& s, int P, int N, F f) {
  f(cols.x, (r * cols.heads + s.h0) * P, 0, int64_t{s.nh} * P, false);
  if (!s.full) return;
  const int64_t x = int64_t{s.nh} * P, g = int64_t{s.ng} * N;
  f(cols.dt, r * cols.heads + s.h0, x, int64_t{s.nh}, false);
  f(cols.B, (r * cols.groups + s.g0) * N, x + s.nh, g, true);
  f(cols.C, (r * cols.groups + s.g0) * N, x + s.nh + g, g, true);
}

// Row r's record out of `cols` (a null array leaves its part zero).
template <class T>
void read_record(const Columns<const T>& cols, int64_t r, const RecordShape& s, int P, int N, T* rec) {
  for_parts(cols, r, s, P, N, [&](const T* a, int64_t at, int64_t off, int64_t n, bool) {
    if (a) std::copy(a + at, a + at + n, rec + off);
  });
}

// Row r's record into `cols`; `group_mode` applies to B and C (a null array is skipped).
template <class T>
void write_record(const Columns<T>& cols, int64_t r, const RecordShape& s, int P, int N, const T* rec, Io mode,
                  Io group_mode) {
  for_parts(cols, r, s, P, N, [&](T* a, int64_t at, int64_t off, int64_t n, bool group) {
    if (!a) return;
    if ((group ? group_mode : mode) == Io::Assign) std::copy(rec + off, rec + off + n, a + at);
    else
      for (int64_t i = 0; i < n; ++i) a[at + i] += rec[off + i];
  });
}

// The Mamba-2 chunked kernels as the affine protocol's recurrence (runtime/affine_cp.hpp) on the CPU
// backend: the state of a head is one row of N·P values and a run's map is a scalar decay.
template <class T>
struct Mamba2Recurrence {
  using Grads = Mamba2Grads<T>;
  using Buffer = typename CpuBackend<T>::Buffer;
  static constexpr const char* name = "mamba2";
  const Mamba2Params<T>& p;
  bool drop_decay = false;  // Mamba2Fault::SummaryWithoutDecay

  int64_t tokens() const { return p.tokens; }
  void forward(CpuBackend<T>&, int64_t row, int64_t rows, Buffer& state, Buffer& y) const {
    const int64_t ssz = p.state_size();
    for (int h = 0; h < p.heads; ++h) mamba2_chunked_forward(p, h, row, row + rows, state.data() + h * ssz, y.data());
  }
  void summary(CpuBackend<T>&, int64_t row, int64_t rows, Buffer& maps, int64_t item) const {
    const int64_t blk = 1 + p.state_size();  // the decay, then E
    T* m = maps.data() + item * p.heads * blk;
    for (int h = 0; h < p.heads; ++h) {
      T* M = m + h * blk;
      mamba2_chunked_summary(p, h, row, row + rows, M, M + 1);
      if (drop_decay) *M = T(1);
    }
  }
  void backward(CpuBackend<T>&, int64_t row, int64_t rows, const Buffer& state_in, const Buffer& dy, Buffer& dstate,
                const Grads& g) const {
    const int64_t ssz = p.state_size();
    for (int h = 0; h < p.heads; ++h)
      mamba2_chunked_backward(p, h, row, row + rows, state_in.data() + h * ssz, dy.data(), dstate.data() + h * ssz, g);
  }
};

}  // namespace

template <class T>
Mamba2CP<T>::Mamba2CP(const Mamba2Plan& plan, const Row& row, const Mamba2Shape& shape, Communicator& comm,
                      Mamba2Fault fault)
    : plan_(plan), row_(row), shape_(shape), comm_(comm), fault_(fault) {
  require(plan.ranks == comm.size() && static_cast<int>(plan.tokens.size()) == comm.size(), "mamba2: plan is for ",
          plan.ranks, " ranks, communicator has ", comm.size());
  require(shape.heads >= 1 && shape.groups >= 1 && shape.heads % shape.groups == 0, "mamba2: heads (", shape.heads,
          ") must be a positive multiple of groups (", shape.groups, ")");
  require(shape.head_dim >= 1 && shape.state_dim >= 1, "mamba2: head_dim and state_dim must be >= 1");
  validate_ownership(plan.tokens, row.tokens());
  require(plan.head_cuts == mamba2_head_cuts(shape.heads, plan.ranks), "mamba2: the plan's head cuts are not for ",
          shape.heads, " heads");
  owned_rows_ = tokens_of(plan.tokens[static_cast<size_t>(comm.rank())]);
  if (plan.strategy == Mamba2Strategy::Summary) {
    require(plan.chains.ranks == plan.ranks, "mamba2: the chain plan is for ", plan.chains.ranks, " ranks");
    chain_cp_ = std::make_unique<AffineCP<CpuBackend<T>>>(
        plan.chains, row, AffineShape{shape.heads, 1, static_cast<int>(int64_t{shape.state_dim} * shape.head_dim)},
        comm, be_, "mamba2");
    chain_layout_ = gdn_ownership(row, plan.chains);
  }
}

template <class T>
void Mamba2CP<T>::forward(const Mamba2Inputs<T>& in, T* y) {
  require(in.A && (owned_rows_ == 0 || (in.x && in.dt && in.B && in.C && y)),
          "mamba2: x, dt, A, B, C and y must be given");
  A_.assign(in.A, in.A + shape_.heads);
  if (in.D) D_.assign(in.D, in.D + shape_.heads);
  else D_.clear();
  if (plan_.strategy == Mamba2Strategy::Transpose) transpose_forward(in, y);
  else summary_forward(in, y);
  forward_done_ = true;
}

template <class T>
void Mamba2CP<T>::backward(const T* dy, const Mamba2Grads<T>& grads) {
  require(forward_done_, "mamba2: backward needs the forward first");
  require(owned_rows_ == 0 || dy, "mamba2: dy must be given");
  if (plan_.strategy == Mamba2Strategy::Transpose) transpose_backward(dy, grads);
  else summary_backward(dy, grads);
}

// ---- head transpose

template <class T>
Mamba2Params<T> Mamba2CP<T>::shard_params() const {
  const int me = comm_.rank();
  const int h0 = plan_.head_cuts[static_cast<size_t>(me)], h1 = plan_.head_cuts[static_cast<size_t>(me) + 1];
  Mamba2Params<T> p;
  p.x = xs_.data(); p.dt = dts_.data(); p.B = Bs_.data(); p.C = Cs_.data();
  p.A = A_.data() + h0;
  p.D = D_.empty() ? nullptr : D_.data() + h0;
  p.tokens = row_.tokens();
  p.heads = h1 - h0;
  p.head_dim = shape_.head_dim;
  p.groups = mamba2_groups_of(shape_, h0, h1).size();
  p.state_dim = shape_.state_dim;
  p.heads_per_group = shape_.heads / shape_.groups;
  p.first_head = fault_ == Mamba2Fault::ShardReadsGroupZero ? 0 : h0;
  p.chunk = shape_.chunk;
  return p;
}

namespace {

// One all-to-all of per-token records between the token owners and the head shards. to_shards:
// every owner sends each rank the records of that rank's heads for all its tokens (src = the
// owner's arrays), and each rank files what it receives by physical token (dst = its shard's).
// Otherwise the shards send back (src = shard, dst = owner).
template <class T>
void exchange_records(Communicator& comm, const Mamba2Plan& plan, const Mamba2Shape& shape, bool to_shards, bool full,
                      const Columns<const T>& src, const Columns<T>& dst, Io mode, Io group_mode) {
  const int n = comm.size(), me = comm.rank(), P = shape.head_dim, N = shape.state_dim;
  // The owner's arrays hold every head and group; a shard's only its own.
  auto record = [&](int r, bool at_owner) {
    const int h0 = plan.head_cuts[static_cast<size_t>(r)], h1 = plan.head_cuts[static_cast<size_t>(r) + 1];
    const GroupRange g = mamba2_groups_of(shape, h0, h1);
    return at_owner ? RecordShape{h0, h1 - h0, g.begin, g.size(), full} : RecordShape{0, h1 - h0, 0, g.size(), full};
  };
  const int64_t my_rows = tokens_of(plan.tokens[static_cast<size_t>(me)]);
  std::vector<int64_t> sc(static_cast<size_t>(n)), sd(sc), rc(sc), rd(sc);
  int64_t send_total = 0, recv_total = 0;
  for (int p = 0; p < n; ++p) {
    const int64_t peer_rows = tokens_of(plan.tokens[static_cast<size_t>(p)]);
    const int64_t to_peer = my_rows * record(p, true).size(P, N), from_peer = peer_rows * record(me, false).size(P, N);
    sd[p] = send_total;
    rd[p] = recv_total;
    sc[p] = to_shards ? to_peer : from_peer;
    rc[p] = to_shards ? from_peer : to_peer;
    send_total += sc[p];
    recv_total += rc[p];
  }
  std::vector<T> sbuf(static_cast<size_t>(send_total), T(0)), rbuf(static_cast<size_t>(recv_total));
  // Owner side: its buffer rows in order, for every peer. Shard side: peer p's tokens by id.
  auto owner_rows = [&](int p, auto&& f) {
    const RecordShape s = record(p, true);
    for (int64_t r = 0; r < my_rows; ++r) f(r, s, r * s.size(P, N));
  };
  auto shard_rows = [&](int p, auto&& f) {
    const RecordShape s = record(me, false);
    int64_t at = 0;
    for (const TokenRange& t : plan.tokens[static_cast<size_t>(p)])
      for (int64_t r = t.begin; r < t.end; ++r, at += s.size(P, N)) f(r, s, at);
  };
  for (int p = 0; p < n; ++p) {
    T* out = sbuf.data() + sd[p];
    auto read = [&](int64_t r, const RecordShape& s, int64_t at) { read_record(src, r, s, P, N, out + at); };
    if (to_shards) owner_rows(p, read);
    else shard_rows(p, read);
  }
  comm.all_to_all_v(sbuf.data(), sc, sd, rbuf.data(), rc, rd, CpuBackend<T>::comm_type);
  for (int p = 0; p < n; ++p) {
    const T* in = rbuf.data() + rd[p];
    auto write = [&](int64_t r, const RecordShape& s, int64_t at) {
      write_record(dst, r, s, P, N, in + at, mode, group_mode);
    };
    if (to_shards) shard_rows(p, write);
    else owner_rows(p, write);
  }
}

}  // namespace

template <class T>
void Mamba2CP<T>::transpose_forward(const Mamba2Inputs<T>& in, T* y) {
  const Mamba2Params<T> p0 = shard_params();
  const int64_t S = row_.tokens(), P = shape_.head_dim, N = shape_.state_dim;
  xs_.assign(static_cast<size_t>(S * p0.heads * P), T(0));
  dts_.assign(static_cast<size_t>(S * p0.heads), T(0));
  Bs_.assign(static_cast<size_t>(S * p0.groups * N), T(0));
  Cs_.assign(Bs_.size(), T(0));
  const Columns<const T> owner{in.x, in.dt, in.B, in.C, shape_.heads, shape_.groups};
  const Columns<T> shard{xs_.data(), dts_.data(), Bs_.data(), Cs_.data(), p0.heads, p0.groups};
  exchange_records<T>(comm_, plan_, shape_, true, true, owner, shard, Io::Assign, Io::Assign);
  std::vector<T> ys(xs_.size(), T(0));
  const Mamba2Params<T> p = shard_params();  // the arrays now hold this rank's heads
  if (p.heads > 0) tree_saved_ = mamba2_tree_forward(row_, p, ys.data());
  const Columns<T> y_owner{y, nullptr, nullptr, nullptr, shape_.heads, shape_.groups};
  const Columns<const T> y_shard{ys.data(), nullptr, nullptr, nullptr, p.heads, p.groups};
  exchange_records<T>(comm_, plan_, shape_, false, false, y_shard, y_owner, Io::Assign, Io::Assign);
}

template <class T>
void Mamba2CP<T>::transpose_backward(const T* dy, const Mamba2Grads<T>& grads) {
  const Mamba2Params<T> p = shard_params();
  std::vector<T> dys(xs_.size(), T(0));
  const Columns<const T> dy_owner{dy, nullptr, nullptr, nullptr, shape_.heads, shape_.groups};
  const Columns<T> dy_shard{dys.data(), nullptr, nullptr, nullptr, p.heads, p.groups};
  exchange_records<T>(comm_, plan_, shape_, true, false, dy_owner, dy_shard, Io::Assign, Io::Assign);
  std::vector<T> dxs(xs_.size(), T(0)), ddts(dts_.size(), T(0)), dBs(Bs_.size(), T(0)), dCs(Cs_.size(), T(0)),
      dA(static_cast<size_t>(p.heads), T(0)), dD(static_cast<size_t>(p.heads), T(0));
  if (p.heads > 0)
    mamba2_tree_backward(row_, p, tree_saved_, dys.data(),
                         Mamba2Grads<T>{dxs.data(), ddts.data(), dA.data(), dBs.data(), dCs.data(), dD.data()});
  // A group that several shards read comes back from each of them: the owner sums the parts.
  const Columns<T> g_owner{grads.dx, grads.ddt, grads.dB, grads.dC, shape_.heads, shape_.groups};
  const Columns<const T> g_shard{dxs.data(), ddts.data(), dBs.data(), dCs.data(), p.heads, p.groups};
  exchange_records<T>(comm_, plan_, shape_, false, true, g_shard, g_owner, Io::Add,
                   fault_ == Mamba2Fault::GroupGradientsAssigned ? Io::Assign : Io::Add);
  const int h0 = plan_.head_cuts[static_cast<size_t>(comm_.rank())];
  for (int h = 0; h < p.heads; ++h) {
    if (grads.dA) grads.dA[h0 + h] += dA[static_cast<size_t>(h)];
    if (grads.dD && !D_.empty()) grads.dD[h0 + h] += dD[static_cast<size_t>(h)];
  }
}

// ---- state summaries

template <class T>
Mamba2Params<T> Mamba2CP<T>::chain_params() const {
  Mamba2Params<T> p;
  p.x = xl_.data(); p.dt = dtl_.data(); p.B = Bl_.data(); p.C = Cl_.data();
  p.A = A_.data();
  p.D = D_.empty() ? nullptr : D_.data();
  p.tokens = tokens_of(chain_layout_[static_cast<size_t>(comm_.rank())]);
  p.heads = shape_.heads;
  p.head_dim = shape_.head_dim;
  p.groups = shape_.groups;
  p.state_dim = shape_.state_dim;
  p.heads_per_group = shape_.heads / shape_.groups;
  p.chunk = shape_.chunk;
  return p;
}

namespace {

// A token's [x | dt | B | C] (or their gradients) with every head and group, packed into one row
// so that one all-to-all moves all four between layouts.
template <class T>
std::vector<T> pack_rows(const Columns<const T>& c, int64_t rows, const Mamba2Shape& s) {
  const RecordShape all{0, s.heads, 0, s.groups, true};
  const int64_t w = all.size(s.head_dim, s.state_dim);
  std::vector<T> out(static_cast<size_t>(rows * w), T(0));
  for (int64_t r = 0; r < rows; ++r) read_record(c, r, all, s.head_dim, s.state_dim, out.data() + r * w);
  return out;
}

template <class T>
void unpack_rows(const std::vector<T>& packed, int64_t rows, const Mamba2Shape& s, const Columns<T>& c, Io mode) {
  const RecordShape all{0, s.heads, 0, s.groups, true};
  const int64_t w = all.size(s.head_dim, s.state_dim);
  for (int64_t r = 0; r < rows; ++r)
    write_record(c, r, all, s.head_dim, s.state_dim, packed.data() + r * w, mode, mode);
}

// Rows between two layouts; a copy when no token changes rank (every rank knows both layouts, so
// all of them skip the collective together).
template <class T>
std::vector<T> move_rows(Communicator& comm, const std::vector<T>& src, const Ownership& from, const Ownership& to,
                         int64_t width) {
  if (!tokens_move(from, to)) return src;
  CpuBackend<T> be;
  return redistribute(comm, be, src, from, to, width);
}

}  // namespace

template <class T>
void Mamba2CP<T>::summary_forward(const Mamba2Inputs<T>& in, T* y) {
  const Mamba2Shape& s = shape_;
  const int64_t rows = tokens_of(chain_layout_[static_cast<size_t>(comm_.rank())]);
  const int64_t w = s.input_elements(0, s.heads), yw = int64_t{s.heads} * s.head_dim;
  const Columns<const T> owner{in.x, in.dt, in.B, in.C, s.heads, s.groups};
  const std::vector<T> moved = move_rows(comm_, pack_rows(owner, owned_rows_, s), plan_.tokens, chain_layout_, w);
  xl_.assign(static_cast<size_t>(rows * yw), T(0));
  dtl_.assign(static_cast<size_t>(rows * s.heads), T(0));
  Bl_.assign(static_cast<size_t>(rows * s.groups * s.state_dim), T(0));
  Cl_.assign(Bl_.size(), T(0));
  unpack_rows(moved, rows, s, Columns<T>{xl_.data(), dtl_.data(), Bl_.data(), Cl_.data(), s.heads, s.groups},
              Io::Assign);
  const Mamba2Params<T> p = chain_params();
  mamba2_check_params(p);
  std::vector<T> yl(xl_.size(), T(0));
  chain_cp_->forward(Mamba2Recurrence<T>{p, fault_ == Mamba2Fault::SummaryWithoutDecay}, yl);
  const std::vector<T> home = move_rows(comm_, yl, chain_layout_, plan_.tokens, yw);
  std::copy(home.begin(), home.end(), y);
}

template <class T>
void Mamba2CP<T>::summary_backward(const T* dy, const Mamba2Grads<T>& grads) {
  const Mamba2Shape& s = shape_;
  const int64_t yw = int64_t{s.heads} * s.head_dim, w = s.input_elements(0, s.heads);
  const std::vector<T> dy_own(dy, dy + owned_rows_ * yw);
  const std::vector<T> dyl = move_rows(comm_, dy_own, plan_.tokens, chain_layout_, yw);
  const Mamba2Params<T> p = chain_params();
  mamba2_check_params(p);
  std::vector<T> dxl(xl_.size(), T(0)), ddtl(dtl_.size(), T(0)), dBl(Bl_.size(), T(0)), dCl(Cl_.size(), T(0));
  chain_cp_->backward(
      Mamba2Recurrence<T>{p, fault_ == Mamba2Fault::SummaryWithoutDecay}, dyl,
      Mamba2Grads<T>{dxl.data(), ddtl.data(), grads.dA, dBl.data(), dCl.data(), D_.empty() ? nullptr : grads.dD});
  const Columns<const T> local{dxl.data(), ddtl.data(), dBl.data(), dCl.data(), s.heads, s.groups};
  const std::vector<T> home = move_rows(comm_, pack_rows(local, p.tokens, s), chain_layout_, plan_.tokens, w);
  unpack_rows(home, owned_rows_, s, Columns<T>{grads.dx, grads.ddt, grads.dB, grads.dC, s.heads, s.groups}, Io::Add);
}

template class Mamba2CP<float>;
template class Mamba2CP<double>;

}  // namespace treecp
