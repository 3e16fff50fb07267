// runtime/: executes plans on one rank, one class per layer kind, generic over a Backend and a
// Communicator; moves activations between ownerships; the one-process references.
//
// Mamba-2 over a whole packed tree on one rank, for the heads it holds (one process, or a head shard
// of the head-transposed CP strategy). Buffer row t is physical token t.
//
// Segments are grouped into SCAN BUCKETS by depth: the segments of one bucket are independent (their
// parents lie in earlier buckets), so a device backend runs a bucket as one batched scan. The state a
// segment starts from is its parent's final state (zero for a root); siblings never see each other.
// The backward walks the buckets deepest first: the final-state gradient of a segment is the sum of
// its children's incoming-state gradients.
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/cpu/mamba2.hpp"
#include "tree/row.hpp"

namespace treecp {

// buckets[d] = the segments at depth d + 1, in DFS order.
std::vector<std::vector<int32_t>> mamba2_scan_buckets(const Row& row);

// What the forward keeps for the backward: the final state [H][N][P] of every segment with
// children (the state they start from); empty for leaves.
template <class T>
struct Mamba2TreeSaved {
  std::vector<std::vector<T>> final_state;
};

// p.tokens == row.tokens(). Writes y [S, H, P].
template <class T>
Mamba2TreeSaved<T> mamba2_tree_forward(const Row& row, const Mamba2Params<T>& p, T* y);

// Adds the gradients into `grads` (dA, dD: this head set's full gradient).
template <class T>
void mamba2_tree_backward(const Row& row, const Mamba2Params<T>& p, const Mamba2TreeSaved<T>& saved, const T* dy,
                          const Mamba2Grads<T>& grads);

}  // namespace treecp
