// Context parallelism over a packed prefix-tree row for any recurrence whose run over a piece of
// tokens is AFFINE in its incoming state: S_out = M S_in + E per head, with the state a rows x cols
// block and M rows x rows. GDN/KDA (rows = dk, cols = dv) and Mamba-2 (rows = 1, cols = N·P: a scalar
// decay per head) run on it (runtime/gdn_cp.hpp, runtime/mamba2_cp.hpp).
//
// Every rank holds the tokens of gdn_rank_ranges(row, plan, rank), laid out in that order, and calls
// these functions with the same row and plan. The DAG steps of the plan run in order; before each
// step the final states its segments start from travel from their holders in one all-to-all (zero
// counts where nothing moves). A chain step computes each rank's shard summary (M, E), runs an
// exclusive prefix scan over the ranks in ceil(log2 N) doubling rounds of all-to-all, and applies
// the true incoming state. The backward runs the steps in reverse: the final-state gradient of a
// segment is the sum over its children of their incoming-state gradients, and a chain's suffix scan
// gives each shard its true outgoing-state gradient (dS_in = Fᵀ dY + Mᵀ dS_out).
//
// The recurrence comes as an adapter `Rec` over one rank's tokens:
//   using Scalar = T;  using Grads = ...;        (Grads{} = nothing but the state gradient)
//   static constexpr const char* name;           ("gdn", "mamba2": error messages)
//   int heads(), rows(), cols();  int64_t tokens();  void check();
//   void forward(h, t0, t1, T* state, T* y);      runs buffer rows [t0, t1) of head h from state
//   void summary(h, t0, t1, T* M, T* E);          the run's affine map
//   void backward(h, t0, t1, const T* state_in, const T* dy, T* dstate, const Grads&);
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "comm/communicator.hpp"
#include "core/error.hpp"
#include "kernels/cpu/gdn.hpp"
#include "runtime/gdn_plan.hpp"
#include "runtime/row_map.hpp"
#include "tree/row.hpp"

