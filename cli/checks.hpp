// The checks every command applies at its boundary, before any rank starts or any compute: arrays
// (dtype, finite values, dimensions in range), memory estimates against the machine, plan options.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "command.hpp"
#include "core/npy.hpp"

namespace treecp {
class Row;
}

namespace treecp::cli {

const char* dtype_name(DType t);  // "float32", "float64"

// One precision for every array of a command (float64 computes in double, float32 in float): mixing
// them would silently promote or round.
void require_dtype(const NpyArray& a, const std::string& name, DType dtype, const std::string& reference);

// NaN or infinity in an input would propagate silently into every output that reads it. `max`, when
// given, bounds the values too (GDN's log decays are <= 0).
void require_finite(const NpyArray& a, const std::string& name, bool allow_neg_inf = false);
void require_finite_at_most(const NpyArray& a, const std::string& name, double max, const std::string& why);

// Dimension `axis` of `a` as an int, required in [lo, hi]; `what` names it ("Hq", "D").
int require_dim(const NpyArray& a, const std::string& name, size_t axis, const std::string& what, int64_t lo,
                int64_t hi);

// Bytes of memory this machine offers: physical memory, or the cgroup's limit when lower.
int64_t machine_memory_bytes();
// Refuses a request whose estimate exceeds machine_memory_bytes(); the message gives both, and `what`
// says what was estimated ("4 ranks of attention forward and backward").
void require_memory(double estimate_bytes, const std::string& what);

// Memory of a command on arrays, on this machine: every rank holds the inputs as read (double) and
// in their dtype (`elem_bytes`), and rank 0 the outputs in their dtype, gathered, and serialised.
double arrays_memory_bytes(int64_t ranks, int64_t input_elements, int64_t output_elements, int elem_bytes);

// The smallest --chunk the command line accepts (0 = the planner chooses): one kernel tile. Smaller
// chunks only multiply the planner's work (a 2-token chunk took 51 s and 8.9 GB) without a kernel
// that could use them.
void require_chunk(int64_t chunk_tokens);
// Bytes the planner needs at most for `row` cut into chunks of `chunk_tokens` (0 = its default for
// `cp` ranks): slices, and work-matrix entries bounded by the chunk pairs each slice touches.
double plan_memory_estimate_bytes(const Row& row, int64_t window, int64_t chunk_tokens, int cp);

// Multi-rank options: --ranks N (alias --cp) and --timeout SECONDS (the communicator's deadline).
struct RankOptions {
  int64_t count = 1;
  double timeout_s = 0;
};
// Declared on `args` by declare_rank_options (before parse), read and checked by rank_options.
void declare_rank_options(Args& args);
RankOptions rank_options(const Args& args, int64_t default_ranks);

}  // namespace treecp::cli
