// Times the slice decomposition and the row statistics of a preset row (issue: well under 10 ms for
// a 327,680-token varied5k row at CP 8 on one core). Prints a table; not a test.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "tree/accounting.hpp"
#include "tree/presets.hpp"
#include "tree/slice.hpp"

int main(int argc, char** argv) {
  const int cp = argc > 1 ? std::stoi(argv[1]) : 8;
  const int reps = 50;
  std::printf("%-14s %4s %10s %8s %12s %12s %12s\n", "preset", "cp", "tokens", "slices", "slices_ms", "stats_ms",
              "windowed_ms");
  for (const char* name : {"fixed5k", "varied5k", "dominant", "deep", "art-varied5k", "art-manysmall"}) {
    const treecp::Row row = treecp::make_preset(name, cp, 0);
    auto best_of = [&](auto&& fn) {
      double best = 1e30;
      for (int r = 0; r < reps; ++r) {
        const auto t0 = std::chrono::steady_clock::now();
        fn();
        best = std::min(best, std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
      }
      return best;
    };
    size_t nslices = 0;
    const double slices_ms = best_of([&] { nslices = treecp::row_slices(row).size(); });
    const double stats_ms = best_of([&] { (void)treecp::row_stats(row); });
    const double win_ms = best_of([&] { (void)treecp::row_stats(row, 4096); });
    std::printf("%-14s %4d %10lld %8zu %12.3f %12.3f %12.3f\n", name, cp, static_cast<long long>(row.tokens()), nslices,
                slices_ms, stats_ms, win_ms);
  }
  return 0;
}
