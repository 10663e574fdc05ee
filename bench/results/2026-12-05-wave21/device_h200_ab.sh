#!/usr/bin/env bash
# wave 21 call e: only on an H200 (else exit at once): 41eb020 vs main's kernels (09a6b96), the nine shapes, blocks
# 16 and 32, two rounds; test_attention_cuda of the new build
set -uo pipefail
cd "$(dirname "$0")/.."
name=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "$name" > "$OUT/gpu.txt"
[[ $name == *H200* ]] || { echo "not an H200: $name"; exit 0; }
R=/tmp/w21e; rm -rf $R; mkdir -p $R /tmp/kvq-bin/lib /tmp/kvq-bin/bin
X() { python3 -c "import lzma,sys; open(sys.argv[2],'wb').write(lzma.open(sys.argv[1]).read())" "$1" "$2"; }
for f in .device/lib/*.xz; do X "$f" /tmp/kvq-bin/lib/$(basename "$f" .xz); done
export LD_LIBRARY_PATH=/tmp/kvq-bin/lib:${LD_LIBRARY_PATH:-}
B=/tmp/kvq-bin/bin
for v in kvq_base kvq_new test_attention_cuda_new; do X .devbase/$v.xz $B/$v; chmod +x $B/$v; done
S=$R/summary.txt
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee $R/gpu.txt >> $S
timeout 200 $B/test_attention_cuda_new --gtest_brief=1 > $R/test_attention_cuda_new.log 2>&1
echo "test_attention_cuda_new rc=$? $(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' $R/test_attention_cuda_new.log | tr '\n' ' ')" >> $S
for round in 1 2; do
  for v in kvq_base kvq_new; do
    timeout 150 $B/$v bench decode --backend cuda --kv-cache-dtype bf16,fp8,int8,int4 --block-sizes 16,32 --iters 30 \
      --json $R/${v}_$round.json > $R/${v}_$round.log 2>&1
    echo "== $v round $round rc=$?" >> $S
  done
done
python3 - $R <<'PY' >> $S
import json, sys, collections
R = sys.argv[1]; V = ["kvq_base", "kvq_new"]; res = collections.defaultdict(dict); rd = {}
for k in V:
    for r in (1, 2):
        try: rows = json.load(open(f"{R}/{k}_{r}.json"))["decode"]
        except Exception as e: print(k, r, e); continue
        for row in rows:
            key = (f"B{row['batch']} Hq{row['num_q_heads']} Hkv{row['num_kv_heads']} D{row['head_dim']} L{row['seq_len']}", row["format"], row["block_size"])
            res[key].setdefault(k, []).append(row["us_median"]); rd[key, k] = row.get("frac_of_read", 0)
print(f"{'shape':28s} {'fmt':9s} bs {'base us (rounds)':>24s} {'new us (rounds)':>24s} new/base %read_new new/bf16new")
for key, d in res.items():
    if len(d) < 2: continue
    b, n = min(d["kvq_base"]), min(d["kvq_new"])
    bfk = (key[0], "bf16", key[2]); bfn = min(res[bfk]["kvq_new"]) if bfk in res else float("nan")
    f = lambda xs: "/".join(f"{x:.1f}" for x in xs)
    print(f"{key[0]:28s} {key[1]:9s} {key[2]:2d} {b:7.1f} ({f(d['kvq_base'])}) {n:7.1f} ({f(d['kvq_new'])}) {n/b:6.3f} {100*rd[key,'kvq_new']:5.1f} {n/bfn:6.3f}")
PY
cd /tmp && tar czf "$OUT/w21e.tgz" w21e && cp $R/summary.txt "$OUT/"
cat $R/summary.txt
