// The device pool's reuse policy (kernels/cuda/block_cache.hpp; plain C++, so checked here without a GPU):
// size classes against their definition on edge and random sizes; random programs of allocations and frees, run
// twice from the cache the first run left, need no new block the second time (the pool's steady state: what
// GdnCudaCP/CudaCP.SteadyStateAllocatesNothing assert on the GPU); rows whose sizes vary step to step fall into a
// few classes, so the cache stops growing.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <set>
#include <vector>

#include "common/common.hpp"
#include "kernels/cuda/block_cache.hpp"

namespace treecp::cuda {
namespace {

int64_t uniform(testing::Rng& rng, int64_t lo, int64_t hi) {
  return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
}

TEST(BlockCache, SizeClassesAreAlignedAndAtMostASixteenthOver) {
  std::vector<size_t> sizes = {0, 1, 511, 512, 513, 1023, 1024, 1025, 8191, 8192, 8193};
  for (int k = 10; k < 40; ++k)
    for (const int64_t d : {-1, 0, 1}) sizes.push_back((size_t{1} << k) + d);
  testing::Rng rng = testing::test_rng(1);
  for (int i = 0; i < 20000; ++i) sizes.push_back(size_t{1} << uniform(rng, 0, 36) | static_cast<size_t>(uniform(rng, 0, 1 << 20)));
  for (const size_t b : sizes) {
    const size_t c = BlockCache::size_class(b);
    ASSERT_GE(c, b) << b;
    ASSERT_EQ(c % BlockCache::kAlignBytes, 0u) << b;
    if (b > 0) {
      ASSERT_LT(c - b, std::max<size_t>(BlockCache::kAlignBytes, b / 16)) << b;
    }
    ASSERT_EQ(BlockCache::size_class(c), c) << b;  // a class is its own class
    ASSERT_LE(BlockCache::size_class(b > 0 ? b - 1 : 0), c) << b;  // monotone
  }
  // 16 classes per octave, so varying sizes share blocks
  for (int k = 14; k < 34; k += 3) {
    std::set<size_t> classes;
    for (size_t b = (size_t{1} << k) + 1; b <= (size_t{2} << k); b += (size_t{1} << k) / 256)
      classes.insert(BlockCache::size_class(b));
    EXPECT_EQ(classes.size(), 16u) << "octave 2^" << k;
  }
}

// A pool over the cache that counts the blocks it had to create (DevicePool's cudaMallocs); pointers are fake.
struct CountingPool {
  BlockCache cache;
  uintptr_t next = 1;
  int64_t created = 0;
  std::vector<std::pair<void*, size_t>> live;  // handed-out blocks and their classes
  void allocate(size_t bytes) {
    const size_t c = BlockCache::size_class(bytes);
    void* p = cache.take(c);
    if (p == nullptr) {
      p = reinterpret_cast<void*>(next++);
      ++created;
    }
    live.emplace_back(p, c);
  }
  void deallocate(size_t index) {
    cache.give(live[index].second, live[index].first);
    live.erase(live.begin() + static_cast<std::ptrdiff_t>(index));
  }
};

struct Op {
  bool alloc;
  size_t value;  // bytes, or which live block to free (modulo the live count)
};

void run(CountingPool& pool, const std::vector<Op>& program) {
  for (const Op& op : program) {
    if (op.alloc) pool.allocate(op.value);
    else if (!pool.live.empty()) pool.deallocate(op.value % pool.live.size());
  }
  while (!pool.live.empty()) pool.deallocate(pool.live.size() - 1);  // a step gives back what it took
}

TEST(BlockCache, AStepThatRepeatsAnEarlierOneCreatesNoBlock) {
  testing::Rng rng = testing::test_rng(2);
  for (int trial = 0; trial < 300; ++trial) {
    // Sizes from a few nearby families (workspaces, gradients, staging of one geometry), so that classes collide.
    std::vector<size_t> family;
    for (int f = 0; f < 1 + trial % 6; ++f) family.push_back(size_t{1} << uniform(rng, 8, 26));
    std::vector<Op> program;
    const int ops = uniform(rng, 5, 120);
    for (int i = 0; i < ops; ++i) {
      const bool alloc = uniform(rng, 0, 2) != 0;
      const size_t base = family[static_cast<size_t>(uniform(rng, 0, static_cast<int>(family.size()) - 1))];
      program.push_back({alloc, alloc ? base * static_cast<size_t>(uniform(rng, 1, 4)) / 2 + 1
                                      : static_cast<size_t>(uniform(rng, 0, 1000))});
    }
    CountingPool pool;
    run(pool, program);
    const int64_t first = pool.created;
    run(pool, program);
    ASSERT_EQ(pool.created, first) << "trial " << trial << ": the repeated step created blocks";
    run(pool, program);
    ASSERT_EQ(pool.created, first) << "trial " << trial;
  }
}

TEST(BlockCache, SizesThatVaryStepToStepStopCreatingBlocks) {
  // RL rows change every step: each step holds a few large buffers within +-10% of a typical size.
  testing::Rng rng = testing::test_rng(3);
  CountingPool pool;
  std::vector<int64_t> created_after;
  for (int step = 0; step < 400; ++step) {
    std::vector<Op> program;
    for (const size_t typical : {size_t{100} << 20, size_t{6} << 20, size_t{300} << 10}) {
      const double f = 0.9 + 0.2 * uniform(rng, 0, 1000) / 1000.0;
      program.push_back({true, static_cast<size_t>(static_cast<double>(typical) * f)});
      program.push_back({true, static_cast<size_t>(static_cast<double>(typical) * f)});
    }
    run(pool, program);
    created_after.push_back(pool.created);
  }
  // At most two blocks (a step's two buffers of one kind) per class a buffer's sizes can fall into, whatever the
  // number of steps (a best-fit cache without classes keeps creating blocks as sizes drift).
  size_t reachable = 0;
  for (const size_t typical : {size_t{100} << 20, size_t{6} << 20, size_t{300} << 10}) {
    std::set<size_t> classes;
    for (int i = 0; i <= 1000; ++i)
      classes.insert(BlockCache::size_class(static_cast<size_t>(static_cast<double>(typical) * (0.9 + 0.2 * i / 1000.0))));
    reachable += classes.size();
  }
  EXPECT_LE(reachable, 17u);  // 6 + 6 + 5 classes for +-10% at 16 per octave
  EXPECT_LE(pool.created, static_cast<int64_t>(2 * reachable));
  EXPECT_GT(created_after.back(), created_after.front());  // sizes did drift into new classes
}

}  // namespace
}  // namespace treecp::cuda
