// What `treecp run` reports per rank, shared by its CPU runner (cmd_run.cpp) and its GPU runner (gpu_run.cpp):
// the record of figures each rank sends to rank 0, and their JSON form.
#pragma once

#include <cstdint>

#include "core/json.hpp"

namespace treecp::cli {

// One fixed-size record of doubles per rank, gathered on rank 0: the fields both runners have, then each
// runner's own memory figures from kRunCommonFields on.
enum RunField { kTokens, kPairs, kPredFwd, kPredBwd, kFwd, kBwd, kSent, kRecv, kRunCommonFields };

// The record's common fields as the report's per-rank JSON object (the caller adds its memory figures).
inline json::Value rank_record_json(const double* f) {
  json::Value rv = json::Value::object();
  rv.set("tokens", static_cast<int64_t>(f[kTokens]));
  rv.set("pairs", static_cast<int64_t>(f[kPairs]));
  rv.set("predicted_forward_ms", f[kPredFwd]);
  rv.set("predicted_backward_ms", f[kPredBwd]);
  rv.set("forward_ms", f[kFwd]);
  rv.set("backward_ms", f[kBwd]);
  rv.set("bytes_sent", static_cast<int64_t>(f[kSent]));
  rv.set("bytes_received", static_cast<int64_t>(f[kRecv]));
  return rv;
}

// The checks' errors and bounds as two {name: value} objects (each check has name, error and bound).
template <class Checks>
void checks_json(const Checks& checks, json::Value& errors, json::Value& bounds) {
  errors = json::Value::object();
  bounds = json::Value::object();
  for (const auto& c : checks) {
    errors.set(c.name, c.error);
    bounds.set(c.name, c.bound);
  }
}

}  // namespace treecp::cli
