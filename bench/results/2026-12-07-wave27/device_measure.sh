#!/usr/bin/env bash
# wave 27, device call 1 (main 77dd5d2's build, nothing new in the kernels): the GPU tests and memcheck of the
# product as it is, then what wave 26 wrote and could not run, cut to fit one call:
#  - on an H200 (L2 60 MiB, the card issues #9/#10 record their lines on): ../2026-12-07-wave26/device_l2_rule.sh
#    (tests, memcheck on the decode tests, arms off / ef / auto of `kvq bench decode`; GPU_NOTES §33), then the
#    near-line sweep;
#  - on an H100 (that A/B ran twice there in wave 26): the tests, memcheck, then the sweep.
# The sweep (../2026-12-07-wave26/device_near_line_sweep.sh) stops starting runs after SWEEP_S seconds.
# Carry .device (PACK_ONLY="kvq test_attention_cuda" PACK_BUNDLE=1 scripts/device_engine.sh pack build-cuda).
set -uo pipefail
cd "$(dirname "$0")/../../.."
FINAL="${OUT:-/tmp/w27}"; mkdir -p "$FINAL"
t0=$SECONDS
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>&1 | head -1)
echo "gpu: $gpu" | tee "$FINAL/times.txt"
if [[ $gpu == *H200* ]]; then
  OUT="$FINAL" bash bench/results/2026-12-07-wave26/device_l2_rule.sh > "$FINAL/l2_rule_console.txt" 2>&1
  sweep_s=${SWEEP_S:-250}
else
  source scripts/device_unpack.sh
  kvq_unpack_device || { echo "no .device/ carried" >&2; exit 2; }
  B=/tmp/kvq-bin/bin
  timeout 300 "$B/test_attention_cuda" --gtest_brief=1 > "$FINAL/test_attention_cuda.log" 2>&1
  echo "test_attention_cuda rc=$? $(grep -E '^\[  (PASSED|FAILED) ' "$FINAL/test_attention_cuda.log" | tr '\n' ' ')" | tee -a "$FINAL/times.txt"
  CS=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
  timeout 90 "$CS" --tool memcheck --error-exitcode 9 "$B/test_attention_cuda" --gtest_brief=1 --gtest_filter='*Decode*' \
    > /tmp/memcheck.log 2>&1
  echo "memcheck rc=$? $(grep -E 'ERROR SUMMARY|^\[  (PASSED|FAILED) ' /tmp/memcheck.log | tr '\n' ' ')" | tee -a "$FINAL/times.txt"
  sweep_s=${SWEEP_S:-200}
fi
echo "first part done at $((SECONDS - t0)) s" | tee -a "$FINAL/times.txt"
SWEEP_S=$sweep_s OUT="$FINAL" bash bench/results/2026-12-07-wave26/device_near_line_sweep.sh > "$FINAL/sweep_console.txt" 2>&1
echo "sweep done at $((SECONDS - t0)) s" | tee -a "$FINAL/times.txt"
tail -3 "$FINAL/l2_rule_console.txt" 2>/dev/null; cat "$FINAL/table.txt" 2>/dev/null | head -80
