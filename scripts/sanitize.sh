#!/usr/bin/env bash
# Builds the CPU library, the CLI and the tests with AddressSanitizer and UndefinedBehaviorSanitizer
# into build-asan/ and runs the CPU tests through CTest (the CLI tests start the instrumented treecp,
# under mpirun where they use ranks), then the multi-rank MPI tests. Any memory error, undefined
# behaviour or (outside MPI) leak fails its test. Extra arguments go to both ctest runs.
# usage: scripts/sanitize.sh [ctest arguments]
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
build="$root/build-asan"
bash "$root/scripts/setup.sh"
flags="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer"
cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DTREECP_WITH_CUDA=OFF \
      -DTREECP_BUILD_BENCH=OFF -DCMAKE_CXX_FLAGS="$flags" -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=address,undefined" >/dev/null
cmake --build "$build" -j "$(nproc)"
export UBSAN_OPTIONS="print_stacktrace=1"
cd "$build"
# OpenMPI keeps allocations until exit by design (some in plugins it unloads, whose frames no
# suppression can name): the CPU tests run with leak detection and OpenMPI's named libraries
# suppressed, the multi-rank tests without leak detection (memory errors and UB still fail them).
status=0
LSAN_OPTIONS="suppressions=$root/scripts/lsan_suppressions.txt:print_suppressions=0" \
  ASAN_OPTIONS="detect_stack_use_after_return=1" \
  ctest --output-on-failure -j "$(nproc)" --timeout 1800 -E "^mpi_test_" "$@" || status=1
ASAN_OPTIONS="detect_leaks=0:detect_stack_use_after_return=1" \
  ctest --output-on-failure -j "$(nproc)" --timeout 1800 -R "^mpi_test_" "$@" || status=1
exit "$status"
