// The limits every command checks at its boundary, before any rank starts or any compute: memory
// estimates against the machine, the chunk size, the rank options (arrays' checks: arrays.hpp).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "command.hpp"
#include "plan/plan.hpp"

namespace treecp {
class Row;
}

namespace treecp::cli {

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
// --d and --dv on GPUs (`treecp run`, `treecp bench cp`): one of the CUDA kernels' (D, Dv) pairs, else refused with
// their list (kernels/cuda/attention_dims.hpp). CPU ranks take any head dims.
void require_gpu_attention_dims(int d, int dv);
// Bytes the planner needs at most for `row` cut into chunks of `chunk_tokens` (0 = its default for
// `cp` ranks): slices, and work-matrix entries bounded by the chunk pairs each slice touches.
double plan_memory_estimate_bytes(const Row& row, int64_t window, int64_t chunk_tokens, int cp);

// A file of config/ (cost coefficients): under $TREECP_CONFIG_DIR when set (binaries run away from their
// source tree, as on a lent GPU machine), else under the source tree's config/ this binary was built from.
std::string config_file(const std::string& name);

// --layout (default "searched"), required to be one of plan/plan.hpp's layout_names().
Layout layout_option(const Args& args);

// Multi-rank options: --ranks N (alias --cp) and --timeout SECONDS (the communicator's deadline).
struct RankOptions {
  int64_t count = 1;
  double timeout_s = 0;
};
// Declared on `args` by declare_rank_options (before parse), read and checked by rank_options.
void declare_rank_options(Args& args);
RankOptions rank_options(const Args& args, int64_t default_ranks);

}  // namespace treecp::cli
