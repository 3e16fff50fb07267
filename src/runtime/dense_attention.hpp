// runtime/: executes plans on one rank, one class per layer kind, generic over a Backend and a
// Communicator; moves activations between ownerships; the one-process references.
//
// Dense attention context parallelism (ART 03-04): executes a Plan on one rank, generic over a
// Backend (runtime/backend.hpp) and a Communicator. Q and O stay with their owner; stage 0 runs owned
// queries against owned keys while wave 1's KV travels; each remote wave's KV (K and V side by side in one
// buffer, one exchange per wave) is consumed by its stage; the stages' partial (O, LSE) are merged by
// log-sum-exp in one fused call that also applies the learned sink, once. Backward uses the complete O and
// LSE, keeps dQ local and returns remote dK/dV contributions to their owners in one exchange per wave,
// where they are added. Gradients of weights replicated across CP ranks (projections, the sink) are only
// this rank's contribution: reducing them is the caller's job.
//
// Stream order, written once: the protocol only calls backend operations and starts/waits exchanges, so on
// the CPU every call runs at once (waits block the host) and on a GPU a whole forward or backward is
// enqueued without any host wait (backend.hpp "Ordering"). Buffers an exchange touches are released only
// after its wait().
//
// Memory: kept (the default unless the plan says otherwise), every wave's received KV stays from the forward
// to the backward; fetched again (Plan::refetch_backward, chosen by the planner where keeping does not fit, or
// BackwardKv::Refetch), each is released after its forward stage and fetched again, one wave ahead, in the
// backward (more traffic, less memory). plan/memory.hpp predicts the peak of what this class holds for either
// choice; the tests compare it with the backend's meter.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.hpp"
#include "core/error.hpp"
#include "plan/plan.hpp"
#include "runtime/backend.hpp"
#include "runtime/rank_schedule.hpp"
#include "tree/row.hpp"

namespace treecp {

enum class BackwardKv { FromPlan, Keep, Refetch };

struct DenseAttentionOptions {
  BackwardKv backward_kv = BackwardKv::FromPlan;  // Plan::refetch_backward, the planner's priced choice
  // Benchmarks only: every exchange is skipped (received buffers hold whatever they held), so a run times
  // the same stages without communication. Results are wrong.
  bool skip_transfers = false;
};

struct RankTraffic {
  int64_t bytes_sent = 0, bytes_received = 0;  // the last forward and backward, this rank, peers only
  double forward_ms = 0.0, backward_ms = 0.0;  // the last calls, measured by the backend's marks
};

// A named interval of the last forward or backward, in ms from the start of that forward.
struct StageSpan {
  std::string name;
  double begin_ms = 0.0, end_ms = 0.0;
};

// Everything one rank needs about a plan before any tensor exists: the schedule and the host side of every
// stage's geometry (tile lists on the GPU). Pure host work, safe on any thread (lookahead builds the next
// row's while the current one runs); checks the plan against the row first.
template <class Backend>
struct PreparedAttention {
  AttentionShape dims;
  bool refetch_backward = false;  // the plan's choice
  RankSchedule schedule;
  typename Backend::HostGeometry local;
  std::vector<typename Backend::HostGeometry> waves;
};

template <class Backend>
PreparedAttention<Backend> prepare_attention(const Plan& plan, const Row& row, const AttentionShape& dims, int rank) {
  dims.validate();
  validate_plan(plan, row, dims.window, plan.cp);
  PreparedAttention<Backend> p;
  p.dims = dims;
  p.refetch_backward = plan.refetch_backward;
  p.schedule = make_rank_schedule(plan, rank);
  const int64_t rows = p.schedule.owned_rows();
  p.local = Backend::prepare_geometry(p.schedule.local_slices, rows, rows, dims);
  for (const WaveSchedule& w : p.schedule.waves)
    p.waves.push_back(Backend::prepare_geometry(w.slices, rows, w.fetched.rows(), dims));
  return p;
}

template <class Backend>
class DenseAttentionCP {
 public:
  using Act = typename Backend::Act;
  using Stat = typename Backend::Stat;
  using Grad = typename Backend::Grad;
  using Elem = typename Backend::Elem;
  using GradElem = typename Backend::GradElem;
  using Mark = typename Backend::Mark;

