// runtime/: executes plans on one rank, one class per layer kind, generic over a Backend and a
// Communicator; moves activations between ownerships; the one-process references.
//
// Per-input host work off the critical path: the plan of the next row and its prepared stages (tile lists on
// the GPU) are built on a host thread while the current row's forward and backward run. ART plans a row in
// about 40 ms and hides it the same way; treecp's planning takes a few ms and is hidden too.
//
//   Lookahead<CudaBackend> ahead(comm.rank(), comm.size(), costs, options, shape, &cache);
//   ahead.submit(row_0);
//   for (i...) {
//     if (i + 1 < n) ahead.submit(row_{i+1});        // planned while row i runs
//     auto next = ahead.next();                      // row i's, ready (or waited for: next.waited_ms)
//     DenseAttentionCP<CudaBackend> cp(next.prepared, comm, backend);
//     ... forward / backward ...
//   }
//
// Every rank submits the same rows in the same order, and make_plan is deterministic, so every rank
// prepares its share of the same plan without a collective.
#pragma once

#include <chrono>
#include <deque>
#include <future>
#include <memory>

#include "core/error.hpp"
#include "plan/plan_cache.hpp"
#include "plan/planner.hpp"
#include "runtime/dense_attention.hpp"
#include "tree/row.hpp"

namespace treecp {

template <class Backend>
class Lookahead {
 public:
  struct Ready {
    std::shared_ptr<const Row> row;
    std::shared_ptr<const Plan> plan;
    PreparedAttention<Backend> prepared;
    double host_ms = 0.0;    // planning + preparation on the worker thread
    double waited_ms = 0.0;  // how long next() waited for it (the part lookahead did not hide)
    bool cache_hit = false;
  };

  // `cache` may be null (no caching) and must outlive this object.
  // Plans every row for a layer of `shape` (its window included).
  Lookahead(int rank, int ranks, CostModel costs, PlanOptions options, AttentionShape shape, PlanCache* cache = nullptr)
      : rank_(rank), ranks_(ranks), costs_(std::move(costs)), options_(std::move(options)), shape_(shape),
        cache_(cache) {
    require(ranks >= 1 && rank >= 0 && rank < ranks, "Lookahead: rank ", rank, " of ", ranks, " is out of range");
  }
  ~Lookahead() {
    for (auto& f : queue_)
      if (f.valid()) f.wait();  // the workers read this object
  }
  Lookahead(const Lookahead&) = delete;
  Lookahead& operator=(const Lookahead&) = delete;

  // Starts planning `row` (copied) on a host thread.
  void submit(Row row) {
    auto shared = std::make_shared<const Row>(std::move(row));
    queue_.push_back(std::async(std::launch::async, [this, shared] { return build(shared); }));
  }
  size_t pending() const { return queue_.size(); }

  // The oldest submitted row's plan, waiting for it if it is not ready yet. Rethrows the worker's Error.
  Ready next() {
    require(!queue_.empty(), "Lookahead::next: nothing was submitted");
    const auto t0 = std::chrono::steady_clock::now();
    std::future<Ready> f = std::move(queue_.front());
    queue_.pop_front();  // before get(): a worker's error leaves the queue consistent
    Ready r = f.get();
    r.waited_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    return r;
  }

 private:
  Ready build(const std::shared_ptr<const Row>& row) const {
    const auto t0 = std::chrono::steady_clock::now();
    Ready r;
    r.row = row;
    r.plan = cache_ ? cache_->get(*row, ranks_, shape_, costs_, options_, &r.cache_hit)
                    : std::make_shared<const Plan>(make_plan(*row, ranks_, shape_, costs_, options_));
    r.prepared = prepare_attention<Backend>(*r.plan, *row, shape_, rank_);
    r.host_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    return r;
  }

  int rank_, ranks_;
  CostModel costs_;
  PlanOptions options_;
  AttentionShape shape_;
  PlanCache* cache_;
  std::deque<std::future<Ready>> queue_;
};

}  // namespace treecp
