#!/usr/bin/env bash
# A base kvq for a same-run A/B (scripts/device_ab.sh) that differs from BUILD_DIR's kvq in the named
# kernel objects alone: each SOURCE is compiled from BASE_REV's tree with BUILD_DIR's own command, swapped
# into a copy of libkvq_cuda.a, and kvq is relinked. Base and new then share every other byte, which keeps
# a PACK_BUNDLE=1 pack of both (and the test binaries) small, and the A/B measures exactly those kernels.
#
#   scripts/device_base.sh BUILD_DIR BASE_REV SOURCE...   e.g. build-cuda main src/attention/cuda/decode_inst_int8.cu
#   -> BUILD_DIR/kvq_base; then PACK_BASE=BUILD_DIR/kvq_base PACK_BUNDLE=1 scripts/device_engine.sh pack BUILD_DIR
#
# Only for changes confined to the named objects (the headers they include may differ; code in other
# objects must not), since the rest of the base is the new build.
set -euo pipefail
cd "$(dirname "$0")/.."
build="${1:?usage: device_base.sh BUILD_DIR BASE_REV SOURCE...}"
rev="${2:?usage: device_base.sh BUILD_DIR BASE_REV SOURCE...}"
shift 2
(($# > 0)) || { echo "device_base.sh: name at least one .cu source that differs from the base" >&2; exit 2; }
[[ -f $build/libkvq_cuda.a ]] || { echo "device_base.sh: $build/libkvq_cuda.a missing (build kvq with -DKVQ_CUDA=ON first)" >&2; exit 2; }
root=$PWD
tmp=$(mktemp -d /tmp/kvq-base.XXXXXX)
trap 'git -C "$root" worktree remove --force "$tmp/src" >/dev/null 2>&1 || true; rm -rf "$tmp"' EXIT
git worktree add --detach -q "$tmp/src" "$rev"
cp "$build/libkvq_cuda.a" "$tmp/"
cmds=$(ninja -C "$build" -t commands kvq)
for src in "$@"; do
  obj="$(basename "$src").o"
  cmd=$(grep -F -- "-c $root/$src -o" <<<"$cmds" | head -1)
  [[ -n $cmd ]] || { echo "device_base.sh: no compile command for $src in $build" >&2; exit 2; }
  # The build's command with the base tree's sources and headers, writing into the scratch folder.
  cmd=${cmd//$root\//$tmp/src/}
  cmd=$(sed -E "s# -o [^ ]+\$# -o $tmp/$obj#; s# -MD -MT [^ ]+ -MF [^ ]+##" <<<"$cmd")
  (cd "$build" && eval "$cmd")
  (cd "$tmp" && ar r libkvq_cuda.a "$obj")
done
link=$(tail -1 <<<"$cmds")
link=${link/ -o kvq / -o kvq_base }
link=${link/ libkvq_cuda.a / $tmp/libkvq_cuda.a }
(cd "$build" && eval "$link")
echo "$build/kvq_base: $build/kvq with $* from $rev ($(git rev-parse --short "$rev"))"
