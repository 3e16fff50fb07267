#include "checks.hpp"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <cstdio>
#include <limits>

#include "comm/communicator.hpp"
#include "core/error.hpp"
#include "kernels/cuda/attention_dims.hpp"
#include "plan/work.hpp"
#include "tree/row.hpp"
#include "tree/slice.hpp"

namespace treecp::cli {

namespace {
// A cgroup's memory limit in bytes, or 0 when the file is missing or says "max".
int64_t cgroup_limit(const char* path) {
  std::ifstream in(path);
  std::string text;
  if (!(in >> text) || text == "max") return 0;
  try {
    return std::stoll(text);
  } catch (const std::exception&) {
    return 0;
  }
}
}  // namespace

int64_t machine_memory_bytes() {
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
  int64_t bytes = pages > 0 && page > 0 ? static_cast<int64_t>(pages) * page : std::numeric_limits<int64_t>::max();
  for (const char* path : {"/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"}) {
    const int64_t limit = cgroup_limit(path);
    if (limit > 0) bytes = std::min(bytes, limit);
  }
  return bytes;
}

void require_memory(double estimate_bytes, const std::string& what) {
  const double have = static_cast<double>(machine_memory_bytes());
  constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
  if (estimate_bytes <= have) return;
  char text[160];
  std::snprintf(text, sizeof text, "needs about %.1f GiB (%s), more than the %.1f GiB of this machine",
                estimate_bytes / kGiB, what.c_str(), have / kGiB);
  fail(text);
}

double arrays_memory_bytes(int64_t ranks, int64_t input_elements, int64_t output_elements, int elem_bytes) {
  return static_cast<double>(ranks) * static_cast<double>(input_elements) * (8.0 + elem_bytes) +
         3.0 * static_cast<double>(output_elements) * elem_bytes;
}

void require_chunk(int64_t chunk_tokens) {
  require(chunk_tokens == 0 || (chunk_tokens >= kKernelTileTokens && chunk_tokens <= Row::kMaxTokens),
          "option --chunk must be 0 (the planner chooses) or at least the kernel tile of ", kKernelTileTokens,
          " tokens, got ", chunk_tokens);
}

void require_gpu_attention_dims(int d, int dv) {
  require(cuda::attention_dims_supported(d, dv), "options --d and --dv on GPUs must be one of (D, Dv) ",
          cuda::attention_dims_list(), ", got (", d, ", ", dv, ")");
}

double plan_memory_estimate_bytes(const Row& row, int64_t window, int64_t chunk_tokens, int cp) {
  const int64_t chunk = chunk_tokens > 0 ? chunk_tokens : default_chunk_tokens(row.tokens(), cp);
  const double chunks = std::ceil(static_cast<double>(row.tokens()) / static_cast<double>(chunk)) + 1;
  double entries = 0;
  const std::vector<Slice> slices = row_slices(row, window);
  for (const Slice& s : slices) {
    const double q = std::min(chunks, std::ceil(static_cast<double>(s.q_len()) / static_cast<double>(chunk)) + 1);
    const double k = std::min(chunks, std::ceil(static_cast<double>(s.k_len()) / static_cast<double>(chunk)) + 1);
    entries += q * k;
  }
  entries = std::min(entries, chunks * chunks);
  constexpr double kSliceBytes = sizeof(Slice), kEntryBytes = 4 + 8 + 8;  // a work-matrix entry: col, pairs, compute
  // the row's slices and the plan's copies of them; two grids of entries; per-rank scratch of one entry per chunk
  return 3 * kSliceBytes * static_cast<double>(slices.size()) + 2 * kEntryBytes * entries + 16.0 * cp * chunks;
}

void declare_rank_options(Args& args) { args.value("--ranks").alias("--cp", "--ranks").value("--timeout"); }

RankOptions rank_options(const Args& args, int64_t default_ranks) {
  RankOptions o;
  o.count = args.get_int_in("--ranks", default_ranks, 1, 256);
  o.timeout_s = args.get_double_or("--timeout", Communicator::kDefaultTimeoutS);
  require(std::isfinite(o.timeout_s) && o.timeout_s > 0 && o.timeout_s <= 1e6,
          "option --timeout must be a number of seconds in (0, 1e6], got ", o.timeout_s);
  return o;
}

std::string config_file(const std::string& name) {
  const char* env = std::getenv("TREECP_CONFIG_DIR");
  return std::string(env != nullptr && *env != '\0' ? env : TREECP_CONFIG_DIR) + "/" + name;
}

Layout layout_option(const Args& args) { return parse_layout(args.get_choice("--layout", "searched", layout_names())); }

}  // namespace treecp::cli