  // Checks the shape, and the plan against the row, the layer's window and the communicator, on every
  // rank, and agrees on the verdict before any data moves: a bad plan throws the same error on every
  // rank, no collective hangs.
  DenseAttentionCP(const Plan& plan, const Row& row, const AttentionShape& shape, Communicator& comm, Backend& backend,
                   DenseAttentionOptions options = {})
      : comm_(comm), be_(backend), opt_(options) {
    std::string problem;
    PreparedAttention<Backend> prepared;
    try {
      require(plan.cp == comm.size(), "plan is for ", plan.cp, " ranks but the communicator has ", comm.size());
      prepared = prepare_attention<Backend>(plan, row, shape, comm.rank());
    } catch (const Error& e) {
      problem = e.what();
    }
    if (!comm.all_ok(problem.empty())) fail(problem.empty() ? "plan refused on another rank" : problem);
    init(prepared);
  }

  // From a prepared plan (no collective: every rank must have prepared the same plan, as make_plan's
  // determinism gives; use the constructor above for plans from elsewhere).
  DenseAttentionCP(const PreparedAttention<Backend>& prepared, Communicator& comm, Backend& backend,
                   DenseAttentionOptions options = {})
      : comm_(comm), be_(backend), opt_(options) {
    require(prepared.schedule.ranks == comm.size() && prepared.schedule.rank == comm.rank(),
            "prepared attention is for rank ", prepared.schedule.rank, " of ", prepared.schedule.ranks,
            ", the communicator is rank ", comm.rank(), " of ", comm.size());
    init(prepared);
  }

  ~DenseAttentionCP() { release_saved(); }
  DenseAttentionCP(const DenseAttentionCP&) = delete;
  DenseAttentionCP& operator=(const DenseAttentionCP&) = delete;

  int64_t owned_rows() const { return s_.owned_rows(); }
  const RowMap& owned() const { return s_.owned; }
  const RankSchedule& schedule() const { return s_; }
  const AttentionShape& dims() const { return dims_; }
  const DenseAttentionOptions& options() const { return opt_; }

  // q [owned, Hq, D], k [owned, Hkv, D], v [owned, Hkv, Dv], sink [Hq] or null. Writes y [owned, Hq, Dv]
  // (sink applied) and lse [owned, Hq] (over tokens only); with a sink and o_presink given, also the output
  // before the sink (what the stateless backward takes as o). For backward(dy, ...): q, k, v, sink, y and
  // lse must stay alive and unchanged until it returns.
  void forward(const Act& q, const Act& k, const Act& v, const Stat* sink, Act& y, Stat& lse, Act* o_presink = nullptr) {
    release_saved();
    const size_t W = s_.waves.size();
    const int64_t rows = owned_rows();
    const int64_t o_elems = rows * dims_.hq * dims_.dv, l_elems = rows * dims_.hq;
    fwd_spans_.clear();
    traffic_.bytes_sent = traffic_.bytes_received = 0;
    be_.record(marks_[0]);
    // A wave none of this rank's queries reads from (it only sends in it) adds no part to the merge.
    // Without merge or sink, stage 0 writes the outputs themselves.
    const bool direct = live_waves_ == 0 && sink == nullptr;
    std::vector<Act> o_parts(W + 1);
    std::vector<Stat> lse_parts(W + 1);
    if (!direct) {
      o_parts[0] = be_.alloc_act(o_elems);
      lse_parts[0] = be_.alloc_stat(l_elems);
    }
    std::unique_ptr<Communicator::Pending> pending;
    if (W > 0) pending = start_fetch(0, k, v);
    begin_span(fwd_spans_, "fwd local");
    be_.attention_forward(dims_, local_geom_, q, owned_kv(k, v), direct ? y : o_parts[0], direct ? lse : lse_parts[0]);
    end_span(fwd_spans_);
    for (size_t w = 0; w < W; ++w) {
      begin_span(fwd_spans_, "fwd wait " + std::to_string(w + 1));
      pending->wait();
      end_span(fwd_spans_);
      be_.release(waves_[w].send);
      if (w + 1 < W) pending = start_fetch(w + 1, k, v);
      if (!live(w)) continue;
      o_parts[w + 1] = be_.alloc_act(o_elems);
      lse_parts[w + 1] = be_.alloc_stat(l_elems);
      begin_span(fwd_spans_, "fwd wave " + std::to_string(w + 1));
      be_.attention_forward(dims_, wave_geom_[w], q, fetched_kv(w), o_parts[w + 1], lse_parts[w + 1]);
      end_span(fwd_spans_);
      if (refetch_) be_.release(waves_[w].kv);
    }
    if (!direct) {
      begin_span(fwd_spans_, sink ? "fwd merge+sink" : "fwd merge");
      std::vector<const Act*> op;
      std::vector<const Stat*> lp;
      for (size_t i = 0; i <= W; ++i) {
        if (i > 0 && !live(i - 1)) continue;
        op.push_back(&o_parts[i]);
        lp.push_back(&lse_parts[i]);
      }
      Act* keep = nullptr;
      if (sink) {
        if (o_presink) {
          keep = o_presink;
        } else {
          o_saved_ = be_.alloc_act(o_elems);
          keep = &o_saved_;
        }
      }
      be_.merge_sink_forward(dims_, rows, op, lp, sink, y, keep, lse);
      end_span(fwd_spans_);
      for (size_t i = 0; i <= W; ++i) {
        be_.release(o_parts[i]);
        be_.release(lse_parts[i]);
      }
    }
    be_.record(marks_[1]);
    fwd_timed_ = true;
    bwd_timed_ = false;
    forward_pending_ = true;
    q_ = &q;
    k_ = &k;
    v_ = &v;
    sink_ = sink;
    o_ = sink ? (o_presink ? o_presink : &o_saved_) : &y;
    lse_ = &lse;
    kv_kept_ = !refetch_;
  }

