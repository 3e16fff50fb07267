// runtime/: executes plans on one rank, one class per layer kind, generic over a Backend and a
// Communicator; moves activations between ownerships; the one-process references.
//
// Dense attention context parallelism (ART 03-04): executes a Plan on one rank, generic over a
// Backend (runtime/backend.hpp) and a Communicator. Q and O stay with their owner; stage 0 runs owned
// queries against owned keys while wave 1's KV travels; each remote wave's KV is consumed by its stage
// and merged by log-sum-exp; the sink is applied once to the composed output. Backward uses the saved
// complete O and LSE, keeps dQ local and returns remote dK/dV contributions to their owners, where
// they are added. Gradients of weights replicated across CP ranks (projections, the sink) are only
// this rank's contribution: reducing them is the caller's job.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.hpp"
#include "core/error.hpp"
#include "plan/plan.hpp"
#include "runtime/backend.hpp"
#include "runtime/row_map.hpp"
#include "tree/row.hpp"

namespace treecp {

struct RankTraffic {
  int64_t bytes_sent = 0, bytes_received = 0;  // forward KV plus backward dKV, this rank
  double forward_ms = 0.0, backward_ms = 0.0;  // wall time of the last calls
};

template <class Backend>
class DenseAttentionCP {
 public:
  using Real = typename Backend::Real;
  using Buffer = typename Backend::Buffer;

  // Checks the shape, and the plan against the row, the layer's window and the communicator, on every
  // rank, and agrees on the verdict before any data moves: a bad plan throws the same error on every
  // rank, no collective hangs.
  DenseAttentionCP(const Plan& plan, const Row& row, const AttentionShape& shape, Communicator& comm, Backend& backend)
      : plan_(plan), shape_(shape), comm_(comm), be_(backend) {
    std::string problem;
    try {
      shape.validate();
      require(plan.cp == comm.size(), "plan is for ", plan.cp, " ranks but the communicator has ", comm.size());
      validate_plan(plan, row, shape.window, comm.size());
    } catch (const Error& e) {
      problem = e.what();
    }
    if (!comm.all_ok(problem.empty())) {
      fail(problem.empty() ? "plan refused on another rank" : problem);
    }
    const int r = comm.rank();
    const RankPlan& mine = plan.ranks[static_cast<size_t>(r)];
    owned_ = RowMap(mine.owned);
    waves_.resize(static_cast<size_t>(plan.num_waves));
    stage0_slices_ = to_buffer(mine.stages[0].slices, owned_, owned_);
    for (int w = 0; w < plan.num_waves; ++w) {
      const Stage& st = mine.stages[static_cast<size_t>(w) + 1];
      Wave& wave = waves_[static_cast<size_t>(w)];
      std::vector<TokenRange> recv_order;
      wave.send_rows.assign(static_cast<size_t>(comm.size()), 0);
      wave.recv_rows.assign(static_cast<size_t>(comm.size()), 0);
      int64_t send_row = 0;
      for (int p = 0; p < comm.size(); ++p) {
        for (const TokenRange& tr : st.recv[static_cast<size_t>(p)]) {
          recv_order.push_back(tr);
          wave.recv_rows[static_cast<size_t>(p)] += tr.size();
        }
        for (const TokenRange& tr : st.send[static_cast<size_t>(p)]) {
          wave.pack.push_back({owned_.row_of_range(tr.begin, tr.end), send_row, tr.size()});
          send_row += tr.size();
          wave.send_rows[static_cast<size_t>(p)] += tr.size();
        }
      }
      wave.send_total = send_row;
      wave.fetched = RowMap(recv_order);
      wave.slices = to_buffer(st.slices, owned_, wave.fetched);
      // backward: the returned dK/dV arrive in the order they were sent, and add into those owned rows
      for (const RowCopy& c : wave.pack) wave.unpack.push_back({c.dst_row, c.src_row, c.rows});
    }
  }

  int64_t owned_rows() const { return owned_.rows(); }
  const RowMap& owned() const { return owned_; }
  const RankTraffic& traffic() const { return traffic_; }

