#!/usr/bin/env bash
# wave 30: a patched build (carried in .device) against main, one call: the patched build's test_attention_cuda;
# device_ab.sh with main's kvq as kvq_base (from /tmp/kvq-main, which device_main_check.sh left on this warm
# machine, else .devbase/kvq_base.xz) and the patched kvq, four formats, block 16, two rounds; then both binaries'
# CTA timelines of the near-line shapes, alternating, two runs each (the merge's last step judged by m_store, the
# ring's prime by primed / query / item0). Run for wave 29's merge_quads.patch + prime_after_query.patch, then for
# merge_quads.patch + split_prime.patch, then for the final build (README).
# Carry .device (the patched build: PACK_ONLY="kvq test_attention_cuda" PACK_BUNDLE=1 scripts/device_engine.sh pack)
# and .devbase (main's kvq, xz).
set -uo pipefail
cd "$(dirname "$0")/../../.."
source scripts/device_unpack.sh
kvq_device_prelude /tmp/w30ab || exit 2
echo "card: $(cat "$FINAL/gpu.txt")"
if [[ -x /tmp/kvq-main/bin/kvq ]]; then
  cp /tmp/kvq-main/bin/kvq "$B/kvq_base"
elif [[ -f .devbase/kvq_base.xz ]]; then
  kvq_unpack_file .devbase/kvq_base.xz "$B/kvq_base" && chmod +x "$B/kvq_base"
else
  echo "no base: neither /tmp/kvq-main (device_main_check.sh on this machine) nor .devbase/kvq_base.xz" >&2; exit 2
fi
t0=$SECONDS
timeout 200 "$B/test_attention_cuda" --gtest_brief=1 > "$FINAL/test_attention_cuda_patched.log" 2>&1
echo "test_attention_cuda (patched) rc=$? at $((SECONDS - t0)) s: $(grep -E '^\[  (PASSED|FAILED) ' "$FINAL/test_attention_cuda_patched.log" | tr '\n' ' ')"
grep -E '^\[  FAILED  \]' "$FINAL/test_attention_cuda_patched.log" | head -5
AB_BINS="kvq_base kvq" AB_TESTS=0 AB_ROUNDS=2 AB_FORMATS=bf16,fp8,int8,int4 AB_BS=16 OUT="$FINAL/ab" \
  timeout 330 bash scripts/device_ab.sh > "$FINAL/ab_console.txt" 2>&1
echo "A/B rc=$? at $((SECONDS - t0)) s"
for r in 1 2; do
  for bin in kvq_base kvq; do
    timeout 40 "$B/$bin" bench decode --backend cuda --kv-cache-dtype fp8,int8,int4 --block-sizes 16 --iters 30 --timeline-runs 3 \
      --shapes "8,32,8,128,8192;16,8,1,256,8192;1,32,8,128,32768;32,32,8,128,4096;8,9,3,64,2048" \
      --json "$FINAL/tl_${bin}_$r.json" > "$FINAL/tl_${bin}_$r.log" 2>&1
  done
done
echo "timelines at $((SECONDS - t0)) s"
for bin in kvq_base kvq; do
  for r in 1 2; do
    echo "== $bin run $r"
    grep -A24 "decode kernel CTAs" "$FINAL/tl_${bin}_$r.log" | grep -E "^(shape|B)"
  done
done > "$FINAL/timeline_summary.txt"
gzip -9 "$FINAL"/tl_*.json "$FINAL"/ab/*.json 2>/dev/null
(cd "$FINAL" && tar czf all.tgz ab tl_* test_attention_cuda_patched.log && rm -rf ab tl_*)
tail -45 "$FINAL/ab_console.txt"
