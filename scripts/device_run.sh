#!/usr/bin/env bash
# One GPU session: build (or take prebuilt binaries), GPU tests, compute-sanitizer on a small
# subset, benchmarks; logs and JSON go to $OUT (default ./device-out), a short table is printed last.
#
#   scripts/device_run.sh                  configure + build in build-device/, then run everything
#   scripts/device_run.sh pack BUILD_DIR   (on the build machine) collect kvq, the CUDA test binaries
#                                          and the shared libraries they need into .device/ (xz),
#                                          for a GPU machine that lacks the build dependencies
#   scripts/device_run.sh run              (on the GPU machine) use .device/ if present, else build
#
# Environment: OUT (results folder), KVQ_STEPS (default "info tests sanitize bench"; add "ncu" for
# one Nsight Compute profile, "ncusrc" for its per-instruction source page, "ab16" for the 16-bit
# kernel comparison of GPU_NOTES §16), KVQ_BENCH_ARGS (extra `kvq bench decode` arguments).
set -uo pipefail
cd "$(dirname "$0")/.."
mode="${1:-run}"

if [[ $mode == pack ]]; then
  build="${2:?usage: device_run.sh pack BUILD_DIR}"
  rm -rf .device && mkdir -p .device/bin .device/lib
  for b in kvq tests/test_attention_cuda tests/test_format_cuda tests/test_backend; do
    [[ -x $build/$b ]] && cp "$build/$b" .device/bin/ && strip -s ".device/bin/$(basename "$b")"
  done
  # Shared libraries outside the C/C++ runtime that the GPU image may lack (it brings cuBLAS).
  ldd .device/bin/* 2>/dev/null | awk '/=> \//{print $3}' | sort -u |
    grep -vE '/(libc|libm|libstdc\+\+|libgcc_s|libpthread|libdl|librt|ld-linux[^/]*|libcublas(Lt)?)\.so' |
    while read -r lib; do cp -L "$lib" .device/lib/; done
  xz -T0 -6 .device/bin/* .device/lib/*  # unpacked there by scripts/device_unpack.sh (python lzma)
  du -sh .device
  exit 0
fi

OUT="${OUT:-$PWD/device-out}"
mkdir -p "$OUT"
steps="${KVQ_STEPS:-info tests sanitize bench}"
summary="$OUT/summary.txt"
: >"$summary"
note() { echo "$*" | tee -a "$summary"; }

source scripts/device_unpack.sh
if kvq_unpack_device; then
  KVQ=/tmp/kvq-bin/bin/kvq
  TESTS=(/tmp/kvq-bin/bin/test_attention_cuda /tmp/kvq-bin/bin/test_format_cuda /tmp/kvq-bin/bin/test_backend)
  note "binaries: prebuilt (.device/)"
else
  cmake -S . -B build-device -G Ninja -DCMAKE_BUILD_TYPE=Release -DKVQ_CUDA=ON >"$OUT/env.txt" 2>&1 &&
    cmake --build build-device -j "$(nproc)" --target kvq test_attention_cuda test_format_cuda test_backend >>"$OUT/env.txt" 2>&1 ||
    { note "build FAILED (see env.txt)"; tail -30 "$OUT/env.txt"; exit 1; }
  KVQ=build-device/kvq
  TESTS=(build-device/tests/test_attention_cuda build-device/tests/test_format_cuda build-device/tests/test_backend)
  note "binaries: built in build-device/"
fi

if [[ $steps == *info* ]]; then
  { nvidia-smi; nvidia-smi -q -d CLOCK,POWER | head -60; echo; ldd "$KVQ"; } >>"$OUT/env.txt" 2>&1
  note "device: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null)"
  if command -v cuobjdump >/dev/null; then
    { cuobjdump --dump-resource-usage "${TESTS[0]}" 2>&1 | grep -A1 -E 'decode_(bulk_)?kernel|write_(rows|segments)_kernel' | grep -E 'Function|REG' |
        sed -E 's/.*Function ([^:]*):/\1/' | paste - - | sed -E 's/_ZN3kvq9attention4cuda6detail[0-9]*//' | cut -c1-220
      echo "--- SASS op mix of decode_bulk_kernel<fp8_e4m3, 128, per-token>"
      cuobjdump -sass -fun '_ZN3kvq9attention4cuda6detail18decode_bulk_kernelILNS_6FormatE2ELi128ELNS2_9ScaleModeE2ELi3EEEvNS2_12DecodeParamsE' \
        "${TESTS[0]}" 2>/dev/null | grep -oE '^\s+/\*[0-9a-f]+\*/\s+[A-Z0-9_.]+' | awk '{print $2}' >/tmp/ops.txt
      sed -E 's/\..*//' /tmp/ops.txt | sort | uniq -c | sort -rn | head -25
      echo "--- memory ops with their widths"
      grep -E '^(LDG|STG|LDS|STS|LDL|STL|LDGSTS)' /tmp/ops.txt | sort | uniq -c
    } >>"$OUT/env.txt" 2>&1
  fi
fi

if [[ $steps == *tests* ]]; then
  for t in "${TESTS[@]}"; do
    name=$(basename "$t")
    echo "=== $name" >>"$OUT/tests.log"
    timeout 500 "$t" --gtest_brief=1 >"/tmp/$name.log" 2>&1
    rc=$?
    cat "/tmp/$name.log" >>"$OUT/tests.log"
    note "$name: rc=$rc $(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' "/tmp/$name.log" | tr '\n' ' ')"
    grep -E '^\[  FAILED  \]' "/tmp/$name.log" | head -20 | tee -a "$summary"
  done
fi

