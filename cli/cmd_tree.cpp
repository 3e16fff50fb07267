// treecp tree generate | stats
#include <chrono>
#include <climits>
#include <cstdio>
#include <iostream>

#include "command.hpp"
#include "core/error.hpp"
#include "tree/accounting.hpp"
#include "tree/presets.hpp"
#include "tree/row.hpp"

namespace treecp::cli {
namespace {

int tree_generate(const std::vector<std::string>& argv) {
  Args args(argv);
  args.value("--preset").value("--ranks").alias("--cp", "--ranks").value("--seed").value("--out");
  args.parse();
  const int64_t ranks = args.get_int_in("--ranks", 1, 1, 4096);
  const int64_t seed = args.get_int_in("--seed", 0, 0, INT64_MAX);
  const std::string out = args.get_or("--out", "-");
  check_output_file(out);
  const Row row = make_preset(args.get("--preset"), static_cast<int>(ranks), static_cast<uint64_t>(seed));
  write_output(out, row_to_json(row));
  return 0;
}

int tree_stats(const std::vector<std::string>& argv) {
  Args args(argv);
  args.value("--tree").value("--window").flag("--json");
  args.parse();
  const int64_t window = args.get_int_in("--window", 0, 0, Row::kMaxTokens);
  const Row row = load_row(args.get("--tree"));
  const auto t0 = std::chrono::steady_clock::now();
  const RowStats st = row_stats(row, window);
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  if (args.get_flag("--json")) {
    json::Value v = to_json(st);
    v.set("stats_ms", ms);
    std::cout << json::dump(v) << "\n";
    return 0;
  }
  auto pct = [](int64_t a, int64_t b) { return b > 0 ? 100.0 * (1.0 - static_cast<double>(a) / static_cast<double>(b)) : 0.0; };
  std::printf("row: %s, %s, %s, depth %d\n", count_of(st.segments, "segment").c_str(),
              count_of(st.families, "family", "families").c_str(), count_of(st.trajectories, "trajectory", "trajectories").c_str(),
              st.depth);
  std::printf("tokens:        %14lld physical  %14lld flattened  (sharing saves %.1f%%)\n",
              static_cast<long long>(st.physical_tokens), static_cast<long long>(st.flattened_tokens),
              pct(st.physical_tokens, st.flattened_tokens));
  std::printf("visible pairs: %14lld tree      %14lld flattened  (sharing saves %.1f%%)%s\n",
              static_cast<long long>(st.visible_pairs), static_cast<long long>(st.flattened_visible_pairs),
              pct(st.visible_pairs, st.flattened_visible_pairs),
              window > 0 ? (" window " + std::to_string(window)).c_str() : "");
  std::printf("slices:        %14lld\n", static_cast<long long>(st.slices));
  std::printf("computed in %.3f ms\n", ms);
  return 0;
}

const Register kGenerate("tree generate", "--preset NAME --ranks N [--seed S] [--out FILE]",
                         "write a preset row (base tokens x N) as JSON", tree_generate);
const Register kStats("tree stats", "--tree FILE [--window W] [--json]", "tokens, pairs, depth, families, slices",
                      tree_stats);

}  // namespace
}  // namespace treecp::cli
