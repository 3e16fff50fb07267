#!/usr/bin/env bash
# Builds treecp's extension (CUDA off) on this machine in a few ways and calls the first C++ exception
# into Python (Row.from_segments with a zero length), to find which part of the toolchain makes it crash
# (docs/benchmarks-gpu.md, runs 119-122). A crash prints the native backtrace (segv_trace.c, no gdb
# needed) resolved with addr2line. Usage, from the repository root:
#   scripts/diagnose/exceptions/treecp_builds.sh [variant ...]   (all when none)
# variants: default (the environment's CXX), gxx12 (/usr/bin/g++-12), nb261 (nanobind 2.6.1: its wheel in
# .gpu/wheels), exclude (default linked with -Wl,--exclude-libs,ALL), symbolic (default with -Wl,-Bsymbolic).
set -u
root=$(pwd); here=$root/scripts/diagnose/exceptions
variants=("$@"); [ ${#variants[@]} -eq 0 ] && variants=(default gxx12 nb261 exclude symbolic)
gcc -shared -fPIC -O1 -o /tmp/segv_trace.so "$here/segv_trace.c" || exit 1
probe='import treecp
try:
    treecp.Row.from_segments([-1, 0], [3, 0])
except ValueError as e:
    print("ValueError:", e)'
for v in "${variants[@]}"; do
  args=(-C cmake.define.TREECP_WITH_CUDA=OFF -C cmake.build-type=RelWithDebInfo -C build-dir=/tmp/b-$v)
  envs=()
  case $v in
    default) ;;
    gxx12) envs=(CXX=/usr/bin/g++-12 CC=/usr/bin/gcc-12) ;;
    nb261) rm -rf /tmp/nb261 && python3 -m pip install -q --no-deps --target /tmp/nb261 .gpu/wheels/nanobind-2.6.1-*.whl || continue
           args+=(-C cmake.define.nanobind_ROOT=/tmp/nb261/nanobind/cmake) ;;
    exclude) args+=(-C "cmake.define.CMAKE_MODULE_LINKER_FLAGS=-Wl,--exclude-libs,ALL") ;;
    symbolic) args+=(-C "cmake.define.CMAKE_MODULE_LINKER_FLAGS=-Wl,-Bsymbolic") ;;
    *) echo "unknown variant $v"; continue ;;
  esac
  echo "== $v: ${envs[*]:-} ${args[*]}"
  rm -rf /tmp/site-$v
  t0=$(date +%s)
  if ! env "${envs[@]}" python3 -m pip install -q --no-build-isolation --no-deps --target /tmp/site-$v "${args[@]}" . >/tmp/build-$v.log 2>&1; then
    echo "build failed"; tail -20 /tmp/build-$v.log; continue
  fi
  so=$(ls /tmp/site-$v/treecp/_core*.so); echo "built in $(( $(date +%s) - t0 )) s: $so"
  grep -m2 "CMAKE_CXX_COMPILER:\|nanobind_DIR:" /tmp/b-$v/CMakeCache.txt
  cxx=$(sed -n 's/^CMAKE_CXX_COMPILER:[A-Z]*=//p' /tmp/b-$v/CMakeCache.txt)
  echo "libstdc++: so $($cxx -print-file-name=libstdc++.so) a $($cxx -print-file-name=libstdc++.a)"
  echo "NEEDED: $(readelf -d "$so" | sed -n 's/.*Shared library: \[\(.*\)\]/\1/p' | tr '\n' ' ')"
  echo "libstdc++ symbols defined in the module (exported / all): $(nm -D --defined-only "$so" | grep -c ' _ZNS[oit]\| _ZNSt') / $(nm --defined-only "$so" 2>/dev/null | grep -c ' _ZNS[oit]\| _ZNSt')"
  PYTHONPATH=/tmp/site-$v LD_PRELOAD=/tmp/segv_trace.so python3 -c "$probe" >/tmp/out-$v.txt 2>&1; rc=$?
  echo "rc $rc"; head -c 4000 /tmp/out-$v.txt
  if [ $rc -ne 0 ]; then
    grep -o '_core[^(]*(+0x[0-9a-f]*)' /tmp/out-$v.txt | sed 's/.*(+\(0x[0-9a-f]*\))/\1/' | head -20 |
      xargs -r addr2line -f -C -i -e "$so" | head -80
  fi
done
