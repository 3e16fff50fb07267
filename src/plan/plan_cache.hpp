// plan/: pure data between the row and the runtime: ownership, the dense, GDN/KDA, Mamba-2 and sparse MLA
// planners, their cost models, and the Plans they produce (no tensor values).
//
// A bounded cache of Plans keyed by everything a plan depends on: the row's segments, the rank count, the
// layer's shape (window included), the planning options and the cost coefficients. Training revisits rows (several epochs, several layers of one
// geometry, microbatches that repeat a tree); a hit costs one key comparison instead of a search. Least
// recently used entries go first. Thread-safe: lookahead plans on a host thread while the GPU runs.
#pragma once

#include <cstddef>
#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

#include "plan/cost.hpp"
#include "plan/plan.hpp"
#include "plan/planner.hpp"

namespace treecp {

class Row;

class PlanCache {
 public:
  explicit PlanCache(size_t capacity = 128);

  // The cached plan for these inputs, or a new one made (outside the lock) and cached. `hit` says which.
  std::shared_ptr<const Plan> get(const Row& row, int cp, const AttentionShape& shape, const CostModel& costs,
                                  const PlanOptions& options, bool* hit = nullptr);

  size_t size() const;
  size_t capacity() const { return capacity_; }
  int64_t hits() const;
  int64_t misses() const;

  // The key (exact, not a hash: two inputs never share a plan by collision).
  static std::string key(const Row& row, int cp, const AttentionShape& shape, const CostModel& costs,
                         const PlanOptions& options);

 private:
  using Entry = std::pair<std::string, std::shared_ptr<const Plan>>;
  size_t capacity_;
  mutable std::mutex m_;
  std::list<Entry> lru_;  // most recent first
  std::unordered_map<std::string, std::list<Entry>::iterator> index_;
  int64_t hits_ = 0, misses_ = 0;
};

}  // namespace treecp
