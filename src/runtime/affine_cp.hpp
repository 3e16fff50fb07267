// runtime/: executes plans on one rank, one class per layer kind, generic over a Backend and a
// Communicator; moves activations between ownerships; the one-process references.
//
// Context parallelism over a packed prefix-tree row for any recurrence whose run over a piece of tokens
// is AFFINE in its incoming state: S_out = M S_in + E per head, with the state a rows x cols block and M
// rows x rows (kernels/shapes.hpp AffineShape). GDN/KDA (rows = dk, cols = dv; runtime/gdn_cp.hpp) and
// Mamba-2's summary strategy (rows = 1, cols = N·P: a scalar decay per head; runtime/mamba2_cp.cpp) run
// on it. Executes a GdnPlan (plan/gdn_plan.hpp) on one rank, generic over a Backend (runtime/backend.hpp)
// and a Communicator, like dense attention: states, summary maps and their exchanges are Backend Grad
// buffers moved by copy_rows / add_rows and the affine_* operations.
//
// Every rank holds the tokens of gdn_rank_ranges(row, plan, rank), laid out in that order, and every rank
// constructs the same AffineCP from the same row and plan. The DAG steps of the plan run in order; before
// each step the final states its segments start from travel from their holders in one all-to-all (zero
// counts where nothing moves). A chain step computes each rank's shard summary (M, E), runs an exclusive
// prefix scan over the ranks in ceil(log2 N) doubling rounds of all-to-all, and applies the true incoming
// state. The backward runs the steps in reverse: the final-state gradient of a segment is the sum over
// its children of their incoming-state gradients, and a chain's suffix scan gives each shard its true
// outgoing-state gradient (dS_in = Fᵀ dY + Mᵀ dS_out).
//
// The recurrence comes as an adapter `Rec` over this rank's buffers, every head of the run of buffer rows
// [row, row + rows), rows >= 1:
//   static constexpr const char* name;        ("gdn", "mamba2": error messages)
//   using Grads = ...;                        (Grads{} = nothing but the state gradient)
//   int64_t tokens() const;                   the rows this rank's inputs hold
//   void forward(Backend&, int64_t row, int64_t rows, Grad& state, Act& y) const;     state: in -> out
//   void summary(Backend&, int64_t row, int64_t rows, Grad& maps, int64_t item) const;   the run's (M, E)
//   void backward(Backend&, int64_t row, int64_t rows, const Grad& state_in, const Act& dy, Grad& dstate,
//                 const Grads&) const;        dstate: dL/dS_out in, dL/dS_in out; the gradients +=
#pragma once

#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "comm/communicator.hpp"
#include "core/error.hpp"
#include "kernels/shapes.hpp"
#include "plan/gdn_plan.hpp"
#include "runtime/backend.hpp"
#include "runtime/row_map.hpp"
#include "tree/row.hpp"

namespace treecp {

// Exclusive prefix scan of summary maps over the ranks: `own` holds `items` maps (AffineShape's map
// layout); the composition of item i of all earlier ranks in scan order (direction +1: rank order, -1:
// reverse) lands in `excl` (allocated here). False on the first rank, which has no earlier one.
// ceil(log2 N) all-to-all rounds; every rank calls it with the same items.
template <class Backend>
bool affine_exclusive_scan(Communicator& comm, Backend& be, const AffineShape& shape, int direction, int64_t items,
                           const typename Backend::Grad& own, typename Backend::Grad& excl) {
  using Grad = typename Backend::Grad;
  const int n = comm.size(), me = comm.rank();
  const int64_t count = items * shape.map_elements();
  require(be.size(own) == count, "affine scan: ", count, " elements expected, got ", be.size(own));
  Grad agg = be.alloc_grad(count), recv = be.alloc_grad(count);
  be.copy_rows(own, {{0, 0, 1}}, count, agg);
  excl = be.alloc_grad(count);
  bool have = false;
  // Position in scan order; the peer d positions earlier / later.
  const int pos = direction > 0 ? me : n - 1 - me;
  auto rank_at = [&](int position) { return direction > 0 ? position : n - 1 - position; };
  for (int d = 1; d < n; d *= 2) {
    std::vector<int64_t> sc(static_cast<size_t>(n), 0), sd(sc), rc(sc), rd(sc);
    const bool sends = pos + d < n, receives = pos - d >= 0;
    if (sends) sc[static_cast<size_t>(rank_at(pos + d))] = count;
    if (receives) rc[static_cast<size_t>(rank_at(pos - d))] = count;
    comm.all_to_all_v(be.data(agg), sc, sd, be.data(recv), rc, rd, Backend::grad_comm_type);
    if (!receives) continue;
    be.affine_compose(shape, items, agg, recv);
    if (have) {
      be.affine_compose(shape, items, excl, recv);
    } else {
      be.copy_rows(recv, {{0, 0, 1}}, count, excl);
    }
    have = true;
  }
  be.release(agg);
  be.release(recv);
  return have;
}

template <class Backend>
class AffineCP {
 public:
  using Act = typename Backend::Act;
  using Grad = typename Backend::Grad;

