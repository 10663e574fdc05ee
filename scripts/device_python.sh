#!/usr/bin/env bash
# The Python package on the GPU machine (no internet there; torch, numpy, nvcc, cmake present).
#
#   scripts/device_python.sh wheels   (here, with PyPI) download the build and test wheels into .whl/
#                                     for the device image's Python (3.12, manylinux x86_64)
#   scripts/device_python.sh run      (on the GPU machine) venv over the system site-packages (its
#                                     torch), offline install from .whl/, KVQ_CUDA=ON build of the
#                                     package, pytest (GPU tests included), the decode timing script
#                                     and, when a kvq binary is at hand, `kvq bench decode` on the
#                                     same shapes. Logs go to $OUT (default ./device-out).
set -euo pipefail
cd "$(dirname "$0")/.."
mode="${1:-run}"
shapes="${KVQ_PY_SHAPES:-64,32,8,128,4096;16,64,8,128,16384}"
if [[ $mode == wheels ]]; then
  rm -rf .whl && mkdir -p .whl
  python3 -m pip download -q -d .whl --only-binary=:all: --python-version 3.12 \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform any \
    scikit-build-core nanobind pathspec packaging ml_dtypes pytest iniconfig pluggy
  ls .whl
  exit 0
fi
OUT="${OUT:-$PWD/device-out}"
mkdir -p "$OUT"
venv=build-py/venv-gpu
[[ -x $venv/bin/python ]] || python3 -m venv --system-site-packages "$venv"
"$venv/bin/python" -m pip install -q --no-index --find-links .whl scikit-build-core nanobind ml_dtypes pytest
KVQ_CUDA=ON KVQ_CUDA_ARCH="${KVQ_CUDA_ARCH:-90a-real}" \
  "$venv/bin/python" -m pip install -v --no-build-isolation --no-index --find-links .whl ./python >"$OUT/py-build.txt" 2>&1 ||
  { tail -30 "$OUT/py-build.txt"; exit 1; }
(cd build-py && venv-gpu/bin/python -m pytest -v ../python/tests) 2>&1 | tee "$OUT/py-tests.txt" | tail -15
"$venv/bin/python" python/bench/bench_decode.py --shapes "$shapes" 2>&1 | tee "$OUT/py-bench.txt"
for kvq in build-device/kvq /tmp/kvq-bin/bin/kvq build/kvq; do
  if [[ -x $kvq ]]; then
    "$kvq" bench decode --backend cuda --kv-cache-dtype fp8 --shapes "$shapes" 2>&1 | tee "$OUT/cpp-bench.txt"
    break
  fi
done
