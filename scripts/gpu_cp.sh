#!/usr/bin/env bash
# One call on a GPU machine of any GPU count: build (unless BIN_DIR holds prebuilt binaries), the GPU tests,
# compute-sanitizer on a small CP1 case, `treecp run --device cuda` at 1 rank and at every GPU (CPU double
# reference on down-scaled rows, every layout, a window and a sink; one GPU at full size), and the
# weak-scaling benchmark `treecp bench cp` with FlexAttention beside it. Logs go to $OUT_DIR (default out/gpu).
#   BIN_DIR=DIR        treecp and treecp_cuda_tests built elsewhere (e.g. carried, built for sm_90a)
#   SKIP_TESTS=1 SKIP_SANITIZER=1 SKIP_RUN=1 SKIP_BENCH=1 SKIP_FLEX=1 SKIP_GDN=1   trim the call
# With several GPUs it also runs scripts/gpu_gdn_cp.sh (GDN / KDA CP across them: every layout, weak scaling).
#   GPUS=N             use N GPUs (default: all)
# NVLink multicast stays off (NCCL_NVLS_ENABLE=0 and its siblings): this script never enables it.
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
out="${OUT_DIR:-$root/out/gpu}"
mkdir -p "$out"
export PATH="$PATH:/usr/local/cuda/bin"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# NCCL from PyPI's nvidia-nccl (torch's) when the system has none
nccl_lib=$(python3 -c 'import nvidia.nccl; print(list(nvidia.nccl.__path__)[0] + "/lib")' 2>/dev/null || true)
[ -n "$nccl_lib" ] && export LD_LIBRARY_PATH="$nccl_lib:${LD_LIBRARY_PATH:-}"
status=0
step() { echo; echo "== $*"; }

if [ -n "${BIN_DIR:-}" ]; then
  treecp="$BIN_DIR/treecp"
  tests="$BIN_DIR/treecp_cuda_tests"
  kernels="$BIN_DIR/bench_attention"
  export TREECP_CONFIG_DIR="$root/config"  # binaries built in another checkout find this one's cost files
else
  build="$root/build-cuda"
  cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null || exit 1
  ninja -C "$build" treecp_cli treecp_cuda_tests bench_attention || exit 1
  treecp="$build/treecp"
  tests="$build/tests/treecp_cuda_tests"
  kernels="$build/bench/bench_attention"
fi
gpus="${GPUS:-$(nvidia-smi -L | wc -l)}"
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.sm,clocks.max.sm,memory.total --format=csv | tee "$out/gpu.txt"
mpi=(mpirun --allow-run-as-root --oversubscribe -x LD_LIBRARY_PATH -x NCCL_NVLS_ENABLE -x PATH)

if [ -z "${SKIP_TESTS:-}" ]; then
  step "GPU tests"
  "$tests" 2>&1 | tee "$out/gpu_tests.log" | grep -E "^\[ *(OK|FAILED|PASSED|SKIPPED) |Failure|Expected|error|Which is" || true
  grep -q "\[  PASSED  \]" "$out/gpu_tests.log" && ! grep -q "\[  FAILED  \]" "$out/gpu_tests.log" || status=1
fi

if [ -z "${SKIP_SANITIZER:-}" ] && command -v compute-sanitizer >/dev/null; then
  step "compute-sanitizer (memcheck, racecheck) on a small CP1 case"
  for tool in memcheck racecheck; do
    # NCCL probes kernels of other architectures at init (cudaErrorNoKernelImageForDevice): API errors, not ours
    compute-sanitizer --tool "$tool" --report-api-errors no --error-exitcode 3 "$treecp" run --device cuda --ranks 1 --preset fixed5k \
      --scale 64 --hq 8 --hkv 2 --sink --window 300 --reps 1 >"$out/sanitizer_$tool.log" 2>&1
    rc=$?
    tail -n 2 "$out/sanitizer_$tool.log"
    [ $rc -eq 0 ] || { echo "compute-sanitizer $tool: exit $rc"; status=1; }
  done
