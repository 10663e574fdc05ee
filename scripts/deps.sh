#!/usr/bin/env bash
# Installs what kvq builds and tests with, from Debian's archive and PyPI, only when missing.
set -euo pipefail
pkgs=(cmake g++ ninja-build libgtest-dev libgmock-dev libbenchmark-dev libcli11-dev nlohmann-json3-dev
      libopenblas-dev libssl-dev libcpp-httplib-dev pkg-config python3 python3-pip python3-venv python3-dev
      clang-14 libclang-rt-14-dev)  # clang + libFuzzer: scripts/fuzz.sh
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "deps: installing ${missing[*]}" >&2
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi
# Python oracles for the tests (ml_dtypes: FP8 codes) and the model fetcher.
if ! python3 -c "import ml_dtypes, numpy" 2>/dev/null; then
  echo "deps: pip install ml_dtypes numpy" >&2
  python3 -m pip install -q ml_dtypes numpy 2>/dev/null || python3 -m pip install -q --break-system-packages ml_dtypes numpy
fi
