#!/usr/bin/env bash
# wave 30 (for the next session with a GPU): what the self-fed ring's instruction-fetch stalls wait on. Wave 29's
# stall samples (fetch_reading_wave29.txt) put 1.3-2.0 us of no_inst on the first instruction after the ring's prime
# (a branch target right after the warp's last bulk copies) and 0.1 us per page on the join after the refill's
# copies, in the self-fed instances only. Three readings fit: (1) a cold instruction line fetched from DRAM behind
# the grid's just-requested ring bytes; (2) the warp held until the SM's copy engine has taken its copies; (3) a loop
# larger than the first-level instruction cache (no: 6-13 KB a warp runs per iteration, sass_loops.txt). Arms, each
# one Nsight Compute warp-state sampling of the first decode launch (as wave 29: cold caches, clocks untouched):
#   fp8 B1 Hq32 Hkv8 L32768, 66 splits, self-fed, ring stages 4 / 8 / 16 (1, 2, 4 units a warp primed): (2) grows
#     with the copies in flight at the prime, (1) does not;
#   the same at L131072 (4x the pages a warp, same prime): a cost paid once a warp keeps its microseconds while
#     the loop's share of the samples grows; a cost per page keeps its share;
#   fp8 B16 Hq8 Hkv1 D256 L8192, producer-fed against self-fed (the same loop code but the refill): whether the
#     consumers of a producer wait on fetch there too.
# Then fetch_reading.py over the exports. Carry .device (PACK_ONLY="kvq" scripts/device_engine.sh pack build-cuda);
# about 6 minutes.
set -uo pipefail
cd "$(dirname "$0")/../../.."
source scripts/device_unpack.sh
kvq_device_prelude /tmp/w30fetch || exit 2
echo "card: $(cat "$FINAL/gpu.txt")"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
[[ -n $NCU ]] || { echo "no ncu on this machine" >&2; exit 3; }
"$NCU" --version | tail -1 | tee "$FINAL/ncu_version.txt"
D=/tmp/w30fetch-ncu && rm -rf $D && mkdir -p $D
profile() {  # name shape splits(0: planned) env...
  local name=$1 shape=$2 splits=$3; shift 3
  local args=(--clock-control none --cache-control all --kernel-name-base demangled -c 1
              --section SourceCounters --section WarpStateStats --section SpeedOfLight --section LaunchStats
              --warp-sampling-interval 0 --import-source no -f -o "$D/$name")
  # Format enum 2 = fp8_e4m3 (include/kvq/format/traits.h)
  env "$@" timeout 150 "$NCU" "${args[@]}" -k 'regex:decode_bulk_kernel<\(kvq::Format\)2,' "$B/kvq" bench decode \
    --backend cuda --kv-cache-dtype fp8 --block-sizes 16 --iters 30 --warmup-ms 0 --splits "$splits" --shapes "$shape" \
    > "$D/${name}_run.log" 2>&1
  echo "$name rc=$? $(grep -E '^B[0-9]' "$D/${name}_run.log" | head -1 | awk '{print "splits", $9, "ctas", $10, "stages", $11, $12}')"
  [[ -f $D/$name.ncu-rep ]] || return 1
  "$NCU" -i "$D/$name.ncu-rep" --page details --print-kernel-base demangled > "$D/${name}_details.txt" 2>&1
  "$NCU" -i "$D/$name.ncu-rep" --page source --csv --print-source sass > "$D/${name}_sass.csv" 2>"$D/${name}_sass.err"
}
for st in 4 8 16; do
  profile b1_l32k_s$st "1,32,8,128,32768" 66 KVQ_DECODE_RING_FEED=self KVQ_DECODE_RING_STAGES=$st
done
profile b1_l128k_s8 "1,32,8,128,131072" 66 KVQ_DECODE_RING_FEED=self KVQ_DECODE_RING_STAGES=8
profile d256_self "16,8,1,256,8192" 0 KVQ_DECODE_RING_FEED=self
profile d256_producer "16,8,1,256,8192" 0 KVQ_DECODE_RING_FEED=producer
python3 bench/results/2026-12-07-wave30/fetch_reading.py $D | tee "$FINAL/fetch_reading.txt"
(cd $D && gzip -9 ./*_sass.csv && tar czf "$FINAL/ncu_text.tgz" ./*.txt ./*.csv.gz ./*.log ./*.err)
ls -la "$FINAL"
