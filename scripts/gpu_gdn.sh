#!/usr/bin/env bash
# One call on a GPU machine for the GDN / KDA chunk kernels: build (unless BIN_DIR holds prebuilt binaries), the
# GPU tests of the kernels and of GDN/KDA and conv1d CP through the CUDA backend (1-4 ranks as threads on one GPU),
# compute-sanitizer (memcheck, racecheck, initcheck) on small cases, and the benchmark
# bench_gdn_cuda (T = 40,960, H = 32, dk = dv = 128, GDN and KDA). Logs go to $OUT_DIR (default out/gpu_gdn).
#   BIN_DIR=DIR        treecp_cuda_tests and bench_gdn_cuda built elsewhere (e.g. carried, built for sm_90a)
#   SKIP_TESTS=1 SKIP_SANITIZER=1 SKIP_CLI=1 SKIP_BENCH=1   trim the call
#   BENCH_REPS=N       repetitions of each timing (default 10); BENCH_ARGS="--docs 8" etc. passed on
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
out="${OUT_DIR:-$root/out/gpu_gdn}"
mkdir -p "$out"
export PATH="$PATH:/usr/local/cuda/bin"
status=0
step() { echo; echo "== $*"; }

if [ -n "${BIN_DIR:-}" ]; then
  tests="$BIN_DIR/treecp_cuda_tests"
  bench="$BIN_DIR/bench_gdn_cuda"
  cli="$BIN_DIR/treecp"
else
  build="$root/build-cuda"
  cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null || exit 1
  ninja -C "$build" treecp_cuda_tests bench_gdn_cuda treecp || exit 1
  tests="$build/tests/treecp_cuda_tests"
  bench="$build/bench/bench_gdn_cuda"
  cli="$build/treecp"
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.total --format=csv | tee "$out/gpu.txt"

if [ -z "${SKIP_TESTS:-}" ]; then
  step "GPU tests of the GDN / KDA kernels and of GDN/KDA and conv1d CP on the CUDA backend (errors beside the float CPU reference's and the tolerance)"
  "$tests" --gtest_filter='*GdnCuda*:*ConvCudaCP.*' 2>&1 | tee "$out/gdn_tests.log" \
    | grep -E "^\[ *(OK|FAILED|PASSED|SKIPPED) |Failure|Expected|error|Which is|tolerance" || true
  grep -q "\[  PASSED  \]" "$out/gdn_tests.log" && ! grep -q "\[  FAILED  \]" "$out/gdn_tests.log" || status=1
fi

if [ -z "${SKIP_SANITIZER:-}" ] && command -v compute-sanitizer >/dev/null; then
  step "compute-sanitizer (memcheck, racecheck, initcheck) on the 64-dim ragged cases (tensor-core scans and the bf16 path included) and the algebra"
  filter='Shapes/GdnCuda.ForwardMatchesTheRecurrence/kda_dk64_dv64:Shapes/GdnCuda.TensorCoreScans/gdn_dk64_dv64:Shapes/GdnCuda.Bf16TensorCorePrepAndGradients/kda_dk48_dv80:Shapes/GdnCuda.BackwardMatchesTheRecurrence/gdn_dk64_dv64:Shapes/GdnCuda.SummaryAppliedEqualsTheForward/kda_dk48_dv80:GdnCudaAlgebra.*:GdnCudaCP.SteadyStateAllocatesNothing'
  for tool in memcheck racecheck initcheck; do
    compute-sanitizer --tool "$tool" --error-exitcode 3 "$tests" --gtest_filter="$filter" >"$out/sanitizer_$tool.log" 2>&1
    rc=$?
    tail -n 2 "$out/sanitizer_$tool.log"
    [ $rc -eq 0 ] || { echo "compute-sanitizer $tool: exit $rc"; status=1; }
  done
fi

if [ -z "${SKIP_CLI:-}" ] && [ -x "$cli" ]; then
  step "treecp gdn / conv1d --device cuda against --device cpu (scripts/gpu_layers_cli.sh)"
  bash "$root/scripts/gpu_layers_cli.sh" "$cli" "$out/cli" 2>&1 | tee "$out/cli.log" || status=1
fi

if [ -z "${SKIP_BENCH:-}" ]; then
  step "bench_gdn_cuda"
  # shellcheck disable=SC2086
  "$bench" --reps "${BENCH_REPS:-10}" ${BENCH_ARGS:-} 2>&1 | tee "$out/bench_gdn.log" || status=1
fi
exit $status
