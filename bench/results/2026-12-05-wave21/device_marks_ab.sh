#!/usr/bin/env bash
# wave 21 call c: marks compiled out of the product's decode kernels (kTL instances for --timeline):
# GPU tests + sanitizers of the new build, then a same-run A/B against main (09a6b96 kernels)
set -uo pipefail
cd "$(dirname "$0")/.."
R=/tmp/w21c; rm -rf $R; mkdir -p $R /tmp/kvq-bin/lib /tmp/kvq-bin/bin
for f in .device/lib/*.gz; do gunzip -c "$f" > /tmp/kvq-bin/lib/$(basename "$f" .gz); done
export LD_LIBRARY_PATH=/tmp/kvq-bin/lib:${LD_LIBRARY_PATH:-}
B=/tmp/kvq-bin/bin
for v in kvq_base kvq_new test_attention_cuda_new; do python3 -c "import lzma,sys; open(sys.argv[2],'wb').write(lzma.open(sys.argv[1]).read())" .devbase/$v.xz $B/$v; chmod +x $B/$v; done
S=$R/summary.txt
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee $R/gpu.txt >> $S
timeout 300 $B/test_attention_cuda_new --gtest_brief=1 > $R/test_attention_cuda.log 2>&1
echo "test_attention_cuda rc=$? $(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' $R/test_attention_cuda.log | tr '\n' ' ')" >> $S
grep -E '^\[  FAILED  \]' $R/test_attention_cuda.log | head -10 >> $S
sub='Sweep/CudaDecode.MatchesCpuReference/int4*:CudaDecodeApi.*'
for tool in memcheck racecheck; do
  timeout 150 compute-sanitizer --tool $tool --error-exitcode 9 $B/test_attention_cuda_new --gtest_filter="$sub" --gtest_brief=1 > $R/sanitizer_$tool.log 2>&1
  echo "sanitizer $tool rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|PASSED' $R/sanitizer_$tool.log | tr '\n' ' ')" >> $S
done
for v in kvq_base kvq_new; do
  echo "== $v" >> $R/resources.txt
  cuobjdump --dump-resource-usage $B/$v 2>&1 | grep -A1 -E 'Function .*decode_(bulk_)?kernel' | grep -E 'Function|REG' | paste - - | sed -E 's/.*Function ([^:]*):/\1/' | cut -c1-300 >> $R/resources.txt
done
for round in 1 2; do
  for v in kvq_base kvq_new; do
    timeout 120 $B/$v bench decode --backend cuda --kv-cache-dtype bf16,fp8,int8,int4 --block-sizes 16 --iters 30 \
      --json $R/${v}_$round.json > $R/${v}_$round.log 2>&1
    echo "== $v round $round rc=$?" >> $S
  done
done
timeout 60 $B/kvq_new bench decode --backend cuda --kv-cache-dtype int4,fp8 --block-sizes 16 --iters 30 --timeline \
  --shapes "64,9,3,64,8192;1,32,8,128,32768" > $R/timeline_new.log 2>&1
echo "timeline run rc=$?" >> $S
python3 - $R <<'PY' >> $S
import json, sys, collections
R = sys.argv[1]; V = ["kvq_base", "kvq_new"]; res = collections.defaultdict(dict); rd = {}
for k in V:
    for r in (1, 2):
        try: rows = json.load(open(f"{R}/{k}_{r}.json"))["decode"]
        except Exception as e: print(k, r, e); continue
        for row in rows:
            key = (f"B{row['batch']} Hq{row['num_q_heads']} Hkv{row['num_kv_heads']} D{row['head_dim']} L{row['seq_len']}", row["format"])
            res[key].setdefault(k, []).append(row["us_median"]); rd[key, k] = row.get("frac_of_read", 0)
print(f"{'shape':28s} {'fmt':9s} {'base(r1/r2)':>18s} {'new(r1/r2)':>18s} new/base %read_new")
for key, d in res.items():
    if len(d) < 2: continue
    b, n = min(d["kvq_base"]), min(d["kvq_new"])
    print(f"{key[0]:28s} {key[1]:9s} {b:7.1f}({'/'.join(f'{x:.1f}' for x in d['kvq_base'])}) {n:7.1f}({'/'.join(f'{x:.1f}' for x in d['kvq_new'])}) {n/b:6.3f} {100*rd[key,'kvq_new']:5.1f}")
PY
cd /tmp && tar czf "$OUT/w21c.tgz" w21c && cp $R/summary.txt $R/resources.txt "$OUT/"
cat $R/summary.txt
