#!/usr/bin/env bash
# wave 28, device call 1: main (2b2fed9) on a lent GPU -- the build whose overlap rule (a8209ec) never ran on one.
#  1. test_attention_cuda (all), compute-sanitizer memcheck on the decode tests, racecheck on the overlap and L2 tests;
#  2. `kvq bench decode --with-write`, arms plain (KVQ_DECODE_OVERLAP_PREVIOUS=0) and plan (the product's default:
#     overlap on sm_90 for plans of three or more splits), all four formats, blocks 16 and 32, two rounds: the
#     issue lines of #9 / #10 on this card and the step with the plan's choice (step_table.py of wave 27);
#  3. the CTA timeline of the near-line shapes (three cold runs each), for where their fixed time goes.
# Carry .device (PACK_ONLY="kvq test_attention_cuda" PACK_BUNDLE=1 scripts/device_engine.sh pack build-cuda).
set -uo pipefail
cd "$(dirname "$0")/../../.."
FINAL="${OUT:-/tmp/w28v}"; mkdir -p "$FINAL"
OUT=$FINAL/ab; mkdir -p "$OUT"
S=$FINAL/summary.txt
t0=$SECONDS
if [[ ${V_AB:-1} == 1 ]]; then
AB_TESTS=1 AB_ROUNDS=2 AB_ARMS="plain:KVQ_DECODE_OVERLAP_PREVIOUS=0 plan:" AB_MEMCHECK="${V_MEMCHECK-*Decode*}" \
  AB_MEMCHECK_S=${V_MEMCHECK_S:-100} AB_FORMATS=bf16,fp8,int8,int4 AB_BS=${V_BS:-16,32} AB_ARGS="--with-write" \
  OUT="$OUT" bash scripts/device_ab.sh >> "$S" 2>&1
python3 bench/results/2026-12-07-wave27/step_table.py "$OUT" 2 plain plan > "$FINAL/step_table.txt" 2>&1
echo "A/B done at $((SECONDS - t0)) s" >> "$S"
else
  source scripts/device_unpack.sh; kvq_unpack_device
fi
B=/tmp/kvq-bin/bin
export LD_LIBRARY_PATH="/tmp/kvq-bin/lib:${LD_LIBRARY_PATH:-}"  # device_ab.sh unpacked it in its own shell
CS=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
if [[ -n $CS && -n ${V_RACECHECK-1} ]]; then
  timeout 90 "$CS" --tool racecheck --error-exitcode 9 "$B/test_attention_cuda" --gtest_brief=1 \
    --gtest_filter='CudaDecodeApi.Overlapped*:CudaDecodeApi.L2Policy*' > "$FINAL/racecheck.log" 2>&1
  echo "racecheck rc=$? $(grep -E 'RACECHECK SUMMARY|ERROR SUMMARY|^\[  (PASSED|FAILED) ' "$FINAL/racecheck.log" | tr '\n' ' ')" >> "$S"
fi
"$B/kvq" bench decode --backend cuda --kv-cache-dtype bf16,fp8,int8,int4 --block-sizes 16 --iters 30 --timeline-runs 3 \
  --shapes "8,32,8,128,8192;16,8,1,256,8192;1,32,8,128,32768;32,32,8,128,4096" --json "$FINAL/timeline.json" \
  > "$FINAL/timeline.log" 2>&1
echo "timeline rc=$? at $((SECONDS - t0)) s" >> "$S"
# The split merge at head dim 256 is launched plainly (wave 14 measured its overlapped launch at 0.995-1.047);
# re-measured on today's kernels: arms 0 / 1 of KVQ_DECODE_OVERLAP_MERGE on the D256 shape, three rounds.
for r in 1 2 3; do for m in 0 1; do
  KVQ_DECODE_OVERLAP_MERGE=$m "$B/kvq" bench decode --backend cuda --kv-cache-dtype bf16,fp8,int8,int4 --block-sizes 16,32 \
    --iters 30 --shapes "16,8,1,256,8192" --json "$FINAL/d256_merge${m}_$r.json" >> "$FINAL/d256_merge.log" 2>&1
done; done
echo "d256 merge arms done at $((SECONDS - t0)) s" >> "$S"
tar czf "$FINAL/all.tgz" -C "$FINAL" --exclude all.tgz .  # the tool returns at most eight files
cat "$S"; grep -A30 "decode kernel CTAs" "$FINAL/timeline.log" | head -40
