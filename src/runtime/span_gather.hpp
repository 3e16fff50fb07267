// runtime/: executes plans on one rank, one class per layer kind, generic over a Backend and a
// Communicator; moves activations between ownerships; the one-process references.
//
// Every rank's spans on one rank, for one trace of the whole run (`treecp run --trace`). Two
// collectives that every rank calls: an all-gather of the sizes and an all-to-all of the spans.
#pragma once

#include <vector>

#include "comm/communicator.hpp"
#include "core/trace.hpp"

namespace treecp {

// Returns, on `root`, the spans of every rank in rank order, each span's rank set to the rank that
// sent it; on the other ranks an empty list.
std::vector<Span> gather_spans(Communicator& comm, const std::vector<Span>& mine, int root);

}  // namespace treecp
