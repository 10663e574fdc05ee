#!/usr/bin/env bash
# wave 31: a candidate build (carried in .device) against main's kvq (.devbase/kvq_base.xz), one call --
#   1. the candidate's test_attention_cuda, compute-sanitizer memcheck on its decode tests and racecheck on the
#      overlap and L2-policy tests;
#   2. device_ab.sh: main (kvq_base) and the candidate (kvq), four formats, blocks 16 and 32, two rounds;
#   3. both binaries' CTA timelines of the near-line shapes (block 16, one process each, three runs): m_store;
#   4. on an H200 only, main's ring-depth and feed arms (device_h200_main.sh's steps 3, with main's kvq).
# Carry .device (PACK_ONLY="kvq test_attention_cuda" PACK_BUNDLE=1 scripts/device_engine.sh pack build-cuda) and
# .devbase (main's stripped kvq, xz).
set -uo pipefail
cd "$(dirname "$0")/../../.."
source scripts/device_unpack.sh
kvq_device_prelude /tmp/w31cand || exit 2
TOP=$FINAL
echo "card: $(cat "$TOP/gpu.txt")"
kvq_unpack_file .devbase/kvq_base.xz "$B/kvq_base" && chmod +x "$B/kvq_base" || { echo "no .devbase/kvq_base.xz" >&2; exit 2; }
[[ -d .device ]] && mv .device .device.unpacked  # later steps use /tmp/kvq-bin
t0=$SECONDS
kvq_gpu_checks "$TOP" candidate
AB_BINS="kvq_base kvq" AB_TESTS=0 AB_ROUNDS=2 AB_BS=16,32 OUT="$TOP/ab" timeout 200 bash scripts/device_ab.sh > "$TOP/ab_console.txt" 2>&1
echo "A/B rc=$? at $((SECONDS - t0)) s"
for bin in kvq_base kvq; do
  timeout 40 "$B/$bin" bench decode --backend cuda --kv-cache-dtype bf16,fp8,int8,int4 --block-sizes 16 --iters 30 --timeline-runs 3 \
    --shapes "8,32,8,128,8192;16,8,1,256,8192;1,32,8,128,32768;8,9,3,64,2048;64,9,3,64,8192" \
    --json "$TOP/tl_$bin.json" > "$TOP/tl_$bin.log" 2>&1
  echo "== $bin"; grep -A30 "decode kernel CTAs" "$TOP/tl_$bin.log" | grep -E "^(shape|B)"
done > "$TOP/timeline_summary.txt"
echo "timelines at $((SECONDS - t0)) s"
if [[ $GPU_NAME == *H200* ]]; then
  SHAPES="1,32,8,128,32768;8,32,8,128,8192;16,8,1,256,8192;8,9,3,64,2048;64,9,3,64,8192"
  cp "$B/kvq" "$B/kvq_cand" && cp "$B/kvq_base" "$B/kvq"  # the knob arms run $B/kvq: main's
  OUT=$TOP/stages AB_TESTS=0 AB_FORMATS=fp8,int8,int4 AB_ARGS="--shapes $SHAPES" \
    AB_ARMS="plan: s4:KVQ_DECODE_RING_STAGES=4 s8:KVQ_DECODE_RING_STAGES=8 s16:KVQ_DECODE_RING_STAGES=16" \
    timeout 120 bash scripts/device_ab.sh > "$TOP/stages_console.txt" 2>&1
  OUT=$TOP/feed AB_TESTS=0 AB_FORMATS=fp8,int8,int4 AB_ARGS="--shapes $SHAPES" \
    AB_ARMS="plan: self:KVQ_DECODE_RING_FEED=self prod:KVQ_DECODE_RING_FEED=producer" \
    timeout 100 bash scripts/device_ab.sh > "$TOP/feed_console.txt" 2>&1
  cp "$B/kvq_cand" "$B/kvq"
  echo "knob arms at $((SECONDS - t0)) s"
fi
[[ -d .device.unpacked ]] && mv .device.unpacked .device
gzip -9 "$TOP"/*.log "$TOP"/*.json 2>/dev/null
# What comes back: gpu.txt, the consoles, timeline_summary.txt and all.tgz (the rest), within the tool's file count.
(cd "$TOP" && tar czf all.tgz ab ./*.gz $(ls -d stages feed 2>/dev/null) && rm -rf ab ./*.gz stages feed) 2>/dev/null
tail -75 "$TOP/ab_console.txt"
