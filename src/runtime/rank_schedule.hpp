// runtime/: executes plans on one rank, one class per layer kind, generic over a Backend and a
// Communicator; moves activations between ownerships; the one-process references.
//
// One rank's share of a dense attention Plan in buffer terms, computed once per plan on the host (any
// thread): where owned and received tokens sit in this rank's buffers, the slices of every stage in those
// coordinates, and per wave the rows to pack for each peer and to add back when their dK/dV return.
// Backend independent; DenseAttentionCP uploads it through its backend.
#pragma once

#include <cstdint>
#include <vector>

#include "plan/plan.hpp"
#include "runtime/backend.hpp"
#include "runtime/row_map.hpp"
#include "tree/slice.hpp"

namespace treecp {

struct WaveSchedule {
  RowMap fetched;                             // received KV rows, peer by peer
  std::vector<Slice> slices;                  // buffer coordinates: owned q x fetched k
  std::vector<RowCopy> pack;                  // owned rows -> send buffer rows
  std::vector<RowCopy> unpack;                // returned dK/dV rows -> owned rows (the mirror of pack)
  std::vector<int64_t> send_rows, recv_rows;  // per peer
  int64_t send_total = 0;
};

struct RankSchedule {
  int rank = 0, ranks = 1;
  RowMap owned;
  std::vector<Slice> local_slices;  // stage 0, buffer coordinates: owned q x owned k
  std::vector<WaveSchedule> waves;
  int64_t owned_rows() const { return owned.rows(); }
};

// `plan` must have been checked (validate_plan) against its row.
RankSchedule make_rank_schedule(const Plan& plan, int rank);

// Element counts and displacements of one exchange of rows `width` elements wide, per peer.
struct ExchangeCounts {
  std::vector<int64_t> send_counts, send_displs, recv_counts, recv_displs;
};
ExchangeCounts exchange_counts(const std::vector<int64_t>& send_rows, const std::vector<int64_t>& recv_rows,
                               int64_t width);

}  // namespace treecp