  // q [owned, Hq, D], k [owned, Hkv, D], v [owned, Hkv, Dv], sink [Hq] or null. Writes y [owned, Hq, Dv]
  // (sink applied) and lse [owned, Hq] (over tokens only). The inputs must outlive backward().
  void forward(const Buffer& q, const Buffer& k, const Buffer& v, const Buffer* sink, Buffer& y, Buffer& lse) {
    const auto t0 = std::chrono::steady_clock::now();
    const int64_t rows = owned_.rows();
    const int64_t kw = int64_t{shape_.hkv} * shape_.d, vw = int64_t{shape_.hkv} * shape_.dv;
    q_ = &q;
    k_ = &k;
    v_ = &v;
    sink_ = sink;
    o_ = be_.alloc(rows * shape_.hq * shape_.dv);
    lse_ = be_.alloc(rows * shape_.hq);
    // The next wave's KV is in flight while the current stage computes.
    std::vector<std::unique_ptr<Communicator::Pending>> pending;
    if (!waves_.empty()) pending = start_fetch(waves_[0], kw, vw);
    be_.attention_forward(shape_, q, rows, k, v, rows, stage0_slices_, o_, lse_);
    Buffer o_part = be_.alloc(rows * shape_.hq * shape_.dv), lse_part = be_.alloc(rows * shape_.hq);
    for (size_t w = 0; w < waves_.size(); ++w) {
      for (auto& p : pending) p->wait();
      pending.clear();
      if (w + 1 < waves_.size()) pending = start_fetch(waves_[w + 1], kw, vw);
      Wave& wave = waves_[w];
      wave.send_k = Buffer();  // the send buffers are no longer read
      wave.send_v = Buffer();
      be_.attention_forward(shape_, q, rows, wave.k, wave.v, wave.fetched.rows(), wave.slices, o_part, lse_part);
      be_.merge(o_, lse_, o_part, lse_part, rows, shape_.hq, shape_.dv);
    }
    if (sink) {
      be_.sink_forward(o_, lse_, *sink, rows, shape_.hq, shape_.dv, y);
    } else {
      be_.copy_rows(o_, {{0, 0, rows}}, int64_t{shape_.hq} * shape_.dv, y);
    }
    be_.copy_rows(lse_, {{0, 0, rows}}, shape_.hq, lse);
    traffic_.forward_ms = ms_since(t0);
  }

  // dy [owned, Hq, Dv] -> dq, dk, dv over owned rows (overwritten); dsink_local [Hq] gets this rank's
  // contribution to the sink gradient (sum it over ranks).
  void backward(const Buffer& dy, Buffer& dq, Buffer& dk, Buffer& dv, Buffer* dsink_local) {
    require(q_ != nullptr, "backward() called before forward()");
    const auto t0 = std::chrono::steady_clock::now();
    const int64_t rows = owned_.rows();
    const int64_t kw = int64_t{shape_.hkv} * shape_.d, vw = int64_t{shape_.hkv} * shape_.dv;
    Buffer d_o = be_.alloc(rows * shape_.hq * shape_.dv), dlse = be_.alloc(rows * shape_.hq);
    be_.sink_backward(dy, o_, lse_, sink_, rows, shape_.hq, shape_.dv, d_o, dlse, dsink_local);
    be_.zero(dq);
    be_.zero(dk);
    be_.zero(dv);
    // Remote stages first so that their dK/dV returns overlap the remaining compute.
    std::vector<std::unique_ptr<Communicator::Pending>> returns;
    for (size_t w = 0; w < waves_.size(); ++w) {
      Wave& wave = waves_[w];
      const int64_t fr = wave.fetched.rows();
      wave.dk = be_.alloc(fr * kw);
      wave.dv = be_.alloc(fr * vw);
      be_.attention_backward(shape_, *q_, rows, wave.k, wave.v, fr, o_, lse_, d_o, dlse, wave.slices, dq, wave.dk, wave.dv);
      wave.k = Buffer();
      wave.v = Buffer();
      wave.ret_k = be_.alloc(wave.send_total * kw);
      wave.ret_v = be_.alloc(wave.send_total * vw);
      // The mirror of the forward fetch: what came from a peer goes back to it.
      returns.push_back(exchange(wave.dk, wave.recv_rows, kw, wave.ret_k, wave.send_rows));
      returns.push_back(exchange(wave.dv, wave.recv_rows, vw, wave.ret_v, wave.send_rows));
    }
    be_.attention_backward(shape_, *q_, rows, *k_, *v_, rows, o_, lse_, d_o, dlse, stage0_slices_, dq, dk, dv);
    for (auto& p : returns) p->wait();
    for (Wave& wave : waves_) {
      be_.add_rows(wave.ret_k, wave.unpack, kw, dk);
      be_.add_rows(wave.ret_v, wave.unpack, vw, dv);
      wave.dk = wave.dv = wave.ret_k = wave.ret_v = Buffer();
    }
    traffic_.backward_ms = ms_since(t0);
  }