  // Checks the layer (`check_layer`, may be empty) and the plan against the row and the communicator, on
  // every rank, and agrees on the verdict before any data moves: a bad plan throws the same error on
  // every rank, no collective hangs. `name` prefixes the errors.
  AffineCP(const GdnPlan& plan, const Row& row, const AffineShape& shape, Communicator& comm, Backend& backend,
           const std::string& name, const std::function<void()>& check_layer = {})
      : plan_(plan), row_(row), shape_(shape), comm_(comm), be_(backend), name_(name) {
    std::string problem;
    try {
      if (check_layer) check_layer();
      require(shape.heads >= 0 && shape.rows >= 1 && shape.cols >= 1, name, ": state of ", shape.rows, " x ",
              shape.cols, " for ", shape.heads, " heads");
      require(plan.ranks == comm.size(), name, ": plan is for ", plan.ranks, " ranks, communicator has ", comm.size());
      validate_gdn_plan(row, plan);
    } catch (const Error& e) {
      problem = e.what();
    }
    if (!comm.all_ok(problem.empty())) fail(problem.empty() ? name + " plan refused on another rank" : problem);
    map_ = RowMap(gdn_rank_ranges(row, plan, comm.rank()));
    sched_ = gdn_schedule(row, plan);
  }

  AffineCP(const AffineCP&) = delete;
  AffineCP& operator=(const AffineCP&) = delete;
  ~AffineCP() { forget(); }

  int64_t owned_rows() const { return map_.rows(); }
  const RowMap& owned() const { return map_; }
  const AffineShape& shape() const { return shape_; }

  // Writes y for this rank's rows. Keeps, per segment this rank runs, the state its run started from and,
  // for a chained segment, its shard's summary map, for backward().
  template <class Rec>
  void forward(const Rec& rec, Act& y) {
    require(rec.tokens() == owned_rows(), name_, ": rank ", comm_.rank(), " holds ", owned_rows(),
            " tokens in this plan, got ", rec.tokens());
    forget();
    const int me = comm_.rank(), N = comm_.size();
    const int32_t nseg = row_.num_segments();
    const int64_t item = shape_.map_elements();
    state_in_.resize(static_cast<size_t>(nseg));  // empty after forget(); resize, as a GPU's buffers do not copy
    chain_map_.resize(static_cast<size_t>(nseg));
    std::vector<Grad> final_state(static_cast<size_t>(nseg)), parent_in(static_cast<size_t>(nseg));

    for (int st = 0; st < sched_.steps; ++st) {
      exchange(sched_.transfers[static_cast<size_t>(st)], false,
               [&](int32_t s) -> const Grad& { return final_state[static_cast<size_t>(row_.parent(s))]; },
               [&](int32_t s) -> Grad& { return parent_in[static_cast<size_t>(s)]; });
      const std::vector<int32_t>& segs = sched_.segments[static_cast<size_t>(st)];
      if (st % 2 == 0) {
        for (int32_t s : segs) {
          if (plan_.owner[s] != me) continue;
          const int32_t p = row_.parent(s);
          Grad S = p < 0 ? zero_state() : copy(plan_.chained[p] ? parent_in[s] : final_state[p]);
          state_in_[s] = copy(S);
          run(rec, row_.start(s), row_.end(s), S, y);
          final_state[s] = std::move(S);
          be_.release(parent_in[s]);
        }
        continue;
      }
      // Chain step: summaries of this rank's pieces (the identity where it holds none).
      Grad own = be_.alloc_grad(static_cast<int64_t>(segs.size()) * item), excl;
      for (size_t i = 0; i < segs.size(); ++i) {
        const int32_t s = segs[i];
        const int64_t b = plan_.cuts[s][me], e = plan_.cuts[s][me + 1], at = static_cast<int64_t>(i);
        if (b < e) {
          rec.summary(be_, map_.row_of_range(b, e), e - b, own, at);
        } else {
          be_.affine_identity(shape_, own, at);
        }
        chain_map_[s] = be_.alloc_grad(item);
        be_.copy_rows(own, {{at, 0, 1}}, item, chain_map_[s]);
        // Seed the first shard with the parent's state: (0, M S_parent + E). Every later prefix then
        // has M = 0 and its E is the true incoming state.
        if (me == 0) be_.affine_seed(shape_, own, at, row_.parent(s) >= 0 ? &parent_in[s] : nullptr);
      }
      affine_exclusive_scan(comm_, be_, shape_, +1, static_cast<int64_t>(segs.size()), own, excl);
      for (size_t i = 0; i < segs.size(); ++i) {
        const int32_t s = segs[i];
        Grad S = zero_state();
        if (me == 0) {
          if (row_.parent(s) >= 0) be_.copy_rows(parent_in[s], {{0, 0, 1}}, shape_.state_elements(), S);
        } else {
          be_.affine_state(shape_, excl, static_cast<int64_t>(i), S);
        }
        state_in_[s] = copy(S);
        run(rec, plan_.cuts[s][me], plan_.cuts[s][me + 1], S, y);
        if (me == N - 1) {
          final_state[s] = std::move(S);
        } else {
          be_.release(S);
        }
        be_.release(parent_in[s]);
      }
      be_.release(own);
      be_.release(excl);
    }
    for (Grad& g : final_state) be_.release(g);
    forward_done_ = true;
  }

