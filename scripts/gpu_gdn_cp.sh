#!/usr/bin/env bash
# GDN / KDA context parallelism across GPUs, one call on a machine of N GPUs (issue 29: CP over NCCL):
#  1. correctness: `treecp gdn --device cuda` on 1 and N GPUs (one process per GPU under mpirun, NCCL between them),
#     every layout (searched, contiguous, zigzag, doc-zigzag), GDN and KDA gates, on a packed-document row and a tree
#     row, against `treecp gdn --device cpu` in double on the same inputs (the GPU rounds its inputs to bf16: the
#     bound is a bf16-level relative difference) and against the one-GPU run;
#  2. weak scaling: 40,960 tokens per GPU of packed documents, H 32, Dk = Dv 128, GDN gates, CP1 and CP N, forward and
#     backward, the median of --reps calls after a warm-up; prints a markdown table.
#   scripts/gpu_gdn_cp.sh TREECP_BINARY [WORK_DIR]
#   GPUS=N (default: all), TOKENS_PER_RANK (default 40960), REPS (default 5), SKIP_CHECK=1, SKIP_SCALING=1,
#   DEVICE=cpu (try the script's logic on CPU ranks: no mpirun, no --reps; the "GPU" runs are CPU runs),
#   GDN_ARGS="--precision bf16_tensor_scans --fla-split" (added to every GPU call: the split kernels for the GDN gates,
#   KDA's calls falling back to the classic kernels of that precision)
# NVLink multicast stays off (NCCL_NVLS_ENABLE=0 and its siblings): this script never enables it.
set -uo pipefail
bin=${1:?usage: gpu_gdn_cp.sh TREECP_BINARY [WORK_DIR]}
work=${2:-$(mktemp -d)}
mkdir -p "$work"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nccl_lib=$(python3 -c 'import nvidia.nccl; print(list(nvidia.nccl.__path__)[0] + "/lib")' 2>/dev/null || true)
[ -n "$nccl_lib" ] && export LD_LIBRARY_PATH="$nccl_lib:${LD_LIBRARY_PATH:-}"
device=${DEVICE:-cuda}
if [ "$device" = cuda ]; then gpus=${GPUS:-$(nvidia-smi -L | wc -l)}; else gpus=${GPUS:-2}; fi
status=0

# treecp gdn on n ranks of $device: launch(n, args...)
read -r -a gdn_args <<<"${GDN_ARGS:-}"
launch() {
  local n=$1; shift
  if [ "$device" = cuda ] && [ "$n" -gt 1 ]; then
    mpirun --allow-run-as-root --oversubscribe -x LD_LIBRARY_PATH -x NCCL_NVLS_ENABLE -x PATH -np "$n" \
      "$bin" gdn --device cuda --ranks "$n" "${gdn_args[@]}" "$@"
  elif [ "$device" = cuda ]; then
    "$bin" gdn --device cuda --ranks 1 "${gdn_args[@]}" "$@"
  else
    "$bin" gdn --ranks "$n" "$@"
  fi
}

# inputs DIR TREE_JSON H D (float64, so the CPU reference computes in double)
inputs() {
  python3 - "$@" <<'PY'
import json, sys, numpy as np
d, tree, H, D = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
open(f"{d}/tree.json", "w").write(json.dumps(tree))
S = sum(s["length"] for s in tree["segments"]); rng = np.random.default_rng(7)
def l2(x): return x / np.linalg.norm(x, axis=-1, keepdims=True)
for name, x in (("q", l2(rng.standard_normal((S, H, D)))), ("k", l2(rng.standard_normal((S, H, D)))),
                ("v", rng.standard_normal((S, H, D))), ("g", -0.1 * rng.random((S, H))),
                ("gk", -0.1 * rng.random((S, H, D))), ("beta", rng.random((S, H))),
                ("do", rng.standard_normal((S, H, D)))):
    np.save(f"{d}/{name}.npy", x.astype(np.float64 if S * H * D < 50_000_000 else np.float32))
PY
}
files() { echo --tree "$1/tree.json" --q "$1/q.npy" --k "$1/k.npy" --v "$1/v.npy" --beta "$1/beta.npy" --dout "$1/do.npy"; }

