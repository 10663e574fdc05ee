#!/usr/bin/env bash
# wave 25, device call 1: the L2 evict_first policy of the ring's bulk copies as a plan setting
# (DecodeOptions::l2_evict_first; docs/GPU_NOTES.md §31, §32), measured as arms of one binary:
#  1. test_attention_cuda (all; its decode runs include every ring with the policy on, self- and producer-fed);
#  2. scripts/device_ab.sh with three arms of `kvq bench decode`: off (KVQ_DECODE_L2_HINT=0: plain copies behind the patch's branch),
#     ef (1: code and sink tiles evict_first; 3 would add the scale runs, what wave 24 measured on an H100; left
#     out for device time),
#     auto (the plan's choice: none as committed, a control arm; with the candidate rule of GPU_NOTES §32 compiled
#     in, the rule); bf16 / fp8 / int8 / int4, block 16 and 32, two rounds alternating;
#  3. compute-sanitizer memcheck on the decode tests.
# L2_FORMATS (default bf16,fp8,int8,int4) and L2_MEMCHECK=0 shorten the call when little device time is left.
# Build from main with l2_plan_setting.patch applied (and candidate_l2_rule.patch for the auto arm to be the rule).
# Carry .device: PACK_ONLY="kvq test_attention_cuda" PACK_BUNDLE=1 scripts/device_engine.sh pack build-cuda.
# Everything but summary.txt goes back in one tar (the tool returns at most eight files).
set -uo pipefail
cd "$(dirname "$0")/../../.."
FINAL="${OUT:-/tmp/w25}"; mkdir -p "$FINAL"
OUT=/tmp/w25-l2; rm -rf "$OUT"; mkdir -p "$OUT"
S=$OUT/summary.txt
memcheck='*Decode*'; [[ ${L2_MEMCHECK:-1} == 1 ]] || memcheck=
AB_TESTS=1 AB_ROUNDS=2 AB_ARMS="off:KVQ_DECODE_L2_HINT=0 ef:KVQ_DECODE_L2_HINT=1 auto:" AB_MEMCHECK="$memcheck" AB_MEMCHECK_S=90 \
  AB_FORMATS=${L2_FORMATS:-bf16,fp8,int8,int4} AB_BS=16,32 OUT="$OUT" bash scripts/device_ab.sh >> "$S" 2>&1
cp "$S" "$FINAL/summary.txt"
tar czf "$FINAL/l2_plan.tgz" -C "$OUT" .
cat "$S"
