#!/usr/bin/env bash
# wave 24, second device call: the ring's bulk copies with an L2 evict_first policy (docs/GPU_NOTES.md §31).
#  1. the new build's GPU tests (test_attention_cuda, all), compute-sanitizer memcheck on its decode tests;
#  2. scripts/device_ab.sh: base vs new, bf16 / fp8 / int8 / int4, block 16 and 32, two rounds alternating. The base is
#     the new build relinked with main's decode_inst_fp8.cu.o and decode_inst_int4.cu.o, so fp8 and int4 are the formats
#     under test and bf16 / int8 (the same objects in both binaries) the controls; all five changed decode objects would
#     not fit the 64 MiB carry in one bundle (43 MB against 31 MB).
# Carry .device: PACK_ONLY="kvq test_attention_cuda" PACK_BASE=build-cuda/kvq_base PACK_BUNDLE=1 \
#   scripts/device_engine.sh pack build-cuda.
# Everything but summary.txt goes back in one tar (the tool returns at most eight files).
set -uo pipefail
cd "$(dirname "$0")/../../.."
FINAL="${OUT:-/tmp/w24}"; mkdir -p "$FINAL"
OUT=/tmp/w24-l2; rm -rf "$OUT"; mkdir -p "$OUT"
S=$OUT/summary.txt
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/gpu.txt" >> "$S"
AB_TESTS=1 AB_FORMATS=bf16,fp8,int8,int4 AB_BS=16,32 OUT="$OUT" bash scripts/device_ab.sh >> "$S" 2>&1
B=/tmp/kvq-bin/bin
export LD_LIBRARY_PATH=/tmp/kvq-bin/lib:${LD_LIBRARY_PATH:-}
CS=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
if [[ -n $CS ]]; then
  timeout 300 "$CS" --tool memcheck --error-exitcode 9 "$B/test_attention_cuda" --gtest_brief=1 \
    --gtest_filter='*Decode*' > "$OUT/memcheck_decode.log" 2>&1
  echo "memcheck decode rc=$? $(grep -E 'ERROR SUMMARY|^\[  (PASSED|FAILED) ' "$OUT/memcheck_decode.log" | tr '\n' ' ')" >> "$S"
fi
cp "$S" "$FINAL/summary.txt"
tar czf "$FINAL/l2_hint.tgz" -C "$OUT" .
cat "$S"
