#include "runtime/exchange.hpp"

namespace treecp {

WaveRows wave_rows(const Stage& stage, const RowMap& owned, int cp) {
  WaveRows w;
  w.send_rows.assign(static_cast<size_t>(cp), 0);
  w.recv_rows.assign(static_cast<size_t>(cp), 0);
  std::vector<TokenRange> recv_order;
  for (int p = 0; p < cp; ++p) {
    for (const TokenRange& t : stage.recv[static_cast<size_t>(p)]) {
      recv_order.push_back(t);
      w.recv_rows[static_cast<size_t>(p)] += t.size();
    }
    for (const TokenRange& t : stage.send[static_cast<size_t>(p)]) {
      w.pack.push_back({owned.row_of_range(t.begin, t.end), w.send_total, t.size()});
      w.send_total += t.size();
      w.send_rows[static_cast<size_t>(p)] += t.size();
    }
  }
  w.fetched = RowMap(recv_order);
  return w;
}

RowExchange row_exchange(const std::vector<int64_t>& send_rows, const std::vector<int64_t>& recv_rows, int64_t width,
                         int self, size_t element_bytes) {
  const size_t n = send_rows.size();
  RowExchange e;
  e.send_counts.resize(n);
  e.send_displs.resize(n);
  e.recv_counts.resize(n);
  e.recv_displs.resize(n);
  int64_t so = 0, ro = 0;
  for (size_t p = 0; p < n; ++p) {
    e.send_counts[p] = send_rows[p] * width;
    e.send_displs[p] = so;
    so += e.send_counts[p];
    e.recv_counts[p] = recv_rows[p] * width;
    e.recv_displs[p] = ro;
    ro += e.recv_counts[p];
    if (static_cast<int>(p) != self) {
      e.bytes_out += e.send_counts[p] * static_cast<int64_t>(element_bytes);
      e.bytes_in += e.recv_counts[p] * static_cast<int64_t>(element_bytes);
    }
  }
  return e;
}

}  // namespace treecp
