#!/usr/bin/env bash
# wave 21: int4 query-late A/B (int4 + fp8 control, blocks 16 and 32), then GPU tests and sanitizers on int4
set -uo pipefail
cd "$(dirname "$0")/.."
R=/tmp/w21; rm -rf $R; mkdir -p $R
S=$R/summary.txt
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee $R/gpu.txt >> $S
OUT=$R/ab AB_TESTS=0 AB_BS=16,32 AB_FORMATS=int4,fp8 bash scripts/device_ab.sh > $R/ab_stdout.log 2>&1
tail -40 $R/ab/ab.log >> $S
B=/tmp/kvq-bin/bin
timeout 300 $B/test_attention_cuda --gtest_brief=1 > $R/test_attention_cuda.log 2>&1
echo "test_attention_cuda rc=$? $(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' $R/test_attention_cuda.log | tr '\n' ' ')" >> $S
grep -E '^\[  FAILED  \]' $R/test_attention_cuda.log | head -10 >> $S
sub='Sweep/CudaDecode.MatchesCpuReference/int4*:CudaDecodeApi.*'
for tool in memcheck racecheck; do
  timeout 200 compute-sanitizer --tool $tool --error-exitcode 9 $B/test_attention_cuda --gtest_filter="$sub" --gtest_brief=1 > $R/sanitizer_$tool.log 2>&1
  echo "sanitizer $tool rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|PASSED' $R/sanitizer_$tool.log | tr '\n' ' ')" >> $S
done
cd /tmp && tar czf "$OUT/w21.tgz" w21 && cp $R/summary.txt "$OUT/"
cat $R/summary.txt
