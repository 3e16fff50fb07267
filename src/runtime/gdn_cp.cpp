#include "runtime/gdn_cp.hpp"

#include <algorithm>

#include "core/error.hpp"
#include "runtime/row_map.hpp"

namespace treecp {
namespace {

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

int holder(const GdnPlan& plan, int32_t s) { return plan.chained[s] ? plan.ranks - 1 : plan.owner[s]; }
int step_of(const GdnPlan& plan, int32_t s) { return plan.chained[s] ? 2 * plan.phase[s] - 1 : 2 * plan.phase[s]; }

Schedule make_schedule(const Row& row, const GdnPlan& plan) {
  Schedule sc;
  sc.steps = 2 * plan.num_phases - 1;
  sc.transfers.resize(static_cast<size_t>(sc.steps));
  sc.segments.resize(static_cast<size_t>(sc.steps));
  for (int32_t s = 0; s < row.num_segments(); ++s) {
    const int st = step_of(plan, s);
    sc.segments[st].push_back(s);
    const int32_t p = row.parent(s);
    // A local child of a local parent runs in the parent's unit, on its rank, in the same step.
    if (p >= 0 && (plan.chained[s] || plan.chained[p])) {
      sc.transfers[st].push_back({s, holder(plan, p), plan.chained[s] ? 0 : plan.owner[s]});
    }
  }
  return sc;
}

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

// (A, B) <- (A, B) ∘ (A1, B1) for H blocks.
template <class T>
void compose_after(int heads, int dk, int dv, T* item, const T* earlier) {
  const int64_t blk = static_cast<int64_t>(dk) * (dk + dv);
  for (int h = 0; h < heads; ++h) {
    T* a = item + h * blk;
    const T* e = earlier + h * blk;
    gdn_compose(dk, dv, a, a + dk * dk, e, e + dk * dk, a, a + dk * dk);
  }
}

}  // namespace

template <class T>
bool gdn_exclusive_scan(Communicator& comm, int direction, int64_t items, int heads, int dk, int dv,
                        const std::vector<T>& own, std::vector<T>& excl) {
  const int n = comm.size(), me = comm.rank();
  const int64_t blk = static_cast<int64_t>(heads) * dk * (dk + dv);
  const int64_t count = items * blk;
  require(static_cast<int64_t>(own.size()) == count, "gdn scan: ", count, " elements expected, got ", own.size());
  std::vector<T> agg = own, recv(static_cast<size_t>(count));
  excl.assign(static_cast<size_t>(count), T(0));
  bool have = false;
  // Position in scan order; the peer `d` positions earlier / later.
  const int pos = direction > 0 ? me : n - 1 - me;
  auto rank_at = [&](int position) { return direction > 0 ? position : n - 1 - position; };
  for (int d = 1; d < n; d *= 2) {
    std::vector<int64_t> sc(n, 0), sd(n, 0), rc(n, 0), rd(n, 0);
    const bool sends = pos + d < n, receives = pos - d >= 0;
    if (sends) sc[rank_at(pos + d)] = count;
    if (receives) rc[rank_at(pos - d)] = count;
    comm.all_to_all_v(agg.data(), sc, sd, recv.data(), rc, rd, comm_type<T>());
    if (!receives) continue;
    for (int64_t i = 0; i < items; ++i) {
      compose_after(heads, dk, dv, agg.data() + i * blk, recv.data() + i * blk);
      if (have) compose_after(heads, dk, dv, excl.data() + i * blk, recv.data() + i * blk);
    }
    if (!have) excl = recv;
    have = true;
  }
  return have;
}

namespace {

// What forward and backward both check and derive: the parameters, the plan against the row and the
// communicator, this rank's rows and the step schedule.
struct RankSetup {
  RowMap map;
  Schedule sched;
};

template <class T>
RankSetup rank_setup(const Communicator& comm, const Row& row, const GdnPlan& plan, const GdnParams<T>& local) {
  gdn_check_params(local);
  require(plan.ranks == comm.size(), "gdn: plan is for ", plan.ranks, " ranks, communicator has ", comm.size());
  validate_gdn_plan(row, plan);
  RankSetup setup{RowMap(gdn_rank_ranges(row, plan, comm.rank())), make_schedule(row, plan)};
  require(setup.map.rows() == local.tokens, "gdn: rank ", comm.rank(), " holds ", setup.map.rows(),
          " tokens in this plan, got ", local.tokens);
  return setup;
}

}  // namespace

template <class T>
GdnSaved<T> gdn_cp_forward(Communicator& comm, const Row& row, const GdnPlan& plan, const GdnParams<T>& local, T* y) {
  const RankSetup setup = rank_setup(comm, row, plan, local);
  const RowMap& map = setup.map;
  const Schedule& sched = setup.sched;
  const int me = comm.rank(), N = comm.size();
  const int H = local.heads, dk = local.dk, dv = local.dv;
  const int64_t ssz = static_cast<int64_t>(dk) * dv, state = H * ssz;
  const int32_t nseg = row.num_segments();
  GdnSaved<T> saved;
  saved.state_in.resize(static_cast<size_t>(nseg));
  saved.chain_m.resize(static_cast<size_t>(nseg));
  std::vector<std::vector<T>> final_state(static_cast<size_t>(nseg)), parent_in(static_cast<size_t>(nseg));
  const std::vector<T> zero(static_cast<size_t>(state), T(0));

  // Runs tokens [b, e) of the row (held here) from `s` over all heads; s becomes the final state.
  auto run = [&](int64_t b, int64_t e, std::vector<T>& s, T* out) {
    if (b >= e) return;
    const int64_t t0 = map.row_of_range(b, e);
    for (int h = 0; h < H; ++h) gdn_chunked_forward(local, h, t0, t0 + (e - b), s.data() + h * ssz, out);
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
          gdn_chunked_summary(local, h, t0, t0 + (e - b), A, B);
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
    gdn_exclusive_scan(comm, +1, static_cast<int64_t>(segs.size()), H, dk, dv, own, excl);
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

template <class T>
void gdn_cp_backward(Communicator& comm, const Row& row, const GdnPlan& plan, const GdnParams<T>& local,
                     const GdnSaved<T>& saved, const T* dy, const GdnGrads<T>& grads) {
  const RankSetup setup = rank_setup(comm, row, plan, local);
  const RowMap& map = setup.map;
  const Schedule& sched = setup.sched;
  const int me = comm.rank(), N = comm.size();
  const int H = local.heads, dk = local.dk, dv = local.dv;
  const int64_t ssz = static_cast<int64_t>(dk) * dv, state = H * ssz;
  const int32_t nseg = row.num_segments();
  require(static_cast<int32_t>(saved.state_in.size()) == nseg, "gdn backward: saved state is for another row");
  // grad_final[s]: dL/d(final state of s), summed over children, on s's holder.
  // grad_in[s]: dL/d(state s started from), on the rank that started s, until sent to the holder.
  std::vector<std::vector<T>> grad_final(static_cast<size_t>(nseg)), grad_in(static_cast<size_t>(nseg));
  auto add_into = [&](std::vector<T>& acc, const T* g) {
    if (acc.empty()) acc.assign(static_cast<size_t>(state), T(0));
    for (int64_t i = 0; i < state; ++i) acc[i] += g[i];
  };
  auto run_back = [&](int64_t b, int64_t e, const std::vector<T>& s_in, std::vector<T>& ds, const GdnGrads<T>& g) {
    if (b >= e) return;
    const int64_t t0 = map.row_of_range(b, e);
    for (int h = 0; h < H; ++h)
      gdn_chunked_backward(local, h, t0, t0 + (e - b), s_in.data() + h * ssz, dy, ds.data() + h * ssz, g);
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
        run_back(b, e, saved.state_in[s], a, GdnGrads<T>{});
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
      gdn_exclusive_scan(comm, -1, static_cast<int64_t>(segs.size()), H, dk, dv, own, excl);
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

#define TREECP_GDN_CP_INSTANTIATE(T)                                                                            \
  template GdnSaved<T> gdn_cp_forward<T>(Communicator&, const Row&, const GdnPlan&, const GdnParams<T>&, T*);  \
  template void gdn_cp_backward<T>(Communicator&, const Row&, const GdnPlan&, const GdnParams<T>&,             \
                                   const GdnSaved<T>&, const T*, const GdnGrads<T>&);                          \
  template bool gdn_exclusive_scan<T>(Communicator&, int, int64_t, int, int, int, const std::vector<T>&,        \
                                      std::vector<T>&);

TREECP_GDN_CP_INSTANTIATE(float)
TREECP_GDN_CP_INSTANTIATE(double)

}  // namespace treecp
