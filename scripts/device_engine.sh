#!/usr/bin/env bash
# One GPU session for the CUDA backend / engine (issue 7): backend tests, compute-sanitizer on a small
# engine test, CUDA-vs-CPU evals (stories260K, SmolLM2) and the batched engine decode benchmark.
# Logs and JSON go to $OUT; a short table is printed last.
#
#   scripts/device_engine.sh pack BUILD_DIR   (build machine) stripped, xz-compressed binaries and
#                                             the non-CUDA shared libraries they need -> .device/
#                                             (the GPU image brings its own CUDA runtime and cuBLAS;
#                                             PACK_ONLY, PACK_BASE, PACK_BUNDLE: see the pack step)
#   scripts/device_engine.sh run              (GPU machine) unpack .device/, run KVQ_STEPS
#
# Inputs on the GPU machine (carried): MODELS_DIR (default ../.gpu-model) with stories260K/, the eval
# text pydoc_topics.txt and SmolLM2 as SmolLM2.part* pieces (the carry limit is below the file size;
# pieces may arrive in different calls while the machine stays warm, see PIECES_DIRS). Environment: OUT, KVQ_STEPS (default
# "tests sanitize stories smolcuda smolcpu bench"; add "serve" for the serving SLA check).
set -uo pipefail
cd "$(dirname "$0")/.."
mode="${1:-run}"

