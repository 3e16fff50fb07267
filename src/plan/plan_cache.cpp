#include "plan/plan_cache.hpp"

#include "core/error.hpp"
#include "core/json.hpp"
#include "tree/row.hpp"

namespace treecp {

PlanCache::PlanCache(size_t capacity) : capacity_(capacity) {
  require(capacity >= 1, "PlanCache: capacity must be >= 1");
}

std::string PlanCache::key(const Row& row, int cp, const AttentionShape& shape, const CostModel& costs,
                           const PlanOptions& o) {
  std::string k;
  k.reserve(static_cast<size_t>(row.num_segments()) * 12 + 256);
  auto put = [&k](int64_t x) {
    k.append(reinterpret_cast<const char*>(&x), sizeof x);
  };
  put(cp);
  put(row.num_segments());
  for (const Segment& s : row.segments()) {
    put(s.parent);
    put(s.length);
  }
  put(shape.hq);
  put(shape.hkv);
  put(shape.d);
  put(shape.dv);
  put(shape.window);
  k.append(reinterpret_cast<const char*>(&shape.scale), sizeof shape.scale);
  put(o.chunk_tokens);
  put(o.max_waves);
  put(o.search_evaluations);
  put(o.search_steps);
  put(o.perdoc_min_piece);
  k.append(reinterpret_cast<const char*>(&o.min_gain), sizeof o.min_gain);
  k += layout_name(o.layout);
  k += '\0';
  k += o.backward_kv;
  k += '\0';
  k += json::dump(to_json(costs));  // every coefficient, in a fixed order
  return k;
}

std::shared_ptr<const Plan> PlanCache::get(const Row& row, int cp, const AttentionShape& shape, const CostModel& costs,
                                           const PlanOptions& options, bool* hit) {
  std::string k = key(row, cp, shape, costs, options);
  {
    std::lock_guard<std::mutex> lock(m_);
    auto it = index_.find(k);
    if (it != index_.end()) {
      lru_.splice(lru_.begin(), lru_, it->second);
      ++hits_;
      if (hit) *hit = true;
      return it->second->second;
    }
    ++misses_;
  }
  if (hit) *hit = false;
  auto plan = std::make_shared<const Plan>(make_plan(row, cp, shape, costs, options));
  std::lock_guard<std::mutex> lock(m_);
  if (index_.count(k) == 0) {  // another thread may have made the same plan meanwhile
    lru_.emplace_front(k, plan);
    index_.emplace(std::move(k), lru_.begin());
    while (lru_.size() > capacity_) {
      index_.erase(lru_.back().first);
      lru_.pop_back();
    }
  }
  return plan;
}

size_t PlanCache::size() const {
  std::lock_guard<std::mutex> lock(m_);
  return lru_.size();
}
int64_t PlanCache::hits() const {
  std::lock_guard<std::mutex> lock(m_);
  return hits_;
}
int64_t PlanCache::misses() const {
  std::lock_guard<std::mutex> lock(m_);
  return misses_;
}

}  // namespace treecp
