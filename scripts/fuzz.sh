#!/usr/bin/env bash
# Fuzzes the input parsers for a bounded time: builds the libFuzzer targets of fuzz/ (clang, ASan and
# UBSan) into build-fuzz/ and runs each from the regression corpus tests/fuzz_corpus/<target>/. An
# input that crashes, hangs or gets a malformed refusal is saved to build-fuzz/artifacts/ and the script
# exits non-zero: fix the parser and add the input to tests/fuzz_corpus/ (test_fuzz_corpus replays it).
# usage: scripts/fuzz.sh [seconds per target, default 60]
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
seconds="${1:-60}"
build="$root/build-fuzz"
command -v clang++ >/dev/null || { echo "fuzz: clang++ is needed (apt-get install clang)"; exit 2; }
cmake -S "$root/fuzz" -B "$build" -G Ninja -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build "$build" -j "$(nproc)"
mkdir -p "$build/artifacts"
status=0
for target in row npy; do
  # New inputs go to build-fuzz/corpus-<target>; the committed corpus is only read.
  mkdir -p "$build/corpus-$target"
  echo "fuzz: $target for ${seconds} s"
  "$build/fuzz_$target" -max_total_time="$seconds" -max_len=65536 -timeout=10 -rss_limit_mb=2048 \
      -artifact_prefix="$build/artifacts/$target-" -print_final_stats=1 \
      "$build/corpus-$target" "$root/tests/fuzz_corpus/$target" 2>"$build/fuzz_$target.log" || status=1
  grep -E "^(stat::number_of_executed_units|stat::peak_rss_mb|#[0-9]+ +DONE)" "$build/fuzz_$target.log" || true
  [ "$status" -eq 0 ] || { tail -n 30 "$build/fuzz_$target.log"; break; }
done
exit "$status"
