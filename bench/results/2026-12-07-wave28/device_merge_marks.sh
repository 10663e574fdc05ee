#!/usr/bin/env bash
# wave 28: where the CTA's tail goes, with two marks in the warps' merge (timeline instances only): every warp past
# its pages (warps), their rows in shared memory (m_rows), the heads' weights (m_heads), the rows merged and stored
# (m_store). test_attention_cuda first (CudaDecodeTimeline checks the marks' order), then the timeline of the
# near-line shapes, three cold runs each, twice. Carry .device (PACK_ONLY="kvq test_attention_cuda" PACK_BUNDLE=1
# scripts/device_engine.sh pack build-cuda).
set -uo pipefail
cd "$(dirname "$0")/../../.."
FINAL="${OUT:-/tmp/w28mm}"; mkdir -p "$FINAL"
source scripts/device_unpack.sh
kvq_unpack_device || { echo "no .device/ carried" >&2; exit 2; }
B=/tmp/kvq-bin/bin
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$FINAL/gpu.txt"
timeout 300 "$B/test_attention_cuda" --gtest_brief=1 > "$FINAL/test_attention_cuda.log" 2>&1
echo "test_attention_cuda rc=$? $(grep -E '^\[  (PASSED|FAILED) ' "$FINAL/test_attention_cuda.log" | tr '\n' ' ')"
grep -E '^\[  FAILED  \]' "$FINAL/test_attention_cuda.log" | head -5
for r in 1 2; do
  "$B/kvq" bench decode --backend cuda --kv-cache-dtype bf16,fp8,int8,int4 --block-sizes 16 --iters 30 --timeline-runs 3 \
    --shapes "16,8,1,256,8192;8,32,8,128,8192;1,32,8,128,32768;32,32,8,128,4096;8,9,3,64,2048" \
    --json "$FINAL/marks_$r.json" > "$FINAL/marks_$r.log" 2>&1
  echo "timeline $r rc=$?"
done
gzip -9 "$FINAL"/marks_*.json
grep -A22 "decode kernel CTAs" "$FINAL/marks_1.log" | grep -E "^B|^shape" | awk '{printf "%-28s %-9s", $1" "$2" "$3" "$4" "$5, $6; for (i=NF-11;i<=NF;i++) printf " %s", $i; print ""}'
