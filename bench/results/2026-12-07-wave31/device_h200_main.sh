#!/usr/bin/env bash
# wave 31: main (d5f95e2: the merge's four dims a thread of wave 30) on the lent card in one call --
#   1. its GPU tests and sanitizers (wave 30's device_main_check.sh: test_attention_cuda, memcheck on the decode
#      tests, racecheck on the overlap and L2-policy tests);
#   2. the issue table: `kvq bench decode`, four formats, blocks 16 and 32, two rounds (device_ab.sh, one arm);
#   3. the self-fed ring's depth (KVQ_DECODE_RING_STAGES 4 / 8 / 12 / 16 against the plan) and the feed
#      (KVQ_DECODE_RING_FEED self / producer against the plan) on the shapes whose plans are self-fed or near the
#      line (B1 L32768, B8 Hkv8 L8192, D256, the two head-dim-64 shapes), 8- and 4-bit, block 16, two rounds.
# Carry .device (PACK_ONLY="kvq test_attention_cuda" PACK_BUNDLE=1 scripts/device_engine.sh pack build-cuda).
set -uo pipefail
cd "$(dirname "$0")/../../.."
source scripts/device_unpack.sh
kvq_device_prelude /tmp/w31main || exit 2
TOP=$FINAL
echo "card: $(cat "$TOP/gpu.txt")"
# The steps below reuse the unpacked binaries (/tmp/kvq-bin) instead of unpacking the carry again.
[[ -d .device ]] && mv .device .device.unpacked
OUT=$TOP/check bash bench/results/2026-12-07-wave30/device_main_check.sh 2>&1 | tee "$TOP/check_console.txt"
t0=$SECONDS
OUT=$TOP/table AB_TESTS=0 AB_ARMS="main:" AB_BS=16,32 timeout 200 bash scripts/device_ab.sh > "$TOP/table_console.txt" 2>&1
echo "table rc=$? at $((SECONDS - t0)) s"
SHAPES="1,32,8,128,32768;8,32,8,128,8192;16,8,1,256,8192;8,9,3,64,2048;64,9,3,64,8192"
OUT=$TOP/stages AB_TESTS=0 AB_FORMATS=fp8,int8,int4 AB_ARGS="--shapes $SHAPES" \
  AB_ARMS="plan: s4:KVQ_DECODE_RING_STAGES=4 s8:KVQ_DECODE_RING_STAGES=8 s12:KVQ_DECODE_RING_STAGES=12 s16:KVQ_DECODE_RING_STAGES=16" \
  timeout 170 bash scripts/device_ab.sh > "$TOP/stages_console.txt" 2>&1
echo "stages rc=$? at $((SECONDS - t0)) s"
OUT=$TOP/feed AB_TESTS=0 AB_FORMATS=fp8,int8,int4 AB_ARGS="--shapes $SHAPES" \
  AB_ARMS="plan: self:KVQ_DECODE_RING_FEED=self prod:KVQ_DECODE_RING_FEED=producer" \
  timeout 120 bash scripts/device_ab.sh > "$TOP/feed_console.txt" 2>&1
echo "feed rc=$? at $((SECONDS - t0)) s"
[[ -d .device.unpacked ]] && mv .device.unpacked .device
for d in table stages feed; do
  (cd "$TOP/$d" && tar czf all.tgz ./*.json ab.log && rm -f ./*.json ab.log) 2>/dev/null
done
