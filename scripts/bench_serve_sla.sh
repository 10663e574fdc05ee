#!/usr/bin/env bash
# The design's serving SLA check: for each cache spec, start `kvq serve`, drive it with
# `kvq bench serve` (three context tiers of real-text prompts), stop it (SIGTERM drains), then
# compare every spec with bf16 (P99 TTFT and TPOT <= 1.5x) and write everything under OUT.
#
#   scripts/bench_serve_sla.sh [OUT] [extra `kvq bench serve` flags...]
#
# Environment (defaults are the issue's H200 setup: SmolLM2, tiers ~1k/4k/7k, 50 prompts each):
#   KVQ=build/kvq MODEL=smollm2 BACKEND=auto SPECS="bf16 fp8_e4m3 fp8_fnuz int8" GRAN=per_token_head
#   TIERS=1024,4096,7168 PROMPTS=50 MAX_TOKENS=128 RATE=0 KV_GIB=8 MAX_SEQS=64 PORT=8321
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-bench/results/serve-sla-$(date -u +%Y%m%d-%H%M%S)}
shift || true
KVQ=${KVQ:-build/kvq}
MODEL=${MODEL:-smollm2}
BACKEND=${BACKEND:-auto}
SPECS=${SPECS:-"bf16 fp8_e4m3 fp8_fnuz int8"}
GRAN=${GRAN:-per_token_head}
TIERS=${TIERS:-1024,4096,7168}
PROMPTS=${PROMPTS:-50}
MAX_TOKENS=${MAX_TOKENS:-128}
RATE=${RATE:-0}
KV_GIB=${KV_GIB:-8}
MAX_SEQS=${MAX_SEQS:-64}
PORT=${PORT:-8321}
mkdir -p "$OUT"
{
  echo "date: $(date -u +%FT%TZ)"; echo "commit: $(git rev-parse HEAD)"; echo "host: $(uname -n)"
  "$KVQ" probe 2>&1 | head -20 || true
} > "$OUT/environment.txt"
results=()
for spec in $SPECS; do
  log="$OUT/serve-$spec.log"
  "$KVQ" serve --model "$MODEL" --backend "$BACKEND" --kv-cache-dtype "$spec" --kv-scale-granularity "$GRAN" ${SERVE_FLAGS:-} \
    --kv-cache-memory "$KV_GIB" --max-num-seqs "$MAX_SEQS" --port "$PORT" > "$log" 2>&1 &
  pid=$!
  for _ in $(seq 1 600); do
    curl -sf "http://127.0.0.1:$PORT/health" > /dev/null 2>&1 && break
    kill -0 "$pid" 2>/dev/null || { cat "$log"; exit 1; }
    sleep 0.5
  done
  "$KVQ" bench serve --url "http://127.0.0.1:$PORT" --tiers "$TIERS" --prompts "$PROMPTS" --max-tokens "$MAX_TOKENS" \
    --rate "$RATE" --tokenizer-model "$MODEL" --label "$spec" --out-dir "$OUT" "$@" || echo "bench serve: $spec had errors" >&2
  curl -s "http://127.0.0.1:$PORT/metrics" > "$OUT/metrics-$spec.txt" || true
  kill -TERM "$pid"
  wait "$pid" || true
  results+=("$OUT/$spec.json")
done
"$KVQ" capacity --model "$MODEL" --tokens "${TIERS##*,}" --kv-cache-memory "$KV_GIB" \
  --specs "$(echo "$SPECS" | tr ' ' ',')" --kv-scale-granularity "$GRAN" ${SERVE_FLAGS:-} --md "$OUT/capacity.md" > /dev/null
python3 scripts/plot_serve_cdf.py "$OUT/latency_cdf.png" "${results[@]}" || true  # needs matplotlib
"$KVQ" bench serve --compare "${results[@]}" --out-dir "$OUT"
