// Times the planner (issue 5: a 327,680-token varied5k row at CP 8 in <= 5 ms on one core, search
// included) and its parts, and prints every layout's predicted makespan. Prints a table; not a test.
// usage: bench_plan [cp] [reps]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <string>
#include <vector>

#include "plan/cost.hpp"
#include "plan/plan.hpp"
#include "plan/planner.hpp"
#include "plan/work.hpp"
#include "tree/presets.hpp"
#include "tree/row.hpp"
#include "tree/slice.hpp"

namespace {

// CPU time of this thread: unlike wall time, it does not count time the scheduler gave to other
// processes on a shared machine.
double thread_cpu_ms() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) * 1e3 + static_cast<double>(ts.tv_nsec) * 1e-6;
}

template <class Fn>
double median_cpu_ms(int reps, Fn&& fn) {
  std::vector<double> t;
  for (int r = 0; r < reps; ++r) {
    const double t0 = thread_cpu_ms();
    fn();
    t.push_back(thread_cpu_ms() - t0);
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

template <class Fn>
double median_ms(int reps, Fn&& fn) {
  std::vector<double> t;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    t.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  using namespace treecp;
  const int cp = argc > 1 ? std::stoi(argv[1]) : 8;
  const int reps = argc > 2 ? std::stoi(argv[2]) : 21;
  const CostModel costs;
  std::printf("planning time, median of %d runs, one thread; default cost coefficients\n", reps);
  std::printf("%-14s %3s %8s %6s %7s %9s %9s %9s %11s %11s %11s | %10s %10s %10s %10s %10s %8s\n", "preset", "cp",
              "tokens", "chunks", "nnz", "slices_ms", "work_ms", "plan_ms", "plan_cpu_ms", "plan_ms_w4k", "validate_ms",
              "contiguous", "zigzag", "perdoc", "family", "searched", "bound");
  for (const char* name : {"varied5k", "fixed5k", "dominant", "longchain", "deep", "art-varied5k", "art-manysmall"}) {
    const Row row = make_preset(name, cp, 0);
    const int64_t chunk = default_chunk_tokens(row.tokens(), cp);
    std::vector<Slice> slices;
    const double slices_ms = median_ms(reps, [&] { slices = row_slices(row); });
    WorkMatrix w;
    const double work_ms = median_ms(reps, [&] { w = build_work_matrix(slices, make_chunk_bounds(row, chunk)); });
    PlanOptions opt;
    PlanReport report;
    Plan plan;
    const AttentionShape shape;  // DESIGN.md's benchmark shape
    const double plan_ms = median_ms(reps, [&] { plan = make_plan(row, cp, shape, costs, opt, &report); });
    const double plan_cpu_ms = median_cpu_ms(reps, [&] { plan = make_plan(row, cp, shape, costs, opt, &report); });
    const double validate_ms = median_ms(reps, [&] { validate_plan(plan, row, 0, cp); });
    AttentionShape windowed = shape;
    windowed.window = 4096;
    const double plan_w_ms = median_ms(reps, [&] { (void)make_plan(row, cp, windowed, costs, opt); });
    std::printf("%-14s %3d %8lld %6d %7lld %9.3f %9.3f %9.3f %11.3f %11.3f %11.3f |", name, cp,
                static_cast<long long>(row.tokens()), w.num_chunks(), static_cast<long long>(w.nonzeros()), slices_ms,
                work_ms, plan_ms, plan_cpu_ms, plan_w_ms, validate_ms);
    for (const LayoutResult& l : report.layouts) std::printf(" %10.3f", l.makespan_ms);
    // Lower bound: every pair at the local rate and every token's own work, spread perfectly.
    const double bound = own_work_ms(costs, static_cast<double>(w.total_pairs), static_cast<double>(row.tokens())) / cp;
    std::printf(" %8.3f\n", bound);
  }
  std::printf(
      "plan_ms: make_plan from the row (slices, chunks, work matrices, every layout, search, Plan);\n"
      "plan_cpu_ms: the same, this thread's CPU time (robust on a loaded machine);\n"
      "plan_ms_w4k: the same with a 4,096-token window; validate_ms: validate_plan on the plan;\n"
      "the right-hand columns are predicted makespans in ms (forward + backward, slowest rank);\n"
      "bound: all pairs at the local rate and all token-local work split perfectly, no overheads.\n");
  return 0;
}