fi

if [ -z "${SKIP_RUN:-}" ]; then
  for n in 1 $([ "$gpus" -gt 1 ] && echo "$gpus"); do
    launch=()
    [ "$n" -gt 1 ] && launch=("${mpi[@]}" -np "$n")
    for layout in searched contiguous zigzag perdoc family; do
      step "treecp run --device cuda, $n GPU(s), $layout, window and sink, vs the CPU double reference"
      "${launch[@]}" "$treecp" run --device cuda --ranks "$n" --preset longchain --scale 128 --layout "$layout" \
        --window 700 --sink 2>&1 | tee -a "$out/run.log" | tail -n 4
      [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
    done
    step "treecp run --device cuda, $n GPU(s), backward KV fetched again, vs the CPU double reference"
    "${launch[@]}" "$treecp" run --device cuda --ranks "$n" --preset varied5k --scale 32 --backward-kv refetch \
      --sink 2>&1 | tee -a "$out/run.log" | tail -n 4
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
    # the kernels' other (D, Dv) pairs (MLA's dense form, 256) through the whole GPU pipeline
    for dims in "192 128" "256 256"; do
      read -r d dv <<<"$dims"
      step "treecp run --device cuda, $n GPU(s), (D, Dv) = ($d, $dv), window and sink, vs the CPU double reference"
      "${launch[@]}" "$treecp" run --device cuda --ranks "$n" --preset varied5k --scale 32 --d "$d" --dv "$dv" \
        --window 700 --sink 2>&1 | tee -a "$out/run.log" | tail -n 4
      [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
    done
    step "treecp run --device cuda, $n GPU(s), full size, vs one GPU"
    "${launch[@]}" "$treecp" run --device cuda --ranks "$n" --preset fixed5k --full 2>&1 | tee -a "$out/run.log" | tail -n 8
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  done
fi

if [ -z "${SKIP_BENCH:-}" ] && [ -x "$kernels" ]; then
  step "the local kernels alone on one GPU (bench_attention: what CP1 adds to them shows beside treecp bench cp)"
  "$kernels" --out "$out/kernel_rows" --reps 20 --experiments 0 --presets fixed5k,art-fixed5k 2>&1 \
    | tee "$out/bench_kernels.log" | grep -E "^\| |^preset|treecp" | head -20
fi

if [ -z "${SKIP_BENCH:-}" ] && "$treecp" help 2>/dev/null | grep -q "bench cp"; then
  step "treecp bench cp, CP 1..$gpus"
  cps=1
  for c in 2 4 8; do [ "$c" -le "$gpus" ] && cps="$cps,$c"; done
  launch=()
  [ "$gpus" -gt 1 ] && launch=("${mpi[@]}" -np "$gpus")
  "${launch[@]}" "$treecp" bench cp --device cuda --ranks "$gpus" --cp "$cps" --rows "$out/rows" \
    --json "$out/bench_cp.json" --svg "$out/bench_cp.svg" 2>&1 | tee "$out/bench_cp.log" || status=1
  if [ -z "${SKIP_FLEX:-}" ] && [ -d "$out/rows" ]; then
    step "FlexAttention on one GPU, the same CP1 rows"
    PYTHONUNBUFFERED=1 python3 "$root/scripts/bench_flex.py" --rows "$out/rows" --no-sdpa \
      --presets fixed5k,varied5k,dominant,longchain,art-fixed5k,art-varied5k 2>&1 | tee "$out/bench_flex.log" || status=1
  fi
fi
if [ -z "${SKIP_GDN:-}" ] && [ "$gpus" -gt 1 ]; then
  step "GDN / KDA CP across $gpus GPUs (scripts/gpu_gdn_cp.sh)"
  GPUS="$gpus" bash "$root/scripts/gpu_gdn_cp.sh" "$treecp" "$out/gdn_cp" 2>&1 | tee "$out/gdn_cp.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
exit $status