  // Adds this rank's gradients into `grads` (the caller zeroes them first); dy is laid out like y.
  template <class Rec>
  void backward(const Rec& rec, const Act& dy, const typename Rec::Grads& grads) {
    using Grads = typename Rec::Grads;
    require(forward_done_, name_, ": backward() called before forward()");
    require(rec.tokens() == owned_rows(), name_, ": rank ", comm_.rank(), " holds ", owned_rows(),
            " tokens in this plan, got ", rec.tokens());
    const int me = comm_.rank(), N = comm_.size();
    const int32_t nseg = row_.num_segments();
    const int64_t item = shape_.map_elements();
    // grad_final[s]: dL/d(final state of s), summed over children, on s's holder.
    // grad_in[s]: dL/d(state s started from), on the rank that started s, until sent to the holder.
    std::vector<Grad> grad_final(static_cast<size_t>(nseg)), grad_in(static_cast<size_t>(nseg));
    auto final_grad = [&](int32_t s) {
      Grad& g = grad_final[static_cast<size_t>(s)];
      return be_.size(g) == 0 ? zero_state() : copy(g);
    };

    for (int st = sched_.steps - 1; st >= 0; --st) {
      const std::vector<int32_t>& segs = sched_.segments[static_cast<size_t>(st)];
      if (st % 2 == 0) {
        for (auto it = segs.rbegin(); it != segs.rend(); ++it) {
          const int32_t s = *it;
          if (plan_.owner[s] != me) continue;
          Grad ds = final_grad(s);
          run_back(rec, row_.start(s), row_.end(s), state_in_[s], dy, ds, grads);
          const int32_t p = row_.parent(s);
          if (p < 0) {
            be_.release(ds);
          } else if (plan_.chained[p]) {
            grad_in[s] = std::move(ds);
          } else {
            add_into(grad_final[p], ds);
            be_.release(ds);
          }
        }
      } else {
        // Each shard's gradient map dS_in = Mᵀ dS_out + a, a = its own outputs' contribution; the last
        // shard is seeded with the chain's final-state gradient.
        Grad own = be_.alloc_grad(static_cast<int64_t>(segs.size()) * item), excl;
        std::vector<Grad> g_final(segs.size());
        for (size_t i = 0; i < segs.size(); ++i) {
          const int32_t s = segs[i];
          Grad a = zero_state();
          run_back(rec, plan_.cuts[s][me], plan_.cuts[s][me + 1], state_in_[s], dy, a, Grads{});
          if (me == N - 1) g_final[i] = final_grad(s);
          be_.affine_adjoint(shape_, chain_map_[s], a, me == N - 1 ? &g_final[i] : nullptr, own,
                             static_cast<int64_t>(i));
          be_.release(a);
        }
        affine_exclusive_scan(comm_, be_, shape_, -1, static_cast<int64_t>(segs.size()), own, excl);
        for (size_t i = 0; i < segs.size(); ++i) {
          const int32_t s = segs[i];
          Grad ds;
          if (me == N - 1) {
            ds = std::move(g_final[i]);
          } else {
            ds = zero_state();
            be_.affine_state(shape_, excl, static_cast<int64_t>(i), ds);
          }
          run_back(rec, plan_.cuts[s][me], plan_.cuts[s][me + 1], state_in_[s], dy, ds, grads);
          if (me == 0 && row_.parent(s) >= 0) {
            grad_in[s] = std::move(ds);
          } else {
            be_.release(ds);
          }
        }
        be_.release(own);
        be_.release(excl);
      }
      // Incoming-state gradients of this step's segments go back to their parents' holders, added there.
      std::vector<Grad> arrived(static_cast<size_t>(nseg));
      exchange(sched_.transfers[static_cast<size_t>(st)], true,
               [&](int32_t s) -> const Grad& { return grad_in[static_cast<size_t>(s)]; },
               [&](int32_t s) -> Grad& { return arrived[static_cast<size_t>(s)]; });
      for (const GdnTransfer& t : sched_.transfers[static_cast<size_t>(st)]) {
        if (t.src == me) add_into(grad_final[static_cast<size_t>(row_.parent(t.seg))], arrived[t.seg]);
        be_.release(arrived[t.seg]);
        be_.release(grad_in[static_cast<size_t>(t.seg)]);
      }
    }
    for (Grad& g : grad_final) be_.release(g);
  }

