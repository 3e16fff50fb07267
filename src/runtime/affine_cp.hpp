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
// counts where nothing moves). A chain step computes the summary (M, E) of each run of a chain a rank
// holds (consecutive pieces of one rank, plan/gdn_plan.hpp; a zigzag chain visits a rank twice), runs an
// exclusive prefix scan over the chain's runs in ceil(log2 runs) doubling rounds of all-to-all (every
// chain of the step at once), and applies the true incoming state. The backward runs the steps in
// reverse: the final-state gradient of a segment is the sum over its children of their incoming-state
// gradients, and a chain's suffix scan gives each run its true outgoing-state gradient
// (dS_in = Fᵀ dY + Mᵀ dS_out).
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

#include <algorithm>
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

// Exclusive prefix scan of summary maps along chains whose positions lie on any ranks: chain i has
// ranks[i].size() positions, position k held by rank ranks[i][k] (a rank may hold several). `own` holds
// this rank's positions' maps (AffineShape's map layout) in (chain, position) order; the composition of
// every earlier position of the same chain lands in `excl` (allocated here, the same order). Returns,
// per own position, whether it has an earlier one (false: position 0, excl holds the identity).
// Hillis-Steele doubling: ceil(log2 longest chain) all-to-all rounds, in round d position k sending its
// aggregate to position k + d; every rank calls it with the same chains.
template <class Backend>
std::vector<uint8_t> affine_chain_scan(Communicator& comm, Backend& be, const AffineShape& shape,
                                       const std::vector<std::vector<int>>& ranks, const typename Backend::Grad& own,
                                       typename Backend::Grad& excl) {
  using Grad = typename Backend::Grad;
  const int n = comm.size(), me = comm.rank();
  const int64_t item = shape.map_elements();
  // This rank's positions, and per chain position the index of its map in `own` (-1: another rank's).
  struct Pos {
    size_t chain;
    size_t k;
  };
  std::vector<Pos> mine;
  std::vector<std::vector<int64_t>> index(ranks.size());
  size_t longest = 0;
  for (size_t i = 0; i < ranks.size(); ++i) {
    longest = std::max(longest, ranks[i].size());
    index[i].assign(ranks[i].size(), -1);
    for (size_t k = 0; k < ranks[i].size(); ++k) {
      require(ranks[i][k] >= 0 && ranks[i][k] < n, "affine scan: chain ", i, " position ", k, " on rank ",
              ranks[i][k], " of ", n);
      if (ranks[i][k] != me) continue;
      index[i][k] = static_cast<int64_t>(mine.size());
      mine.push_back({i, k});
    }
  }
  const int64_t count = static_cast<int64_t>(mine.size()) * item;
  require(be.size(own) == count, "affine scan: ", count, " elements expected, got ", be.size(own));
  Grad agg = be.alloc_grad(count);
  if (count > 0) be.copy_rows(own, {{0, 0, 1}}, count, agg);
  excl = be.alloc_grad(count);
  std::vector<uint8_t> has(mine.size(), 0);
  for (size_t j = 0; j < mine.size(); ++j) {
    be.affine_identity(shape, excl, static_cast<int64_t>(j));
    has[j] = mine[j].k > 0;
  }
  for (size_t d = 1; d < longest; d *= 2) {
    // Both sides list a peer's summaries in (chain, position) order: the sender's k and the receiver's
    // k + d rise together.
    std::vector<int64_t> sc(static_cast<size_t>(n), 0), sd(sc), rc(sc), rd(sc);
    std::vector<RowCopy> pack, arrived;  // arrived: recv row -> own index
    for (int p = 0; p < n; ++p) {
      sd[static_cast<size_t>(p)] = static_cast<int64_t>(pack.size()) * item;
      rd[static_cast<size_t>(p)] = static_cast<int64_t>(arrived.size()) * item;
      for (size_t j = 0; j < mine.size(); ++j) {
        const auto& chain = ranks[mine[j].chain];
        const size_t k = mine[j].k;
        if (k + d < chain.size() && chain[k + d] == p)
          pack.push_back({static_cast<int64_t>(j), static_cast<int64_t>(pack.size()), 1});
        if (k >= d && chain[k - d] == p)
          arrived.push_back({static_cast<int64_t>(arrived.size()), static_cast<int64_t>(j), 1});
      }
      sc[static_cast<size_t>(p)] = static_cast<int64_t>(pack.size()) * item - sd[static_cast<size_t>(p)];
      rc[static_cast<size_t>(p)] = static_cast<int64_t>(arrived.size()) * item - rd[static_cast<size_t>(p)];
    }
    const int64_t received = static_cast<int64_t>(arrived.size());
    Grad send = be.alloc_grad(static_cast<int64_t>(pack.size()) * item), recv = be.alloc_grad(received * item);
    be.copy_rows(agg, pack, item, send);
    comm.all_to_all_v(be.data(send), sc, sd, be.data(recv), rc, rd, Backend::grad_comm_type);
    be.release(send);
    if (received > 0) {
      // Gather the receivers' aggregates and prefixes, compose each with what arrived, scatter back.
      std::vector<RowCopy> gather, scatter;
      for (const RowCopy& a : arrived) {
        gather.push_back({a.dst_row, a.src_row, 1});
        scatter.push_back({a.src_row, a.dst_row, 1});
      }
      Grad a = be.alloc_grad(received * item), x = be.alloc_grad(received * item);
      be.copy_rows(agg, gather, item, a);
      be.copy_rows(excl, gather, item, x);
      be.affine_compose(shape, received, a, recv);
      be.affine_compose(shape, received, x, recv);
      be.copy_rows(a, scatter, item, agg);
      be.copy_rows(x, scatter, item, excl);
      be.release(a);
      be.release(x);
    }
    be.release(recv);
  }
  be.release(agg);
  return has;
}

