#!/usr/bin/env bash
# wave 21 call i: int4 keeps the self-fed ring where producer_fills switched (decode.cu plan) vs 41eb020:
# test_attention_cuda of the new build, then int4 (+ fp8 control) on the nine shapes, blocks 16 and 32, two rounds
set -uo pipefail
cd "$(dirname "$0")/.."
R=/tmp/w21i; rm -rf $R; mkdir -p $R /tmp/kvq-bin/lib /tmp/kvq-bin/bin
X() { python3 -c "import lzma,sys; open(sys.argv[2],'wb').write(lzma.open(sys.argv[1]).read())" "$1" "$2"; }
for f in .device/lib/*.xz; do X "$f" /tmp/kvq-bin/lib/$(basename "$f" .xz); done
export LD_LIBRARY_PATH=/tmp/kvq-bin/lib:${LD_LIBRARY_PATH:-}
B=/tmp/kvq-bin/bin
for v in kvq_new kvq_plan test_attention_cuda_plan; do X .devbase/$v.xz $B/$v; chmod +x $B/$v; done
S=$R/summary.txt
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $R/gpu.txt >> $S
timeout 200 $B/test_attention_cuda_plan --gtest_brief=1 > $R/test_attention_cuda_plan.log 2>&1
echo "test_attention_cuda_plan rc=$? $(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' $R/test_attention_cuda_plan.log | tr '\n' ' ')" >> $S
grep -E '^\[  FAILED  \]' $R/test_attention_cuda_plan.log | head >> $S
for round in 1 2; do
  for v in kvq_new kvq_plan; do
    timeout 100 $B/$v bench decode --backend cuda --kv-cache-dtype bf16,fp8,int4 --block-sizes 16,32 --iters 30 \
      --json $R/${v}_$round.json > $R/${v}_$round.log 2>&1
    echo "== $v round $round rc=$?" >> $S
  done
done
python3 - $R <<'PY' >> $S
import json, sys, collections
R = sys.argv[1]; V = ["kvq_new", "kvq_plan"]; res = collections.defaultdict(dict); feed = {}
for k in V:
    for r in (1, 2):
        try: rows = json.load(open(f"{R}/{k}_{r}.json"))["decode"]
        except Exception as e: print(k, r, e); continue
        for row in rows:
            key = (f"B{row['batch']} Hq{row['num_q_heads']} Hkv{row['num_kv_heads']} D{row['head_dim']} L{row['seq_len']}", row["format"], row["block_size"])
            res[key].setdefault(k, []).append(row["us_median"]); feed[key, k] = str(row.get("feed", ""))
print(f"{'shape':28s} {'fmt':9s} bs {'41eb020 us':>20s} {'plan us':>20s} plan/41eb020 feed(41eb020->plan) plan/bf16")
for key, d in res.items():
    if len(d) < 2: continue
    b, n = min(d["kvq_new"]), min(d["kvq_plan"])
    bfk = (key[0], "bf16", key[2]); bfn = min(res[bfk]["kvq_plan"]) if bfk in res else float("nan")
    f = lambda xs: "/".join(f"{x:.1f}" for x in xs)
    print(f"{key[0]:28s} {key[1]:9s} {key[2]:2d} {b:7.1f} ({f(d['kvq_new'])}) {n:7.1f} ({f(d['kvq_plan'])}) {n/b:6.3f} {feed[key,'kvq_new']}->{feed[key,'kvq_plan']} {n/bfn:6.3f}")
PY
cd /tmp && tar czf "$OUT/w21i.tgz" w21i && cp $R/summary.txt "$OUT/i_summary.txt"
cat $R/summary.txt
