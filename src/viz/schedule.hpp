// viz/: pictures and traces of plans and runs (SVG, Chrome trace), from plans and measured spans.
//
// The simulated schedule as words and as predicted spans: one naming for the plan picture and the
// Chrome trace, so that a span reads the same in both.
#pragma once

#include <string>
#include <vector>

#include "core/trace.hpp"
#include "plan/cost.hpp"

namespace treecp::viz {

// "fwd local", "bwd wave 2", "KV wave 1", "dKV wave 3", "wait KV wave 2", "wait dKV", "token-local fwd".
std::string span_name(const ScheduleSpan& s);
// "stage", "transfer", "wait", "token-local".
const char* span_category(SpanKind kind);

// The timeline as predicted spans (track 1): per rank a "forward" and a "backward" span enclosing
// that pass's stages, waits and transfers, then the spans themselves.
std::vector<Span> predicted_spans(const Timeline& timeline);

}  // namespace treecp::viz
