#!/usr/bin/env bash
# Same-run A/B of two kvq builds' decode kernels on a lent GPU (docs/GPU_NOTES.md §16): the new build's GPU
# tests first, then both `kvq bench decode` runs alternating, two rounds each, and a table of the better
# round per binary (time new/base, new's fraction of the read stream).
#
#   here:  scripts/device_engine.sh pack BUILD_DIR      (.device/: the new kvq and test binaries)
#          mkdir -p .devbase && cp OLD/.device/bin/kvq.xz .devbase/kvq_base.xz   (the base kvq, packed the same way)
#          or, smaller and exact: scripts/device_base.sh BUILD_DIR BASE_REV CHANGED.cu...   (BUILD_DIR/kvq_base)
#                                 PACK_BUNDLE=1 PACK_BASE=BUILD_DIR/kvq_base scripts/device_engine.sh pack BUILD_DIR
#   there: scripts/device_ab.sh                          (carry .device, and .devbase when used)
#
# Or arms of one binary that differ by a measurement knob (no base build): AB_ARMS="plan: self:KVQ_DECODE_RING_FEED=self
# prod:KVQ_DECODE_RING_FEED=producer" -- NAME:VAR=VALUE[,VAR=VALUE] (none: the defaults), the first arm the base;
# every arm runs kvq. Or several builds at once: AB_BINS="kvq_base kvq kvq_b" -- kvq binaries in /tmp/kvq-bin/bin
# (kvq_base from .devbase/ when not there), the first the base.
#
# Environment: OUT (results), AB_TESTS (1: run test_attention_cuda and test_backend first), AB_FORMATS
# (bf16,fp8,int8,int4), AB_BS (16), AB_ARGS (more `kvq bench decode` arguments, e.g. --shapes), AB_ROUNDS (2),
# AB_MEMCHECK (a gtest filter: compute-sanitizer memcheck on those test_attention_cuda tests after the A/B, at most
# AB_MEMCHECK_S seconds, default 120).
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device_unpack.sh
kvq_device_prelude "$PWD/device-out" || exit 2
OUT=$FINAL
cat "$OUT/gpu.txt"
arms="${AB_ARMS:-}"
if [[ -z $arms ]]; then  # builds, each a kvq binary in $B, the first the base (AB_BINS, or main's kvq_base and kvq)
  for b in ${AB_BINS:-kvq_base kvq}; do arms+="$b: "; done
  if [[ " $arms" == *" kvq_base:"* && ! -x $B/kvq_base ]]; then  # not in a PACK_BASE bundle: carried in .devbase/
    base=$(ls .devbase/kvq_base.xz .devbase/kvq_base.gz 2>/dev/null | head -1)
    [[ -n $base ]] || { echo "no kvq_base in .device/ and no .devbase/kvq_base.xz (or .gz) carried" >&2; exit 2; }
    kvq_unpack_file "$base" $B/kvq_base && chmod +x $B/kvq_base
  fi
fi
if [[ ${AB_TESTS:-1} == 1 ]]; then
  for t in test_attention_cuda test_backend; do
    [[ -x $B/$t ]] || continue
    timeout 300 "$B/$t" --gtest_brief=1 >"$OUT/$t.log" 2>&1
    echo "$t rc=$? $(grep -E '^\[  (PASSED|FAILED) ' "$OUT/$t.log" | tr '\n' ' ')"
    grep -E '^\[  FAILED  \]' "$OUT/$t.log" | head -5
  done
fi
rounds="${AB_ROUNDS:-2}"
for round in $(seq 1 "$rounds"); do
  for arm in $arms; do
    name=${arm%%:*} vars=${arm#*:}
    bin=$B/kvq
    [[ -z ${AB_ARMS:-} ]] && bin=$B/$name
    [[ -x $bin ]] || { echo "arm $name: no $bin" >&2; continue; }
    echo "=== $name ($vars) round $round" >>"$OUT/ab.log"
    # shellcheck disable=SC2086
    env ${vars//,/ } "$bin" bench decode --backend cuda --kv-cache-dtype "${AB_FORMATS:-bf16,fp8,int8,int4}" \
      --block-sizes "${AB_BS:-16}" --iters 30 ${AB_ARGS:-} --json "$OUT/ab_${name}_$round.json" >>"$OUT/ab.log" 2>&1
  done
done
python3 - "$OUT" "$rounds" $arms <<'PY' | tee -a "$OUT/ab.log"
import collections, json, sys
out, rounds, names = sys.argv[1], int(sys.argv[2]), [a.split(":")[0] for a in sys.argv[3:]]
res = collections.defaultdict(dict)
for k in names:
    for r in range(1, rounds + 1):
        for row in json.load(open(f"{out}/ab_{k}_{r}.json"))["decode"]:
            key = (f"B{row['batch']} Hq{row['num_q_heads']} Hkv{row['num_kv_heads']} D{row['head_dim']} L{row['seq_len']}",
                   row["format"], row["block_size"])
            res[key].setdefault(k, []).append(row["us_median"])
            res[key].setdefault("read_" + k, []).append(row.get("frac_of_read", 0))
base = names[0]
# Per arm: its best round's time, that over the base arm's best, and its best round's share of the read stream.
print(f"{'shape':30s} {'format':9s} bs " + " ".join(f"{n + '_us':>9s}" for n in names) + "  " +
      " ".join(f"{n + '/' + base:>12s}" for n in names[1:]) + "  " + " ".join(f"{'%read_' + n:>10s}" for n in names))
for key, v in res.items():
    best = {n: min(v[n]) for n in names}
    print(f"{key[0]:30s} {key[1]:9s} {key[2]:2d} " + " ".join(f"{best[n]:9.1f}" for n in names) + "  " +
          " ".join(f"{best[n] / best[base]:12.3f}" for n in names[1:]) + "  " +
          " ".join(f"{100 * max(v['read_' + n]):10.1f}" for n in names))
PY
if [[ -n ${AB_MEMCHECK:-} ]]; then
  CS=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
  if [[ -z $CS ]]; then
    echo "memcheck: no compute-sanitizer on this machine"
  else
    timeout "${AB_MEMCHECK_S:-120}" "$CS" --tool memcheck --error-exitcode 9 "$B/test_attention_cuda" --gtest_brief=1 \
      --gtest_filter="$AB_MEMCHECK" >"$OUT/memcheck.log" 2>&1
    echo "memcheck ($AB_MEMCHECK) rc=$? $(grep -E 'ERROR SUMMARY|^\[  (PASSED|FAILED) ' "$OUT/memcheck.log" | tr '\n' ' ')"
  fi
fi
