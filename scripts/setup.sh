#!/usr/bin/env bash
# Installs what treecp needs to build and test on a Debian/Ubuntu machine; idempotent (installs only
# what is missing). The CUDA toolkit is optional: CUDA sources are compiled when nvcc is found.
# With --python (scripts/test.sh), also the Python package's test environment: a virtual environment
# with torch, numpy, pytest, nanobind and scikit-build-core from PyPI (scripts/python_env.sh says
# where), created and filled once. librsvg2-bin (rsvg-convert) is for the tests only: they render the
# SVG pictures to PNG.
set -euo pipefail
need=()
for pkg in cmake ninja-build g++ libgtest-dev libbenchmark-dev libopenmpi-dev openmpi-bin python3 python3-dev python3-venv \
           librsvg2-bin; do
  dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg")
done
if ((${#need[@]})); then
  echo "setup: installing ${need[*]}"
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need[@]}" >/dev/null
fi

[ "${1:-}" = "--python" ] || exit 0
root="$(cd "$(dirname "$0")/.." && pwd)"
# shellcheck source=python_env.sh
source "$root/scripts/python_env.sh"
if [ ! -x "$TREECP_VENV/bin/python" ]; then
  echo "setup: creating the Python environment $TREECP_VENV"
  python3 -m venv "$TREECP_VENV"
fi
if ! "$TREECP_VENV/bin/python" -c "import torch, numpy, pytest, nanobind, scikit_build_core" >/dev/null 2>&1; then
  echo "setup: installing ${TREECP_PY_PACKAGES[*]} into $TREECP_VENV (torch is large: a few minutes, once)"
  "$TREECP_VENV/bin/python" -m pip install -q "${TREECP_PY_PACKAGES[@]}"
fi