if [[ $steps == *sanitize* ]]; then
  subset='Sweep/CudaDecode.MatchesCpuReference/fp8_e4m3_per_token_head_D64*:Sweep/CudaDecode.MatchesCpuReference/int8_per_block_head_D128*:Sweep/CudaDecode.MatchesCpuReference/bf16_D64_Hkv3*:Sweep/CudaDecode.MatchesCpuReference/bf16_D128_Hkv2_G4_B32*:Sweep/CudaWrite.BitExactWithHostCache/fp8_e4m3_per_block_head_D64*:Sweep/CudaWrite.BitExactWithHostCache/int8_per_tensor_D128_Hkv2*:Sweep/CudaWrite.BitExactWithHostCache/fp8_e4m3_per_token_head_D128*:Sweep/CudaDecode.MatchesCpuReference/int4_per_block_head_D64_Hkv2*:Sweep/CudaDecode.MatchesCpuReference/int4_per_tensor_D128_Hkv2*:Sweep/CudaDecode.MatchesCpuReference/int4_per_token_head_fp16scales_D64_Hkv4*'
  for tool in memcheck racecheck; do
    timeout 300 compute-sanitizer --tool $tool --error-exitcode 9 "${TESTS[0]}" --gtest_filter="$subset" --gtest_brief=1 \
      >>"$OUT/sanitizer.log" 2>&1
    rc=$?
    note "compute-sanitizer $tool: rc=$rc $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitizer.log" | tail -1)"
  done
fi

if [[ $steps == *bench* ]]; then
  # shellcheck disable=SC2086
  timeout 400 "$KVQ" bench decode --backend cuda --json "$OUT/bench_decode.json" ${KVQ_BENCH_ARGS:-} >"$OUT/bench.log" 2>&1
  note "bench decode: rc=$?"
  timeout 120 "$KVQ" bench write --backend cuda --json "$OUT/bench_write.json" >>"$OUT/bench.log" 2>&1
  note "bench write: rc=$?"
fi

if [[ $steps == *ab16* ]]; then
  # docs/GPU_NOTES.md §16: every format at both block sizes (16-bit through the ring, the planner's
  # choice), then bf16 on the register kernel and with deeper rings, in the same run.
  { echo "=== all formats, block 16 and 32 (planner's choice)"
    "$KVQ" bench decode --backend cuda --kv-cache-dtype bf16,fp8,int8,int4 --block-sizes 16,32 --iters 30 --json "$OUT/bench_ab16.json"
    echo "=== bf16 on the register kernel"
    KVQ_DECODE_16BIT=register "$KVQ" bench decode --backend cuda --kv-cache-dtype bf16 --block-sizes 16,32 --iters 30
    for st in 8 12; do
      echo "=== bf16 ring, $st stages"
      KVQ_DECODE_RING_STAGES=$st "$KVQ" bench decode --backend cuda --kv-cache-dtype bf16 --block-sizes 16,32 --iters 30
    done
  } >>"$OUT/bench.log" 2>&1
  note "ab16: rc=$?"
fi

if [[ $steps == *configs* ]]; then
  # Evidence for docs/GPU_NOTES.md: the same cases with other cache settings.
  big="64,32,8,128,8192;16,32,16,128,32768;8,32,8,128,8192"
  { echo "=== per_block_head scales"
    "$KVQ" bench decode --backend cuda --shapes "$big" --kv-cache-dtype bf16,fp8,int8 --kv-scale-granularity per_block_head --iters 30
    echo "=== no sink"
    "$KVQ" bench decode --backend cuda --shapes "$big" --kv-cache-dtype bf16,fp8 --kv-sink-tokens 0 --iters 30
    echo "=== block 32"
    "$KVQ" bench decode --backend cuda --shapes "$big" --kv-cache-dtype bf16,fp8 --block-size 32 --iters 30
    echo "=== int4 against fp8, block 16 and 32 (docs/GPU_NOTES.md §11)"
    "$KVQ" bench decode --backend cuda --kv-cache-dtype bf16,fp8,int4 --block-sizes 16,32 --iters 30
  } >>"$OUT/bench.log" 2>&1
  note "configs: rc=$?"
fi

if [[ $steps == *ncusrc* ]] && command -v ncu >/dev/null; then
  # Per-instruction counts and stall samples of one decode launch (docs/GPU_NOTES.md §16: instructions
  # per page = the executed counts of the page loop / pages); the CSV is Nsight Compute's source page.
  timeout 180 ncu --clock-control none -k regex:decode_bulk_kernel -s 3 -c 1 --section SourceCounters --page source \
    --print-source sass --csv "$KVQ" bench decode --backend cuda --shapes "${KVQ_NCU_SHAPE:-64,32,8,128,8192}" \
    --kv-cache-dtype "${KVQ_NCU_FORMAT:-fp8}" --iters 3 >"$OUT/ncu_source.csv" 2>&1
  note "ncu source: rc=$?"
fi

if [[ $steps == *ncu* ]] && [[ $steps != *ncusrc* ]] && command -v ncu >/dev/null; then
  timeout 180 ncu --clock-control none --kernel-name regex:"decode_(bulk_)?kernel" --launch-skip 3 --launch-count 1 \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section SchedulerStats --section WarpStateStats \
    "$KVQ" bench decode --backend cuda --shapes "64,32,8,128,8192" --kv-cache-dtype fp8 --iters 30 ${KVQ_NCU_ARGS:-} >"$OUT/ncu.txt" 2>&1
  note "ncu: rc=$?"
fi

echo
cat "$OUT/bench.log" 2>/dev/null | grep -vE '^wrote ' | tail -60
echo
cat "$summary"
