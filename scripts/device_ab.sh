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
# Environment: OUT (results), AB_TESTS (1: run test_attention_cuda and test_backend first), AB_FORMATS
# (bf16,fp8,int8,int4), AB_BS (16), AB_ARGS (more `kvq bench decode` arguments, e.g. --shapes).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/device-out}"
mkdir -p "$OUT"
source scripts/device_unpack.sh
kvq_unpack_device || { echo "no .device/ carried (scripts/device_engine.sh pack BUILD_DIR)" >&2; exit 2; }
if [[ ! -x /tmp/kvq-bin/bin/kvq_base ]]; then  # not in a PACK_BASE bundle: carried in .devbase/
  base=$(ls .devbase/kvq_base.xz .devbase/kvq_base.gz 2>/dev/null | head -1)
  [[ -n $base ]] || { echo "no kvq_base in .device/ and no .devbase/kvq_base.xz (or .gz) carried" >&2; exit 2; }
  kvq_unpack_file "$base" /tmp/kvq-bin/bin/kvq_base && chmod +x /tmp/kvq-bin/bin/kvq_base
fi
B=/tmp/kvq-bin/bin
if [[ ${AB_TESTS:-1} == 1 ]]; then
  for t in test_attention_cuda test_backend; do
    [[ -x $B/$t ]] || continue
    timeout 300 "$B/$t" --gtest_brief=1 >"$OUT/$t.log" 2>&1
    echo "$t rc=$? $(grep -E '^\[  (PASSED|FAILED) ' "$OUT/$t.log" | tr '\n' ' ')"
    grep -E '^\[  FAILED  \]' "$OUT/$t.log" | head -5
  done
fi
for round in 1 2; do
  for k in kvq_base kvq; do
    echo "=== $k round $round" >>"$OUT/ab.log"
    # shellcheck disable=SC2086
    "$B/$k" bench decode --backend cuda --kv-cache-dtype "${AB_FORMATS:-bf16,fp8,int8,int4}" --block-sizes "${AB_BS:-16}" \
      --iters 30 ${AB_ARGS:-} --json "$OUT/ab_${k}_$round.json" >>"$OUT/ab.log" 2>&1
  done
done
python3 - "$OUT" <<'PY' | tee -a "$OUT/ab.log"
import collections, json, sys
out = sys.argv[1]
res = collections.defaultdict(dict)
for k in ("kvq_base", "kvq"):
    for r in (1, 2):
        for row in json.load(open(f"{out}/ab_{k}_{r}.json"))["decode"]:
            key = (f"B{row['batch']} Hq{row['num_q_heads']} Hkv{row['num_kv_heads']} D{row['head_dim']} L{row['seq_len']}",
                   row["format"], row["block_size"])
            res[key].setdefault(k, []).append(row["us_median"])
            res[key]["read_" + k] = row.get("frac_of_read", 0)
print(f"{'shape':30s} {'format':9s} bs  base_us(r1,r2)   new_us(r1,r2)   new/base  %read_new")
for key, v in res.items():
    b, n = min(v["kvq_base"]), min(v["kvq"])
    print(f"{key[0]:30s} {key[1]:9s} {key[2]:2d} {v['kvq_base'][0]:7.1f} {v['kvq_base'][1]:7.1f}  "
          f"{v['kvq'][0]:7.1f} {v['kvq'][1]:7.1f}  {n / b:6.3f}  {100 * v['read_kvq']:5.1f}")
PY
