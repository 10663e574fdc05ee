#!/usr/bin/env bash
# wave 28: the warps' merge with four elements per thread in flight (merge_and_store, GPU_NOTES §35) against
# main's kernels. The two kvq binaries share too few bytes to travel together under the tool's 64 MiB carry, so
# two calls on one warm machine, back to back:
#  MA_STEP=1 (carry .device: PACK_ONLY="kvq test_attention_cuda" PACK_BUNDLE=1 scripts/device_engine.sh pack
#            build-cuda): test_attention_cuda of the new build (the merge's bits are unchanged: the decode tests
#            compare them), the binaries kept in build-keep/ for the next call;
#  MA_STEP=2 (carry .devbase: kvq_base.xz, main's 2b2fed9 kernels, libkvq_cuda.a of main relinked): device_ab.sh,
#            kvq_base against kvq, all four formats, block 16, two rounds; then the new build's CTA timeline of the
#            near-line shapes.
set -uo pipefail
cd "$(dirname "$0")/../../.."
FINAL="${OUT:-/tmp/w28m}"; mkdir -p "$FINAL"
S=$FINAL/summary.txt
t0=$SECONDS
if [[ ${MA_STEP:-1} == 1 ]]; then
  source scripts/device_unpack.sh
  kvq_unpack_device || { echo "no .device/ carried" >&2; exit 2; }
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$FINAL/gpu.txt"
  rm -rf build-keep && cp -r /tmp/kvq-bin build-keep
  timeout 300 /tmp/kvq-bin/bin/test_attention_cuda --gtest_brief=1 > "$FINAL/test_attention_cuda.log" 2>&1
  echo "test_attention_cuda rc=$? $(grep -E '^\[  (PASSED|FAILED) ' "$FINAL/test_attention_cuda.log" | tr '\n' ' ')" | tee -a "$S"
  grep -E '^\[  FAILED  \]' "$FINAL/test_attention_cuda.log" | head -5
  exit 0
fi
AB_TESTS=0 AB_ROUNDS=${MA_ROUNDS:-2} AB_FORMATS=bf16,fp8,int8,int4 AB_BS=${MA_BS:-16} \
  OUT="$FINAL/ab" bash scripts/device_ab.sh >> "$S" 2>&1
echo "A/B done at $((SECONDS - t0)) s" >> "$S"
export LD_LIBRARY_PATH="/tmp/kvq-bin/lib:${LD_LIBRARY_PATH:-}"
/tmp/kvq-bin/bin/kvq bench decode --backend cuda --kv-cache-dtype fp8,int8,int4 --block-sizes 16 --iters 30 --timeline-runs 3 \
  --shapes "8,32,8,128,8192;16,8,1,256,8192;1,32,8,128,32768;32,32,8,128,4096" --json "$FINAL/timeline.json" \
  > "$FINAL/timeline.log" 2>&1
echo "timeline rc=$? at $((SECONDS - t0)) s" >> "$S"
tar czf "$FINAL/all.tgz" -C "$FINAL" --exclude all.tgz .
grep -v "^=== " "$S"; grep -A20 "decode kernel CTAs" "$FINAL/timeline.log" | head -16
