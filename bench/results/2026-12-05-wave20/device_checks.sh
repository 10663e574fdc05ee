#!/usr/bin/env bash
# wave 20 call b (H100 or H200): GPU tests, compute-sanitizer on the decode subset, plan checks on this card
set -uo pipefail
cd "$(dirname "$0")/.."
R=/tmp/w20b; rm -rf $R; mkdir -p $R
source scripts/device_unpack.sh; kvq_unpack_device
B=/tmp/kvq-bin/bin
S=$R/summary.txt
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee $R/gpu.txt >> $S
mkdir -p /work/shared/models && cp -r .devmodels/stories260K /work/shared/models/
python3 -c "import pydoc_data.topics as t, sys; sys.stdout.write('\n\n'.join(t.topics[k].rstrip() for k in sorted(t.topics)) + '\n')" > /tmp/pydoc.txt 2>/dev/null
export KVQ_EVAL_TEXT=/tmp/pydoc.txt
for t in test_attention_cuda test_backend; do
  timeout 300 $B/$t --gtest_brief=1 > $R/$t.log 2>&1
  echo "$t rc=$? $(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' $R/$t.log | tr '\n' ' ')" >> $S
  grep -E '^\[  FAILED  \]' $R/$t.log | head -10 >> $S
done
sub='Sweep/CudaDecode.MatchesCpuReference/*D256*:CudaDecodeApi.*'
for tool in memcheck racecheck; do
  timeout 240 compute-sanitizer --tool $tool --error-exitcode 9 $B/test_attention_cuda --gtest_filter="$sub" --gtest_brief=1 > $R/sanitizer_$tool.log 2>&1
  echo "sanitizer $tool rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|PASSED' $R/sanitizer_$tool.log | tr '\n' ' ')" >> $S
done
# plan checks: splits on the one-wave B8 Hkv8 L8192; feeds and splits on B32 L4096 int8 block 16
for sp in 0 4 6 8 12; do
  $B/kvq bench decode --backend cuda --kv-cache-dtype fp8,int4 --block-sizes 16 --iters 30 --splits $sp \
    --shapes "8,32,8,128,8192" --json $R/b8_splits$sp.json > $R/b8_splits$sp.log 2>&1
  echo "== B8 Hkv8 splits $sp rc=$?" >> $S; grep -E "^B8" $R/b8_splits$sp.log >> $S
done
for feed in auto self producer; do
  for sp in 0 1 2; do
    KVQ_DECODE_RING_FEED=$([[ $feed == auto ]] && echo "" || echo $feed) $B/kvq bench decode --backend cuda --kv-cache-dtype int8,fp8 --block-sizes 16 --iters 30 --splits $sp \
      --shapes "32,32,8,128,4096" --json $R/b32_${feed}_$sp.json > $R/b32_${feed}_$sp.log 2>&1
    echo "== B32 feed $feed splits $sp rc=$?" >> $S; grep -E "^B32" $R/b32_${feed}_$sp.log >> $S
  done
done
cd /tmp && tar czf "$OUT/w20b.tgz" w20b && cp $R/summary.txt "$OUT/"
