#!/usr/bin/env bash
# wave 24, one device call: int8 K codes as subnormal halves (docs/GPU_NOTES.md §31).
#  1. the new build's GPU tests (test_attention_cuda), and compute-sanitizer memcheck on its int8 decode tests;
#  2. scripts/device_ab.sh: base (main before the change) vs new, bf16 (control) and int8, block 16 and 32,
#     two rounds alternating, best round per binary;
#  3. int8 B32 Hq32 Hkv8 D128 L4096 at block 16 under the new binary: the plan vs one producer-fed split of
#     16 stages (the §25 rule that lost for int8 before), three rounds alternating.
# Carry .device: PACK_ONLY="kvq test_attention_cuda" PACK_BASE=<kvq relinked with main's int8 object> PACK_BUNDLE=1
# scripts/device_engine.sh pack build-cuda (one 27 MB bundle; separate .xz files of the three binaries were 74 MB).
set -uo pipefail
cd "$(dirname "$0")/../../.."
OUT="${OUT:-/tmp/w24}"; mkdir -p "$OUT"
S=$OUT/summary.txt
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/gpu.txt" >> "$S"
AB_TESTS=1 AB_FORMATS=bf16,int8 AB_BS=16,32 OUT="$OUT" bash scripts/device_ab.sh >> "$S" 2>&1
B=/tmp/kvq-bin/bin
export LD_LIBRARY_PATH=/tmp/kvq-bin/lib:${LD_LIBRARY_PATH:-}
CS=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
if [[ -n $CS ]]; then
  timeout 240 "$CS" --tool memcheck --error-exitcode 9 "$B/test_attention_cuda" --gtest_brief=1 \
    --gtest_filter='*Int8*:*int8*' > "$OUT/memcheck_int8.log" 2>&1
  echo "memcheck int8 rc=$? $(grep -E 'ERROR SUMMARY|^\[  (PASSED|FAILED) ' "$OUT/memcheck_int8.log" | tr '\n' ' ')" >> "$S"
else
  echo "no compute-sanitizer on this image" >> "$S"
fi
B32="32,32,8,128,4096"
for r in 1 2 3; do
  for c in "plan||0" "p1_s16|KVQ_DECODE_RING_FEED=producer KVQ_DECODE_RING_STAGES=16|1"; do
    IFS='|' read -r label env splits <<< "$c"
    (( SECONDS < 540 )) || break 2
    env $env timeout 60 $B/kvq bench decode --backend cuda --kv-cache-dtype int8 --block-sizes 16 --iters 30 \
      --splits $splits --shapes "$B32" --json "$OUT/b32_${label}_$r.json" > "$OUT/b32_${label}_$r.log" 2>&1
  done
done
python3 - "$OUT" <<'PY' >> "$S"
import glob, json, sys, collections
res = collections.defaultdict(list)
for fn in glob.glob(f"{sys.argv[1]}/b32_*.json"):
    label = fn.split("/")[-1][4:-7]
    for row in json.load(open(fn))["decode"]:
        res[label].append((row["us_median"], row.get("frac_of_read", 0)))
for label, v in sorted(res.items()):
    us, fr = min(v)
    print(f"int8 B32 Hq32 Hkv8 D128 L4096 bs16 {label:8s} best of {len(v)}: {us:7.1f} us  {100 * fr:5.1f}% of read")
PY
cat "$S"
