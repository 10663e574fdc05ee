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
  # Earlier builds to compare with: NAME=PATH pairs in KVQ_EXTRA_BINS (e.g. kvq_base=/tmp/kvq).
  [[ -n ${3:-} ]] && cp "$3" $pack/bin/kvq_base && strip -s $pack/bin/kvq_base
  for nb in ${KVQ_EXTRA_BINS:-}; do cp "${nb#*=}" "$pack/bin/${nb%%=*}" && strip -s "$pack/bin/${nb%%=*}"; done
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
  : >"$OUT/bench.log"
  for bin in $B/kvq_*; do  # earlier builds (kvq_base: main's kernel, without --input)
    [[ -x $bin ]] || continue
    in=(--input both)
    [[ $bin == */kvq_base ]] && in=()
    echo "=== $(basename "$bin")" >>"$OUT/bench.log"
    timeout 120 "$bin" bench write --backend cuda "${shape[@]}" "${in[@]}" --json "$OUT/bench_write_$(basename "$bin").json" >>"$OUT/bench.log" 2>&1
    note "bench write ($(basename "$bin")): rc=$?"
  done
  echo "=== kvq" >>"$OUT/bench.log"
  timeout 150 $B/kvq bench write --backend cuda "${shape[@]}" --input both --json "$OUT/bench_write.json" >>"$OUT/bench.log" 2>&1
  note "bench write: rc=$?"
  timeout 60 $B/kvq bench write --backend cuda "${shape[@]}" --block-size 32 --kv-cache-dtype fp8,int8 >>"$OUT/bench.log" 2>&1
  note "bench write block 32: rc=$?"
fi

if [[ $steps == *ncu* ]] && command -v ncu >/dev/null; then
  : >"$OUT/ncu.txt"
  for bin in ${KVQ_NCU_BINS:-kvq_base kvq}; do
    [[ -x $B/$bin ]] || continue
    for gr in ${KVQ_NCU_GRANULARITIES:-per_token_head per_block_head}; do
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
  : >"$OUT/tests.log"
  for t in $B/test_attention_cuda*; do  # test_attention_cuda_NAME: an earlier build's
    timeout 200 "$t" --gtest_filter='*CudaWrite*' >"/tmp/kw/t.log" 2>&1
    note "$(basename "$t") *CudaWrite*: rc=$? $(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' /tmp/kw/t.log | tr '\n' ' ')"
    grep -E '^\[  FAILED  \]' /tmp/kw/t.log | head -20 | tee -a "$summary"
    cat /tmp/kw/t.log >>"$OUT/tests.log"
  done
  timeout 200 $B/test_backend --gtest_filter="${KVQ_BACKEND_FILTER:-CudaBackendWrite*}" >/tmp/kw/t.log 2>&1
  note "test_backend ${KVQ_BACKEND_FILTER:-CudaBackendWrite*}: rc=$? $(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' /tmp/kw/t.log | tr '\n' ' ')"
  grep -E '^\[  FAILED  \]' /tmp/kw/t.log | head -20 | tee -a "$summary"
  cat /tmp/kw/t.log >>"$OUT/tests.log"
fi

if [[ $steps == *sanitize* ]] && command -v compute-sanitizer >/dev/null; then
  : >"$OUT/sanitizer.log"
  for t in $B/test_attention_cuda*; do
    timeout 240 compute-sanitizer --tool memcheck --error-exitcode 9 "$t" \
      --gtest_filter='Sweep/CudaWrite.*in:Sweep/CudaWrite.*fnuz*bulk*' --gtest_brief=1 >>"$OUT/sanitizer.log" 2>&1
    note "compute-sanitizer memcheck $(basename "$t") CudaWrite sweep: rc=$? $(grep -E 'ERROR SUMMARY' "$OUT/sanitizer.log" | tail -1)"
  done
fi

echo
grep -vE '^wrote ' "$OUT/bench.log" 2>/dev/null | tail -45
grep -E '^  [a-z_]+_kernel|Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Registers Per|No Eligible|Issued Warp|Theoretical Occ' "$OUT/ncu.txt" 2>/dev/null | head -80
echo
cat "$summary"