  // dy [owned, Hq, Dv] -> dq, dk, dv over owned rows (overwritten); dsink_local [Hq] gets this rank's
  // contribution to the sink gradient added (sum it over ranks).
  void backward(const Act& dy, Grad& dq, Grad& dk, Grad& dv, Stat* dsink_local) {
    require(q_ != nullptr, "backward() called before forward()");
    backward_impl(*q_, *k_, *v_, sink_, *o_, *lse_, dy, dq, dk, dv, dsink_local, kv_kept_);
    release_saved();
  }

  // The stateless form, for autograd frameworks that keep tensors rather than this object's state: the
  // forward's inputs, its output before the sink (y without a sink, o_presink with one) and its lse, and
  // dy. Remote KV is fetched again, one wave ahead.
  void backward(const Act& q, const Act& k, const Act& v, const Stat* sink, const Act& o, const Stat& lse, const Act& dy,
                Grad& dq, Grad& dk, Grad& dv, Stat* dsink_local) {
    release_saved();
    backward_impl(q, k, v, sink, o, lse, dy, dq, dk, dv, dsink_local, false);
  }

  // Measured by the backend's marks: may wait for the device to finish (never call it inside a step you
  // time). Bytes count the last forward and backward.
  RankTraffic traffic() {
    RankTraffic t = traffic_;
    if (fwd_timed_) t.forward_ms = be_.elapsed_ms(marks_[0], marks_[1]);
    if (bwd_timed_) t.backward_ms = be_.elapsed_ms(marks_[2], marks_[3]);
    return t;
  }

  // The named stages of the last forward and backward, from the forward's start (same waiting rule).
  std::vector<StageSpan> spans() {
    std::vector<StageSpan> out;
    auto resolve = [&](const std::vector<Timed>& list) {
      for (const Timed& t : list)
        out.push_back({t.name, be_.elapsed_ms(marks_[0], t.begin), be_.elapsed_ms(marks_[0], t.end)});
    };
    if (fwd_timed_) resolve(fwd_spans_);
    if (bwd_timed_) resolve(bwd_spans_);
    return out;
  }

 private:
  struct Wave {
    typename Backend::CopyList pack, unpack;
    ExchangeCounts kv_counts, dkv_counts;  // forward fetch (Act) and backward return (Grad), K|V rows
    Act send, kv;                          // packed sends, received K|V rows
    Grad dkv, ret;                         // dK|dV of the received rows, dK|dV returned to us
  };
  struct Timed {
    std::string name;
    Mark begin, end;
  };

  void init(const PreparedAttention<Backend>& p) {
    dims_ = p.dims;
    refetch_ = opt_.backward_kv == BackwardKv::Refetch ||
               (opt_.backward_kv == BackwardKv::FromPlan && p.refetch_backward);
    s_ = p.schedule;
    kw_ = int64_t{dims_.hkv} * dims_.d;
    vw_ = int64_t{dims_.hkv} * dims_.dv;
    local_geom_ = be_.upload(p.local);
    waves_.resize(s_.waves.size());
    for (size_t w = 0; w < s_.waves.size(); ++w) {
      const WaveSchedule& ws = s_.waves[w];
      wave_geom_.push_back(be_.upload(p.waves[w]));
      waves_[w].pack = be_.upload(ws.pack);
      waves_[w].unpack = be_.upload(ws.unpack);
      waves_[w].kv_counts = exchange_counts(ws.send_rows, ws.recv_rows, kw_ + vw_);
      waves_[w].dkv_counts = exchange_counts(ws.recv_rows, ws.send_rows, kw_ + vw_);
    }
    live_waves_ = 0;
    for (size_t w = 0; w < s_.waves.size(); ++w) live_waves_ += live(w) ? 1 : 0;
    for (int i = 0; i < 4; ++i) marks_.push_back(be_.make_mark());
  }

