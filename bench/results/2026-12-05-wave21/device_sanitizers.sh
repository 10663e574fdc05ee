#!/usr/bin/env bash
# wave 21 call f: on an H200 first the A/B of w21e.sh; then compute-sanitizer memcheck and racecheck of 41eb020's
# test_attention_cuda over the whole decode sweep and the timeline tests
set -uo pipefail
cd "$(dirname "$0")/.."
name=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
[[ $name == *H200* ]] && bash scripts/w21e.sh
R=/tmp/w21f; rm -rf $R; mkdir -p $R /tmp/kvq-bin/lib /tmp/kvq-bin/bin
X() { python3 -c "import lzma,sys; open(sys.argv[2],'wb').write(lzma.open(sys.argv[1]).read())" "$1" "$2"; }
for f in .device/lib/*.xz; do X "$f" /tmp/kvq-bin/lib/$(basename "$f" .xz); done
export LD_LIBRARY_PATH=/tmp/kvq-bin/lib:${LD_LIBRARY_PATH:-}
B=/tmp/kvq-bin/bin
X .devbase/test_attention_cuda_new.xz $B/tac; chmod +x $B/tac
S=$R/summary.txt
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $R/gpu.txt >> $S
sub='Sweep/CudaDecode.MatchesCpuReference/*:Kernels/CudaDecodeTimeline.*'
for tool in memcheck racecheck; do
  start=$(date +%s)
  timeout 230 compute-sanitizer --tool $tool --error-exitcode 9 $B/tac --gtest_filter="$sub" --gtest_brief=1 > $R/sanitizer_$tool.log 2>&1
  echo "sanitizer $tool rc=$? $(( $(date +%s) - start )) s: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|PASSED|FAILED' $R/sanitizer_$tool.log | tr '\n' ' ')" >> $S
done
cd /tmp && tar czf "$OUT/w21f.tgz" w21f && cp $R/summary.txt "$OUT/f_summary.txt"
cat $R/summary.txt