namespace treecp {

// What the forward keeps for the backward on this rank: the state each of its runs started from
// and, per chained segment, its shard's M. Indexed by segment; empty where this rank runs nothing.
template <class T>
struct AffineSaved {
  std::vector<std::vector<T>> state_in;  // [H][rows][cols] per segment this rank runs (a piece for chains)
  std::vector<std::vector<T>> chain_m;   // [H][rows][rows] per chained segment
};

// Exclusive prefix scan of affine maps over the ranks: `own` holds, per item, H blocks of
// (A [dk][dk], B [dk][dv]); the composition is (A2, B2) ∘ (A1, B1) = (A2 A1, A2 B1 + B2) with 1
// before 2. direction +1 scans in rank order, -1 in reverse rank order. On return `excl` holds the
// composition of all earlier ranks' items (in scan order), and the result is false on the first rank,
// which has none. ceil(log2 N) all-to-all rounds; every rank calls it.
template <class T>
bool affine_exclusive_scan(Communicator& comm, int direction, int64_t items, int heads, int dk, int dv,
                           const std::vector<T>& own, std::vector<T>& excl);

namespace affine_detail {

template <class T>
constexpr CommType comm_type() {
  return sizeof(T) == 8 ? CommType::F64 : CommType::F32;
}

// A parent state moving into step `step`: the final state of row.parent(seg) goes from its holder
// (src) to the rank that starts `seg` (dst); the backward sends dS_in(seg) the other way.
struct Transfer {
  int32_t seg;
  int src;
  int dst;
};

struct Schedule {
  int steps = 1;
  std::vector<std::vector<Transfer>> transfers;  // per step
  std::vector<std::vector<int32_t>> segments;    // per step, DFS order
};

Schedule make_schedule(const Row& row, const GdnPlan& plan);

// One all-to-all moving a state-sized block per transfer. Sender side: `out(seg)` gives the block to
// send; receiver side: `in(seg, block)` consumes it. Both sides enumerate transfers in list order.
template <class T, class Out, class In>
void exchange(Communicator& comm, const std::vector<Transfer>& ts, bool reverse, int64_t block, Out out, In in) {
  const int n = comm.size(), me = comm.rank();
  std::vector<int64_t> sc(n, 0), sd(n, 0), rc(n, 0), rd(n, 0);
  std::vector<T> sbuf, rbuf;
  std::vector<int32_t> rsegs;
  for (int p = 0; p < n; ++p) {
    sd[p] = static_cast<int64_t>(sbuf.size());
    rd[p] = static_cast<int64_t>(rbuf.size());
    for (const Transfer& t : ts) {
      const int from = reverse ? t.dst : t.src, to = reverse ? t.src : t.dst;
      if (from == me && to == p) {
        const T* b = out(t.seg);
        sbuf.insert(sbuf.end(), b, b + block);
      }
      if (to == me && from == p) {
        rsegs.push_back(t.seg);
        rbuf.resize(rbuf.size() + static_cast<size_t>(block));
      }
    }
    sc[p] = static_cast<int64_t>(sbuf.size()) - sd[p];
    rc[p] = static_cast<int64_t>(rbuf.size()) - rd[p];
  }
  comm.all_to_all_v(sbuf.data(), sc, sd, rbuf.data(), rc, rd, comm_type<T>());
  for (size_t i = 0; i < rsegs.size(); ++i) in(rsegs[i], rbuf.data() + static_cast<int64_t>(i) * block);
}

// What forward and backward both check and derive: the parameters, the plan against the row and the
// communicator, this rank's rows and the step schedule.
struct RankSetup {
  RowMap map;
  Schedule sched;
};

template <class Rec>
RankSetup rank_setup(const Communicator& comm, const Row& row, const GdnPlan& plan, const Rec& rec) {
  rec.check();
  require(plan.ranks == comm.size(), Rec::name, ": plan is for ", plan.ranks, " ranks, communicator has ",
          comm.size());
  validate_gdn_plan(row, plan);
  RankSetup setup{RowMap(gdn_rank_ranges(row, plan, comm.rank())), make_schedule(row, plan)};
  require(setup.map.rows() == rec.tokens(), Rec::name, ": rank ", comm.rank(), " holds ", setup.map.rows(),
          " tokens in this plan, got ", rec.tokens());
  return setup;
}

}  // namespace affine_detail

// `rec` describes this rank's tokens (rec.tokens() == tokens of its ranges). Writes y for them.
template <class Rec>
AffineSaved<typename Rec::Scalar> affine_cp_forward(Communicator& comm, const Row& row, const GdnPlan& plan,
                                                    const Rec& rec, typename Rec::Scalar* y) {
  using T = typename Rec::Scalar;
  using namespace affine_detail;
  const RankSetup setup = rank_setup(comm, row, plan, rec);
  const RowMap& map = setup.map;
  const Schedule& sched = setup.sched;
  const int me = comm.rank(), N = comm.size();
  const int H = rec.heads(), dk = rec.rows(), dv = rec.cols();
  const int64_t ssz = static_cast<int64_t>(dk) * dv, state = H * ssz;
  const int32_t nseg = row.num_segments();
  AffineSaved<T> saved;
  saved.state_in.resize(static_cast<size_t>(nseg));
  saved.chain_m.resize(static_cast<size_t>(nseg));
  std::vector<std::vector<T>> final_state(static_cast<size_t>(nseg)), parent_in(static_cast<size_t>(nseg));
  const std::vector<T> zero(static_cast<size_t>(state), T(0));

  // Runs tokens [b, e) of the row (held here) from `s` over all heads; s becomes the final state.
  auto run = [&](int64_t b, int64_t e, std::vector<T>& s, T* out) {
    if (b >= e) return;
    const int64_t t0 = map.row_of_range(b, e);
    for (int h = 0; h < H; ++h) rec.forward(h, t0, t0 + (e - b), s.data() + h * ssz, out);
  };

  for (int st = 0; st < sched.steps; ++st) {
    exchange<T>(
        comm, sched.transfers[st], false, state, [&](int32_t s) { return final_state[row.parent(s)].data(); },
        [&](int32_t s, const T* b) { parent_in[s].assign(b, b + state); });
    if (st % 2 == 0) {
      for (int32_t s : sched.segments[st]) {
        if (plan.owner[s] != me) continue;
        const int32_t p = row.parent(s);
        std::vector<T> S = p < 0 ? zero : plan.chained[p] ? parent_in[s] : final_state[p];
        saved.state_in[s] = S;
        run(row.start(s), row.end(s), S, y);
        final_state[s] = std::move(S);
        parent_in[s].clear();
      }
      continue;
    }
    // Chain step: summaries of this rank's pieces (identity where it holds none).
    const std::vector<int32_t>& segs = sched.segments[st];
    const int64_t blk = static_cast<int64_t>(dk) * (dk + dv), item = H * blk;
    std::vector<T> own(segs.size() * static_cast<size_t>(item), T(0)), excl;
    for (size_t i = 0; i < segs.size(); ++i) {
      const int32_t s = segs[i];
      const int64_t b = plan.cuts[s][me], e = plan.cuts[s][me + 1];
      std::vector<T>& m = saved.chain_m[s];
      m.assign(static_cast<size_t>(H * dk * dk), T(0));
      for (int h = 0; h < H; ++h) {
        T* A = own.data() + i * item + h * blk;
        T* B = A + dk * dk;
        if (b < e) {
          const int64_t t0 = map.row_of_range(b, e);
          rec.summary(h, t0, t0 + (e - b), A, B);
        } else {
          for (int d = 0; d < dk; ++d) A[d * dk + d] = 1;
        }
        std::copy(A, A + dk * dk, m.begin() + h * dk * dk);
        if (me == 0) {
          // Seed the first shard with the parent's state: (0, M S_parent + E). Every later prefix
          // then has M = 0 and its E is the true incoming state.
          const int32_t p = row.parent(s);
          if (p >= 0) {
            std::vector<T> out(static_cast<size_t>(ssz));
            gdn_apply(dk, dv, A, B, parent_in[s].data() + h * ssz, out.data());
            std::copy(out.begin(), out.end(), B);
          }
          std::fill(A, A + dk * dk, T(0));
        }
      }
    }
    affine_exclusive_scan(comm, +1, static_cast<int64_t>(segs.size()), H, dk, dv, own, excl);
    for (size_t i = 0; i < segs.size(); ++i) {
      const int32_t s = segs[i];
      const int32_t p = row.parent(s);
      std::vector<T> S(static_cast<size_t>(state));
      if (me == 0) {
        S = p < 0 ? zero : parent_in[s];
      } else {
        for (int h = 0; h < H; ++h) {
          const T* E = excl.data() + i * item + h * blk + dk * dk;
          std::copy(E, E + ssz, S.begin() + h * ssz);
        }
      }
      saved.state_in[s] = S;
      run(plan.cuts[s][me], plan.cuts[s][me + 1], S, y);
      if (me == N - 1) final_state[s] = std::move(S);
      parent_in[s].clear();
    }
  }
  return saved;
}

// Adds this rank's gradients into `grads` (zero them first). `dy` is laid out like y.
template <class Rec>
void affine_cp_backward(Communicator& comm, const Row& row, const GdnPlan& plan, const Rec& rec,
                        const AffineSaved<typename Rec::Scalar>& saved, const typename Rec::Scalar* dy,
                        const typename Rec::Grads& grads) {
  using T = typename Rec::Scalar;
  using namespace affine_detail;
  const RankSetup setup = rank_setup(comm, row, plan, rec);
  const RowMap& map = setup.map;
  const Schedule& sched = setup.sched;
  const int me = comm.rank(), N = comm.size();
  const int H = rec.heads(), dk = rec.rows(), dv = rec.cols();
  const int64_t ssz = static_cast<int64_t>(dk) * dv, state = H * ssz;
  const int32_t nseg = row.num_segments();
  require(static_cast<int32_t>(saved.state_in.size()) == nseg, Rec::name, " backward: saved state is for another row");
  // grad_final[s]: dL/d(final state of s), summed over children, on s's holder.
  // grad_in[s]: dL/d(state s started from), on the rank that started s, until sent to the holder.
  std::vector<std::vector<T>> grad_final(static_cast<size_t>(nseg)), grad_in(static_cast<size_t>(nseg));
  auto add_into = [&](std::vector<T>& acc, const T* g) {
    if (acc.empty()) acc.assign(static_cast<size_t>(state), T(0));
    for (int64_t i = 0; i < state; ++i) acc[i] += g[i];
  };
  using Grads = typename Rec::Grads;
  auto run_back = [&](int64_t b, int64_t e, const std::vector<T>& s_in, std::vector<T>& ds, const Grads& g) {
    if (b >= e) return;
    const int64_t t0 = map.row_of_range(b, e);
    for (int h = 0; h < H; ++h) rec.backward(h, t0, t0 + (e - b), s_in.data() + h * ssz, dy, ds.data() + h * ssz, g);
  };

  for (int st = sched.steps - 1; st >= 0; --st) {
    if (st % 2 == 0) {
      const auto& segs = sched.segments[st];
      for (auto it = segs.rbegin(); it != segs.rend(); ++it) {
        const int32_t s = *it;
        if (plan.owner[s] != me) continue;
        std::vector<T> ds = grad_final[s].empty() ? std::vector<T>(static_cast<size_t>(state), T(0)) : grad_final[s];
        run_back(row.start(s), row.end(s), saved.state_in[s], ds, grads);
        const int32_t p = row.parent(s);
        if (p < 0) continue;
        if (plan.chained[p]) grad_in[s] = std::move(ds);
        else add_into(grad_final[p], ds.data());
      }
    } else {
      const std::vector<int32_t>& segs = sched.segments[st];
      const int64_t blk = static_cast<int64_t>(dk) * (dk + dv), item = H * blk;
      // Each shard's gradient map dS_in = Mᵀ dS_out + a, a = its own outputs' contribution.
      std::vector<T> own(segs.size() * static_cast<size_t>(item), T(0)), excl;
      std::vector<std::vector<T>> g_final(segs.size());
      for (size_t i = 0; i < segs.size(); ++i) {
        const int32_t s = segs[i];
        const int64_t b = plan.cuts[s][me], e = plan.cuts[s][me + 1];
        std::vector<T> a(static_cast<size_t>(state), T(0));
        run_back(b, e, saved.state_in[s], a, Grads{});
        if (me == N - 1) {
          g_final[i] = grad_final[s].empty() ? std::vector<T>(static_cast<size_t>(state), T(0)) : grad_final[s];
        }
        for (int h = 0; h < H; ++h) {
          T* A = own.data() + i * item + h * blk;
          T* B = A + dk * dk;
          const T* m = saved.chain_m[s].data() + h * dk * dk;
          if (me == N - 1) {
            // Seed the last shard with the chain's final-state gradient: (0, Mᵀ g + a).
            gdn_apply_transposed(dk, dv, m, a.data() + h * ssz, g_final[i].data() + h * ssz, B);
          } else {
            for (int r = 0; r < dk; ++r)
              for (int c = 0; c < dk; ++c) A[r * dk + c] = m[c * dk + r];
            std::copy(a.begin() + h * ssz, a.begin() + (h + 1) * ssz, B);
          }
        }
      }
      affine_exclusive_scan(comm, -1, static_cast<int64_t>(segs.size()), H, dk, dv, own, excl);
      for (size_t i = 0; i < segs.size(); ++i) {
        const int32_t s = segs[i];
        std::vector<T> ds(static_cast<size_t>(state));
        if (me == N - 1) {
          ds = g_final[i];
        } else {
          for (int h = 0; h < H; ++h) {
            const T* E = excl.data() + i * item + h * blk + dk * dk;
            std::copy(E, E + ssz, ds.begin() + h * ssz);
          }
        }
        run_back(plan.cuts[s][me], plan.cuts[s][me + 1], saved.state_in[s], ds, grads);
        if (me == 0 && row.parent(s) >= 0) grad_in[s] = std::move(ds);
      }
    }
    // Incoming-state gradients of this step's segments go back to their parents' holders.
    exchange<T>(
        comm, sched.transfers[st], true, state, [&](int32_t s) { return grad_in[s].data(); },
        [&](int32_t s, const T* g) { add_into(grad_final[row.parent(s)], g); });
    for (const Transfer& t : sched.transfers[st]) grad_in[t.seg].clear();
  }
}

}  // namespace treecp
