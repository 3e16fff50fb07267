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
"$TREECP_VENV/bin/python" -m pip install -q --no-build-isolation "$root"
cd "$root/python/tests"
"$TREECP_VENV/bin/python" -m pytest -q -p no:cacheprovider
