#!/usr/bin/env bash
# wave 28: is the CTA's tail (merge_and_store after the last page) paying for cold instruction fetch? §35 found the
# tail longer with more code. With one CTA per SM (D256 fp8, the plan's 16 stages) every CTA runs its merge code cold;
# with two per SM (8 stages, so two fit) the second CTA of an SM can find it cached. Timeline (three cold runs) of
# B16 Hq8 Hkv1 D256 L8192 at 8 and 16 splits x 8 and 16 stages, fp8 and int8, alternating twice. On an H200 it then
# runs device_h200.sh (main's lines there and wave 26's L2 A/B). Carry .device (main's kvq and tests).
set -uo pipefail
cd "$(dirname "$0")/../../.."
FINAL="${OUT:-/tmp/w28t}"; mkdir -p "$FINAL/probe"
source scripts/device_unpack.sh
kvq_unpack_device || { echo "no .device/ carried" >&2; exit 2; }
B=/tmp/kvq-bin/bin
name=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "card: $name" | tee "$FINAL/gpu.txt"
for r in 1 2; do for st in 16 8; do for sp in 8 16; do
  KVQ_DECODE_RING_STAGES=$st "$B/kvq" bench decode --backend cuda --kv-cache-dtype fp8,int8 --block-sizes 16 --iters 30 \
    --timeline-runs 3 --splits $sp --shapes "16,8,1,256,8192" --json "$FINAL/probe/st${st}_sp${sp}_$r.json" \
    > "$FINAL/probe/st${st}_sp${sp}_$r.log" 2>&1 || echo "st$st sp$sp rc=$?"
done; done; done
python3 - "$FINAL/probe" <<'PY' | tee "$FINAL/probe_table.txt"
import glob, json, os, sys
print(f"{'arm':14s} {'format':9s} {'ctas/sm':>7s} {'median':>7s} {'mean_cta':>8s} {'ramp':>6s} {'pages':>6s} {'tail':>6s} {'warps':>6s}")
for f in sorted(glob.glob(sys.argv[1] + "/*.json")):
    for row in json.load(open(f))["decode"]:
        t = row.get("timeline") or {}
        print(f"{os.path.basename(f)[:-5]:14s} {row['format'][:9]:9s} {row['ctas_per_sm']:7d} {row['us_median']:7.2f} "
              f"{t.get('mean_cta_us', 0):8.2f} {t.get('mean_ramp_us', 0):6.2f} {t.get('mean_pages_us', 0):6.2f} "
              f"{t.get('mean_tail_us', 0):6.2f} {t.get('mean_warps_us', 0):6.2f}")
PY
if [[ $name == *H200* ]]; then
  OUT="$FINAL/h200" bash bench/results/2026-12-07-wave28/device_h200.sh > "$FINAL/h200_console.txt" 2>&1
  tail -30 "$FINAL/h200_console.txt"
fi
tar czf "$FINAL/all.tgz" -C "$FINAL" --exclude all.tgz .