  // Whether wave w brings this rank any KV: a wave can carry only this rank's sends, and then neither
  // direction runs a kernel for it (plan/memory.cpp replays the same rule).
  bool live(size_t w) const { return s_.waves[w].fetched.rows() > 0; }

  KvView<Elem> owned_kv(const Act& k, const Act& v) const {
    return {be_.data(k), be_.data(v), kw_, vw_, owned_rows()};
  }
  KvView<Elem> fetched_kv(size_t w) const {
    const Elem* base = be_.data(waves_[w].kv);
    return {base, base + kw_, kw_ + vw_, kw_ + vw_, s_.waves[w].fetched.rows()};
  }

  std::unique_ptr<Communicator::Pending> exchange(const void* send, void* recv, const ExchangeCounts& c, CommType type) {
    const int64_t es = static_cast<int64_t>(comm_type_size(type));
    const size_t me = static_cast<size_t>(comm_.rank());
    int64_t out = 0, in = 0;
    for (size_t p = 0; p < c.send_counts.size(); ++p) {
      if (p == me) continue;
      out += c.send_counts[p];
      in += c.recv_counts[p];
    }
    if (opt_.skip_transfers) return std::make_unique<Communicator::Pending>();
    traffic_.bytes_sent += out * es;
    traffic_.bytes_received += in * es;
    return comm_.start_all_to_all_v(send, c.send_counts, c.send_displs, recv, c.recv_counts, c.recv_displs, type);
  }

  // Packs K|V of the rows wave w sends into one buffer and starts the exchange into wave w's kv.
  std::unique_ptr<Communicator::Pending> start_fetch(size_t w, const Act& k, const Act& v) {
    Wave& wave = waves_[w];
    const int64_t kvw = kw_ + vw_;
    wave.send = be_.alloc_act(s_.waves[w].send_total * kvw);
    be_.pack_rows(k, kw_, wave.pack, wave.send, kvw, 0);
    be_.pack_rows(v, vw_, wave.pack, wave.send, kvw, kw_);
    wave.kv = be_.alloc_act(s_.waves[w].fetched.rows() * kvw);
    return exchange(be_.data(wave.send), be_.data(wave.kv), wave.kv_counts, Backend::act_comm_type);
  }

