#!/usr/bin/env bash
# wave 27, device call 1 (the first call that starts): since the build of the overlapped decode is packed, the call
# runs device_overlap.sh (which ends with the near-line sweep of wave 26). Carry .device.
set -uo pipefail
exec bash "$(dirname "$0")/device_overlap.sh"
