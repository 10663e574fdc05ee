#!/usr/bin/env bash
# wave 27, device call 1 (main 77dd5d2's build, nothing new in the kernels): the two measurements wave 26 wrote and
# could not run, in one call so that one machine start serves both:
#  1. ../2026-12-07-wave26/device_l2_rule.sh -- GPU tests, memcheck on the decode tests, arms off / ef / auto of
#     `kvq bench decode` (the L2 evict_first rule of GPU_NOTES §33) on whatever card the tool lends;
#  2. ../2026-12-07-wave26/device_near_line_sweep.sh -- forced splits and ring depths around the near-line shapes,
#     cut by its time guard (SWEEP_S) so the tar always comes back.
# Carry .device (PACK_ONLY="kvq test_attention_cuda" PACK_BUNDLE=1 scripts/device_engine.sh pack build-cuda).
set -uo pipefail
cd "$(dirname "$0")/../../.."
FINAL="${OUT:-/tmp/w27}"; mkdir -p "$FINAL"
t0=$SECONDS
OUT="$FINAL" bash bench/results/2026-12-07-wave26/device_l2_rule.sh > "$FINAL/l2_rule_console.txt" 2>&1
echo "l2 rule done at $((SECONDS - t0)) s" | tee -a "$FINAL/times.txt"
SWEEP_S=${SWEEP_S:-280} OUT="$FINAL" bash bench/results/2026-12-07-wave26/device_near_line_sweep.sh > "$FINAL/sweep_console.txt" 2>&1
echo "sweep done at $((SECONDS - t0)) s" | tee -a "$FINAL/times.txt"
tail -5 "$FINAL/l2_rule_console.txt"; cat "$FINAL/table.txt" 2>/dev/null | head -60
