#!/usr/bin/env bash
# Builds the libFuzzer targets (fuzz/*.cpp) with clang under ASan + UBSan (float-cast-overflow
# included) into build-fuzz/ and runs each for a bounded time from its seed corpus
# (fuzz/corpus/<target>/). Any crash, sanitizer report, leak, timeout or out-of-memory fails the
# script; the input that caused it is left in build-fuzz/artifacts/.
#   scripts/fuzz.sh [seconds per target (default 30)] [target ...]   (targets: see fuzz/CMakeLists.txt)
set -euo pipefail
cd "$(dirname "$0")/.."
secs="${1:-30}"
shift || true
targets=("$@")
if ((${#targets[@]} == 0)); then
  targets=(gguf gguf_tokenizer llama2c_model llama2c_tokenizer text cache_spec serve_request)
fi
CXX_FUZZ="${CXX_FUZZ:-clang++-14}"
if ! command -v "$CXX_FUZZ" >/dev/null; then
  echo "fuzz: $CXX_FUZZ not found (scripts/deps.sh installs clang-14 and libclang-rt-14-dev)" >&2
  exit 1
fi
dir=build-fuzz
cmake -S . -B "$dir" -G Ninja -DCMAKE_CXX_COMPILER="$CXX_FUZZ" \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKVQ_CUDA=OFF -DKVQ_FUZZ=ON -DKVQ_BUILD_TESTS=OFF -DKVQ_BUILD_BENCH=OFF >/dev/null
cmake --build "$dir" -j "$(nproc)" --target "${targets[@]/#/fuzz_}"
mkdir -p "$dir/artifacts"
# Targets that need a path write each input to a scratch file: keep those in memory when possible.
scratch=$(mktemp -d "$( [[ -d /dev/shm && -w /dev/shm ]] && echo /dev/shm || echo "${TMPDIR:-/tmp}")/kvq-fuzz.XXXXXX")
trap 'rm -rf "$scratch"' EXIT
export TMPDIR="$scratch"
export ASAN_OPTIONS="detect_leaks=1:abort_on_error=1:allocator_may_return_null=0"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
# Each fuzzer is single-threaded: run up to KVQ_FUZZ_JOBS (default: the core count) at once; each
# writes its verdict to fuzz_<target>.status, read once all have finished.
max_jobs="${KVQ_FUZZ_JOBS:-$(nproc)}"
run_one() {
  local t=$1 work="$dir/corpus/$1" log="$dir/fuzz_$1.log" start=$SECONDS
  mkdir -p "$work"   # grows across runs; the committed seeds stay read-only
  if "$dir/fuzz/fuzz_$t" "$work" "fuzz/corpus/$t" -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 \
      -max_len=65536 -print_final_stats=1 -artifact_prefix="$dir/artifacts/$t-" >"$log" 2>&1; then
    runs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' || echo "?")
    cov=$(grep -o 'cov: [0-9]*' "$log" | tail -1 || true)
    echo "fuzz: $t: ok, $runs runs in $((SECONDS - start)) s ($cov)"
    echo ok >"$dir/fuzz_$t.status"
  else
    echo "fuzz: $t: FAILED after $((SECONDS - start)) s; log $log, inputs in $dir/artifacts/" >&2
    grep -E 'ERROR|runtime error|SUMMARY|fuzz invariant|Test unit written' "$log" | head -20 >&2 || true
    echo failed >"$dir/fuzz_$t.status"
  fi
}
for t in "${targets[@]}"; do
  rm -f "$dir/fuzz_$t.status"
  while (( $(jobs -rp | wc -l) >= max_jobs )); do wait -n || true; done
  run_one "$t" &
done
wait
status=0
for t in "${targets[@]}"; do
  [[ $(cat "$dir/fuzz_$t.status" 2>/dev/null) == ok ]] || { status=1; echo "fuzz: $t did not pass" >&2; }
done
exit $status
