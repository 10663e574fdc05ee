#!/usr/bin/env bash
# wave 21 call g: 41eb020's ring feed on the two shapes where the plan picks the producer warp (producer_fills):
# KVQ_DECODE_RING_FEED auto / self / producer, three rounds alternating
set -uo pipefail
cd "$(dirname "$0")/.."
R=/tmp/${G_NAME:-w21g}; rm -rf $R; mkdir -p $R /tmp/kvq-bin/lib /tmp/kvq-bin/bin
X() { python3 -c "import lzma,sys; open(sys.argv[2],'wb').write(lzma.open(sys.argv[1]).read())" "$1" "$2"; }
for f in .device/lib/*.xz; do X "$f" /tmp/kvq-bin/lib/$(basename "$f" .xz); done
export LD_LIBRARY_PATH=/tmp/kvq-bin/lib:${LD_LIBRARY_PATH:-}
B=/tmp/kvq-bin/bin
X .devbase/kvq_new.xz $B/kvq; chmod +x $B/kvq
S=$R/summary.txt
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $R/gpu.txt >> $S
for round in 1 2 3; do
  for feed in auto self producer; do
    KVQ_DECODE_RING_FEED=$feed timeout 60 $B/kvq bench decode --backend cuda --kv-cache-dtype bf16,fp8,int8,int4 --block-sizes 16,32 \
      --iters 30 --shapes "${G_SHAPES:-8,32,8,128,8192;8,32,16,128,16384}" --json $R/${feed}_$round.json > $R/${feed}_$round.log 2>&1
    echo "== $feed round $round rc=$?" >> $S
  done
done
python3 - $R <<'PY' >> $S
import json, sys, collections
R = sys.argv[1]; V = ["auto", "self", "producer"]; res = collections.defaultdict(dict); feedname = {}
for k in V:
    for r in (1, 2, 3):
        try: rows = json.load(open(f"{R}/{k}_{r}.json"))["decode"]
        except Exception as e: print(k, r, e); continue
        for row in rows:
            key = (f"B{row['batch']} Hq{row['num_q_heads']} Hkv{row['num_kv_heads']} D{row['head_dim']} L{row['seq_len']}", row["format"], row["block_size"])
            res[key].setdefault(k, []).append(row["us_median"]); feedname[key, k] = str(row.get("feed", row.get("ring_feed", "")))
print(f"{'shape':28s} {'fmt':9s} bs " + " ".join(f"{k:>26s}" for k in V) + "  (us min (rounds); auto's feed)")
for key, d in res.items():
    f = lambda xs: "/".join(f"{x:.1f}" for x in xs)
    print(f"{key[0]:28s} {key[1]:9s} {key[2]:2d} " + " ".join(f"{min(d[k]):6.1f} ({f(d[k])})".rjust(26) if k in d else " " * 26 for k in V) + f"  {feedname.get((key, 'auto'), '')}")
PY
cd /tmp && tar czf "$OUT/${G_NAME:-w21g}.tgz" ${G_NAME:-w21g} && cp $R/summary.txt "$OUT/g_summary.txt"
cat $R/summary.txt
