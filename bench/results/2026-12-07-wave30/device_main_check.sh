#!/usr/bin/env bash
# wave 30: main's GPU tests on the lent card (test_attention_cuda: every test; compute-sanitizer memcheck on the
# decode tests, racecheck on the overlap and L2-policy tests), and main's binaries kept on the machine
# (/tmp/kvq-main) as the base of a later call's A/B (device_patched_ab.sh) while the machine stays warm.
# Carry .device (PACK_ONLY="kvq test_attention_cuda" PACK_BUNDLE=1 scripts/device_engine.sh pack build-cuda).
set -uo pipefail
cd "$(dirname "$0")/../../.."
source scripts/device_unpack.sh
kvq_device_prelude /tmp/w30main || exit 2
echo "card: $(cat "$FINAL/gpu.txt")"
rm -rf /tmp/kvq-main && cp -r /tmp/kvq-bin /tmp/kvq-main
kvq_gpu_checks "$FINAL" main  # scripts/device_unpack.sh (since wave 31; the same runs)
gzip -9 "$FINAL"/*.log
