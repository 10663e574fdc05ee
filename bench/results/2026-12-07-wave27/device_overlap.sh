#!/usr/bin/env bash
# wave 27, device call 2: the decode as a programmatic dependent of the cache write before it
# (DecodePlan::overlap_previous, GPU_NOTES §34), measured as arms of one binary:
#  1. test_attention_cuda (all, incl. CudaDecodeApi.OverlappedDecodeSeesTheWriteBeforeIt), test_backend where
#     packed (the CUDA engine against the CPU engine on stories260K, carried in .device/shared) and memcheck on the
#     decode tests (scripts/device_ab.sh);
#  2. `kvq bench decode --with-write` (the one-token write, then the decode, in one graph), arms plain
#     (KVQ_DECODE_OVERLAP_PREVIOUS=0) and overlap (the plan's default), bf16 / fp8 / int8 / int4, block 16, the
#     nine shapes, two rounds alternating; step_table.py makes the step's table, device_ab.sh the decode's;
#  3. what time is left: the near-line sweep of wave 26 (SWEEP_S).
# Carry .device (PACK_ONLY="kvq test_attention_cuda" PACK_BUNDLE=1 scripts/device_engine.sh pack build-cuda; with
# test_backend and ../shared/models/stories260K in .device/shared/models/ the carry was over the tool's 64 MiB).
set -uo pipefail
cd "$(dirname "$0")/../../.."
FINAL="${OUT:-/tmp/w27o}"; mkdir -p "$FINAL"
OUT=$FINAL/ab; mkdir -p "$OUT"  # under $FINAL: what a cut-off run wrote still comes back
t0=$SECONDS
S=$FINAL/summary.txt
# test_backend's CUDA-engine tests (the engine's captured step now has the write -> decode programmatic edge)
# read stories260K from the carried copy.
[[ -d .device/shared/models/stories260K ]] && export KVQ_SHARED_DIR="$PWD/.device/shared"

AB_TESTS=1 AB_ROUNDS=${OV_ROUNDS:-2} AB_ARMS="plain:KVQ_DECODE_OVERLAP_PREVIOUS=0 overlap:" AB_MEMCHECK="${OV_MEMCHECK-*Decode*}" AB_MEMCHECK_S=${OV_MEMCHECK_S:-100} \
  AB_FORMATS=${OV_FORMATS:-bf16,fp8,int8,int4} AB_BS=16 AB_ARGS="--with-write" OUT="$OUT" bash scripts/device_ab.sh >> "$S" 2>&1
python3 bench/results/2026-12-07-wave27/step_table.py "$OUT" ${OV_ROUNDS:-2} plain overlap > "$OUT/step_table.txt" 2>&1
echo "overlap A/B done at $((SECONDS - t0)) s" >> "$S"
cp "$OUT/step_table.txt" "$FINAL/"
if [[ ${SWEEP_S:-150} -gt 0 ]]; then
  OUT="$FINAL" SWEEP_S=${SWEEP_S:-150} bash bench/results/2026-12-07-wave26/device_near_line_sweep.sh > "$FINAL/sweep_console.txt" 2>&1
  echo "sweep done at $((SECONDS - t0)) s" >> "$FINAL/summary.txt"
fi
cat "$FINAL/summary.txt"; cat "$FINAL/step_table.txt"
