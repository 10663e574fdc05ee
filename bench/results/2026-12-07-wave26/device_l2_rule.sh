#!/usr/bin/env bash
# wave 26, device call: the ring copies' L2 evict_first policy as instances of their own (DecodePlan::l2_evict_first,
# docs/GPU_NOTES.md §33), measured as arms of one binary:
#  1. test_attention_cuda (all; every 8- and 4-bit decode case also runs on the evict_first instances, self- and
#     producer-fed; the plan test of the rule by size);
#  2. scripts/device_ab.sh, arms of `kvq bench decode`: off (KVQ_DECODE_L2_HINT=0, the default instances, the
#     same code as main's), ef (1: every 8- and 4-bit case on the evict_first instances), auto (the plan's rule:
#     8- and 4-bit caches where the batch's pages outgrow L2); bf16 / fp8 / int8 / int4, block 16 and 32, two rounds;
#  3. compute-sanitizer memcheck on the decode tests.
# L2_FORMATS (default bf16,fp8,int8,int4) and L2_MEMCHECK=0 shorten the call when little device time is left.
# Build: kvq and test_attention_cuda with -DKVQ_CUDA=ON; pack: PACK_ONLY="kvq test_attention_cuda" PACK_BUNDLE=1
# scripts/device_engine.sh pack build-cuda; carry .device. Everything but summary.txt goes back in one tar.
set -uo pipefail
cd "$(dirname "$0")/../../.."
FINAL="${OUT:-/tmp/w26}"; mkdir -p "$FINAL"
OUT=/tmp/w26-l2; rm -rf "$OUT"; mkdir -p "$OUT"
S=$OUT/summary.txt
memcheck='*Decode*'; [[ ${L2_MEMCHECK:-1} == 1 ]] || memcheck=
AB_TESTS=1 AB_ROUNDS=2 AB_ARMS="off:KVQ_DECODE_L2_HINT=0 ef:KVQ_DECODE_L2_HINT=1 auto:" AB_MEMCHECK="$memcheck" AB_MEMCHECK_S=90 \
  AB_FORMATS=${L2_FORMATS:-bf16,fp8,int8,int4} AB_BS=16,32 OUT="$OUT" bash scripts/device_ab.sh >> "$S" 2>&1
cp "$S" "$FINAL/summary.txt"
tar czf "$FINAL/l2_rule.tgz" -C "$OUT" .
cat "$S"
