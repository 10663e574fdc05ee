#!/usr/bin/env bash
# One GPU call for the cache-write kernels (issue #9, docs/GPU_NOTES.md §6): the write benchmark at
# the issue's shape (65,536 tokens x 8 kv heads x 128, bf16 and fp32 rows), Nsight Compute on the
# fp8 write kernels, the bit-exactness tests and compute-sanitizer memcheck on them.
#
#   scripts/device_write.sh pack BUILD_DIR [BASE_KVQ]   (build machine) stripped, gzipped kvq,
#        test_attention_cuda, test_backend and their non-CUDA shared libraries -> .gpu-write/ (KVQ_PACK_DIR);
#        BASE_KVQ: a kvq binary of the previous kernel, timed in the same run for comparison.
#   scripts/device_write.sh run                         (GPU machine, carry .gpu-write) KVQ_STEPS
#        from "bench ncu tests sanitize" (default: all); logs and JSON in $OUT, a table printed last.
set -uo pipefail
cd "$(dirname "$0")/.."
pack="${KVQ_PACK_DIR:-.gpu-write}"  # git-ignored (/.gpu-*/)

if [[ ${1:-run} == pack ]]; then
  build="${2:?usage: device_write.sh pack BUILD_DIR [BASE_KVQ]}"
  rm -rf $pack && mkdir -p $pack/bin $pack/lib
  for b in kvq tests/test_attention_cuda tests/test_backend; do
    [[ -x $build/$b ]] && cp "$build/$b" $pack/bin/ && strip -s "$pack/bin/$(basename "$b")"
  done
  [[ -n ${3:-} ]] && cp "$3" $pack/bin/kvq_base && strip -s $pack/bin/kvq_base
  ldd $pack/bin/* 2>/dev/null | awk '/=> \//{print $3}' | sort -u |
    grep -vE '/(libc|libm|libstdc\+\+|libgcc_s|libpthread|libdl|librt|ld-linux[^/]*)\.so|libcu' |
    while read -r lib; do cp -L "$lib" $pack/lib/; done
  gzip -9 $pack/bin/* $pack/lib/*
  du -sh $pack
  exit 0
fi

OUT="${OUT:-$PWD/device-out}"
mkdir -p "$OUT" /tmp/kw/bin /tmp/kw/lib
for f in $pack/bin/*.gz; do gunzip -c "$f" >"/tmp/kw/bin/$(basename "$f" .gz)"; done
for f in $pack/lib/*.gz; do [[ -e $f ]] && gunzip -c "$f" >"/tmp/kw/lib/$(basename "$f" .gz)"; done
chmod +x /tmp/kw/bin/*
cudalib=$(dirname "$(find / -name 'libcublas.so.13*' -path '*cuda*' 2>/dev/null | head -1)")
export LD_LIBRARY_PATH="/tmp/kw/lib:${cudalib}:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
B=/tmp/kw/bin
steps="${KVQ_STEPS:-bench ncu tests sanitize}"
summary="$OUT/summary.txt"
note() { echo "$*" | tee -a "$summary"; }
note "device: $(nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader 2>/dev/null)"
shape=(--tokens "${KVQ_TOKENS:-65536}" --heads 8 --head-dim 128)

if [[ $steps == *bench* ]]; then
  if [[ -x $B/kvq_base ]]; then
    timeout 120 $B/kvq_base bench write --backend cuda "${shape[@]}" --json "$OUT/bench_write_base.json" >"$OUT/bench.log" 2>&1
    note "bench write (base): rc=$?"
  fi
  timeout 150 $B/kvq bench write --backend cuda "${shape[@]}" --input both --json "$OUT/bench_write.json" >>"$OUT/bench.log" 2>&1
  note "bench write: rc=$?"
  timeout 60 $B/kvq bench write --backend cuda "${shape[@]}" --block-size 32 --kv-cache-dtype fp8,int8 >>"$OUT/bench.log" 2>&1
  note "bench write block 32: rc=$?"
fi

if [[ $steps == *ncu* ]] && command -v ncu >/dev/null; then
  : >"$OUT/ncu.txt"
  for bin in kvq_base kvq; do
    [[ -x $B/$bin ]] || continue
    for gr in per_token_head per_block_head; do
      echo "=== $bin fp8 $gr" >>"$OUT/ncu.txt"
      timeout 90 ncu --clock-control none --kernel-name regex:"write_(rows|segments)_kernel" --launch-count 2 \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section SchedulerStats \
        --section WarpStateStats --section LaunchStats \
        $B/$bin bench write --backend cuda "${shape[@]}" --kv-cache-dtype fp8 --kv-scale-granularity $gr --iters 30 \
        --warmup 1 >>"$OUT/ncu.txt" 2>&1
      note "ncu $bin $gr: rc=$?"
    done
  done
fi

if [[ $steps == *tests* ]]; then
  timeout 200 $B/test_attention_cuda --gtest_filter='CudaWrite*' >"$OUT/tests.log" 2>&1
  note "test_attention_cuda CudaWrite*: rc=$? $(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' "$OUT/tests.log" | tr '\n' ' ')"
  grep -E '^\[  FAILED  \]' "$OUT/tests.log" | head -20 | tee -a "$summary"
  timeout 120 $B/test_backend --gtest_filter='CudaBackendWrite*' >>"$OUT/tests.log" 2>&1
  note "test_backend CudaBackendWrite*: rc=$? $(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' "$OUT/tests.log" | tail -3 | tr '\n' ' ')"
fi

if [[ $steps == *sanitize* ]] && command -v compute-sanitizer >/dev/null; then
  timeout 240 compute-sanitizer --tool memcheck --error-exitcode 9 $B/test_attention_cuda \
    --gtest_filter='Sweep/CudaWrite.*in:Sweep/CudaWrite.*fnuz*bulk*' --gtest_brief=1 >"$OUT/sanitizer.log" 2>&1
  note "compute-sanitizer memcheck CudaWrite sweep: rc=$? $(grep -E 'ERROR SUMMARY' "$OUT/sanitizer.log" | tail -1)"
fi

echo
grep -vE '^wrote ' "$OUT/bench.log" 2>/dev/null | tail -45
grep -E '^  [a-z_]+_kernel|Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Registers Per|No Eligible|Issued Warp|Theoretical Occ' "$OUT/ncu.txt" 2>/dev/null | head -80
echo
cat "$summary"
