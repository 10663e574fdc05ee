#!/usr/bin/env bash
# wave 29: two kernel changes against main's kernels, three builds, one warm machine, three calls back to back
# (two kvq binaries do not fit the tool's 64 MiB carry together; each call leaves its build in an ignored
# build-keep-* folder, which the machine keeps between calls):
#  STEP=a (carry .device: build A = main + the warps' merge four dims a thread, PACK_ONLY="kvq test_attention_cuda"):
#         test_attention_cuda of A; A kept in build-keep-a/.
#  STEP=b (carry .device: build B = A + the self-fed ring primed after the query): test_attention_cuda of B; kept.
#  STEP=c (carry .devbase/kvq_base.xz, main 0cdcd69): device_ab.sh with the three kvq binaries (base, A as kvq, B
#         as kvq_b), four formats, block 16, two rounds; then each binary's CTA timeline of the near-line shapes.
set -uo pipefail
cd "$(dirname "$0")/../../.."
source scripts/device_unpack.sh
step=${STEP:-a}
if [[ $step == solo ]]; then  # one call, no base binary (device time short): tests, the bench and the timelines
  kvq_device_prelude /tmp/w29solo || exit 2
  timeout 300 "$B/test_attention_cuda" --gtest_brief=1 > "$FINAL/test_attention_cuda.log" 2>&1
  echo "test_attention_cuda rc=$? $(grep -E '^\[  (PASSED|FAILED) ' "$FINAL/test_attention_cuda.log" | tr '\n' ' ')"
  grep -E '^\[  FAILED  \]' "$FINAL/test_attention_cuda.log" | head -5
  for r in 1 2; do
    "$B/kvq" bench decode --backend cuda --kv-cache-dtype bf16,fp8,int8,int4 --block-sizes 16 --iters 30 \
      --json "$FINAL/bench_$r.json" > "$FINAL/bench_$r.log" 2>&1
    "$B/kvq" bench decode --backend cuda --kv-cache-dtype fp8,int8,int4 --block-sizes 16 --iters 30 --timeline-runs 3 \
      --shapes "8,32,8,128,8192;16,8,1,256,8192;1,32,8,128,32768;32,32,8,128,4096;8,9,3,64,2048" \
      --json "$FINAL/tl_$r.json" > "$FINAL/tl_$r.log" 2>&1
  done
  grep -A24 "decode kernel CTAs" "$FINAL/tl_1.log" | grep -E "^B" | awk '{printf "%-26s %-9s %s %s", $1" "$2" "$3" "$4" "$5, $6, $9, $10; for (i=NF-13;i<=NF;i++) printf " %s", $i; print ""}'
  gzip -9 "$FINAL"/*.json; (cd "$FINAL" && tar czf all.tgz bench_* tl_* && rm -f bench_* tl_*)
  exit 0
fi
if [[ $step == a || $step == b ]]; then
  kvq_device_prelude /tmp/w29ab || exit 2
  rm -rf "build-keep-$step" && cp -r /tmp/kvq-bin "build-keep-$step"
  timeout 300 "$B/test_attention_cuda" --gtest_brief=1 > "$FINAL/test_attention_cuda_$step.log" 2>&1
  echo "test_attention_cuda ($step) rc=$? $(grep -E '^\[  (PASSED|FAILED) ' "$FINAL/test_attention_cuda_$step.log" | tr '\n' ' ')"
  grep -E '^\[  FAILED  \]' "$FINAL/test_attention_cuda_$step.log" | head -5
  exit 0
fi
FINAL="${OUT:-/tmp/w29ab}"; mkdir -p "$FINAL"
[[ -d build-keep-a/bin ]] || { echo "no build-keep-a: run STEP=a first" >&2; exit 2; }
rm -rf /tmp/kvq-bin && cp -r build-keep-a /tmp/kvq-bin
bins="kvq_base kvq"  # without STEP=b (device time short): base against one build
[[ -d build-keep-b/bin ]] && cp build-keep-b/bin/kvq /tmp/kvq-bin/bin/kvq_b && bins+=" kvq_b"
export LD_LIBRARY_PATH="/tmp/kvq-bin/lib:${LD_LIBRARY_PATH:-}"
B=/tmp/kvq-bin/bin
kvq_unpack_file .devbase/kvq_base.xz $B/kvq_base && chmod +x $B/kvq_base
t0=$SECONDS
AB_BINS="$bins" AB_TESTS=0 AB_ROUNDS=2 AB_FORMATS=bf16,fp8,int8,int4 AB_BS=16 OUT="$FINAL/ab" \
  bash scripts/device_ab.sh > "$FINAL/ab_console.txt" 2>&1
echo "A/B rc=$? at $((SECONDS - t0)) s"
for r in 1 2; do
  for bin in $bins; do
    "$B/$bin" bench decode --backend cuda --kv-cache-dtype fp8,int8,int4 --block-sizes 16 --iters 30 --timeline-runs 3 \
      --shapes "8,32,8,128,8192;16,8,1,256,8192;1,32,8,128,32768;32,32,8,128,4096;8,9,3,64,2048" \
      --json "$FINAL/tl_${bin}_$r.json" > "$FINAL/tl_${bin}_$r.log" 2>&1
  done
done
echo "timelines at $((SECONDS - t0)) s"
for bin in $bins; do
  echo "== $bin (run 1): shape format bs ctas median span ... ramp pages tail ... m_rows m_heads m_store"
  grep -A24 "decode kernel CTAs" "$FINAL/tl_${bin}_1.log" | grep -E "^B" | awk '{printf "%-26s %-9s %s %s", $1" "$2" "$3" "$4" "$5, $6, $9, $10; for (i=NF-13;i<=NF;i++) printf " %s", $i; print ""}'
done > "$FINAL/timeline_summary.txt"
gzip -9 "$FINAL"/tl_*.json "$FINAL"/ab/*.json
(cd "$FINAL" && tar czf all.tgz ab tl_* && rm -rf ab tl_*)
tail -40 "$FINAL/ab_console.txt"
