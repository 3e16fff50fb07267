#!/usr/bin/env bash
# The test of the cost model (DESIGN.md): predicted against measured time on alternative plans.
# Runs `treecp run` for every layout on a few workloads and prints one table: the planner's predicted
# makespan (slowest rank, forward + backward) beside the measured one (slowest rank's forward +
# backward wall time). Usage: scripts/model_check.sh [ranks] (default 2; one rank per core is what
# config/costs_cpu.json describes).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
ranks="${1:-2}"
bin="$root/build/treecp"
printf "%-28s %-11s %6s %12s %12s %7s\n" workload layout waves predicted_ms measured_ms ratio
for work in "longchain --scale 64" "varied5k --scale 16" "deep --scale 16" "art-dominant --scale 16"; do
  for layout in contiguous zigzag perdoc family searched; do
    # shellcheck disable=SC2086
    "$bin" run --ranks "$ranks" --preset $work --layout "$layout" --json | python3 -c '
import json, sys
d = json.load(sys.stdin)
measured = max(r["forward_ms"] + r["backward_ms"] for r in d["per_rank"])
work, layout = sys.argv[1], sys.argv[2]
print("%-28s %-11s %6d %12.2f %12.2f %7.2f" % (work, layout, d["waves"], d["predicted_makespan_ms"], measured,
                                               measured / d["predicted_makespan_ms"]))
' "$work" "$layout"
  done
done
