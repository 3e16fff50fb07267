// Causal depthwise conv1d over a packed prefix-tree row whose tokens are spread over ranks by any
// Ownership (plan/ownership.hpp; a rank's buffers hold its tokens in that order). Each rank needs the K-1 inputs preceding each of its tokens
// along the token's logical path: its HALO. A child's halo is its parent's tail (wherever the parent
// lives), and a very short shard's halo may come from several earlier ranks. One all-to-all brings
// the halo; the backward returns the halo's input gradients to their owners, who add them.
#pragma once

#include <cstdint>
#include <vector>

#include "comm/communicator.hpp"
#include "kernels/cpu/conv1d.hpp"
#include "plan/ownership.hpp"
#include "tree/row.hpp"

namespace treecp {

// Rank `rank`'s conv geometry: owned rows first, then halo rows (sorted by token id).
struct ConvHalo {
  int64_t owned_rows = 0;
  std::vector<int64_t> halo_tokens;             // physical ids of the halo rows
  std::vector<int64_t> prev;                    // per buffer row: row of the logical predecessor, or -1
  std::vector<std::vector<int64_t>> send_rows;  // per peer: owned rows it needs from this rank
  std::vector<std::vector<int64_t>> recv_rows;  // per peer: halo rows it fills
};
ConvHalo make_conv_halo(const Row& row, const Ownership& layout, int rank, int width);

struct Conv1dArgs {
  int channels = 0;
  int width = 4;
  bool silu = false;
};

// y_local [owned, C] from x_local [owned, C]; weight [C, K], bias [C] or null.
template <class T>
void conv1d_cp_forward(Communicator& comm, const Row& row, const Ownership& layout, const Conv1dArgs& args,
                       const T* x_local, const T* weight, const T* bias, T* y_local);

// Adds dx_local [owned, C] (including the halo gradients other ranks return). dweight [C, K] and
// dbias [C] (may be null) receive the full gradient, summed over all ranks, on every rank.
template <class T>
void conv1d_cp_backward(Communicator& comm, const Row& row, const Ownership& layout, const Conv1dArgs& args,
                        const T* x_local, const T* weight, const T* bias, const T* dy_local, T* dx_local,
                        T* dweight, T* dbias);

}  // namespace treecp
