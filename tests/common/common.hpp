// What every test shares (tests/common): a seeded random generator that prints its seed, one
// random-tree generator, one error metric whose tolerance comes from an independent lower-precision
// reference, and size checks. A test adopts it with `#include "common/common.hpp"` (tests/ is on the
// include path of every test target).
//
//   TREECP_SEED_TRACE;                         // every failure in scope names TREECP_TEST_SEED=N
//   testing::Rng rng = testing::test_rng(7);   // from the run's seed and a per-test salt
//   const Row row = testing::random_tree(rng, {.segments = 8, .max_len = 9});
//   const auto x = testing::randn(n, rng);
//   EXPECT_LE(testing::max_error(got, exact), 1e-12);
//   EXPECT_TRUE(testing::within_reference(got, same_precision, exact, 4.0, 1e-7)) << what;
//
// Seeds: a run draws a fresh seed (STYLE.md: fresh random inputs every run) unless TREECP_TEST_SEED=N
// is set, prints it once on stderr, and every failure under TREECP_SEED_TRACE repeats it, so any
// failure replays with `TREECP_TEST_SEED=N ctest -R ...`. MPI tests agree on one seed across ranks
// (common/mpi_main.hpp). A test whose assertion bounds a heuristic rather than a property of every
// input (the planner search against the exhaustive optimum) may pin its own seed: `Rng rng(23)`.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "tree/row.hpp"

namespace treecp::testing {

using Rng = std::mt19937_64;

namespace detail {
inline uint64_t& seed_slot() {
  static uint64_t seed = 0;
  return seed;
}
inline bool& seed_set() {
  static bool set = false;
  return set;
}
}  // namespace detail

// Sets the run's seed (the MPI main broadcasts rank 0's so that every rank draws the same inputs);
// `announce` prints it.
inline void set_base_seed(uint64_t seed, bool announce = true) {
  detail::seed_slot() = seed;
  detail::seed_set() = true;
  if (announce)
    std::fprintf(stderr, "treecp tests: TREECP_TEST_SEED=%llu (set it to replay this run)\n",
                 static_cast<unsigned long long>(seed));
}

// The run's seed: TREECP_TEST_SEED when set, else a fresh one; printed once.
inline uint64_t base_seed() {
  if (!detail::seed_set()) {
    const char* env = std::getenv("TREECP_TEST_SEED");
    set_base_seed(env ? std::stoull(env)
                      : (static_cast<uint64_t>(std::random_device{}()) << 32) ^ std::random_device{}());
  }
  return detail::seed_slot();
}

// A generator for one test: the run's seed mixed with a salt, so tests do not share a stream.
inline Rng test_rng(uint64_t salt) { return Rng(base_seed() * 1000003u + salt); }

#define TREECP_SEED_TRACE \
  SCOPED_TRACE("TREECP_TEST_SEED=" + std::to_string(::treecp::testing::base_seed()))

inline std::vector<double> randn(size_t n, Rng& rng, double sigma = 1.0) {
  std::normal_distribution<double> d(0.0, sigma);
  std::vector<double> x(n);
  for (double& e : x) e = d(rng);
  return x;
}

// ---- random trees

// What random_tree draws: exactly `segments` segments in DFS preorder; each segment gets
// [min_children, max_children] children (fewer when the count runs out) down to `max_depth`
// segments per root-to-leaf path; roots are added until the count is reached. Lengths are uniform in
// [min_len, max_len] ([root_min_len, root_max_len] for roots when those are > 0), except that a
// non-root segment has a single token with probability `single_token` (kernel tile edge cases).
struct TreeSpec {
  int segments = 8;
  int64_t min_len = 1, max_len = 16;
  int max_depth = 4;
  int min_children = 0, max_children = 3;
  int64_t root_min_len = 0, root_max_len = 0;
  double single_token = 0.0;
};

inline Row random_tree(Rng& rng, const TreeSpec& spec) {
  std::vector<Segment> segs;
  auto length = [&](bool root) -> int64_t {
    if (!root && spec.single_token > 0 && std::uniform_real_distribution<double>(0, 1)(rng) < spec.single_token) return 1;
    const bool own = root && spec.root_max_len > 0;
    return std::uniform_int_distribution<int64_t>(own ? spec.root_min_len : spec.min_len,
                                                  own ? spec.root_max_len : spec.max_len)(rng);
  };
  // Depth-first with an explicit stack: a segment's subtree is complete before its next sibling.
  struct Open {
    int32_t segment;
    int depth, children_left;
  };
  std::vector<Open> stack;
  std::uniform_int_distribution<int> children(spec.min_children, spec.max_children);
  while (static_cast<int>(segs.size()) < spec.segments) {
    if (stack.empty()) {
      segs.push_back({-1, length(true)});
      stack.push_back({static_cast<int32_t>(segs.size()) - 1, 1, spec.max_depth > 1 ? children(rng) : 0});
      continue;
    }
    Open& top = stack.back();
    if (top.children_left == 0) {
      stack.pop_back();
      continue;
    }
    --top.children_left;
    const int depth = top.depth + 1;
    segs.push_back({top.segment, length(false)});
    stack.push_back({static_cast<int32_t>(segs.size()) - 1, depth, depth < spec.max_depth ? children(rng) : 0});
  }
  return Row(std::move(segs));
}

// The same from a generator made for this one tree: random_tree(test_rng(salt), spec).
inline Row random_tree(Rng&& rng, const TreeSpec& spec) { return random_tree(rng, spec); }

// ---- errors

// max |got - want| over two arrays of one size (a size mismatch fails the test and returns +inf).
// Infinities must match exactly (the -inf LSE of a row with no key); NaN anywhere counts as +inf.
template <class A, class B>
double max_error(const std::vector<A>& got, const std::vector<B>& want) {
  EXPECT_EQ(got.size(), want.size()) << "arrays of different sizes";
  if (got.size() != want.size()) return std::numeric_limits<double>::infinity();
  double m = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double g = static_cast<double>(got[i]), w = static_cast<double>(want[i]);
    if (std::isinf(g) || std::isinf(w)) {
      if (g != w) return std::numeric_limits<double>::infinity();
      continue;
    }
    const double e = std::abs(g - w);
    if (!(e <= m)) m = std::isnan(e) ? std::numeric_limits<double>::infinity() : e;
  }
  return m;
}

// The largest finite |x| (the scale a tolerance on x is relative to).
template <class A>
double max_abs(const std::vector<A>& x) {
  double m = 0;
  for (const A& e : x) {
    if (std::isfinite(static_cast<double>(e))) m = std::max(m, std::abs(static_cast<double>(e)));
  }
  return m;
}

// STYLE.md's rule: `got` may differ from the exact (double or long double) reference by at most k
// times what an independent reference in got's precision differs from it, plus atol.
template <class A, class B, class C>
::testing::AssertionResult within_reference(const std::vector<A>& got, const std::vector<B>& same_precision,
                                            const std::vector<C>& exact, double k, double atol) {
  const double ref_err = max_error(same_precision, exact), err = max_error(got, exact);
  const double bound = k * ref_err + atol;
  if (err <= bound) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "error " << err << " > " << k << " x " << ref_err
                                       << " (the same-precision reference's error) + " << atol;
}

}  // namespace treecp::testing
