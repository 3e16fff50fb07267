// Timing helpers of the CUDA benchmarks: CUDA-event timings of one call, warmed up, median of repetitions.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <vector>

#include "kernels/cuda/attention.hpp"  // check_cuda

namespace treecp::cuda::bench {

inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// One call of fn timed alone with CUDA events (the pair is created once and reused).
class EventTimer {
 public:
  EventTimer() {
    check_cuda(cudaEventCreate(&a_), "event");
    check_cuda(cudaEventCreate(&b_), "event");
  }
  ~EventTimer() {
    cudaEventDestroy(a_);
    cudaEventDestroy(b_);
  }
  EventTimer(const EventTimer&) = delete;
  EventTimer& operator=(const EventTimer&) = delete;
  template <class Fn>
  double ms(Fn&& fn) {
    check_cuda(cudaEventRecord(a_), "record");
    fn();
    check_cuda(cudaEventRecord(b_), "record");
    check_cuda(cudaEventSynchronize(b_), "sync");
    float t = 0;
    check_cuda(cudaEventElapsedTime(&t, a_, b_), "elapsed");
    return t;
  }

 private:
  cudaEvent_t a_, b_;
};

// Median of `reps` timed calls after 3 untimed ones.
template <class Fn>
double time_ms(int reps, Fn&& fn) {
  EventTimer timer;
  for (int i = 0; i < 3; ++i) fn();
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) t.push_back(timer.ms(fn));
  return median(t);
}

}  // namespace treecp::cuda::bench