// The scan over the ranks themselves: one position per rank and item, in rank order (direction +1) or
// reverse (-1). False on the first rank in that order.
template <class Backend>
bool affine_exclusive_scan(Communicator& comm, Backend& be, const AffineShape& shape, int direction, int64_t items,
                           const typename Backend::Grad& own, typename Backend::Grad& excl) {
  const int n = comm.size();
  std::vector<int> order(static_cast<size_t>(n));
  for (int p = 0; p < n; ++p) order[static_cast<size_t>(p)] = direction > 0 ? p : n - 1 - p;
  const std::vector<uint8_t> has =
      affine_chain_scan(comm, be, shape, std::vector<std::vector<int>>(static_cast<size_t>(items), order), own, excl);
  return !has.empty() && has[0];
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
    const size_t nseg = static_cast<size_t>(row.num_segments());
    runs_.resize(nseg);
    run_ranks_.resize(nseg);
    my_runs_.resize(nseg);
    for (int32_t s = 0; s < row.num_segments(); ++s) {
      if (!plan.chained[s]) continue;
      runs_[s] = gdn_chain_runs(plan, s);
      for (size_t k = 0; k < runs_[s].size(); ++k) {
        run_ranks_[s].push_back(runs_[s][k].rank);
        if (runs_[s][k].rank == comm.rank()) my_runs_[s].push_back(k);
      }
    }
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
    const int me = comm_.rank();
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
          state_in_[s].push_back(copy(S));
          run(rec, row_.start(s), row_.end(s), S, y);
          final_state[s] = std::move(S);
          be_.release(parent_in[s]);
        }
        continue;
      }
      // Chain step: summaries of this rank's runs, in (segment, run) order (the identity for an empty
      // run), the scan over every chain's runs, then each run from its true incoming state.
      std::vector<std::vector<int>> order;
      int64_t count = 0;
      for (int32_t s : segs) {
        order.push_back(run_ranks_[s]);
        count += static_cast<int64_t>(my_runs_[s].size());
      }
      Grad own = be_.alloc_grad(count * item), excl;
      int64_t at = 0;
      for (int32_t s : segs) {
        for (const size_t k : my_runs_[s]) {
          const GdnPiece& r = runs_[s][k];
          if (r.begin < r.end) {
            rec.summary(be_, map_.row_of_range(r.begin, r.end), r.size(), own, at);
          } else {
            be_.affine_identity(shape_, own, at);
          }
          Grad map = be_.alloc_grad(item);
          be_.copy_rows(own, {{at, 0, 1}}, item, map);
          chain_map_[s].push_back(std::move(map));
          // Seed the first run with the parent's state: (0, M S_parent + E). Every later prefix then
          // has M = 0 and its E is the true incoming state.
          if (k == 0) be_.affine_seed(shape_, own, at, row_.parent(s) >= 0 ? &parent_in[s] : nullptr);
          ++at;
        }
      }
      affine_chain_scan(comm_, be_, shape_, order, own, excl);
      at = 0;
      for (int32_t s : segs) {
        for (const size_t k : my_runs_[s]) {
          const GdnPiece& r = runs_[s][k];
          Grad S = zero_state();
          if (k == 0) {
            if (row_.parent(s) >= 0) be_.copy_rows(parent_in[s], {{0, 0, 1}}, shape_.state_elements(), S);
          } else {
            be_.affine_state(shape_, excl, at, S);
          }
          state_in_[s].push_back(copy(S));
          run(rec, r.begin, r.end, S, y);
          if (k + 1 == runs_[s].size()) {
            final_state[s] = std::move(S);
          } else {
            be_.release(S);
          }
          ++at;
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
    const int me = comm_.rank();
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
          run_back(rec, row_.start(s), row_.end(s), state_in_[s][0], dy, ds, grads);
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
        // Each run's gradient map dS_in = Mᵀ dS_out + a, a = its own outputs' contribution; the last
        // run is seeded with the chain's final-state gradient. The scan runs the chains backwards, so
        // this rank's runs are listed last first.
        std::vector<std::vector<int>> order;
        int64_t count = 0;
        for (int32_t s : segs) {
          order.emplace_back(run_ranks_[s].rbegin(), run_ranks_[s].rend());
          count += static_cast<int64_t>(my_runs_[s].size());
        }
        Grad own = be_.alloc_grad(count * item), excl;
        std::vector<Grad> g_final(static_cast<size_t>(count));
        int64_t at = 0;
        for (int32_t s : segs) {
          const bool holds_end = !my_runs_[s].empty() && my_runs_[s].back() + 1 == runs_[s].size();
          for (size_t li = my_runs_[s].size(); li-- > 0; ++at) {
            const GdnPiece& r = runs_[s][my_runs_[s][li]];
            Grad a = zero_state();
            run_back(rec, r.begin, r.end, state_in_[s][li], dy, a, Grads{});
            const bool last = holds_end && li + 1 == my_runs_[s].size();
            if (last) g_final[static_cast<size_t>(at)] = final_grad(s);
            be_.affine_adjoint(shape_, chain_map_[s][li], a, last ? &g_final[static_cast<size_t>(at)] : nullptr, own,
                               at);
            be_.release(a);
          }
        }
        affine_chain_scan(comm_, be_, shape_, order, own, excl);
        at = 0;
        for (int32_t s : segs) {
          const bool holds_end = !my_runs_[s].empty() && my_runs_[s].back() + 1 == runs_[s].size();
          for (size_t li = my_runs_[s].size(); li-- > 0; ++at) {
            const size_t k = my_runs_[s][li];
            const GdnPiece& r = runs_[s][k];
            Grad ds;
            if (holds_end && li + 1 == my_runs_[s].size()) {
              ds = std::move(g_final[static_cast<size_t>(at)]);
            } else {
              ds = zero_state();
              be_.affine_state(shape_, excl, at, ds);
            }
            run_back(rec, r.begin, r.end, state_in_[s][li], dy, ds, grads);
            if (k == 0 && row_.parent(s) >= 0) {
              grad_in[s] = std::move(ds);
            } else {
              be_.release(ds);
            }
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
    for (auto& gs : state_in_)
      for (Grad& g : gs) be_.release(g);
    for (auto& gs : chain_map_)
      for (Grad& g : gs) be_.release(g);
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
  // Per chained segment, its runs (gdn_chain_runs), their ranks, and the positions of this rank's runs.
  std::vector<std::vector<GdnPiece>> runs_;
  std::vector<std::vector<int>> run_ranks_;
  std::vector<std::vector<size_t>> my_runs_;
  // What the forward keeps for the backward, per segment this rank runs (empty elsewhere): per run of
  // this rank (a local segment: one), the state it started from and, for a chain, its summary map.
  std::vector<std::vector<Grad>> state_in_, chain_map_;
};

}  // namespace treecp
