#!/usr/bin/env bash
# wave 30: main's GPU tests on the lent card (test_attention_cuda: every test; compute-sanitizer memcheck on the
# decode tests, racecheck on the overlap and L2-policy tests), and main's binaries kept on the machine
# (/tmp/kvq-main) as the base of a later call's A/B (device_patched_ab.sh) while the machine stays warm.
# Carry .device (PACK_ONLY="kvq test_attention_cuda" PACK_BUNDLE=1 scripts/device_engine.sh pack build-cuda).
set -uo pipefail
cd "$(dirname "$0")/../../.."
source scripts/device_unpack.sh
kvq_device_prelude /tmp/w30main || exit 2
echo "card: $(cat "$FINAL/gpu.txt")"
rm -rf /tmp/kvq-main && cp -r /tmp/kvq-bin /tmp/kvq-main
t0=$SECONDS
timeout 240 "$B/test_attention_cuda" --gtest_brief=1 > "$FINAL/test_attention_cuda.log" 2>&1
echo "test_attention_cuda rc=$? at $((SECONDS - t0)) s: $(grep -E '^\[  (PASSED|FAILED) ' "$FINAL/test_attention_cuda.log" | tr '\n' ' ')"
grep -E '^\[  FAILED  \]' "$FINAL/test_attention_cuda.log" | head -5
CS=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
if [[ -n $CS ]]; then
  timeout 150 "$CS" --tool memcheck --error-exitcode 9 "$B/test_attention_cuda" --gtest_brief=1 \
    --gtest_filter='*Decode*' > "$FINAL/memcheck.log" 2>&1
  echo "memcheck rc=$? at $((SECONDS - t0)) s: $(grep -E 'ERROR SUMMARY|^\[  (PASSED|FAILED) ' "$FINAL/memcheck.log" | tr '\n' ' ')"
  timeout 90 "$CS" --tool racecheck --error-exitcode 9 "$B/test_attention_cuda" --gtest_brief=1 \
    --gtest_filter='CudaDecodeApi.Overlapped*:CudaDecodeApi.L2Policy*' > "$FINAL/racecheck.log" 2>&1
  echo "racecheck rc=$? at $((SECONDS - t0)) s: $(grep -E 'RACECHECK SUMMARY|ERROR SUMMARY|^\[  (PASSED|FAILED) ' "$FINAL/racecheck.log" | tr '\n' ' ')"
else
  echo "no compute-sanitizer on this machine"
fi
gzip -9 "$FINAL"/*.log
