#!/usr/bin/env bash
# On a GPU machine: `treecp gdn` (GDN and KDA gates, with gradients) and `treecp conv1d` with --device cuda
# against --device cpu on the same small tree row, inputs made by numpy; prints the largest differences of every
# output and fails when one is beyond bf16 expectations (the CUDA path rounds its inputs to bf16), and the same with
# --dtype fp16 at 2^-3 of the bf16 bound (fp16's unit roundoff is 8 times smaller), and GDN with
# --precision bf16_tensor (bf16 tensor-core products) at the bf16 bound; then the FLA-like split (--precision
# bf16_tensor_scans --fla-split, GDN's gate at D 64; KDA's runs the classic kernels) at the bf16 bound, and with
# --keep-forward, whose outputs must be the split's bit for bit.
#   scripts/gpu_layers_cli.sh TREECP_BINARY [WORK_DIR]
set -euo pipefail
bin=${1:?usage: gpu_layers_cli.sh TREECP_BINARY [WORK_DIR]}
work=${2:-$(mktemp -d)}
mkdir -p "$work"
echo '{"segments":[{"parent":-1,"length":300},{"parent":0,"length":200},{"parent":1,"length":100},{"parent":0,"length":150}]}' > "$work/tree.json"
python3 - "$work" <<'PY'
import sys, numpy as np
w = sys.argv[1]; rng = np.random.default_rng(3); S, H, D = 750, 4, 64
def l2(x): return x / np.linalg.norm(x, axis=-1, keepdims=True)
np.save(f"{w}/q.npy", l2(rng.standard_normal((S, H, D))).astype(np.float32))
np.save(f"{w}/k.npy", l2(rng.standard_normal((S, H, D))).astype(np.float32))
np.save(f"{w}/v.npy", rng.standard_normal((S, H, D)).astype(np.float32))
np.save(f"{w}/g.npy", (-0.1 * rng.random((S, H))).astype(np.float32))
np.save(f"{w}/gk.npy", (-0.1 * rng.random((S, H, D))).astype(np.float32))
np.save(f"{w}/beta.npy", rng.random((S, H)).astype(np.float32))
np.save(f"{w}/do.npy", rng.standard_normal((S, H, D)).astype(np.float32))
np.save(f"{w}/x.npy", rng.standard_normal((S, 96)).astype(np.float32))
np.save(f"{w}/wt.npy", (0.3 * rng.standard_normal((96, 4))).astype(np.float32))
np.save(f"{w}/dy.npy", rng.standard_normal((S, 96)).astype(np.float32))
PY
for run in cpu cuda:bf16 cuda:fp16 cuda:bf16t cuda:split cuda:kept; do
  dev=${run%%:*}; opts=(--device "$dev"); dtype=${run#*:}
  case "$dtype" in
    bf16t) opts+=(--dtype bf16 --precision bf16_tensor) ;;
    split) opts+=(--dtype bf16 --precision bf16_tensor_scans --fla-split) ;;
    kept) opts+=(--dtype bf16 --precision bf16_tensor_scans --fla-split --keep-forward) ;;
    cpu) ;;
    *) opts+=(--dtype "$dtype") ;;
  esac
  for gate in g gk; do
    "$bin" gdn --tree "$work/tree.json" --q "$work/q.npy" --k "$work/k.npy" --v "$work/v.npy" --g "$work/$gate.npy" \
      --beta "$work/beta.npy" --dout "$work/do.npy" "${opts[@]}" --out "$work/gdn_${gate}_${run/:/_}"
  done
  case "$dtype" in bf16t | split | kept) continue ;; esac  # conv1d has no products to choose
  "$bin" conv1d --tree "$work/tree.json" --x "$work/x.npy" --weight "$work/wt.npy" --silu --dout "$work/dy.npy" \
    "${opts[@]}" --out "$work/conv_${run/:/_}"
done
python3 - "$work" <<'PY'
import sys, os, numpy as np
w = sys.argv[1]; bad = 0
for dt, bound in (("bf16", 3e-2), ("fp16", 3e-2 / 8), ("bf16t", 3e-2), ("split", 3e-2), ("kept", 3e-2)):
    for what in ("gdn_g", "gdn_gk") + (("conv",) if dt in ("bf16", "fp16") else ()):
        for name in sorted(os.listdir(f"{w}/{what}_cpu")):
            a = np.load(f"{w}/{what}_cpu/{name}").astype(np.float64)
            b = np.load(f"{w}/{what}_cuda_{dt}/{name}").astype(np.float64)
            rel = np.abs(a - b).max() / max(np.abs(a).max(), 1e-30)
            print(f"{dt} {what:7s} {name:12s} max |cpu - cuda| / max |cpu| = {rel:.3e} (bound {bound:.2e})")
            bad += rel > bound
for what in ("gdn_g", "gdn_gk"):
    for name in sorted(os.listdir(f"{w}/{what}_cuda_split")):
        same = np.array_equal(np.load(f"{w}/{what}_cuda_split/{name}"), np.load(f"{w}/{what}_cuda_kept/{name}"))
        print(f"kept {what:7s} {name:12s} equal to the split's bit for bit: {same}")
        bad += not same
sys.exit(1 if bad else 0)
PY
