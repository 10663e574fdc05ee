#!/usr/bin/env bash
# wave 23 call b: where a one-wave decode's first microseconds go. The same cases with the CTA timeline,
# cold L2 (the read flush before every replay and timeline run, as the tables) and warm (no flush: the
# kernel's code, the lengths, block tables and queries stay in L2 from the replay before, while the first
# pages of each CTA, read first and evicted by the later ones, mostly do not). If the "work" and "query"
# marks shrink warm, the cold prologue (code, metadata) is a part of the ramp; if item0 stays, the first
# pages' queue is the rest. Main's binary.
set -uo pipefail
cd "$(dirname "$0")/../../.."
R=/tmp/w23b; rm -rf $R; mkdir -p $R
source scripts/device_unpack.sh
mkdir -p /tmp/kvq-bin/bin /tmp/kvq-bin/lib
for f in .device/lib/*.xz; do n=$(basename "$f"); kvq_unpack_file "$f" /tmp/kvq-bin/lib/${n%.xz}; done
export LD_LIBRARY_PATH=/tmp/kvq-bin/lib:${LD_LIBRARY_PATH:-}
B=/tmp/kvq-bin/bin; kvq_unpack_file .devbase/kvq_main.xz $B/kvq; chmod +x $B/kvq
S=$R/summary.txt
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee $R/gpu.txt >> $S
SH="8,32,8,128,8192;32,32,8,128,4096;16,8,1,256,8192;8,9,3,64,2048;1,32,8,128,32768"
for round in 1 2; do
  for mode in cold warm; do
    flag=""; [[ $mode == warm ]] && flag="--warm-l2"
    timeout 120 $B/kvq bench decode --backend cuda --kv-cache-dtype bf16,fp8,int4 --block-sizes 16 --iters 30 \
      --shapes "$SH" --timeline --timeline-runs 3 $flag --json $R/${mode}_$round.json > $R/${mode}_$round.log 2>&1
    echo "== $mode round $round rc=$?" >> $S
  done
done
for f in $R/cold_1.log $R/warm_1.log; do echo "---- $(basename $f)" >> $S; sed -n '/decode kernel CTAs/,$p' $f >> $S; done
cd /tmp && tar czf "$OUT/w23b.tgz" w23b && cp $R/summary.txt "$OUT/"
cat $R/summary.txt
