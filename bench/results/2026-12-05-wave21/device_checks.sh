#!/usr/bin/env bash
# wave 21 call j: test_backend of 41eb020 with stories260K in place (the ReproducibleStories suite; the model at
# the build's compile-time path /work/main/../shared) and test_attention_cuda of the final plan
set -uo pipefail
cd "$(dirname "$0")/.."
R=/tmp/w21j; rm -rf $R; mkdir -p $R /tmp/kvq-bin/lib /tmp/kvq-bin/bin /work/main /work/shared/models
X() { python3 -c "import lzma,sys; open(sys.argv[2],'wb').write(lzma.open(sys.argv[1]).read())" "$1" "$2"; }
for f in .device/lib/*.xz; do X "$f" /tmp/kvq-bin/lib/$(basename "$f" .xz); done
export LD_LIBRARY_PATH=/tmp/kvq-bin/lib:${LD_LIBRARY_PATH:-}
B=/tmp/kvq-bin/bin
[[ -e /work/shared/models/stories260K ]] || cp -r .devbase/stories260K /work/shared/models/
for v in test_backend_new test_attention_cuda_plan; do X .devbase/$v.xz $B/$v; chmod +x $B/$v; done
S=$R/summary.txt
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $R/gpu.txt >> $S
for t in test_attention_cuda_plan test_backend_new; do
  timeout 240 $B/$t --gtest_brief=1 > $R/$t.log 2>&1
  echo "$t rc=$? $(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' $R/$t.log | tr '\n' ' ')" >> $S
  grep -E '^\[  FAILED  \]|Failure' $R/$t.log | head -10 >> $S
done
grep -E "^\[  SKIPPED \] [A-Za-z]" $R/test_backend_new.log >> $S
cd /tmp && tar czf "$OUT/w21j.tgz" w21j && cp $R/summary.txt "$OUT/j_summary.txt"
cat $R/summary.txt
