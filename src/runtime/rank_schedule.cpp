#include "runtime/rank_schedule.hpp"

#include "core/error.hpp"

namespace treecp {

RankSchedule make_rank_schedule(const Plan& plan, int rank) {
  require(rank >= 0 && rank < plan.cp, "rank schedule: rank ", rank, " outside a plan for ", plan.cp, " ranks");
  const RankPlan& mine = plan.ranks[static_cast<size_t>(rank)];
  RankSchedule s;
  s.rank = rank;
  s.ranks = plan.cp;
  s.owned = RowMap(mine.owned);
  s.local_slices = to_buffer(mine.stages[0].slices, s.owned, s.owned);
  s.waves.resize(static_cast<size_t>(plan.num_waves));
  const size_t n = static_cast<size_t>(plan.cp);
  for (int w = 0; w < plan.num_waves; ++w) {
    const Stage& st = mine.stages[static_cast<size_t>(w) + 1];
    WaveSchedule& wave = s.waves[static_cast<size_t>(w)];
    std::vector<TokenRange> recv_order;
    wave.send_rows.assign(n, 0);
    wave.recv_rows.assign(n, 0);
    int64_t send_row = 0;
    for (size_t p = 0; p < n; ++p) {
      for (const TokenRange& tr : st.recv[p]) {
        recv_order.push_back(tr);
        wave.recv_rows[p] += tr.size();
      }
      for (const TokenRange& tr : st.send[p]) {
        wave.pack.push_back({s.owned.row_of_range(tr.begin, tr.end), send_row, tr.size()});
        send_row += tr.size();
        wave.send_rows[p] += tr.size();
      }
    }
    wave.send_total = send_row;
    wave.fetched = RowMap(recv_order);
    wave.slices = to_buffer(st.slices, s.owned, wave.fetched);
    // The returned dK/dV arrive in the order the KV was sent and add into those owned rows.
    for (const RowCopy& c : wave.pack) wave.unpack.push_back({c.dst_row, c.src_row, c.rows});
  }
  return s;
}

ExchangeCounts exchange_counts(const std::vector<int64_t>& send_rows, const std::vector<int64_t>& recv_rows,
                               int64_t width) {
  require(send_rows.size() == recv_rows.size(), "exchange_counts: ", send_rows.size(), " send and ",
          recv_rows.size(), " receive peers");
  const size_t n = send_rows.size();
  ExchangeCounts c;
  c.send_counts.resize(n);
  c.send_displs.resize(n);
  c.recv_counts.resize(n);
  c.recv_displs.resize(n);
  int64_t so = 0, ro = 0;
  for (size_t p = 0; p < n; ++p) {
    c.send_counts[p] = send_rows[p] * width;
    c.send_displs[p] = so;
    so += c.send_counts[p];
    c.recv_counts[p] = recv_rows[p] * width;
    c.recv_displs[p] = ro;
    ro += c.recv_counts[p];
  }
  return c;
}

}  // namespace treecp
