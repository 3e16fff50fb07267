#include "viz/schedule.hpp"

namespace treecp::viz {

std::string span_name(const ScheduleSpan& s) {
  const bool fwd = s.pass == Pass::Forward;
  const std::string wave = "wave " + std::to_string(s.wave + 1);
  switch (s.kind) {
    case SpanKind::TokenLocal: return fwd ? "token-local fwd" : "token-local bwd";
    case SpanKind::LocalStage: return fwd ? "fwd local" : "bwd local";
    case SpanKind::RemoteStage: return (fwd ? "fwd " : "bwd ") + wave;
    case SpanKind::Wait: return fwd ? "wait KV " + wave : "wait dKV";
    case SpanKind::Fetch: return "KV " + wave;
    case SpanKind::Return: return "dKV " + wave;
  }
  return "?";
}

const char* span_category(SpanKind kind) {
  switch (kind) {
    case SpanKind::TokenLocal: return "token-local";
    case SpanKind::LocalStage:
    case SpanKind::RemoteStage: return "stage";
    case SpanKind::Wait: return "wait";
    case SpanKind::Fetch:
    case SpanKind::Return: return "transfer";
  }
  return "?";
}

std::vector<Span> predicted_spans(const Timeline& timeline) {
  const Prediction& p = timeline.prediction;
  std::vector<Span> out;
  out.reserve(timeline.spans.size() + 2 * p.forward_ms.size());
  for (size_t r = 0; r < p.forward_ms.size(); ++r) {
    const int rank = static_cast<int>(r);
    out.push_back({"forward", "pass", rank, kPredictedTrack, 0.0, p.forward_ms[r]});
    out.push_back({"backward", "pass", rank, kPredictedTrack, p.forward_ms[r], p.forward_ms[r] + p.backward_ms[r]});
  }
  for (const ScheduleSpan& s : timeline.spans) {
    out.push_back({span_name(s), span_category(s.kind), s.rank, kPredictedTrack, s.begin_ms, s.end_ms});
  }
  return out;
}

}  // namespace treecp::viz
