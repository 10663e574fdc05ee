#!/usr/bin/env bash
# wave 28, an H200 call: main's product lines on the card issue #9 was written for (the last H200 record is wave 24,
# before the L2 rule of wave 26 and the overlap of wave 27), and the A/Bs of those two rules there:
#  1. device_verify.sh without memcheck/racecheck (they ran on the H100): tests, plain vs plan with --with-write, the
#     timeline, the D256 merge-launch arms;
#  2. wave 26's device_l2_rule.sh without memcheck: arms off / ef / auto of the L2 policy, blocks 16 and 32.
# Stops at once on any other card (the H100 lines of this commit are in h100_run1/). Carry .device.
set -uo pipefail
cd "$(dirname "$0")/../../.."
FINAL="${OUT:-/tmp/w28h}"; mkdir -p "$FINAL"
name=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "card: $name"
[[ $name == *H200* || -n ${H200_ANY:-} ]] || { echo "not an H200: nothing run"; exit 0; }
mkdir -p "$FINAL/verify" "$FINAL/l2"
V_MEMCHECK= V_RACECHECK= OUT="$FINAL/verify" bash bench/results/2026-12-07-wave28/device_verify.sh > "$FINAL/verify_console.txt" 2>&1
L2_MEMCHECK=0 OUT="$FINAL/l2" bash bench/results/2026-12-07-wave26/device_l2_rule.sh > "$FINAL/l2_console.txt" 2>&1
tail -5 "$FINAL/verify/summary.txt"; grep -E "rc=|B8 Hq32 Hkv8|D256|Hkv1" "$FINAL/l2/summary.txt" | head -40
