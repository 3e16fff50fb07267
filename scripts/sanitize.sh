#!/usr/bin/env bash
# Builds the CPU library, the CLI and the tests with AddressSanitizer and UndefinedBehaviorSanitizer
# into build-asan/ and runs the CPU tests through CTest (the CLI tests start the instrumented treecp,
# under mpirun where they use ranks). Any memory error, leak of treecp's own or undefined behaviour
# fails its test. Extra arguments go to ctest (e.g. -R Npy).
# usage: scripts/sanitize.sh [ctest arguments]
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
build="$root/build-asan"
bash "$root/scripts/setup.sh"
flags="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer"
cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DTREECP_WITH_CUDA=OFF \
      -DTREECP_BUILD_BENCH=OFF -DCMAKE_CXX_FLAGS="$flags" -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=address,undefined" >/dev/null
cmake --build "$build" -j "$(nproc)"
# OpenMPI keeps allocations until exit by design: its libraries' leaks are not treecp's.
export LSAN_OPTIONS="suppressions=$root/scripts/lsan_suppressions.txt:print_suppressions=0"
export ASAN_OPTIONS="abort_on_error=0:detect_stack_use_after_return=1"
export UBSAN_OPTIONS="print_stacktrace=1"
cd "$build"
ctest --output-on-failure -j "$(nproc)" --timeout 1800 -E "^mpi_test_" "$@"
