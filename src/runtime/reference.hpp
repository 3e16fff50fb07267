// runtime/: executes plans on one rank, one class per layer kind, generic over a Backend and a
// Communicator; moves activations between ownerships; the one-process references.
//
// One process over a whole row, straight on the CPU kernels (kernels/cpu): the CLI's one-process path
// and the oracle every CP test and `treecp run` compare with. Buffer rows are token ids here, so no
// plan, no exchange and no Backend are involved.
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/cpu/attention.hpp"

namespace treecp {

class Row;

// A whole row's arrays, C order, S = row.tokens().
template <class T>
struct AttentionInputs {
  const T* q = nullptr;     // [S, hq, d]
  const T* k = nullptr;     // [S, hkv, d]
  const T* v = nullptr;     // [S, hkv, dv]
  const T* sink = nullptr;  // [hq] or nullptr (no sink)
  const T* dout = nullptr;  // [S, hq, dv] gradient of the final output, or nullptr (forward only)
};

template <class T>
struct AttentionResult {
  std::vector<T> o;      // [S, hq, dv] final output (sink applied)
  std::vector<T> lse;    // [S, hq] over tokens only (before the sink)
  std::vector<T> dq, dk, dv;  // with dout
  std::vector<T> dsink;       // with dout and a sink: [hq]
};

// Whole-row forward (and backward with dout) in one process over row_slices(row, shape.window).
template <class T>
AttentionResult<T> attention_reference(const Row& row, const AttentionShape& shape, const AttentionInputs<T>& in);

// The same in double on the inputs as T holds them: the oracle a run in precision T is measured
// against (with the T run's own attention_reference as the same-precision reference).
template <class T>
AttentionResult<double> attention_reference_double(const Row& row, const AttentionShape& shape,
                                                   const AttentionInputs<T>& in);

}  // namespace treecp
