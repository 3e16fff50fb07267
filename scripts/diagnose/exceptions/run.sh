#!/usr/bin/env bash
# Does a C++ exception thrown into Python survive on this machine, apart from treecp? Builds minimal
# nanobind modules (plain; NB_STATIC + STABLE_ABI as bindings/ builds _core; and nbt_tr, which throws a
# custom type from a static library through a registered translator, as _core does) and calls them: each
# line should read "ok: bad x..." (ValueError). Written for the GPU machine, where treecp extensions built
# there crashed on their first exception (docs/benchmarks-gpu.md, runs 119-122). Needs python3 with
# nanobind, cmake and a C++ compiler; extra cmake arguments pass through (-DCMAKE_CXX_COMPILER=...).
set -u
here=$(cd "$(dirname "$0")" && pwd)
d=$(mktemp -d); cmake -S "$here" -B $d -DPython_EXECUTABLE=$(which python3) -DCMAKE_BUILD_TYPE=Release "$@" >/dev/null && cmake --build $d -j8 >/dev/null || { echo "build failed"; exit 1; }
for m in nbt_plain nbt_sabi nbt_tr; do
  PYTHONPATH=$d python3 -c "import $m
try:
    $m.thrower(1)
except ValueError as e: print('$m ok:', e)"; echo "$m rc $?"
done
PYTHONPATH=$d python3 -c "import nbt_tr
try:
    nbt_tr.vec_thrower([1, 2])
except ValueError as e: print('nbt_tr vector ok:', e)"; echo "nbt_tr vector rc $?"
