// plan/: pure data between the row and the runtime: ownership, the dense, GDN/KDA, Mamba-2 and sparse MLA
// planners, their cost models, and the Plans they produce (no tensor values).
//
// Plans of the CP methods treecp is compared with, built as ordinary Plans so the same runtime executes
// and times them. ring_plan: ring attention as people run it on packed rows — a zigzag layout (2 cp
// chunks folded), and in wave w every rank receives ALL the KV of the rank w + 1 places before it, needed
// or not, computing only the visible pairs; cp - 1 waves.
#pragma once

#include <cstdint>

#include "plan/cost.hpp"
#include "plan/plan.hpp"

namespace treecp {

class Row;

// For a layer of `shape` (its window decides the pairs, its head dims the bytes).
Plan ring_plan(const Row& row, int cp, const AttentionShape& shape, const CostModel& costs);

}  // namespace treecp