  void backward_impl(const Act& q, const Act& k, const Act& v, const Stat* sink, const Act& o, const Stat& lse,
                     const Act& dy, Grad& dq, Grad& dk, Grad& dv, Stat* dsink, bool kv_ready) {
    const size_t W = s_.waves.size();
    const int64_t rows = owned_rows(), kvw = kw_ + vw_;
    bwd_spans_.clear();
    if (!forward_pending_) {  // the stateless form without a forward: spans count from here
      fwd_spans_.clear();
      fwd_timed_ = false;
      be_.record(marks_[0]);
    }
    forward_pending_ = false;
    be_.record(marks_[2]);
    // dO of the pre-sink output: dy itself without a sink (no copy), else sink_backward's.
    Act d_o_store = sink ? be_.alloc_act(rows * dims_.hq * dims_.dv) : Act();
    Stat dstat = be_.alloc_stat(rows * dims_.hq);
    begin_span(bwd_spans_, sink ? "bwd merge+sink" : "bwd prep");
    const Act& d_o = be_.merge_sink_backward(dims_, rows, o, lse, sink, dy, d_o_store, dstat, dsink);
    end_span(bwd_spans_);
    be_.zero(dq);
    be_.zero(dk);
    be_.zero(dv);
    // Remote stages first (the last wave first, as plan/cost's simulator prices it) so that their dK/dV
    // returns overlap the remaining compute.
    std::unique_ptr<Communicator::Pending> fetch;
    if (!kv_ready && W > 0) fetch = start_fetch(W - 1, k, v);
    std::vector<std::unique_ptr<Communicator::Pending>> returns(W);
    for (size_t w = W; w-- > 0;) {
      Wave& wave = waves_[w];
      if (!kv_ready) {
        begin_span(bwd_spans_, "bwd wait " + std::to_string(w + 1));
        fetch->wait();
        end_span(bwd_spans_);
        be_.release(wave.send);
        if (w > 0) fetch = start_fetch(w - 1, k, v);
      }
      const int64_t fr = s_.waves[w].fetched.rows();
      wave.dkv = be_.alloc_grad(fr * kvw);
      be_.zero(wave.dkv);
      GradElem* g = be_.data(wave.dkv);
      if (live(w)) {
        begin_span(bwd_spans_, "bwd wave " + std::to_string(w + 1));
        be_.attention_backward(dims_, wave_geom_[w], q, fetched_kv(w), o, lse, d_o, dstat, dq,
                               DkvView<GradElem>{g, g + kw_, kvw, kvw});
        end_span(bwd_spans_);
      }
      be_.release(wave.kv);
      // The mirror of the forward fetch: what came from a peer goes back to it.
      wave.ret = be_.alloc_grad(s_.waves[w].send_total * kvw);
      returns[w] = exchange(be_.data(wave.dkv), be_.data(wave.ret), wave.dkv_counts, Backend::grad_comm_type);
    }
    begin_span(bwd_spans_, "bwd local");
    be_.attention_backward(dims_, local_geom_, q, owned_kv(k, v), o, lse, d_o, dstat, dq,
                           DkvView<GradElem>{be_.data(dk), be_.data(dv), kw_, vw_});
    end_span(bwd_spans_);
    be_.release(d_o_store);
    be_.release(dstat);
    for (size_t w = W; w-- > 0;) {  // in the order they were started
      Wave& wave = waves_[w];
      begin_span(bwd_spans_, "bwd return " + std::to_string(w + 1));
      returns[w]->wait();
      be_.release(wave.dkv);
      be_.add_rows(wave.ret, kvw, 0, kw_, wave.unpack, dk);
      be_.add_rows(wave.ret, kvw, kw_, vw_, wave.unpack, dv);
      end_span(bwd_spans_);
      be_.release(wave.ret);
    }
    be_.record(marks_[3]);
    bwd_timed_ = true;
  }

  // Span i of a list records into that list's i-th pair of marks, made once and reused by every call.
  void begin_span(std::vector<Timed>& list, std::string name) {
    auto& pool = &list == &fwd_spans_ ? fwd_marks_ : bwd_marks_;
    const size_t i = list.size();
    if (i >= pool.size()) pool.push_back({be_.make_mark(), be_.make_mark()});
    list.push_back({std::move(name), Mark(), Mark()});
    be_.record(pool[i].first);
  }
  void end_span(std::vector<Timed>& list) {
    auto& pool = &list == &fwd_spans_ ? fwd_marks_ : bwd_marks_;
    const size_t i = list.size() - 1;
    be_.record(pool[i].second);
    list.back().begin = pool[i].first;
    list.back().end = pool[i].second;
  }

  // Forgets what a forward kept for its backward (the kept KV of every wave, the pre-sink output).
  void release_saved() {
    for (Wave& w : waves_) be_.release(w.kv);
    be_.release(o_saved_);
    q_ = k_ = v_ = nullptr;
    sink_ = nullptr;
    o_ = nullptr;
    lse_ = nullptr;
    kv_kept_ = false;
  }

  Communicator& comm_;
  Backend& be_;
  DenseAttentionOptions opt_;
  AttentionShape dims_;
  RankSchedule s_;
  int64_t kw_ = 0, vw_ = 0;
  size_t live_waves_ = 0;
  typename Backend::Geometry local_geom_;
  std::vector<typename Backend::Geometry> wave_geom_;
  std::vector<Wave> waves_;
  const Act *q_ = nullptr, *k_ = nullptr, *v_ = nullptr, *o_ = nullptr;
  const Stat *sink_ = nullptr, *lse_ = nullptr;
  Act o_saved_;
  bool kv_kept_ = false;
  bool refetch_ = false;
  RankTraffic traffic_;
  std::vector<Mark> marks_;  // forward begin/end, backward begin/end
  std::vector<std::pair<Mark, Mark>> fwd_marks_, bwd_marks_;
  std::vector<Timed> fwd_spans_, bwd_spans_;
  bool fwd_timed_ = false, bwd_timed_ = false, forward_pending_ = false;
};

}  // namespace treecp
