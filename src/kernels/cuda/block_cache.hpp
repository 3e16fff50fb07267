// The reuse policy of the device pool (memory.hpp's DevicePool), host code only so that the CPU suite tests it:
// which cached block serves a request.
//
// Requests are rounded up to size classes, 16 per octave and 512-byte aligned, so a block is at most 1/16 larger
// than what was asked (plus the alignment), and rows that vary a little from step to step fall into a few classes.
// A cached block serves only requests of its own class. That is what makes "a step that repeats an earlier step's
// requests allocates nothing" hold: per class, the pool then owns as many blocks as that step ever held at once.
// A policy that hands a larger cached block to a smaller request breaks it: the larger class's own later request
// finds nothing and allocates again (seen on an H200: one or two cudaMallocs in the second and third steps of
// GdnCudaCP.SteadyStateAllocatesNothing).
#pragma once

#include <algorithm>
#include <bit>
#include <cstddef>
#include <map>
#include <utility>
#include <vector>

namespace treecp::cuda {

class BlockCache {
 public:
  static constexpr size_t kAlignBytes = 512;
  static constexpr int kClassesPerOctave = 16;

  // The block size a request of `bytes` gets (0 gets the smallest class).
  static size_t size_class(size_t bytes) {
    if (bytes <= kAlignBytes) return kAlignBytes;
    // The octave [2^k, 2^(k+1)) containing bytes - 1, cut into kClassesPerOctave equal steps.
    const int k = static_cast<int>(std::bit_width(bytes - 1)) - 1;
    const size_t step = std::max<size_t>(kAlignBytes, (size_t{1} << k) / kClassesPerOctave);
    return (bytes + step - 1) / step * step;
  }

  // A cached block of exactly `size` bytes (a size_class), taken out of the cache; nullptr when there is none.
  void* take(size_t size) {
    auto it = free_.find(size);
    if (it == free_.end()) return nullptr;
    void* ptr = it->second;
    free_.erase(it);
    return ptr;
  }
  void give(size_t size, void* ptr) { free_.emplace(size, ptr); }
  bool empty() const { return free_.empty(); }
  // Every cached block, removed from the cache (the pool returns them to the driver).
  std::vector<std::pair<size_t, void*>> drain() {
    std::vector<std::pair<size_t, void*>> all(free_.begin(), free_.end());
    free_.clear();
    return all;
  }

 private:
  std::multimap<size_t, void*> free_;  // cached blocks by size
};

}  // namespace treecp::cuda
