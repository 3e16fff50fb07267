// core/: the ground every layer stands on: errors, JSON, .npy and output files, trace spans, random values.
//
// Timed spans of a run and their Chrome trace form (chrome://tracing, https://ui.perfetto.dev).
// A span is one named interval on one rank: measured (track 0, what a rank saw its clock do) or
// predicted (track 1, what the cost model's simulator says). `treecp run --trace` records each rank's
// calls and the runtime's stage spans into a SpanRecorder, gathers every rank's spans and writes them
// as one trace.
#pragma once

#include <chrono>
#include <mutex>
#include <string>
#include <vector>

namespace treecp {

struct Span {
  std::string name, category;
  int rank = 0;
  int track = 0;  // 0 = measured, 1 = predicted
  double begin_ms = 0, end_ms = 0;
};

enum SpanTrack : int { kMeasuredTrack = 0, kPredictedTrack = 1 };

// Records measured spans against a steady-clock origin; safe to call from several threads.
class SpanRecorder {
 public:
  explicit SpanRecorder(int rank = 0, int track = kMeasuredTrack);

  // Moves the origin to now. Ranks that reset it right after a barrier share t = 0 (within the
  // barrier's skew), which is what puts their spans on one time axis.
  void reset_origin();
  double now_ms() const;  // since the origin
  void record(std::string name, std::string category, double begin_ms, double end_ms);
  std::vector<Span> spans() const;  // a copy, in recording order

 private:
  using Clock = std::chrono::steady_clock;
  int rank_, track_;
  Clock::time_point origin_;
  mutable std::mutex mutex_;
  std::vector<Span> spans_;
};

// The Chrome trace event format (JSON object form): one process per rank ("rank R"), per track a
// thread for compute ("measured", "predicted") and one for spans of category "transfer" ("measured
// transfers", ...). Spans of one thread that overlap without nesting go to further threads of it
// ("predicted 2", ...), since a viewer stacks only nested events on one thread. Timestamps are
// microseconds. Throws treecp::Error on a span that ends before it begins, a negative rank or an
// unknown track.
std::string chrome_trace_json(const std::vector<Span>& spans);
// Writes chrome_trace_json(spans) to `path` (atomically; nothing is written on failure).
void write_chrome_trace(const std::vector<Span>& spans, const std::string& path);

}  // namespace treecp
