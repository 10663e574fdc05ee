# Sourced by the device scripts (device_run.sh, device_engine.sh, device_ab.sh): unpacks the carried
# .device/ (xz- or gzip-compressed binaries and the shared libraries they need, made by `device_*.sh
# pack`) into /tmp/kvq-bin and puts its lib/ on LD_LIBRARY_PATH. Returns 1 when no .device/ was carried
# (the caller decides whether an earlier call's /tmp/kvq-bin will do).

# kvq_unpack_file SRC DEST: SRC ends in .xz or .gz. xz goes through Python's lzma because the GPU image
# has python3 but no xz; xz is what keeps two binaries and their libraries inside the 64 MiB carry.
kvq_unpack_file() {
  case "$1" in
    *.xz) python3 -c "import lzma,shutil,sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], 'wb'))" "$1" "$2" ;;
    *.gz) gunzip -c "$1" >"$2" ;;
    *) echo "kvq_unpack_file: $1 is neither .xz nor .gz" >&2; return 1 ;;
  esac
}

kvq_unpack_device() {
  [[ -d .device/bin ]] || return 1
  rm -rf /tmp/kvq-bin && mkdir -p /tmp/kvq-bin/bin /tmp/kvq-bin/lib
  local f d
  for d in bin lib; do
    for f in .device/$d/*.xz .device/$d/*.gz; do
      [[ -e $f ]] || continue
      if [[ $f == *.tar.xz ]]; then  # a PACK_BUNDLE=1 bundle of several binaries
        python3 -c "import tarfile,sys; kw={'filter': 'data'} if hasattr(tarfile, 'data_filter') else {}; tarfile.open(sys.argv[1]).extractall(sys.argv[2], **kw)" "$f" "/tmp/kvq-bin/$d" || return 1
        continue
      fi
      local name; name=$(basename "$f"); kvq_unpack_file "$f" "/tmp/kvq-bin/$d/${name%.*}" || return 1
    done
  done
  chmod +x /tmp/kvq-bin/bin/* 2>/dev/null
  export LD_LIBRARY_PATH="/tmp/kvq-bin/lib:${LD_LIBRARY_PATH:-}"
}

# kvq_device_prelude DEFAULT_OUT: the preamble of every device script (call it from the repository root):
# FINAL = $OUT (the tool's folder) or DEFAULT_OUT, created; the carried .device/ unpacked, or, when none was
# carried, an earlier call's binaries on the same warm machine: /tmp/kvq-bin, else build-keep/ (ignored by git,
# so it stays between calls; a call may carry only .devbase/ when two builds do not fit the carry together);
# B = the binaries' folder; the card's name, driver and clocks in $FINAL/gpu.txt, its name in GPU_NAME.
kvq_device_prelude() {
  FINAL="${OUT:-$1}"
  mkdir -p "$FINAL"
  if ! kvq_unpack_device; then
    [[ -x /tmp/kvq-bin/bin/kvq || ! -d build-keep/bin ]] || { rm -rf /tmp/kvq-bin && cp -r build-keep /tmp/kvq-bin; }
    [[ -x /tmp/kvq-bin/bin/kvq ]] || {
      echo "no .device/ carried (scripts/device_engine.sh pack BUILD_DIR) and no earlier call's binaries" >&2; return 2; }
    export LD_LIBRARY_PATH="/tmp/kvq-bin/lib:${LD_LIBRARY_PATH:-}"
    echo "no .device/ carried: the binaries of an earlier call on this machine" >&2
  fi
  B=/tmp/kvq-bin/bin
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader >"$FINAL/gpu.txt" 2>&1
  GPU_NAME=$(head -1 "$FINAL/gpu.txt" | cut -d, -f1)
}

# kvq_gpu_checks DIR LABEL: $B/test_attention_cuda, then compute-sanitizer memcheck on its decode tests and racecheck
# on the overlap and L2-policy tests (where the machine has compute-sanitizer); logs in DIR, one line each on stdout.
kvq_gpu_checks() {
  local dir=$1 label=$2 t0=$SECONDS cs
  timeout 240 "$B/test_attention_cuda" --gtest_brief=1 >"$dir/test_attention_cuda.log" 2>&1
  echo "test_attention_cuda ($label) rc=$? at $((SECONDS - t0)) s: $(grep -E '^\[  (PASSED|FAILED) ' "$dir/test_attention_cuda.log" | tr '\n' ' ')"
  grep -E '^\[  FAILED  \]' "$dir/test_attention_cuda.log" | head -5
  cs=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
  [[ -n $cs ]] || { echo "no compute-sanitizer on this machine"; return 0; }
  timeout 150 "$cs" --tool memcheck --error-exitcode 9 "$B/test_attention_cuda" --gtest_brief=1 \
    --gtest_filter='*Decode*' >"$dir/memcheck.log" 2>&1
  echo "memcheck rc=$? at $((SECONDS - t0)) s: $(grep -E 'ERROR SUMMARY|^\[  (PASSED|FAILED) ' "$dir/memcheck.log" | tr '\n' ' ')"
  timeout 90 "$cs" --tool racecheck --error-exitcode 9 "$B/test_attention_cuda" --gtest_brief=1 \
    --gtest_filter='CudaDecodeApi.Overlapped*:CudaDecodeApi.L2Policy*' >"$dir/racecheck.log" 2>&1
  echo "racecheck rc=$? at $((SECONDS - t0)) s: $(grep -E 'RACECHECK SUMMARY|ERROR SUMMARY|^\[  (PASSED|FAILED) ' "$dir/racecheck.log" | tr '\n' ' ')"
}
