// Pieces of a row exchange that the CP runtimes share: the row layout of one wave of a Plan on one
// rank, and the per-peer element counts of an all-to-all that moves whole rows.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "plan/plan.hpp"
#include "runtime/backend.hpp"
#include "runtime/row_map.hpp"

namespace treecp {

// One wave on one rank: the rows it receives, peer by peer in the plan's order (what the plan's
// stage.recv lists), and the owned rows it packs for its peers (stage.send), with per-peer row counts.
struct WaveRows {
  RowMap fetched;                             // received rows, peer by peer
  std::vector<RowCopy> pack;                  // owned rows -> the send buffer, peer by peer
  std::vector<int64_t> send_rows, recv_rows;  // per peer
  int64_t send_total = 0;
};
WaveRows wave_rows(const Stage& stage, const RowMap& owned, int cp);

// Element counts and displacements of an all-to-all of rows of `width` elements, peer p's part being
// send_rows[p] rows out and recv_rows[p] rows in, packed in peer order; and the bytes that leave and
// reach this rank (`self`'s own part moves no data between ranks).
struct RowExchange {
  std::vector<int64_t> send_counts, send_displs, recv_counts, recv_displs;
  int64_t bytes_out = 0, bytes_in = 0;
};
RowExchange row_exchange(const std::vector<int64_t>& send_rows, const std::vector<int64_t>& recv_rows, int64_t width,
                         int self, size_t element_bytes);

}  // namespace treecp
