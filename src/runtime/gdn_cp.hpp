// runtime/: executes plans on one rank, one class per layer kind, generic over a Backend and a
// Communicator; moves activations between ownerships; the one-process references.
//
// GDN / KDA context parallelism over a packed prefix-tree row: executes a GdnPlan (plan/gdn_plan.hpp)
// on one rank, generic over a Backend (runtime/backend.hpp) and a Communicator, like dense attention.
//
// Every rank holds the tokens of gdn_rank_ranges(row, plan, rank), laid out in that order, and every
// rank constructs the same GdnCP from the same row and plan. The DAG steps of the plan run in order;
// before each step the final states its segments start from travel from their holders in one
// all-to-all (zero counts where nothing moves). A chain step computes each rank's shard summary
// (M, E), runs an exclusive prefix scan over the ranks in ceil(log2 N) doubling rounds of all-to-all,
// and applies the true incoming state. The backward runs the steps in reverse: the final-state
// gradient of a segment is the sum over its children of their incoming-state gradients, and a chain's
// suffix scan gives each shard its true outgoing-state gradient (dS_in = Fᵀ dY + Mᵀ dS_out).
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "comm/communicator.hpp"
#include "core/error.hpp"
#include "plan/gdn_plan.hpp"
#include "runtime/backend.hpp"
#include "runtime/row_map.hpp"
#include "tree/row.hpp"

namespace treecp {

// Exclusive prefix scan of summary maps over the ranks: `own` holds `items` maps (GdnShape's map
// layout); the composition of item i of all earlier ranks in scan order (direction +1: rank order,
// -1: reverse) lands in `excl` (allocated here). False on the first rank, which has no earlier one.
// ceil(log2 N) all-to-all rounds; every rank calls it with the same items.
template <class Backend>
bool gdn_exclusive_scan(Communicator& comm, Backend& be, const GdnShape& shape, int direction, int64_t items,
                        const typename Backend::Buffer& own, typename Backend::Buffer& excl) {
  using Buffer = typename Backend::Buffer;
  const int n = comm.size(), me = comm.rank();
  const int64_t count = items * shape.map_elements();
  require(be.size(own) == count, "gdn scan: ", count, " elements expected, got ", be.size(own));
  Buffer agg = be.alloc(count), recv = be.alloc(count);
  be.copy_rows(own, {{0, 0, 1}}, count, agg);
  excl = be.alloc(count);
  bool have = false;
  // Position in scan order; the peer d positions earlier / later.
  const int pos = direction > 0 ? me : n - 1 - me;
  auto rank_at = [&](int position) { return direction > 0 ? position : n - 1 - position; };
  for (int d = 1; d < n; d *= 2) {
    std::vector<int64_t> sc(n, 0), sd(n, 0), rc(n, 0), rd(n, 0);
    const bool sends = pos + d < n, receives = pos - d >= 0;
    if (sends) sc[static_cast<size_t>(rank_at(pos + d))] = count;
    if (receives) rc[static_cast<size_t>(rank_at(pos - d))] = count;
    comm.all_to_all_v(be.data(agg), sc, sd, be.data(recv), rc, rd, Backend::comm_type);
    if (!receives) continue;
    be.gdn_compose(shape, items, agg, recv);
    if (have) {
      be.gdn_compose(shape, items, excl, recv);
    } else {
      be.copy_rows(recv, {{0, 0, 1}}, count, excl);
    }
    have = true;
  }
  return have;
}

template <class Backend>
class GdnCP {
 public:
  using Buffer = typename Backend::Buffer;

  // Checks the shape, and the plan against the row and the communicator, on every rank, and agrees on
  // the verdict before any data moves.
  GdnCP(const GdnPlan& plan, const Row& row, const GdnShape& shape, Communicator& comm, Backend& backend)
      : plan_(plan), row_(row), shape_(shape), comm_(comm), be_(backend) {
    std::string problem;
    try {
      shape.validate();
      require(plan.ranks == comm.size(), "gdn: plan is for ", plan.ranks, " ranks, communicator has ", comm.size());
      validate_gdn_plan(row, plan);
    } catch (const Error& e) {
      problem = e.what();
    }
    if (!comm.all_ok(problem.empty())) fail(problem.empty() ? "gdn plan refused on another rank" : problem);
    map_ = RowMap(gdn_rank_ranges(row, plan, comm.rank()));
    sched_ = gdn_schedule(row, plan);
  }

  int64_t owned_rows() const { return map_.rows(); }
  const RowMap& owned() const { return map_; }

