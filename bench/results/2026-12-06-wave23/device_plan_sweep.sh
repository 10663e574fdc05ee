#!/usr/bin/env bash
# wave 23 call a: the plan's knobs around the cases that sit just outside issue #9's and #10's lines, on main's
# binary (no kernel change): B32 Hq32 Hkv8 D128 L4096 (fp8/int8 85%, bf16 92%) and int4 on B64 Hq32 Hkv8 L8192 /
# B8 Hq32 Hkv16 L16384 (0.35x bf16). Each config is one `kvq bench decode` process; three rounds, configs
# alternating within a round; best of the rounds per config.
set -uo pipefail
cd "$(dirname "$0")/../../.."
R=/tmp/w23a; rm -rf $R; mkdir -p $R /tmp/kvq-bin/lib /tmp/kvq-bin/bin
X() { python3 -c "import lzma,sys; open(sys.argv[2],'wb').write(lzma.open(sys.argv[1]).read())" "$1" "$2"; }
for f in .device/lib/*.xz; do X "$f" /tmp/kvq-bin/lib/$(basename "$f" .xz); done
export LD_LIBRARY_PATH=/tmp/kvq-bin/lib:${LD_LIBRARY_PATH:-}
B=/tmp/kvq-bin/bin; X .devbase/kvq_main.xz $B/kvq; chmod +x $B/kvq
S=$R/summary.txt
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee $R/gpu.txt >> $S
B32="32,32,8,128,4096"; I4="64,32,8,128,8192;8,32,16,128,16384"
# label | env | splits | formats | block size | shapes
CONFIGS=(
  "b32_plan||0|bf16,fp8,int8|16|$B32"
  "b32_plan||0|bf16,fp8,int8|32|$B32"
  "b32_p1_s8|KVQ_DECODE_RING_FEED=producer KVQ_DECODE_RING_STAGES=8|1|fp8,int8|16|$B32"
  "b32_p1_s16|KVQ_DECODE_RING_FEED=producer KVQ_DECODE_RING_STAGES=16|1|fp8,int8|16|$B32"
  "b32_p1_s20|KVQ_DECODE_RING_FEED=producer KVQ_DECODE_RING_STAGES=20|1|fp8,int8|16|$B32"
  "b32_p1_s24|KVQ_DECODE_RING_FEED=producer KVQ_DECODE_RING_STAGES=24|1|fp8,int8|16|$B32"
  "b32_p1_s4|KVQ_DECODE_RING_FEED=producer KVQ_DECODE_RING_STAGES=4|1|bf16,fp8,int8|32|$B32"
  "b32_p1_s6|KVQ_DECODE_RING_FEED=producer KVQ_DECODE_RING_STAGES=6|1|bf16,fp8,int8|32|$B32"
  "b32_p1_s10|KVQ_DECODE_RING_FEED=producer KVQ_DECODE_RING_STAGES=10|1|fp8,int8|32|$B32"
  "b32_p1_s12|KVQ_DECODE_RING_FEED=producer KVQ_DECODE_RING_STAGES=12|1|fp8,int8|32|$B32"
  "b32_p1_s4|KVQ_DECODE_RING_FEED=producer KVQ_DECODE_RING_STAGES=4|1|bf16|16|$B32"
  "b32_p1_s8|KVQ_DECODE_RING_FEED=producer KVQ_DECODE_RING_STAGES=8|1|bf16|16|$B32"
  "b32_p1_s10|KVQ_DECODE_RING_FEED=producer KVQ_DECODE_RING_STAGES=10|1|bf16|16|$B32"
  "b32_s1_s8|KVQ_DECODE_RING_FEED=self KVQ_DECODE_RING_STAGES=8|1|bf16|16|$B32"
  "b32_s1_s3|KVQ_DECODE_RING_FEED=self KVQ_DECODE_RING_STAGES=3|1|bf16|32|$B32"
  "b32_s1_s5|KVQ_DECODE_RING_FEED=self KVQ_DECODE_RING_STAGES=5|1|bf16|32|$B32"
  "b32_reg|KVQ_DECODE_16BIT=register|0|bf16|16|$B32"
  "i4_plan||0|bf16,int4|16|$I4"
  "i4_s1_s4|KVQ_DECODE_RING_FEED=self KVQ_DECODE_RING_STAGES=4|0|int4|16|$I4"
  "i4_s1_s6|KVQ_DECODE_RING_FEED=self KVQ_DECODE_RING_STAGES=6|0|int4|16|$I4"
  "i4_s1_s12|KVQ_DECODE_RING_FEED=self KVQ_DECODE_RING_STAGES=12|0|int4|16|$I4"
  "i4_s1_s16|KVQ_DECODE_RING_FEED=self KVQ_DECODE_RING_STAGES=16|0|int4|16|$I4"
  "i4_p_s8|KVQ_DECODE_RING_FEED=producer KVQ_DECODE_RING_STAGES=8|0|int4|16|$I4"
  "i4_p_s12|KVQ_DECODE_RING_FEED=producer KVQ_DECODE_RING_STAGES=12|0|int4|16|$I4"
  "i4_p_s16|KVQ_DECODE_RING_FEED=producer KVQ_DECODE_RING_STAGES=16|0|int4|16|$I4"
)
run_round() {
  local round=$1 i=0 c label env splits fmts bs shapes t0
  for c in "${CONFIGS[@]}"; do
    IFS='|' read -r label env splits fmts bs shapes <<< "$c"
    (( SECONDS < 520 )) || { echo "== stop at round $round: $SECONDS s" >> $S; return; }
    t0=$SECONDS
    env $env timeout 60 $B/kvq bench decode --backend cuda --kv-cache-dtype $fmts --block-sizes $bs --iters 30 \
      --splits $splits --shapes "$shapes" --json $R/${label}_bs${bs}_$round.json > $R/${label}_bs${bs}_$round.log 2>&1
    echo "== $label bs$bs round $round rc=$? $((SECONDS - t0)) s" >> $S
  done
}
for r in 1 2 3; do run_round $r; done
python3 - $R <<'PY' >> $S
import json, sys, glob, collections, re
R = sys.argv[1]; res = collections.defaultdict(list); info = {}; bf = collections.defaultdict(list)
for fn in sorted(glob.glob(f"{R}/*.json")):
    label = re.sub(r"_bs\d+_\d\.json$", "", fn.split("/")[-1])
    try: rows = json.load(open(fn))["decode"]
    except Exception as e: print(fn, e); continue
    for row in rows:
        shape = f"B{row['batch']} Hq{row['num_q_heads']} Hkv{row['num_kv_heads']} L{row['seq_len']}"
        key = (shape, row["format"], row["block_size"], label)
        res[key].append((row["us_median"], row["frac_of_read"]))
        info[key] = f"{row['splits']}x{row['ctas_per_sm']} {row['ring_feed'][:4]} {row['ring_stages']}"
        if row["format"] == "bf16" and label.endswith("plan"): bf[(shape, row["block_size"])].append(row["us_median"])
print(f"{'shape':26s} {'fmt':9s} bs {'config':12s} {'plan(sxc feed st)':18s} {'best us':>8s} {'rounds':>22s} {'%read':>6s} {'vs plan':>7s} {'/bf16plan':>9s}")
for key in sorted(res):
    shape, fmt, bs, label = key
    best = min(res[key]); pl = [k for k in res if k[:3] == key[:3] and k[3].endswith("plan")]
    p = min(res[pl[0]])[0] if pl else float("nan"); b = min(bf.get((shape, bs), [float("nan")]))
    print(f"{shape:26s} {fmt:9s} {bs:2d} {label:12s} {info[key]:18s} {best[0]:8.2f} {'/'.join(f'{x[0]:.1f}' for x in res[key]):>22s} {100*best[1]:5.1f}% {best[0]/p:7.3f} {best[0]/b:9.3f}")
PY
cd /tmp && tar czf "$OUT/w23a.tgz" w23a && cp $R/summary.txt "$OUT/"
cat $R/summary.txt
