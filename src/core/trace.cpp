#include "core/trace.hpp"

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>
#include <tuple>
#include <utility>

#include "core/error.hpp"
#include "core/file.hpp"
#include "core/json.hpp"

namespace treecp {

SpanRecorder::SpanRecorder(int rank, int track) : rank_(rank), track_(track), origin_(Clock::now()) {}

void SpanRecorder::reset_origin() {
  std::lock_guard<std::mutex> lock(mutex_);
  origin_ = Clock::now();
}

double SpanRecorder::now_ms() const {
  Clock::time_point origin;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    origin = origin_;
  }
  return std::chrono::duration<double, std::milli>(Clock::now() - origin).count();
}

void SpanRecorder::record(std::string name, std::string category, double begin_ms, double end_ms) {
  std::lock_guard<std::mutex> lock(mutex_);
  spans_.push_back({std::move(name), std::move(category), rank_, track_, begin_ms, end_ms});
}

std::vector<Span> SpanRecorder::spans() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return spans_;
}

namespace {

const char* track_name(int track) { return track == kMeasuredTrack ? "measured" : "predicted"; }

// Transfers run beside the compute they overlap, not inside it: they get threads of their own.
constexpr int kTransferGroup = 1;
int group_of(const Span& s) { return s.category == "transfer" ? kTransferGroup : 0; }

}  // namespace

std::string chrome_trace_json(const std::vector<Span>& spans) {
  for (size_t i = 0; i < spans.size(); ++i) {
    const Span& s = spans[i];
    require(s.rank >= 0, "trace: span ", i, " ('", s.name, "') has rank ", s.rank, ", expected >= 0");
    require(s.track == kMeasuredTrack || s.track == kPredictedTrack, "trace: span ", i, " ('", s.name,
            "') has track ", s.track, ", expected 0 (measured) or 1 (predicted)");
    require(std::isfinite(s.begin_ms) && std::isfinite(s.end_ms) && s.end_ms >= s.begin_ms, "trace: span ", i,
            " ('", s.name, "') runs from ", s.begin_ms, " to ", s.end_ms, " ms, expected finite and end >= begin");
  }
  // Rank, track, then begin (an enclosing span before what it encloses).
  std::vector<size_t> order(spans.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    const Span &x = spans[a], &y = spans[b];
    if (x.rank != y.rank) return x.rank < y.rank;
    if (x.track != y.track) return x.track < y.track;
    if (x.begin_ms != y.begin_ms) return x.begin_ms < y.begin_ms;
    return x.end_ms > y.end_ms;
  });
  // Threads of one (rank, track, group): each holds spans that are disjoint or nested; a span goes to
  // the first thread whose open spans it fits inside (or after).
  std::vector<int> thread_of(spans.size());
  std::map<std::tuple<int, int, int>, std::vector<std::vector<double>>> open;  // -> per thread: open ends
  for (size_t i : order) {
    const Span& s = spans[i];
    auto& threads = open[{s.rank, s.track, group_of(s)}];
    size_t t = 0;
    for (; t < threads.size(); ++t) {
      std::vector<double>& ends = threads[t];
      while (!ends.empty() && ends.back() <= s.begin_ms) ends.pop_back();
      if (ends.empty() || ends.back() >= s.end_ms) break;
    }
    if (t == threads.size()) threads.emplace_back();
    threads[t].push_back(s.end_ms);
    thread_of[i] = static_cast<int>(t);
  }

  json::Value events = json::Value::array();
  auto metadata = [&](const char* what, int pid, int tid, const char* key, json::Value value) {
    json::Value e = json::Value::object();
    e.set("name", what);
    e.set("ph", "M");
    e.set("pid", pid);
    if (tid >= 0) e.set("tid", tid);
    json::Value args = json::Value::object();
    args.set(key, std::move(value));
    e.set("args", args);
    events.push_back(e);
  };
  // Thread ids within a rank, in display order: measured, measured transfers, predicted, predicted transfers.
  auto tid = [](int track, int group, int thread) { return track * 100000 + group * 10000 + thread; };
  int last_rank = -1;
  for (const auto& [key, threads] : open) {
    const auto [rank, track, group] = key;
    if (rank != last_rank) {
      metadata("process_name", rank, -1, "name", "rank " + std::to_string(rank));
      metadata("process_sort_index", rank, -1, "sort_index", rank);
      last_rank = rank;
    }
    for (size_t t = 0; t < threads.size(); ++t) {
      std::string name = track_name(track);
      if (group == kTransferGroup) name += " transfers";
      if (t > 0) name += ' ' + std::to_string(t + 1);
      const int id = tid(track, group, static_cast<int>(t));
      metadata("thread_name", rank, id, "name", name);
      metadata("thread_sort_index", rank, id, "sort_index", id);
    }
  }
  for (size_t i : order) {
    const Span& s = spans[i];
    json::Value e = json::Value::object();
    e.set("name", s.name);
    e.set("cat", s.category);
    e.set("ph", "X");
    e.set("ts", s.begin_ms * 1000.0);
    e.set("dur", (s.end_ms - s.begin_ms) * 1000.0);
    e.set("pid", s.rank);
    e.set("tid", tid(s.track, group_of(s), thread_of[i]));
    events.push_back(e);
  }
  json::Value doc = json::Value::object();
  doc.set("traceEvents", events);
  doc.set("displayTimeUnit", "ms");
  return json::dump(doc) + "\n";
}

void write_chrome_trace(const std::vector<Span>& spans, const std::string& path) {
  write_file_atomic(path, chrome_trace_json(spans));
}

}  // namespace treecp
