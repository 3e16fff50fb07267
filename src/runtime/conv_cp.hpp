// Causal depthwise conv1d over a packed prefix-tree row whose tokens are spread over ranks.
// layout[r] = the sorted, disjoint physical ranges rank r holds (together: every token once); a rank's
// buffers hold its tokens in that order. Each rank needs the K-1 inputs preceding each of its tokens
// along the token's logical path: its HALO. A child's halo is its parent's tail (wherever the parent
// lives), and a very short shard's halo may come from several earlier ranks. One all-to-all brings
// the halo; the backward returns the halo's input gradients to their owners, who add them.
#pragma once

#include <cstdint>
#include <vector>

#include "comm/communicator.hpp"
#include "kernels/cpu/conv1d.hpp"
#include "plan/plan.hpp"
#include "runtime/row_map.hpp"
#include "tree/row.hpp"

namespace treecp {

using RankLayout = std::vector<std::vector<TokenRange>>;

// Near-equal contiguous shards of the row (the data loader's split).
RankLayout contiguous_layout(const Row& row, int ranks);
// Checks that the layout covers the row exactly once with sorted ranges.
void validate_layout(const Row& row, const RankLayout& layout);

// Every rank's buffer (laid out by layout[rank]) into a full [S, width] array on rank 0 (empty
// elsewhere). One all-to-all in which only rank 0 receives.
template <class T>
std::vector<double> gather_to_root(Communicator& comm, const RankLayout& layout, const std::vector<T>& local,
                                   int64_t width, int64_t S) {
  const int n = comm.size();
  std::vector<int64_t> sc(n, 0), sd(n, 0), rc(n, 0), rd(n, 0);
  sc[0] = static_cast<int64_t>(local.size());
  int64_t total = 0;
  if (comm.rank() == 0) {
    for (int r = 0; r < n; ++r) {
      rd[r] = total;
      for (const TokenRange& t : layout[r]) rc[r] += t.size() * width;
      total += rc[r];
    }
  }
  std::vector<T> stage(static_cast<size_t>(total));
  comm.all_to_all_v(local.data(), sc, sd, stage.data(), rc, rd, sizeof(T) == 8 ? CommType::F64 : CommType::F32);
  std::vector<double> full;
  if (comm.rank() != 0) return full;
  full.assign(static_cast<size_t>(S * width), 0.0);
  for (int r = 0; r < n; ++r) {
    int64_t at = rd[r];
    for (const TokenRange& t : layout[r])
      for (int64_t i = t.begin * width; i < t.end * width; ++i) full[i] = static_cast<double>(stage[at++]);
  }
  return full;
}

// Rank `rank`'s conv geometry: owned rows first, then halo rows (sorted by token id).
struct ConvHalo {
  int64_t owned_rows = 0;
  std::vector<int64_t> halo_tokens;             // physical ids of the halo rows
  std::vector<int64_t> prev;                    // per buffer row: row of the logical predecessor, or -1
  std::vector<std::vector<int64_t>> send_rows;  // per peer: owned rows it needs from this rank
  std::vector<std::vector<int64_t>> recv_rows;  // per peer: halo rows it fills
};
ConvHalo make_conv_halo(const Row& row, const RankLayout& layout, int rank, int width);

struct Conv1dArgs {
  int channels = 0;
  int width = 4;
  bool silu = false;
};

// y_local [owned, C] from x_local [owned, C]; weight [C, K], bias [C] or null.
template <class T>
void conv1d_cp_forward(Communicator& comm, const Row& row, const RankLayout& layout, const Conv1dArgs& args,
                       const T* x_local, const T* weight, const T* bias, T* y_local);

// Adds dx_local [owned, C] (including the halo gradients other ranks return). dweight [C, K] and
// dbias [C] (may be null) receive the full gradient, summed over all ranks, on every rank.
template <class T>
void conv1d_cp_backward(Communicator& comm, const Row& row, const RankLayout& layout, const Conv1dArgs& args,
                        const T* x_local, const T* weight, const T* bias, const T* dy_local, T* dx_local,
                        T* dweight, T* dbias);

}  // namespace treecp
