#!/usr/bin/env bash
# Do two builds' CUDA kernels have the same machine code? Compared by code, not by name: template arguments and the
# unnamed namespace's per-file hash change a kernel's mangled name without changing its code.
#   scripts/diagnose/sass_diff.sh BEFORE AFTER [NAME_REGEX]
# BEFORE, AFTER: an object file, a static library, or a directory (its *.o files, recursively). NAME_REGEX (Python re,
# searched in the mangled name): compare only those kernels of BEFORE (default: all).
# A kernel's code is its `cuobjdump -sass` text, instruction words and control words included, without the addresses
# and with every symbol name replaced by SYM, plus its `cuobjdump -res-usage` line (registers, stack, shared, local and
# constant memory) without the name. Prints, for each kernel of BEFORE, "same" and the kernel of AFTER with identical
# code, or "NO MATCH" when none has it (changed, or gone); then "new" for each kernel of AFTER whose code BEFORE does
# not have.
# Exit status: 0 when every compared kernel of BEFORE has its code in AFTER, 1 when one does not, 2 on bad usage.
# cuobjdump: $CUOBJDUMP, else the one on PATH, else /usr/local/cuda/bin's (pip's nvidia-cuda-cuobjdump and
# nvidia-cuda-nvdisasm provide one where the toolkit has none).
set -euo pipefail
if [ $# -lt 2 ] || [ $# -gt 3 ]; then
  echo "usage: $0 BEFORE AFTER [NAME_REGEX]" >&2
  exit 2
fi
cuobjdump="${CUOBJDUMP:-$(command -v cuobjdump || echo /usr/local/cuda/bin/cuobjdump)}"
[ -x "$cuobjdump" ] || { echo "sass_diff: no cuobjdump (set CUOBJDUMP)" >&2; exit 2; }
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

# The dumps of one input, SASS then resource usage, concatenated over its object files in name order.
dump() {
  local input="$1" out="$2" files
  if [ -d "$input" ]; then
    files="$(find "$input" -name '*.o' | sort)"
  elif [ -f "$input" ]; then
    files="$input"
  else
    echo "sass_diff: $input is not a file or directory" >&2
    exit 2
  fi
  : >"$out.sass"
  : >"$out.res"
  for f in $files; do
    # objects without device code make cuobjdump fail; they hold no kernel
    "$cuobjdump" -sass "$f" >>"$out.sass" 2>/dev/null || true
    "$cuobjdump" -res-usage "$f" >>"$out.res" 2>/dev/null || true
  done
}
dump "$1" "$tmp/before"
dump "$2" "$tmp/after"

python3 - "$tmp/before" "$tmp/after" "${3:-}" <<'EOF'
import re, sys

before, after, pattern = sys.argv[1], sys.argv[2], sys.argv[3]
address = re.compile(r"/\*[0-9a-f]{4,}\*/")
symbol = re.compile(r"(_Z[A-Za-z0-9_]+|\$[A-Za-z0-9_$.]+)")
label = re.compile(r"\.L_x_[0-9]+")
encoding = re.compile(r"/\* 0x[0-9a-f]{16} \*/")

def kernels(prefix):
    """[(name, code)] in dump order; a name seen twice (two objects) keeps both."""
    out, name, body, labels = [], None, [], {}
    def close():
        if name is not None:
            out.append([name, "\n".join(body)])
    for line in open(prefix + ".sass", errors="replace"):
        m = re.match(r"\s*Function : (\S+)", line)
        if m:
            close()
            name, body, labels = m.group(1), [], {}
            continue
        # instructions and their control words (each with its 64-bit encoding), and branch labels; not the dump's
        # headers, which name the source file
        if name is None or not (encoding.search(line) or re.match(r"\s*\.L_x_[0-9]+:", line)):
            continue
        text = address.sub("", line)
        text = symbol.sub("SYM", text)
        text = label.sub(lambda m: "L%d" % labels.setdefault(m.group(0), len(labels)), text)
        body.append(" ".join(text.split()))
    close()
    # resource usage, in the same order as the SASS dumps' functions of that name
    res, current = {}, None
    for line in open(prefix + ".res", errors="replace"):
        m = re.match(r"\s*Function (\S+):\s*$", line)
        if m:
            current = m.group(1)
        elif current is not None and "REG:" in line:
            res.setdefault(current, []).append(" ".join(line.split()))
            current = None
    seen = {}
    for k in out:
        i = seen.get(k[0], 0)
        seen[k[0]] = i + 1
        usage = res.get(k[0], [])
        k[1] += "\nRES " + (usage[i] if i < len(usage) else "?")
    return out

b, a = kernels(before), kernels(after)
by_code = {}
for name, code in a:
    by_code.setdefault(code, []).append(name)
compared = [(n, c) for n, c in b if not pattern or re.search(pattern, n)]
missing = 0
for name, code in compared:
    if code in by_code:
        print("same       %s\n        -> %s" % (name, by_code[code][0]))
    else:
        missing += 1
        print("NO MATCH   %s" % name)
before_codes = {c for _, c in b}
for name, code in a:
    if code not in before_codes:
        print("new        %s" % name)
print("%d of %d compared kernels of BEFORE have identical code in AFTER (%d kernels in AFTER)"
      % (len(compared) - missing, len(compared), len(a)))
sys.exit(1 if missing else 0)
EOF
