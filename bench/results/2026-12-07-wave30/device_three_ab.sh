#!/usr/bin/env bash
# wave 30: main against two candidates in one call, one bundle (.device/bin/bundle.tar.xz: kvq_base = main, kvq_b +
# test_attention_cuda_b = main + merge_quads_d128.patch, kvq + test_attention_cuda = that + split_prime.patch; xz with
# a 256 MiB dictionary stores the three kvq's shared bytes once): both candidates' test_attention_cuda, device_ab.sh
# over the three (four formats, block 16, two rounds), then the three CTA timelines of the near-line shapes, two
# runs each.
set -uo pipefail
cd "$(dirname "$0")/../../.."
source scripts/device_unpack.sh
kvq_device_prelude /tmp/w30three || exit 2
echo "card: $(cat "$FINAL/gpu.txt")"
t0=$SECONDS
for t in test_attention_cuda test_attention_cuda_b; do
  timeout 150 "$B/$t" --gtest_brief=1 > "$FINAL/$t.log" 2>&1
  echo "$t rc=$? at $((SECONDS - t0)) s: $(grep -E '^\[  (PASSED|FAILED) ' "$FINAL/$t.log" | tr '\n' ' ')"
  grep -E '^\[  FAILED  \]' "$FINAL/$t.log" | head -5
done
bins="kvq_base kvq_b kvq"
AB_BINS="$bins" AB_TESTS=0 AB_ROUNDS=2 AB_FORMATS=bf16,fp8,int8,int4 AB_BS=16 OUT="$FINAL/ab" \
  timeout 300 bash scripts/device_ab.sh > "$FINAL/ab_console.txt" 2>&1
echo "A/B rc=$? at $((SECONDS - t0)) s"
for r in 1 2; do
  for bin in $bins; do
    timeout 40 "$B/$bin" bench decode --backend cuda --kv-cache-dtype fp8,int8,int4 --block-sizes 16 --iters 30 --timeline-runs 3 \
      --shapes "8,32,8,128,8192;16,8,1,256,8192;1,32,8,128,32768;32,32,8,128,4096;8,9,3,64,2048" \
      --json "$FINAL/tl_${bin}_$r.json" > "$FINAL/tl_${bin}_$r.log" 2>&1
  done
done
echo "timelines at $((SECONDS - t0)) s"
for bin in $bins; do
  for r in 1 2; do
    echo "== $bin run $r"
    grep -A24 "decode kernel CTAs" "$FINAL/tl_${bin}_$r.log" | grep -E "^(shape|B)" | grep -v "event_us" | awk 'NF > 15'
  done
done > "$FINAL/timeline_summary.txt"
gzip -9 "$FINAL"/tl_*.json "$FINAL"/ab/*.json 2>/dev/null
(cd "$FINAL" && tar czf all.tgz ab tl_* test_attention_cuda*.log && rm -rf ab tl_*)
tail -42 "$FINAL/ab_console.txt"
