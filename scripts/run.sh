#!/usr/bin/env bash
# Builds treecp and runs the main job on its default workload. Extra arguments go to `treecp run`.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
bash "$root/scripts/build.sh"
"$root/build/treecp" run "$@"
