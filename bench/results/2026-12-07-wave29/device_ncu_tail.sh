#!/usr/bin/env bash
# wave 29: where the one-wave decode's fixed cost stalls, instruction by instruction. Nsight Compute's warp-state
# sampling (SourceCounters, one sample per SM every 32 cycles) on the first decode launch of each case, product
# instances of main's build, cold caches (--cache-control all), clocks left alone (--clock-control none); the source
# page exported as SASS with the stall reasons per instruction, for the ramp (before the first ring item), the page
# loop and the tail (after the last page: the warps' merge, the stores) to be told apart offline.
# Cases: fp8 and int4 B8 Hq32 Hkv8 D128 L8192 (the #9 / #10 misses), fp8 B16 Hq8 Hkv1 D256 L8192, fp8 B1 Hq32
# Hkv8 D128 L32768; block 16, sink 256 (the bench's default). On an H200 it first runs wave 28's device_h200.sh.
# Carry .device (PACK_ONLY="kvq test_attention_cuda" PACK_BUNDLE=1 scripts/device_engine.sh pack build-cuda).
set -uo pipefail
cd "$(dirname "$0")/../../.."
source scripts/device_unpack.sh
kvq_device_prelude /tmp/w29ncu || exit 2
echo "card: $(cat "$FINAL/gpu.txt")"
if [[ $GPU_NAME == *H200* ]]; then
  mkdir -p "$FINAL/h200"
  OUT="$FINAL/h200" timeout 330 bash bench/results/2026-12-07-wave28/device_h200.sh > "$FINAL/h200_console.txt" 2>&1
  echo "device_h200.sh rc=$?"; tail -3 "$FINAL/h200_console.txt"
fi
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
[[ -n $NCU ]] || { echo "no ncu on this machine" >&2; exit 3; }
"$NCU" --version | tail -1 | tee "$FINAL/ncu_version.txt"
mkdir -p "$FINAL/ncu"
profile() {  # name dtype shape [kernel regex]
  local name=$1 dt=$2 shape=$3 re=${4:-}
  local args=(--clock-control none --cache-control all --kernel-name-base demangled -c 1
              --section SourceCounters --section WarpStateStats --section SpeedOfLight --section LaunchStats
              --section Occupancy --warp-sampling-interval 0 --import-source no -f -o "$FINAL/ncu/$name")
  timeout 150 "$NCU" "${args[@]}" -k "regex:$re" "$B/kvq" bench decode --backend cuda --kv-cache-dtype "$dt" \
    --block-sizes 16 --iters 30 --warmup-ms 0 --shapes "$shape" > "$FINAL/ncu/${name}_run.log" 2>&1
  echo "$name rc=$? $(grep -c '==PROF==' "$FINAL/ncu/${name}_run.log") prof lines"
  [[ -f $FINAL/ncu/$name.ncu-rep ]] || return 1
  "$NCU" -i "$FINAL/ncu/$name.ncu-rep" --page details --print-kernel-base demangled > "$FINAL/ncu/${name}_details.txt" 2>&1
  "$NCU" -i "$FINAL/ncu/$name.ncu-rep" --page source --csv --print-source sass > "$FINAL/ncu/${name}_sass.csv" 2>"$FINAL/ncu/${name}_sass.err"
  echo "  sass rows $(wc -l < "$FINAL/ncu/${name}_sass.csv"); $(grep -m1 -E 'Duration' "$FINAL/ncu/${name}_details.txt")"
}
# Format enum: 2 = fp8_e4m3, 5 = int4 (include/kvq/format/traits.h).
profile fp8_b8hkv8 fp8 "8,32,8,128,8192" 'decode_bulk_kernel<\(kvq::Format\)2,' ||
  profile fp8_b8hkv8_any fp8 "8,32,8,128,8192" 'decode_bulk_kernel'
profile fp8_d256 fp8 "16,8,1,256,8192" 'decode_bulk_kernel<\(kvq::Format\)2,'
profile fp8_b1 fp8 "1,32,8,128,32768" 'decode_bulk_kernel<\(kvq::Format\)2,'
profile int4_b8hkv8 int4 "8,32,8,128,8192" 'decode_bulk_kernel<\(kvq::Format\)5,'
profile merge_b8hkv8 fp8 "8,32,8,128,8192" 'merge'
ls -la "$FINAL/ncu" > "$FINAL/ncu_ls.txt"
(cd "$FINAL" && tar czf ncu_text.tar.gz ncu/*.txt ncu/*.csv ncu/*.log ncu/*.err 2>/dev/null && tar cf ncu_reps.tar ncu/*.ncu-rep 2>/dev/null && gzip -f ncu_reps.tar)
rm -rf "$FINAL/ncu"
[[ -d $FINAL/h200 ]] && (cd "$FINAL" && tar czf h200.tar.gz h200 && rm -rf h200)
ls -la "$FINAL"
