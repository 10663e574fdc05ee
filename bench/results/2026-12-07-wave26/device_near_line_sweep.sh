#!/usr/bin/env bash
# wave 26, device call 3: with the ring copies' L2 policy in the plan (§33), do the near-line shapes of issues #9 /
# #10 want other splits or ring depths than the plan's? `kvq bench decode` on B8 Hq32 Hkv8 L8192, B16 Hq8 Hkv1 D256
# L8192, B1 Hq32 Hkv8 L32768 and B32 Hq32 Hkv8 L4096 (fp8, int8, int4; block 16): forced splits with the plan's L2
# choice and with plain copies (KVQ_DECODE_L2_HINT=0), then ring depths (KVQ_DECODE_RING_STAGES). A guard stops
# starting runs after SWEEP_S seconds (default 400) so the tar always comes back. Carry .device (as for
# device_l2_rule.sh). Table: sweep_table.py.
set -uo pipefail
cd "$(dirname "$0")/../../.."
FINAL="${OUT:-/tmp/w26s}"; mkdir -p "$FINAL"
OUT=/tmp/w26-sweep; rm -rf "$OUT"; mkdir -p "$OUT"
source scripts/device_unpack.sh
kvq_unpack_device || { echo "no .device/ carried" >&2; exit 2; }
B=/tmp/kvq-bin/bin
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader 2>&1 | tee "$OUT/gpu.txt"
SHAPES="8,32,8,128,8192;16,8,1,256,8192;1,32,8,128,32768;32,32,8,128,4096"
t0=$SECONDS
run() {  # run NAME [VAR=VALUE...] -- [kvq args...]
  local name=$1; shift
  (( SECONDS - t0 < ${SWEEP_S:-400} )) || { echo "skipped $name (time guard)"; return; }
  local vars=()
  while [[ $1 != -- ]]; do vars+=("$1"); shift; done; shift
  env "${vars[@]}" "$B/kvq" bench decode --backend cuda --kv-cache-dtype fp8,int8,int4 --block-sizes 16 --iters 30 \
    --shapes "$SHAPES" "$@" --json "$OUT/$name.json" >>"$OUT/sweep.log" 2>&1
  echo "$name rc=$? at $((SECONDS - t0)) s"
}
# Most telling first (the guard may cut the rest): the plan's L2 choice over splits, then ring depths, then plain copies.
for s in 0 4 8 12 16 24 32 64; do run "split${s}_auto" -- --splits $s; done
for st in 4 8 12 16; do run "stages${st}_auto" KVQ_DECODE_RING_STAGES=$st -- ; done
for s in 0 4 8 12 16 24 32 64; do run "split${s}_off" KVQ_DECODE_L2_HINT=0 -- --splits $s; done
python3 bench/results/2026-12-07-wave26/sweep_table.py "$OUT" | tee "$OUT/table.txt"
tar czf "$FINAL/sweep.tgz" -C "$OUT" .
cp "$OUT/table.txt" "$FINAL/table.txt"
