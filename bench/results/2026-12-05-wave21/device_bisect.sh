#!/usr/bin/env bash
# wave 21 call b: int4's wave-14 step on one H200, same run: main, 832afbc, 079a5d8, main without the timeline
# marks, main with unpadded merge rows (two rounds each, alternating)
set -uo pipefail
cd "$(dirname "$0")/.."
R=/tmp/w21b; rm -rf $R; mkdir -p $R /tmp/kvq-bin/lib /tmp/kvq-bin/bin
for f in .device/lib/*.gz; do gunzip -c "$f" > /tmp/kvq-bin/lib/$(basename "$f" .gz); done
export LD_LIBRARY_PATH=/tmp/kvq-bin/lib:${LD_LIBRARY_PATH:-}
B=/tmp/kvq-bin/bin
V="base 832 079 nomarks unpadded"
for v in $V; do python3 -c "import lzma,sys; open(sys.argv[2],'wb').write(lzma.open(sys.argv[1]).read())" .devbase/kvq_$v.xz $B/kvq_$v; chmod +x $B/kvq_$v; done
S=$R/summary.txt
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee $R/gpu.txt >> $S
for v in $V; do
  echo "== $v" >> $R/resources.txt
  cuobjdump --dump-resource-usage $B/kvq_$v 2>&1 | grep -A1 -E 'Function .*decode_bulk_kernel' | grep -E 'Function|REG' | paste - - | sed -E 's/.*Function ([^:]*):/\1/' | cut -c1-300 >> $R/resources.txt
done
SH="16,32,16,128,32768;64,32,8,128,8192;8,32,16,128,16384;32,32,8,128,4096;64,9,3,64,8192"
for round in 1 2; do
  for v in $V; do
    $B/kvq_$v bench decode --backend cuda --kv-cache-dtype bf16,fp8,int4 --block-sizes 16 --iters 30 --shapes "$SH" \
      --json $R/${v}_$round.json > $R/${v}_$round.log 2>&1
    echo "== $v round $round rc=$?" >> $S
  done
done
python3 - $R "$V" <<'PY' >> $S
import json, sys, collections
R, V = sys.argv[1], sys.argv[2].split(); res = collections.defaultdict(dict)
for k in V:
    for r in (1, 2):
        try: rows = json.load(open(f"{R}/{k}_{r}.json"))["decode"]
        except Exception as e: print(k, r, e); continue
        for row in rows:
            key = (f"B{row['batch']} Hq{row['num_q_heads']} Hkv{row['num_kv_heads']} D{row['head_dim']} L{row['seq_len']}", row["format"])
            res[key].setdefault(k, []).append(row["us_median"])
print(f"{'shape':28s} {'fmt':9s} " + " ".join(f"{k:>14s}" for k in V) + "   (us, min of 2 rounds; r1/r2)")
for key, d in res.items():
    print(f"{key[0]:28s} {key[1]:9s} " + " ".join(f"{min(d[k]):7.1f}({'/'.join(f'{x:.0f}' for x in d[k])})" if k in d else f"{'-':>14s}" for k in V))
PY
cd /tmp && tar czf "$OUT/w21b.tgz" w21b && cp $R/summary.txt $R/resources.txt "$OUT/"
cat $R/summary.txt
