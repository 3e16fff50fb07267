#!/usr/bin/env bash
# Does a C++ exception thrown into Python survive on this machine, apart from treecp? Builds a minimal
# nanobind module (plain, and NB_STATIC + STABLE_ABI as bindings/ builds _core) whose function throws
# std::invalid_argument, and calls it: each line should read "ok: bad x" (nanobind turns it into ValueError).
# Written for the GPU machine, where every treecp extension built there crashed on its first exception
# (docs/benchmarks-gpu.md, runs 119-120). Needs python3 with nanobind, cmake and a C++ compiler.
set -u
d=$(mktemp -d); cmake -S "$(dirname "$0")" -B $d -DPython_EXECUTABLE=$(which python3) -DCMAKE_BUILD_TYPE=Release >/dev/null && cmake --build $d -j8 >/dev/null || { echo "build failed"; exit 1; }
for m in nbt_plain nbt_sabi; do
  PYTHONPATH=$d python3 -c "import $m
try:
    $m.thrower(1)
except ValueError as e: print('$m ok:', e)"; echo "$m rc $?"
done