  // q, k [owned, H, dk], v [owned, H, dv], g [owned, H] (GDN) or [owned, H, dk] (KDA), beta [owned, H]
  // -> y [owned, H, dv]. The inputs must outlive backward().
  void forward(const Buffer& q, const Buffer& k, const Buffer& v, const Buffer& g, const Buffer& beta, Buffer& y) {
    in_ = GdnInputs<Buffer>{&q, &k, &v, &g, &beta};
    require(be_.size(beta) == owned_rows() * shape_.heads, "gdn: rank ", comm_.rank(), " holds ", owned_rows(),
            " tokens in this plan, got ", be_.size(beta) / shape_.heads);
    const int me = comm_.rank(), N = comm_.size();
    const int32_t nseg = row_.num_segments();
    const int64_t state = shape_.state_elements(), item = shape_.map_elements();
    state_in_.assign(static_cast<size_t>(nseg), Buffer());
    chain_map_.assign(static_cast<size_t>(nseg), Buffer());
    std::vector<Buffer> final_state(static_cast<size_t>(nseg)), parent_in(static_cast<size_t>(nseg));

    for (int st = 0; st < sched_.steps; ++st) {
      exchange(sched_.transfers[static_cast<size_t>(st)], false,
               [&](int32_t s) -> const Buffer& { return final_state[static_cast<size_t>(row_.parent(s))]; },
               [&](int32_t s) -> Buffer& { return parent_in[static_cast<size_t>(s)]; });
      const std::vector<int32_t>& segs = sched_.segments[static_cast<size_t>(st)];
      if (st % 2 == 0) {
        for (int32_t s : segs) {
          if (plan_.owner[s] != me) continue;
          const int32_t p = row_.parent(s);
          Buffer S = p < 0 ? be_.alloc(state) : copy(plan_.chained[p] ? parent_in[s] : final_state[p], state);
          state_in_[s] = copy(S, state);
          run(row_.start(s), row_.end(s), S, y);
          final_state[s] = std::move(S);
          parent_in[s] = Buffer();
        }
        continue;
      }
      // Chain step: summaries of this rank's pieces (the identity where it holds none).
      Buffer own = be_.alloc(static_cast<int64_t>(segs.size()) * item), excl;
      for (size_t i = 0; i < segs.size(); ++i) {
        const int32_t s = segs[i];
        const int64_t b = plan_.cuts[s][me], e = plan_.cuts[s][me + 1];
        be_.gdn_summary(shape_, in_, b < e ? map_.row_of_range(b, e) : 0, e - b, own, static_cast<int64_t>(i));
        chain_map_[s] = be_.alloc(item);
        be_.copy_rows(own, {{static_cast<int64_t>(i), 0, 1}}, item, chain_map_[s]);
        // Seed the first shard with the parent's state: (0, M S_parent + E). Every later prefix then
        // has M = 0 and its E is the true incoming state.
        if (me == 0) be_.gdn_seed(shape_, own, static_cast<int64_t>(i), row_.parent(s) >= 0 ? &parent_in[s] : nullptr);
      }
      gdn_exclusive_scan(comm_, be_, shape_, +1, static_cast<int64_t>(segs.size()), own, excl);
      for (size_t i = 0; i < segs.size(); ++i) {
        const int32_t s = segs[i];
        Buffer S = be_.alloc(state);
        if (me == 0) {
          if (row_.parent(s) >= 0) be_.copy_rows(parent_in[s], {{0, 0, 1}}, state, S);
        } else {
          be_.gdn_map_state(shape_, excl, static_cast<int64_t>(i), S);
        }
        state_in_[s] = copy(S, state);
        run(plan_.cuts[s][me], plan_.cuts[s][me + 1], S, y);
        if (me == N - 1) final_state[s] = std::move(S);
        parent_in[s] = Buffer();
      }
    }
  }

