#!/usr/bin/env bash
# Builds treecp and runs every test: the C++ suite through CTest (CPU unit tests, the multi-rank MPI
# tests), then the Python package's tests (pip install of this checkout, then pytest; CPU only).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
bash "$root/scripts/build.sh"
cd "$root/build"
ctest --output-on-failure -j "$(nproc)" --timeout 900

bash "$root/scripts/setup.sh" --python
# shellcheck source=python_env.sh
source "$root/scripts/python_env.sh"
echo "== Python package: pip install . (build/python), then pytest python/tests"
# CUDA off: the CPU-only Python tests do not need the kernels, and compiling them a second time (the C++
# build above already did) would cost CI many minutes on 2 cores.
"$TREECP_VENV/bin/python" -m pip install -q --no-build-isolation -C cmake.define.TREECP_WITH_CUDA=OFF "$root"
cd "$root/python/tests"
"$TREECP_VENV/bin/python" -m pytest -q -p no:cacheprovider
