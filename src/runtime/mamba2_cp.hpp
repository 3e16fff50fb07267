// runtime/: executes plans on one rank, one class per layer kind, generic over a Backend and a
// Communicator; moves activations between ownerships; the one-process references.
//
// Mamba-2 context parallelism over a packed prefix-tree row (CPU backend, any Communicator), by the
// strategy a Mamba2Plan chose (plan/mamba2_plan.hpp says what each does and moves). The summary
// strategy runs the affine-state protocol of runtime/affine_cp.hpp on the CPU backend.
//
// Every rank holds the rows of its token owner's ranges (plan.tokens[rank], in that order) with all
// heads, and calls forward and then backward with the same row, plan and shape; a rank with no
// tokens or no heads still enters every collective. The same object carries what the forward saved
// into the backward.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "comm/communicator.hpp"
#include "kernels/cpu/mamba2.hpp"
#include "runtime/affine_cp.hpp"
#include "runtime/cpu_backend.hpp"
#include "plan/mamba2_plan.hpp"
#include "runtime/mamba2_tree.hpp"
#include "tree/row.hpp"

namespace treecp {

// This rank's token-owned inputs, all heads: x [T, H, P], dt [T, H], B and C [T, G, N]; A and D
// [H] are the layer's (the same on every rank); D may be null.
template <class T>
struct Mamba2Inputs {
  const T* x = nullptr;
  const T* dt = nullptr;
  const T* B = nullptr;
  const T* C = nullptr;
  const T* A = nullptr;
  const T* D = nullptr;
};

// Deliberate bugs, set only by the tests that show the checks catch them.
enum class Mamba2Fault {
  None,
  ShardReadsGroupZero,     // transpose: a head shard's heads read its groups as if it started at head 0
  GroupGradientsAssigned,  // transpose: a B/C group's gradients from several head shards overwrite each other
  SummaryWithoutDecay,     // summary: a shard's summary forgets its decay (a = 1)
};

template <class T>
class Mamba2CP {
 public:
  // Checks the plan against the row, the shape and the communicator on every rank. The plan, the
  // row and the communicator must outlive the object.
  Mamba2CP(const Mamba2Plan& plan, const Row& row, const Mamba2Shape& shape, Communicator& comm,
           Mamba2Fault fault = Mamba2Fault::None);

  int64_t owned_rows() const { return owned_rows_; }

  // Writes y [T, H, P] for this rank's tokens.
  void forward(const Mamba2Inputs<T>& in, T* y);
  // Adds dx, ddt, dB, dC of this rank's tokens into `grads` (zero them first); dA and dD receive
  // this rank's contribution only: the caller sums them over the ranks (the weights are replicated).
  void backward(const T* dy, const Mamba2Grads<T>& grads);

 private:
  void transpose_forward(const Mamba2Inputs<T>& in, T* y);
  void transpose_backward(const T* dy, const Mamba2Grads<T>& grads);
  void summary_forward(const Mamba2Inputs<T>& in, T* y);
  void summary_backward(const T* dy, const Mamba2Grads<T>& grads);
  Mamba2Params<T> shard_params() const;
  Mamba2Params<T> chain_params() const;

  const Mamba2Plan& plan_;
  const Row& row_;
  Mamba2Shape shape_;
  Communicator& comm_;
  Mamba2Fault fault_;
  int64_t owned_rows_ = 0;
  bool forward_done_ = false;
  std::vector<T> A_, D_;
  // Transpose: this rank's heads over the whole row, and the tree's saved states.
  std::vector<T> xs_, dts_, Bs_, Cs_;
  Mamba2TreeSaved<T> tree_saved_;
  // Summary: the tokens in the chain plan's layout, and the protocol's saved states.
  Ownership chain_layout_;
  std::vector<T> xl_, dtl_, Bl_, Cl_;
  CpuBackend<T> be_;
  std::unique_ptr<AffineCP<CpuBackend<T>>> chain_cp_;  // holds what the forward saved for the backward
};

}  // namespace treecp
