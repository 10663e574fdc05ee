#!/usr/bin/env bash
# wave 22 call b: where the cluster merge's time goes: fp8 at block 16, merge kernel (0) vs cluster (1, forced
# where a cluster fits), at the planned splits and forced 4 / 8; --timeline on the planned cluster runs.
set -uo pipefail
cd "$(dirname "$0")/../../.."
R=/tmp/w22b; rm -rf $R; mkdir -p $R /tmp/kvq-bin/lib /tmp/kvq-bin/bin
X() { python3 -c "import lzma,sys; open(sys.argv[2],'wb').write(lzma.open(sys.argv[1]).read())" "$1" "$2"; }
for f in .device/lib/*.xz; do X "$f" /tmp/kvq-bin/lib/$(basename "$f" .xz); done
export LD_LIBRARY_PATH=/tmp/kvq-bin/lib:${LD_LIBRARY_PATH:-}
B=/tmp/kvq-bin/bin; X .devbase/kvq_new.xz $B/kvq; chmod +x $B/kvq
S=$R/summary.txt
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $R/gpu.txt >> $S
SH="8,9,3,64,2048;8,32,8,128,8192;16,8,1,256,8192;64,9,3,64,8192"
for round in 1 2; do
  for sp in 0 4 8; do
    for cl in 0 1; do
      a=(); [[ $sp != 0 ]] && a=(--splits $sp)
      KVQ_DECODE_CLUSTER_MERGE=$cl timeout 60 $B/kvq bench decode --backend cuda --kv-cache-dtype fp8 --block-sizes 16 --iters 30 \
        --shapes "$SH" "${a[@]}" --json $R/s${sp}_c${cl}_$round.json > $R/s${sp}_c${cl}_$round.log 2>&1
      echo "== splits $sp cluster $cl round $round rc=$?" >> $S
    done
  done
done
KVQ_DECODE_CLUSTER_MERGE=1 timeout 60 $B/kvq bench decode --backend cuda --kv-cache-dtype fp8 --block-sizes 16 --iters 30 \
  --shapes "$SH" --timeline > $R/timeline_c1.log 2>&1
KVQ_DECODE_CLUSTER_MERGE=0 timeout 60 $B/kvq bench decode --backend cuda --kv-cache-dtype fp8 --block-sizes 16 --iters 30 \
  --shapes "$SH" --timeline > $R/timeline_c0.log 2>&1
python3 - $R <<'PY' >> $S
import json, sys, collections
R = sys.argv[1]; res = collections.defaultdict(list); info = {}
for sp in (0, 4, 8):
    for cl in (0, 1):
        for r in (1, 2):
            try: rows = json.load(open(f"{R}/s{sp}_c{cl}_{r}.json"))["decode"]
            except Exception as e: print(sp, cl, r, e); continue
            for row in rows:
                k = (f"B{row['batch']} Hq{row['num_q_heads']} Hkv{row['num_kv_heads']} D{row['head_dim']} L{row['seq_len']}", sp, cl)
                res[k].append(row["us_median"]); info[k] = f"{row['splits']}{'c' if row.get('cluster_merge') else ''}"
print(f"{'shape':28s} {'forced':>6s} {'merge kernel us':>16s} {'cluster us':>16s} cluster/kernel")
for (shape, sp, cl), v in sorted(res.items()):
    if cl != 0: continue
    c = res.get((shape, sp, 1))
    if not c: continue
    print(f"{shape:28s} {sp:6d} {min(v):8.1f} ({info[shape,sp,0]:>3s}) {min(c):8.1f} ({info[shape,sp,1]:>3s}) {min(c)/min(v):6.3f}")
PY
grep -A12 '^decode kernel CTAs' $R/timeline_c0.log >> $S; grep -A12 '^decode kernel CTAs' $R/timeline_c1.log >> $S
cd /tmp && tar czf "$OUT/w22b.tgz" w22b && cp $R/summary.txt "$OUT/"
cat $R/summary.txt