  // dy [owned, H, dv] -> dq, dk, dv, dg, dbeta over the owned rows (overwritten).
  void backward(const Buffer& dy, Buffer& dq, Buffer& dk, Buffer& dv, Buffer& dg, Buffer& dbeta) {
    require(in_.q != nullptr, "gdn: backward() called before forward()");
    const int me = comm_.rank(), N = comm_.size();
    const int32_t nseg = row_.num_segments();
    const int64_t state = shape_.state_elements(), item = shape_.map_elements();
    for (Buffer* b : {&dq, &dk, &dv, &dg, &dbeta}) be_.zero(*b);
    const GdnGradients<Buffer> grads{&dq, &dk, &dv, &dg, &dbeta};
    // grad_final[s]: dL/d(final state of s), summed over children, on s's holder.
    // grad_in[s]: dL/d(state s started from), on the rank that started s, until sent to the holder.
    std::vector<Buffer> grad_final(static_cast<size_t>(nseg)), grad_in(static_cast<size_t>(nseg));
    auto final_grad = [&](int32_t s) {
      Buffer& g = grad_final[static_cast<size_t>(s)];
      if (be_.size(g) == 0) g = be_.alloc(state);
      return copy(g, state);
    };

    for (int st = sched_.steps - 1; st >= 0; --st) {
      const std::vector<int32_t>& segs = sched_.segments[static_cast<size_t>(st)];
      if (st % 2 == 0) {
        for (auto it = segs.rbegin(); it != segs.rend(); ++it) {
          const int32_t s = *it;
          if (plan_.owner[s] != me) continue;
          Buffer ds = final_grad(s);
          run_back(row_.start(s), row_.end(s), state_in_[s], dy, ds, grads);
          const int32_t p = row_.parent(s);
          if (p < 0) continue;
          if (plan_.chained[p]) {
            grad_in[s] = std::move(ds);
          } else {
            add_into(grad_final[p], ds);
          }
        }
      } else {
        // Each shard's gradient map dS_in = Mᵀ dS_out + a, a = its own outputs' contribution; the last
        // shard is seeded with the chain's final-state gradient.
        Buffer own = be_.alloc(static_cast<int64_t>(segs.size()) * item), excl;
        std::vector<Buffer> g_final(segs.size());
        for (size_t i = 0; i < segs.size(); ++i) {
          const int32_t s = segs[i];
          Buffer a = be_.alloc(state);
          run_back(plan_.cuts[s][me], plan_.cuts[s][me + 1], state_in_[s], dy, a, GdnGradients<Buffer>{});
          if (me == N - 1) g_final[i] = final_grad(s);
          be_.gdn_adjoint(shape_, chain_map_[s], a, me == N - 1 ? &g_final[i] : nullptr, own, static_cast<int64_t>(i));
        }
        gdn_exclusive_scan(comm_, be_, shape_, -1, static_cast<int64_t>(segs.size()), own, excl);
        for (size_t i = 0; i < segs.size(); ++i) {
          const int32_t s = segs[i];
          Buffer ds = be_.alloc(state);
          if (me == N - 1) {
            ds = std::move(g_final[i]);
          } else {
            be_.gdn_map_state(shape_, excl, static_cast<int64_t>(i), ds);
          }
          run_back(plan_.cuts[s][me], plan_.cuts[s][me + 1], state_in_[s], dy, ds, grads);
          if (me == 0 && row_.parent(s) >= 0) grad_in[s] = std::move(ds);
        }
      }
      // Incoming-state gradients of this step's segments go back to their parents' holders, added there.
      std::vector<Buffer> arrived(static_cast<size_t>(nseg));
      exchange(sched_.transfers[static_cast<size_t>(st)], true,
               [&](int32_t s) -> const Buffer& { return grad_in[static_cast<size_t>(s)]; },
               [&](int32_t s) -> Buffer& { return arrived[static_cast<size_t>(s)]; });
      for (const GdnTransfer& t : sched_.transfers[static_cast<size_t>(st)]) {
        if (t.src == me) add_into(grad_final[static_cast<size_t>(row_.parent(t.seg))], arrived[t.seg]);
        grad_in[static_cast<size_t>(t.seg)] = Buffer();
      }
    }
  }

 private:
  Buffer copy(const Buffer& src, int64_t n) {
    Buffer out = be_.alloc(n);
    be_.copy_rows(src, {{0, 0, 1}}, n, out);
    return out;
  }
  void add_into(Buffer& acc, const Buffer& g) {
    const int64_t state = shape_.state_elements();
    if (be_.size(acc) == 0) acc = be_.alloc(state);
    be_.add_rows(g, {{0, 0, 1}}, state, acc);
  }
  // Tokens [b, e) of the row (held here, contiguous in the buffers) from state S; S becomes the final state.
  void run(int64_t b, int64_t e, Buffer& S, Buffer& y) {
    if (b < e) be_.gdn_forward(shape_, in_, map_.row_of_range(b, e), e - b, S, y);
  }
  void run_back(int64_t b, int64_t e, const Buffer& s_in, const Buffer& dy, Buffer& ds, const GdnGradients<Buffer>& g) {
    if (b < e) be_.gdn_backward(shape_, in_, map_.row_of_range(b, e), e - b, s_in, dy, ds, g);
  }

  // One all-to-all moving a state per transfer (src -> dst; reverse: dst -> src). The sender's
  // out(seg) is sent; the receiver's in(seg) is allocated and filled. Both sides enumerate the
  // transfers in list order, so no segment ids travel.
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
    Buffer send = be_.alloc(static_cast<int64_t>(sent.size()) * state);
    Buffer recv = be_.alloc(static_cast<int64_t>(received.size()) * state);
    for (size_t i = 0; i < sent.size(); ++i) be_.copy_rows(out(sent[i]), {{0, static_cast<int64_t>(i), 1}}, state, send);
    comm_.all_to_all_v(be_.data(send), sc, sd, be_.data(recv), rc, rd, Backend::comm_type);
    for (size_t i = 0; i < received.size(); ++i) {
      Buffer& dst = in(received[i]);
      dst = be_.alloc(state);
      be_.copy_rows(recv, {{static_cast<int64_t>(i), 0, 1}}, state, dst);
    }
  }

  const GdnPlan& plan_;
  const Row& row_;
  GdnShape shape_;
  Communicator& comm_;
  Backend& be_;
  RowMap map_;
  GdnSchedule sched_;
  GdnInputs<Buffer> in_;
  // What the forward keeps for the backward, per segment this rank runs (empty elsewhere): the state
  // its run started from and, for a chained segment, its shard's summary map.
  std::vector<Buffer> state_in_, chain_map_;
};

}  // namespace treecp
