#!/usr/bin/env bash
# Installs what treecp needs to build and test on a Debian/Ubuntu machine; idempotent (installs only
# what is missing). The CUDA toolkit is optional: CUDA sources are compiled when nvcc is found.
# librsvg2-bin (rsvg-convert) is for the tests only: they render the SVG pictures to PNG.
set -euo pipefail
need=()
for pkg in cmake ninja-build g++ libgtest-dev libbenchmark-dev libopenmpi-dev openmpi-bin python3 librsvg2-bin; do
  dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg")
done
if ((${#need[@]})); then
  echo "setup: installing ${need[*]}"
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need[@]}" >/dev/null
fi
