// core/: the ground every layer stands on: errors, JSON, .npy and output files, trace spans, random values.
//
// Counter-based random values: element i of a stream depends only on (seed, i), so every rank can
// generate exactly its shard of an array that a single process would generate whole.
#pragma once

#include <cstdint>

namespace treecp {

inline uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

// Uniform in [-1, 1) from (seed, index).
inline double uniform_at(uint64_t seed, uint64_t index) {
  const uint64_t bits = splitmix64(splitmix64(seed) ^ (index * 0xD1B54A32D192ED03ULL));
  return static_cast<double>(bits >> 11) * 0x1.0p-52 - 1.0;
}

}  // namespace treecp