 private:
  Grad zero_state() {
    Grad s = be_.alloc_grad(shape_.state_elements());
    be_.zero(s);
    return s;
  }
  Grad copy(const Grad& src) {
    Grad out = be_.alloc_grad(shape_.state_elements());
    be_.copy_rows(src, {{0, 0, 1}}, shape_.state_elements(), out);
    return out;
  }
  void add_into(Grad& acc, const Grad& g) {
    const int64_t state = shape_.state_elements();
    if (be_.size(acc) == 0) acc = zero_state();
    be_.add_rows(g, state, 0, state, be_.upload(std::vector<RowCopy>{{0, 0, 1}}), acc);
  }
  // Tokens [b, e) of the row (held here, contiguous in the buffers) from state S; S becomes the final state.
  template <class Rec>
  void run(const Rec& rec, int64_t b, int64_t e, Grad& S, Act& y) {
    if (b < e) rec.forward(be_, map_.row_of_range(b, e), e - b, S, y);
  }
  template <class Rec, class G>
  void run_back(const Rec& rec, int64_t b, int64_t e, const Grad& s_in, const Act& dy, Grad& ds, const G& g) {
    if (b < e) rec.backward(be_, map_.row_of_range(b, e), e - b, s_in, dy, ds, g);
  }
  void forget() {
    for (Grad& g : state_in_) be_.release(g);
    for (Grad& g : chain_map_) be_.release(g);
    state_in_.clear();
    chain_map_.clear();
    forward_done_ = false;
  }

  // One all-to-all moving a state per transfer (src -> dst; reverse: dst -> src). The sender's out(seg)
  // is sent; the receiver's in(seg) is allocated and filled. Both sides enumerate the transfers in list
  // order, so no segment ids travel.
  template <class Out, class In>
  void exchange(const std::vector<GdnTransfer>& ts, bool reverse, Out out, In in) {
    const int n = comm_.size(), me = comm_.rank();
    const int64_t state = shape_.state_elements();
    std::vector<int64_t> sc(static_cast<size_t>(n)), sd(sc), rc(sc), rd(sc);
    std::vector<int32_t> sent, received;
    for (int p = 0; p < n; ++p) {
      sd[static_cast<size_t>(p)] = static_cast<int64_t>(sent.size()) * state;
      rd[static_cast<size_t>(p)] = static_cast<int64_t>(received.size()) * state;
      for (const GdnTransfer& t : ts) {
        const int from = reverse ? t.dst : t.src, to = reverse ? t.src : t.dst;
        if (from == me && to == p) sent.push_back(t.seg);
        if (to == me && from == p) received.push_back(t.seg);
      }
      sc[static_cast<size_t>(p)] = static_cast<int64_t>(sent.size()) * state - sd[static_cast<size_t>(p)];
      rc[static_cast<size_t>(p)] = static_cast<int64_t>(received.size()) * state - rd[static_cast<size_t>(p)];
    }
    Grad send = be_.alloc_grad(static_cast<int64_t>(sent.size()) * state);
    Grad recv = be_.alloc_grad(static_cast<int64_t>(received.size()) * state);
    for (size_t i = 0; i < sent.size(); ++i)
      be_.copy_rows(out(sent[i]), {{0, static_cast<int64_t>(i), 1}}, state, send);
    comm_.all_to_all_v(be_.data(send), sc, sd, be_.data(recv), rc, rd, Backend::grad_comm_type);
    for (size_t i = 0; i < received.size(); ++i) {
      Grad& dst = in(received[i]);
      dst = be_.alloc_grad(state);
      be_.copy_rows(recv, {{static_cast<int64_t>(i), 0, 1}}, state, dst);
    }
    be_.release(send);
    be_.release(recv);
  }

  const GdnPlan& plan_;
  const Row& row_;
  AffineShape shape_;
  Communicator& comm_;
  Backend& be_;
  std::string name_;
  RowMap map_;
  GdnSchedule sched_;
  bool forward_done_ = false;
  // What the forward keeps for the backward, per segment this rank runs (empty elsewhere): the state
  // its run started from and, for a chained segment, its shard's summary map.
  std::vector<Grad> state_in_, chain_map_;
};

}  // namespace treecp
