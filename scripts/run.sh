#!/usr/bin/env bash
# Sets up kvq and runs its main job on the default model and text.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/deps.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j "$(nproc)" --target kvq
./build/kvq probe
