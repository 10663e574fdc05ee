#!/usr/bin/env bash
# wave 20 call c: int4 on main against 832afbc (wave 13's kernels) and 079a5d8 (wave 14's first kernel commit), same machine
set -uo pipefail
cd "$(dirname "$0")/.."
R=/tmp/w20c; rm -rf $R; mkdir -p $R
source scripts/device_unpack.sh; kvq_unpack_device
B=/tmp/kvq-bin/bin
for v in 832 079; do gunzip -c .devbase/kvq_$v.gz > $B/kvq_$v && chmod +x $B/kvq_$v; done
S=$R/summary.txt
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee $R/gpu.txt >> $S
for k in kvq kvq_832 kvq_079; do
  echo "== $k" >> $R/resources.txt
  cuobjdump --dump-resource-usage $B/$k 2>&1 | grep -A1 -E 'Function .*decode_bulk_kernel.*Format.E5' | grep -E 'Function|REG' | paste - - | sed -E 's/.*Function ([^:]*):/\1/' | cut -c1-250 >> $R/resources.txt
done
SH="16,32,16,128,32768;64,32,8,128,8192;8,32,16,128,16384;64,9,3,64,8192;8,32,8,128,8192"
for round in 1 2; do
  for k in kvq_832 kvq_079 kvq; do
    $B/$k bench decode --backend cuda --kv-cache-dtype bf16,fp8,int4 --block-sizes 16 --iters 30 --shapes "$SH" \
      --json $R/${k}_$round.json > $R/${k}_$round.log 2>&1
    echo "== $k round $round rc=$?" >> $S
  done
done
python3 - $R <<'PY' >> $S
import json, sys, collections
R = sys.argv[1]; res = collections.defaultdict(dict)
for k in ("kvq_832", "kvq_079", "kvq"):
    for r in (1, 2):
        for row in json.load(open(f"{R}/{k}_{r}.json"))["decode"]:
            key = (f"B{row['batch']} Hq{row['num_q_heads']} Hkv{row['num_kv_heads']} D{row['head_dim']} L{row['seq_len']}", row["format"])
            res[key].setdefault(k, []).append(row["us_median"])
print(f"{'shape':30s} {'fmt':9s} " + "  ".join(f"{k:>16s}" for k in ("kvq_832", "kvq_079", "kvq")))
for key, v in res.items():
    print(f"{key[0]:30s} {key[1]:9s} " + "  ".join(f"{min(v[k]):7.1f}({max(v[k]):6.1f})" for k in ("kvq_832", "kvq_079", "kvq")))
PY
cd /tmp && tar czf "$OUT/w20c.tgz" w20c && cp $R/summary.txt $R/resources.txt "$OUT/"
