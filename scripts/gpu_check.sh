#!/usr/bin/env bash
# One command on a GPU machine: build the CUDA targets if needed, run the GPU test suite, a
# compute-sanitizer pass on a small case, then the benchmark with the FlexAttention peer in the
# same run. Logs and tables go to $OUT_DIR (default out/gpu), the row JSONs and treecp's raw results
# to $ROWS_DIR (default $OUT_DIR/rows).
#   scripts/gpu_check.sh                 build into build-cuda/ and run everything
#   BIN_DIR=.gpu_bin scripts/gpu_check.sh  use prebuilt treecp_cuda_tests and bench_attention
#   SKIP_FLEX=1 / SKIP_SANITIZER=1 / SKIP_SDPA=1 / BENCH_REPS=N   trim the run (SKIP_SDPA: no torch SDPA
#   peers on gathered paths)
#   EXPERIMENTS=0  the benchmark skips the timings of earlier, decided experiments (about half its GPU time)
#   PROFILE=1   also Nsight Compute sections of the first forward and backward launch on fixed5k (the defaults)
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
out="${OUT_DIR:-$root/out/gpu}"
rows="${ROWS_DIR:-$out/rows}"
mkdir -p "$out" "$rows"
export PATH="$PATH:/usr/local/cuda/bin"
status=0

if [ -n "${BIN_DIR:-}" ]; then
  tests="$BIN_DIR/treecp_cuda_tests"
  bench="$BIN_DIR/bench_attention"
else
  build="$root/build-cuda"
  cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DTREECP_WITH_MPI=OFF >/dev/null || exit 1
  ninja -C "$build" treecp_cuda_tests bench_attention || exit 1
  tests="$build/tests/treecp_cuda_tests"
  bench="$build/bench/bench_attention"
fi

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.total --format=csv | tee "$out/gpu.txt"

echo "== GPU tests"
"$tests" 2>&1 | tee "$out/gpu_tests.log" | grep -E "^\[ *(OK|FAILED|PASSED|SKIPPED) |Failure|Expected|error|Which is" || true
grep -q "\[  PASSED  \]" "$out/gpu_tests.log" && ! grep -q "\[  FAILED  \]" "$out/gpu_tests.log" || status=1

if [ -z "${SKIP_SANITIZER:-}" ] && command -v compute-sanitizer >/dev/null; then
  echo "== compute-sanitizer (memcheck, racecheck) on a small case"
  for tool in memcheck racecheck; do
    compute-sanitizer --tool "$tool" --error-exitcode 3 "$tests" --gtest_filter='*ForwardBackwardRandomTree/hq4_hkv4_d64_w0:*ForwardBackwardRandomTree/hq6_hkv2_d128_w100:*ForwardBackwardRandomTree/hq8_hkv2_d128_w0:*ForwardBackwardRandomTree/hq3_hkv3_d128_w5' \
      >"$out/sanitizer_$tool.log" 2>&1
    rc=$?
    tail -n 3 "$out/sanitizer_$tool.log"
    [ $rc -eq 0 ] || { echo "compute-sanitizer $tool: exit $rc"; status=1; }
  done
fi

echo "== benchmark"
"$bench" --out "$rows" --reps "${BENCH_REPS:-20}" --experiments "${EXPERIMENTS:-1}" 2>&1 | tee "$out/bench_treecp.log" || status=1
if [ -z "${SKIP_FLEX:-}" ]; then
  PYTHONUNBUFFERED=1 python3 "$root/scripts/bench_flex.py" --rows "$rows" --treecp "$rows/treecp_results.json" \
    --reps "${BENCH_REPS:-20}" ${SKIP_SDPA:+--no-sdpa} 2>&1 | tee "$out/bench_flex.log" || status=1
fi
if [ -n "${PROFILE:-}" ] && command -v ncu >/dev/null; then
  echo "== ncu (fixed5k, one launch each; clocks left alone)"
  for k in fwd bwd; do
    timeout 180 ncu --clock-control none -k "regex:attention_${k}_(wgmma_|ws_)?kernel" -c 1 --section SpeedOfLight \
      --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
      --section WarpStateStats "$bench" --presets fixed5k --reps 1 --out "$rows" >"$out/ncu_$k.txt" 2>&1 || true
    grep -E "Duration|Compute \(SM\) Throughput|Memory Throughput|L2 Cache Throughput|Achieved Occupancy|Registers Per|Stall|Issue Slots Busy" "$out/ncu_$k.txt" | head -20
  done
fi
exit $status
