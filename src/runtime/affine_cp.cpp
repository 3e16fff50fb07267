#include "runtime/affine_cp.hpp"

namespace treecp {
namespace affine_detail {
namespace {

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

Schedule make_schedule(const Row& row, const GdnPlan& plan) {
  Schedule sc;
  sc.steps = 2 * plan.num_phases - 1;
  sc.transfers.resize(static_cast<size_t>(sc.steps));
  sc.segments.resize(static_cast<size_t>(sc.steps));
  for (int32_t s = 0; s < row.num_segments(); ++s) {
    const int st = plan.step_of(s);
    sc.segments[st].push_back(s);
    const int32_t p = row.parent(s);
    // A local child of a local parent runs in the parent's unit, on its rank, in the same step.
    if (p >= 0 && (plan.chained[s] || plan.chained[p])) {
      sc.transfers[st].push_back({s, plan.holder(p), plan.starter(s)});
    }
  }
  return sc;
}

}  // namespace affine_detail

template <class T>
bool affine_exclusive_scan(Communicator& comm, int direction, int64_t items, int heads, int dk, int dv,
                           const std::vector<T>& own, std::vector<T>& excl) {
  using namespace affine_detail;
  const int n = comm.size(), me = comm.rank();
  const int64_t blk = static_cast<int64_t>(heads) * dk * (dk + dv);
  const int64_t count = items * blk;
  require(static_cast<int64_t>(own.size()) == count, "affine scan: ", count, " elements expected, got ", own.size());
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

template bool affine_exclusive_scan<float>(Communicator&, int, int64_t, int, int, int, const std::vector<float>&,
                                           std::vector<float>&);
template bool affine_exclusive_scan<double>(Communicator&, int, int64_t, int, int, int, const std::vector<double>&,
                                            std::vector<double>&);

}  // namespace treecp