if [[ $mode == pack ]]; then
  build="${2:?usage: device_engine.sh pack BUILD_DIR}"
  rm -rf .device && mkdir -p .device/bin .device/lib
  for b in kvq tests/test_backend tests/test_attention_cuda bench/kvq_engine_bench; do
    [[ -n ${PACK_ONLY:-} && " $PACK_ONLY " != *" $(basename "$b") "* ]] && continue
    [[ -x $build/$b ]] && cp "$build/$b" .device/bin/ && strip -s ".device/bin/$(basename "$b")"
  done
  ldd .device/bin/* 2>/dev/null | awk '/=> \//{print $3}' | sort -u |
    grep -vE '/(libc|libm|libstdc\+\+|libgcc_s|libpthread|libdl|librt|ld-linux[^/]*)\.so|libcu' |
    while read -r lib; do cp -L "$lib" .device/lib/; done
  # PACK_BASE=FILE adds a base kvq (as kvq_base) for scripts/device_ab.sh. PACK_BUNDLE=1 puts the binaries in
  # one tar.xz with a 256 MiB dictionary: kvq and the test binaries link the same kernel objects, and a base
  # relinked from the same build with one object swapped differs from kvq by that object only, so xz stores
  # the shared bytes once (3 binaries: 27 MB instead of 74 MB of separate .xz; the carry limit is 64 MiB).
  [[ -n ${PACK_BASE:-} ]] && cp "$PACK_BASE" .device/bin/kvq_base && strip -s .device/bin/kvq_base
  if [[ ${PACK_BUNDLE:-0} == 1 ]]; then
    (cd .device/bin && tar cf - ./* | xz -T1 -9e --lzma2=preset=9e,dict=256MiB >../bundle.tar.xz && rm -f ./*)
    mv .device/bundle.tar.xz .device/bin/
    xz -T0 -6 .device/lib/*
  else
    xz -T0 -6 .device/bin/* .device/lib/*  # unpacked there by scripts/device_unpack.sh (python lzma)
  fi
  du -sh .device
  exit 0
fi

OUT_FINAL="${OUT:-$PWD/device-out}"
OUT=/tmp/kvq-out  # everything goes here; at the end one archive + the summary go to $OUT_FINAL
MODELS_DIR="${MODELS_DIR:-$PWD/../.gpu-model-a}"
rm -rf "$OUT" && mkdir -p "$OUT" "$OUT_FINAL"
steps="${KVQ_STEPS:-tests sanitize stories smol bench}"
summary="$OUT/summary.txt"
: >"$summary"
note() { echo "$*" | tee -a "$summary"; }

# Binaries: unpacked from a carried .device/, or (a later call on the same warm machine, whose carry
# left .device/ out to make room for data) the ones an earlier call unpacked.
source scripts/device_unpack.sh
if ! kvq_unpack_device && [[ ! -d /tmp/kvq-bin/bin ]]; then
  echo "no .device/ carried and none unpacked on this machine before" >&2; exit 2
fi
cudalib=$(dirname "$(find / -name 'libcublas.so.13*' -path '*cuda*' 2>/dev/null | head -1)")
export LD_LIBRARY_PATH="/tmp/kvq-bin/lib:${cudalib}:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
B=/tmp/kvq-bin/bin
note "device: $(nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv,noheader 2>/dev/null); cuBLAS from $cudalib"
ldd $B/kvq | grep -E 'not found|cublas|cudart' | tee -a "$OUT/env.txt"

# stories260K where the binaries look for it: $KVQ_SHARED_DIR/models/stories260K.
mkdir -p /tmp/kvq-shared/models && ln -sfn "$(realpath "$MODELS_DIR/stories260K")" /tmp/kvq-shared/models/stories260K
export KVQ_SHARED_DIR=/tmp/kvq-shared
# SmolLM2 from its pieces (PIECES_DIRS: folders that hold SmolLM2.part*, possibly left by an earlier call).
export KVQ_CACHE_DIR=/tmp/kvq-cache
mkdir -p $KVQ_CACHE_DIR
smol=$KVQ_CACHE_DIR/SmolLM2-135M-Instruct.Q4_1.gguf
if [[ ! -s $smol ]]; then
  parts=""
  for d in ${PIECES_DIRS:-$PWD/../.gpu-model-a $PWD/../.gpu-model-b}; do parts="$parts $(ls "$d"/SmolLM2.part* 2>/dev/null)"; done
  [[ -n $parts ]] && cat $parts >"$smol"
fi
if [[ -s $smol ]] && [[ -f $MODELS_DIR/SmolLM2.sha256 ]] && [[ $(sha256sum "$smol" | cut -c1-64) == $(cut -c1-64 "$MODELS_DIR/SmolLM2.sha256") ]]; then
  note "smollm2: assembled, sha256 ok"
else
  note "smollm2: not available (pieces missing or checksum mismatch)"; rm -f "$smol"
fi
text="$MODELS_DIR/pydoc_topics.txt"
# The eval text is CPython's pydoc topics (what `kvq eval` reads by default); made here when not carried,
# so the SmolLM2 tests and evals never run on a missing file.
if [[ ! -s $text ]]; then
  text=/tmp/kvq-pydoc_topics.txt
  python3 -c "import pydoc_data.topics as t, sys; sys.stdout.write('\n\n'.join(t.topics[k].rstrip() for k in sorted(t.topics)) + '\n')" >"$text" 2>/dev/null ||
    note "eval text: $MODELS_DIR/pydoc_topics.txt not carried and python3 has no pydoc_data; SmolLM2 tests will fail on it"
fi

export KVQ_EVAL_TEXT="$text"  # SmolLM2 tests of test_backend
if [[ $steps == *tests* ]]; then
  for t in test_backend test_attention_cuda; do
    [[ -x $B/$t ]] || continue
    timeout 400 $B/$t --gtest_brief=0 --gtest_filter="${GTEST_FILTER:-*}" >"$OUT/$t.log" 2>&1
    note "$t: rc=$? $(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' "$OUT/$t.log" | tr '\n' ' ')"
    grep -E '^\[  FAILED  \]' "$OUT/$t.log" | head -20 | tee -a "$summary"
  done
  grep -E '^\[ (logits|planes|greedy|smollm2) \]' "$OUT/test_backend.log" | tee -a "$summary"
fi

if [[ $steps == *sanitize* ]]; then
  timeout 300 compute-sanitizer --tool memcheck --error-exitcode 9 $B/test_backend \
    --gtest_filter='CudaBackendWrite.*:CudaBackendSample.*:CudaEngineStories.GreedyGenerationIdenticalForBf16Cache:AllBackends/BackendOps.MatchesReference/cuda_reproducible_*' \
    >"$OUT/sanitizer.log" 2>&1
  note "compute-sanitizer memcheck (write, sample, stories greedy engine): rc=$? $(grep -E 'ERROR SUMMARY' "$OUT/sanitizer.log" | tail -1)"
fi

# eval NAME BACKEND ARGS...: timed kvq eval, JSON to $OUT/eval_NAME_BACKEND.json
run_eval() {
  local name=$1 be=$2; shift 2
  local t0=$(date +%s.%N)
  timeout 500 $B/kvq eval --backend "$be" --quiet --markdown --json "$OUT/eval_${name}_${be}.json" "$@" >"$OUT/eval_${name}_${be}.log" 2>&1
  local rc=$? t1=$(date +%s.%N)
  note "eval $name --backend $be: rc=$rc wall $(awk "BEGIN{printf \"%.1f\", $t1 - $t0}") s"
  cat "$OUT/eval_${name}_${be}.log" | grep -E '^\||engine|model|text' | head -20 >>"$summary"
}

if [[ $steps == *stories* ]]; then
  for be in cuda cpu; do
    run_eval stories "$be" --model stories260K --text "$MODELS_DIR/stories260K/tinystories_valid_head.txt" --ctx 512 \
      --max-windows 4 --kv-cache-dtype bf16,fp8,fp8_fnuz,int8 --kv-scale-granularity per_token_head,per_block_head --kv-sink-tokens 16
  done
fi

has() { [[ " $steps " == *" $1 "* ]]; }
if [[ -s $smol ]]; then
  # The main job's eval (scripts/run.sh), then all four formats x both granularities; the CUDA runs
  # also with fp32 weights (the CPU engine's), which isolates the backends' rounding.
  for be in cuda cpu; do
    has "smol$be" || continue
    run_eval mainjob "$be" --model smollm2 --text "$text" --ctx 2048 --max-windows 1 \
      --kv-cache-dtype bf16,fp8,fp8_fnuz,int8,fp8:per_tensor --gate 3%
    run_eval grid "$be" --model smollm2 --text "$text" --ctx 2048 --max-windows 1 \
      --kv-cache-dtype bf16,fp8,fp8_fnuz,int8 --kv-scale-granularity per_token_head,per_block_head
    if [[ $be == cuda ]]; then
      run_eval mainjob_w32 "$be" --weights fp32 --model smollm2 --text "$text" --ctx 2048 --max-windows 1 \
        --kv-cache-dtype bf16,fp8,fp8_fnuz,int8,fp8:per_tensor --gate 3%
      run_eval grid_w32 "$be" --weights fp32 --model smollm2 --text "$text" --ctx 2048 --max-windows 1 \
        --kv-cache-dtype bf16,fp8,fp8_fnuz,int8 --kv-scale-granularity per_token_head,per_block_head
    fi
  done
fi

# Reproducible numerics (ARCHITECTURE §8): the same grid with --numerics reproducible on both backends
# (fp32 weights), the bf16-cache logits of window 0 dumped by each and compared byte for byte, then
# the CPU's fast grid for the pairwise table (scripts/compare_evals.py).
if has repro; then
  for be in cuda cpu; do
    run_eval stories_repro "$be" --numerics reproducible --model stories260K \
      --text "$MODELS_DIR/stories260K/tinystories_valid_head.txt" --ctx 512 --max-windows 4 \
      --kv-cache-dtype bf16,fp8,fp8_fnuz,int8,int4 --kv-scale-granularity per_token_head,per_block_head --kv-sink-tokens 16
  done
  python3 scripts/compare_evals.py "$OUT"/eval_stories_repro_cpu.json "$OUT"/eval_stories_repro_cuda.json \
    "$OUT"/eval_stories_cpu.json "$OUT"/eval_stories_cuda.json 2>&1 | tee -a "$summary"
fi
if has repro && [[ -s $smol ]]; then
  for be in cuda cpu; do
    run_eval repro "$be" --numerics reproducible --model smollm2 --text "$text" --ctx 2048 --max-windows 1 \
      --kv-cache-dtype bf16,fp8,fp8_fnuz,int8 --kv-scale-granularity per_token_head,per_block_head \
      --dump-logits "/tmp/logits_repro_$be.bin"
  done
  cmp /tmp/logits_repro_cuda.bin /tmp/logits_repro_cpu.bin >"$OUT/logits_cmp.txt" 2>&1
  note "bf16-cache logits, reproducible cuda vs cpu: $(cmp -s /tmp/logits_repro_cuda.bin /tmp/logits_repro_cpu.bin && echo identical || head -c 200 "$OUT/logits_cmp.txt") ($(stat -c %s /tmp/logits_repro_cpu.bin) bytes)"
  has smolcpu || run_eval grid cpu --model smollm2 --text "$text" --ctx 2048 --max-windows 1 \
    --kv-cache-dtype bf16,fp8,fp8_fnuz,int8 --kv-scale-granularity per_token_head,per_block_head
  python3 scripts/compare_evals.py "$OUT"/eval_repro_cuda.json "$OUT"/eval_repro_cpu.json "$OUT"/eval_grid_cpu.json \
    "$OUT"/eval_grid_w32_cuda.json "$OUT"/eval_grid_cuda.json 2>&1 | tee -a "$summary"
fi

# Accuracy toolkit (issue 10) on the GPU engine: Hadamard-rotated K at ctx 2048 (4 windows) and 8192.
if has rot && [[ -s $smol ]]; then
  run_eval rot2k cuda --model smollm2 --text "$text" --ctx 2048 --max-windows 4 \
    --kv-cache-dtype int8,int8:hadamard,fp8,fp8:hadamard,fp8_fnuz:hadamard
  run_eval rot8k cuda --model smollm2 --text "$text" --ctx 8192 --max-windows 1 \
    --kv-cache-dtype int8,int8:hadamard,fp8,fp8:hadamard
fi

# Free-form SmolLM2 evals: EVALS="name|backend|args; name|backend|args" (e.g. the accuracy-toolkit table).
if has evals && [[ -s $smol ]]; then
  IFS=';' read -ra evals <<<"${EVALS:-}"
  for e in "${evals[@]}"; do
    IFS='|' read -r ename ebe eargs <<<"$e"
    ename=$(echo $ename)
    # shellcheck disable=SC2086
    run_eval "$ename" "$(echo $ebe)" --model smollm2 --text "$text" $eargs
  done
fi

if [[ $steps == *bench* ]] && [[ -s $smol ]]; then
  timeout 400 $B/kvq_engine_bench --model smollm2 --backend cuda --batch 64 --ctx 8192 --steps 32 \
    --specs "${BENCH_SPECS:-bf16,fp8,int8,fp8_fnuz}" --json "$OUT/bench_engine.json" >"$OUT/bench_engine.log" 2>&1
  note "bench engine: rc=$?"
  cat "$OUT/bench_engine.log" >>"$summary"
fi

# The serving SLA check (issue 8) on the GPU: scripts/bench_serve_sla.sh per spec, then the comparison.
#   serve     SLA run: SERVE_TIERS (1024,4096,7168), SERVE_PROMPTS (50), SERVE_RATE (Poisson req/s; 0 = all
#             at once), SERVE_MAX_TOKENS (128), SERVE_KV_GIB (8) -> $OUT/serve
#   servecap  capacity/throughput run: the top tier at max throughput under a small KV budget
#             (SERVECAP_KV_GIB, default 2) with long outputs (SERVECAP_MAX_TOKENS, default 1024) -> $OUT/servecap
# SERVE_MODEL (default smollm2), SERVE_SPECS, SERVE_GRAN, SERVE_MAX_SEQS, SERVE_FLAGS (extra cache flags) pass through.
run_serve() {  # NAME TIERS RATE MAX_TOKENS KV_GIB
  local sm=${SERVE_MODEL:-smollm2} t0
  [[ $sm == stories260K ]] && sm="$(dirname "$src_dir")/shared/models/stories260K/stories260K.bin"
  t0=$(date +%s)
  KVQ=$B/kvq MODEL="$sm" BACKEND=cuda TIERS="$2" PROMPTS="${SERVE_PROMPTS:-50}" RATE="$3" MAX_TOKENS="$4" \
    KV_GIB="$5" MAX_SEQS="${SERVE_MAX_SEQS:-64}" SPECS="${SERVE_SPECS:-bf16 fp8_e4m3 fp8_fnuz int8}" \
    GRAN="${SERVE_GRAN:-per_token_head}" timeout "${SERVE_TIMEOUT:-420}" bash scripts/bench_serve_sla.sh "$OUT/$1" \
    --text "$MODELS_DIR/stories260K/tinystories_valid_head.txt" --text "$text" >"$OUT/$1.log" 2>&1
  note "$1 ($sm, tiers $2, rate $3, max_tokens $4, kv $5 GiB): rc=$? $(( $(date +%s) - t0 )) s"
  sed -n '/^SLA:/,$p' "$OUT/$1/compare.md" >>"$summary" 2>/dev/null
}
has serve && run_serve serve "${SERVE_TIERS:-1024,4096,7168}" "${SERVE_RATE:-0}" "${SERVE_MAX_TOKENS:-128}" "${SERVE_KV_GIB:-8}"
has servecap && run_serve servecap "${SERVECAP_TIERS:-7168}" 0 "${SERVECAP_MAX_TOKENS:-1024}" "${SERVECAP_KV_GIB:-2}"

tar czf "$OUT_FINAL/logs.tgz" -C "$OUT" . && cp "$summary" "$OUT_FINAL/"
echo
cat "$summary"
