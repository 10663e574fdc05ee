#!/usr/bin/env bash
# wave 21 call d: 41eb020 (marks out of the product's kernels): GPU tests (test_attention_cuda, test_backend),
# sanitizers on the timeline tests, then a same-run A/B against main's kernels (09a6b96), blocks 16 and 32, and
# three more rounds of the latency-bound shapes; SASS of int8's B1 kernel in both builds
set -uo pipefail
cd "$(dirname "$0")/.."
R=/tmp/w21d; rm -rf $R; mkdir -p $R /tmp/kvq-bin/lib /tmp/kvq-bin/bin
X() { python3 -c "import lzma,sys; open(sys.argv[2],'wb').write(lzma.open(sys.argv[1]).read())" "$1" "$2"; }
for f in .device/lib/*.xz; do X "$f" /tmp/kvq-bin/lib/$(basename "$f" .xz); done
export LD_LIBRARY_PATH=/tmp/kvq-bin/lib:${LD_LIBRARY_PATH:-}
B=/tmp/kvq-bin/bin
for v in kvq_base kvq_new test_attention_cuda_new test_backend_new; do X .devbase/$v.xz $B/$v; chmod +x $B/$v; done
S=$R/summary.txt
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee $R/gpu.txt >> $S
for t in test_attention_cuda_new test_backend_new; do
  timeout 240 $B/$t --gtest_brief=1 > $R/$t.log 2>&1
  echo "$t rc=$? $(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' $R/$t.log | tr '\n' ' ')" >> $S
  grep -E '^\[  FAILED  \]' $R/$t.log | head -10 >> $S
done
for tool in memcheck racecheck; do
  timeout 100 compute-sanitizer --tool $tool --error-exitcode 9 $B/test_attention_cuda_new --gtest_filter='*Timeline*' --gtest_brief=1 > $R/sanitizer_$tool.log 2>&1
  echo "sanitizer $tool (timeline tests) rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|PASSED' $R/sanitizer_$tool.log | tr '\n' ' ')" >> $S
done
F=_ZN3kvq9attention4cuda6detail18decode_bulk_kernelILNS_6FormatE4ELi128ELNS2_9ScaleModeE1ELi4ELNS2_4FeedE0ELb1E
cuobjdump -sass -fun ${F}EEvNS2_12DecodeParamsE $B/kvq_base > $R/sass_int8_b1_base.txt 2>&1
cuobjdump -sass -fun ${F}Lb0EEEvNS2_12DecodeParamsE $B/kvq_new > $R/sass_int8_b1_new.txt 2>&1
echo "sass lines base $(wc -l < $R/sass_int8_b1_base.txt) new $(wc -l < $R/sass_int8_b1_new.txt)" >> $S
LAT="1,32,8,128,32768;8,9,3,64,2048"
for round in 1 2 3 4 5; do
  for v in kvq_base kvq_new; do
    if [[ $round -le 2 ]]; then
      timeout 150 $B/$v bench decode --backend cuda --kv-cache-dtype bf16,fp8,int8,int4 --block-sizes 16,32 --iters 30 \
        --json $R/${v}_$round.json > $R/${v}_$round.log 2>&1
    else
      timeout 60 $B/$v bench decode --backend cuda --kv-cache-dtype fp8,int8,int4 --block-sizes 16,32 --iters 30 \
        --shapes "$LAT" --json $R/${v}_$round.json > $R/${v}_$round.log 2>&1
    fi
    echo "== $v round $round rc=$?" >> $S
  done
done
python3 - $R <<'PY' >> $S
import json, sys, collections
R = sys.argv[1]; V = ["kvq_base", "kvq_new"]; res = collections.defaultdict(dict); rd = {}
for k in V:
    for r in range(1, 6):
        try: rows = json.load(open(f"{R}/{k}_{r}.json"))["decode"]
        except Exception as e: print(k, r, e); continue
        for row in rows:
            key = (f"B{row['batch']} Hq{row['num_q_heads']} Hkv{row['num_kv_heads']} D{row['head_dim']} L{row['seq_len']}", row["format"], row["block_size"])
            res[key].setdefault(k, []).append(row["us_median"]); rd[key, k] = row.get("frac_of_read", 0)
print(f"{'shape':28s} {'fmt':9s} bs {'base us (rounds)':>30s} {'new us (rounds)':>30s} new/base %read_new")
for key, d in res.items():
    if len(d) < 2: continue
    b, n = min(d["kvq_base"]), min(d["kvq_new"])
    f = lambda xs: "/".join(f"{x:.1f}" for x in xs)
    print(f"{key[0]:28s} {key[1]:9s} {key[2]:2d} {b:7.1f} ({f(d['kvq_base'])}) {n:7.1f} ({f(d['kvq_new'])}) {n/b:6.3f} {100*rd[key,'kvq_new']:5.1f}")
PY
cd /tmp && tar czf "$OUT/w21d.tgz" w21d && cp $R/summary.txt "$OUT/"
cat $R/summary.txt