 private:
  struct Wave {
    RowMap fetched;                  // received KV rows, peer by peer
    std::vector<Slice> slices;       // buffer coordinates: owned q x fetched k
    std::vector<RowCopy> pack;       // owned rows -> send buffer
    std::vector<RowCopy> unpack;     // returned dKV rows -> owned rows
    std::vector<int64_t> send_rows, recv_rows;  // per peer
    int64_t send_total = 0;
    Buffer send_k, send_v, k, v;     // forward: packed sends, received KV (kept for backward)
    Buffer dk, dv, ret_k, ret_v;     // backward: dKV of fetched rows, dKV returned to us
  };

  static double ms_since(std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  }

  std::unique_ptr<Communicator::Pending> exchange(const Buffer& send, const std::vector<int64_t>& send_rows,
                                                  int64_t width, Buffer& recv, const std::vector<int64_t>& recv_rows) {
    const size_t n = send_rows.size();
    std::vector<int64_t> sc(n), sd(n), rc(n), rd(n);
    int64_t so = 0, ro = 0;
    for (size_t p = 0; p < n; ++p) {
      sc[p] = send_rows[p] * width;
      sd[p] = so;
      so += sc[p];
      rc[p] = recv_rows[p] * width;
      rd[p] = ro;
      ro += rc[p];
    }
    const int64_t esize = static_cast<int64_t>(comm_type_size(Backend::comm_type));
    traffic_.bytes_sent += (so - sc[static_cast<size_t>(comm_.rank())]) * esize;
    traffic_.bytes_received += (ro - rc[static_cast<size_t>(comm_.rank())]) * esize;
    return comm_.start_all_to_all_v(be_.data(send), sc, sd, be_.data(recv), rc, rd, Backend::comm_type);
  }

  std::vector<std::unique_ptr<Communicator::Pending>> start_fetch(Wave& wave, int64_t kw, int64_t vw) {
    wave.send_k = be_.alloc(wave.send_total * kw);
    wave.send_v = be_.alloc(wave.send_total * vw);
    be_.copy_rows(*k_, wave.pack, kw, wave.send_k);
    be_.copy_rows(*v_, wave.pack, vw, wave.send_v);
    wave.k = be_.alloc(wave.fetched.rows() * kw);
    wave.v = be_.alloc(wave.fetched.rows() * vw);
    std::vector<std::unique_ptr<Communicator::Pending>> out;
    out.push_back(exchange(wave.send_k, wave.send_rows, kw, wave.k, wave.recv_rows));
    out.push_back(exchange(wave.send_v, wave.send_rows, vw, wave.v, wave.recv_rows));
    return out;
  }

  const Plan& plan_;
  AttentionShape shape_;
  Communicator& comm_;
  Backend& be_;
  RowMap owned_;
  std::vector<Slice> stage0_slices_;
  std::vector<Wave> waves_;
  const Buffer *q_ = nullptr, *k_ = nullptr, *v_ = nullptr, *sink_ = nullptr;
  Buffer o_, lse_;
  RankTraffic traffic_;
};

}  // namespace treecp