if [ -z "${SKIP_CHECK:-}" ]; then
  echo "== GDN / KDA CP on 1 and $gpus $device rank(s), every layout, against the CPU in double"
  docs='{"segments":[{"parent":-1,"length":700},{"parent":-1,"length":3},{"parent":-1,"length":250},{"parent":-1,"length":130},{"parent":-1,"length":517}]}'
  tree='{"segments":[{"parent":-1,"length":400},{"parent":0,"length":300},{"parent":1,"length":120},{"parent":0,"length":250},{"parent":-1,"length":90},{"parent":4,"length":260}]}'
  for row in docs tree; do
    d="$work/check_$row"; mkdir -p "$d"; inputs "$d" "${!row}" 4 64
    for gate in g gk; do
      "$bin" gdn $(files "$d") --g "$d/$gate.npy" --out "$d/cpu_$gate" >/dev/null || status=1
      for n in 1 "$gpus"; do
        for layout in searched contiguous zigzag doc-zigzag; do
          launch "$n" $(files "$d") --g "$d/$gate.npy" --layout "$layout" --out "$d/${device}_${gate}_${n}_$layout" \
            | sed "s/^/  /" || status=1
        done
      done
    done
  done
  python3 - "$work" "$gpus" "$device" <<'PY' || status=1
import os, sys, numpy as np
w, n, dev = sys.argv[1], sys.argv[2], sys.argv[3]; bad = 0
print(f"| row | gate | {dev} ranks | layout | largest rel. diff vs CPU double | vs 1 rank |\n|---|---|---|---|---|---|")
for row in ("docs", "tree"):
    for gate in ("g", "gk"):
        ref = f"{w}/check_{row}/cpu_{gate}"
        for ranks in sorted({"1", n}):
            for layout in ("searched", "contiguous", "zigzag", "doc-zigzag"):
                got, one = f"{w}/check_{row}/{dev}_{gate}_{ranks}_{layout}", f"{w}/check_{row}/{dev}_{gate}_1_{layout}"
                worst = worst1 = 0.0
                for name in sorted(os.listdir(ref)):
                    a = np.load(f"{ref}/{name}").astype(np.float64); b = np.load(f"{got}/{name}").astype(np.float64)
                    c = np.load(f"{one}/{name}").astype(np.float64); scale = max(np.abs(a).max(), 1e-30)
                    worst = max(worst, np.abs(a - b).max() / scale); worst1 = max(worst1, np.abs(c - b).max() / scale)
                print(f"| {row} | {'GDN' if gate == 'g' else 'KDA'} | {ranks} | {layout} | {worst:.2e} | {worst1:.2e} |")
                bad += worst > 3e-2 or worst1 > 3e-2  # bf16 inputs and outputs: ~4e-3 measured on one GPU (run 129)
sys.exit(1 if bad else 0)
PY
fi

if [ -z "${SKIP_SCALING:-}" ]; then
  per=${TOKENS_PER_RANK:-40960}
  echo; echo "== weak scaling: $per tokens per rank of packed documents, H 32, Dk = Dv 128, GDN gates"
  rows=""
  for n in 1 "$gpus"; do
    d="$work/scale_$n"; mkdir -p "$d"
    # documents of 5,120, 2,048 and 13,312 tokens cycling to n x per tokens (some cross rank boundaries)
    tree=$(python3 -c "
import json; n, per = $n, $per; segs, left, i = [], n * per, 0
while left > 0:
    l = min([5120, 2048, 13312][i % 3], left); segs.append({'parent': -1, 'length': l}); left -= l; i += 1
print(json.dumps({'segments': segs}))")
    inputs "$d" "$tree" 32 128
    reps=(); [ "$device" = cuda ] && reps=(--reps "${REPS:-5}")
    line=$(launch "$n" $(files "$d") --g "$d/g.npy" "${reps[@]}" --out "$d/out" | tail -n 1) || status=1
    echo "  $line"
    fwd=$(sed -n 's/.*forward \([0-9.]*\) ms.*/\1/p' <<<"$line"); bwd=$(sed -n 's/.*backward \([0-9.]*\) ms.*/\1/p' <<<"$line")
    rows="$rows$n $fwd $bwd
"
  done
  python3 - <<PY
rows = [r.split() for r in """$rows""".strip().splitlines()]
base = rows[0]
print("| ranks | tokens | forward ms | backward ms | forward / CP1 | fwd+bwd / CP1 |\n|---|---|---|---|---|---|")
for n, f, b in rows:
    f, b, f1, b1 = float(f), float(b), float(base[1]), float(base[2])
    print(f"| {n} | {int(n) * $per:,} | {f:.3f} | {b:.3f} | {f / f1:.3f} | {(f + b) / (f1 + b1):.3f} |")
PY
fi
exit $status
