// plan/: pure data between the row and the runtime: ownership, the dense, GDN/KDA, Mamba-2 and sparse MLA
// planners, their cost models, and the Plans they produce (no tensor values).
//
// What the dense attention runtime (runtime/dense_attention.hpp) holds on one rank, predicted from the
// plan's sizes alone: the peak over the forward and over the backward of the buffers it allocates itself
// (stage partials, packed sends, received KV, dK/dV, returns), counted from just before the forward, and
// what it keeps from the forward for the backward. The replay below allocates and releases in the
// protocol's own order; the tests hold it against the backend's meter (exact on the CPU backend).
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/shapes.hpp"

namespace treecp {

struct CostModel;  // plan/cost.hpp

struct RuntimeMemoryInput {
  int64_t owned_rows = 0;
  std::vector<int64_t> fetched_rows, sent_rows;  // per wave: KV rows received, KV rows sent (peers and self)
  int64_t hq = 1, hkv = 1, d = 1, dv = 1;
  bool sink = false;
  bool refetch = false;  // BackwardKv::Refetch: received KV is released after its stage and fetched again
  // Bytes per element of the buffer kinds (GPU: bf16 activations, fp32 statistics and gradients).
  int64_t act_bytes = 2, stat_bytes = 4, grad_bytes = 4;
};

struct RuntimeMemory {
  int64_t forward_peak_bytes = 0;   // above what was held before the forward
  int64_t kept_bytes = 0;           // held from the end of the forward to the backward
  int64_t backward_peak_bytes = 0;  // above what was held before the forward (kept_bytes included)
  int64_t peak_bytes() const { return forward_peak_bytes > backward_peak_bytes ? forward_peak_bytes : backward_peak_bytes; }
};

RuntimeMemory attention_runtime_memory(const RuntimeMemoryInput& in);

// The planner's input for a rank owning `owned_rows` tokens of a layer of `shape` (its head counts), with
// element sizes the wire's (costs.kv_bytes_per_element for activations, costs.dkv_bytes_per_element for
// gradients; statistics are fp32) and a sink (the larger bound); the caller adds the waves' sizes.
RuntimeMemoryInput runtime_memory_input(const AttentionShape& shape, const CostModel& costs, int64_t owned_rows);

}  // namespace treecp
