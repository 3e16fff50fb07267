#!/usr/bin/env bash
# Builds treecp and runs every test (CPU unit tests and the multi-rank MPI tests) through CTest.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
bash "$root/scripts/build.sh"
cd "$root/build"
ctest --output-on-failure -j "$(nproc)" --timeout 900
