#!/usr/bin/env bash
# wave 20 call a: the bench's two timings (replay, in-graph), all formats, blocks 16 and 32 (16 twice), the write bench, in-graph timeline
set -uo pipefail
cd "$(dirname "$0")/.."
R=/tmp/w20a; rm -rf $R; mkdir -p $R
source scripts/device_unpack.sh; kvq_unpack_device
B=/tmp/kvq-bin/bin
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader > $R/gpu.txt
S=$R/summary.txt
n=0
for bs in 16 32 16; do
  for tm in replay in-graph; do
    n=$((n+1))
    $B/kvq bench decode --backend cuda --kv-cache-dtype bf16,fp8,int8,int4 --block-sizes $bs --iters 30 --timing $tm \
      --json $R/decode_${tm}_bs${bs}_$n.json > $R/decode_${tm}_bs${bs}_$n.log 2>&1
    echo "== decode $tm bs$bs run $n rc=$?" >> $S
  done
done
for tm in replay in-graph; do
  $B/kvq bench write --backend cuda --tokens 65536 --heads 8 --head-dim 128 --kv-cache-dtype bf16,fp8,int8 \
    --timing $tm --json $R/write_$tm.json > $R/write_$tm.log 2>&1
  echo "== write $tm rc=$?" >> $S; tail -12 $R/write_$tm.log >> $S
done
$B/kvq bench decode --backend cuda --kv-cache-dtype fp8,bf16 --block-sizes 16 --iters 30 --timing in-graph --timeline \
  --shapes "32,32,8,128,4096;8,32,8,128,8192;16,8,1,256,8192;8,9,3,64,2048" > $R/timeline_in_graph.log 2>&1
echo "== timeline rc=$?" >> $S
sed -n '/^decode kernel CTAs/,$p' $R/timeline_in_graph.log >> $S
cd /tmp && tar czf "$OUT/w20a.tgz" w20a && cp $R/summary.txt "$OUT/"
