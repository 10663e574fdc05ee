#!/usr/bin/env bash
# Moves the older records under bench/results/ out of the working tree before a device call, and back after.
# The device tool copies the whole working tree (tracked files included) plus the carried paths, 64 MiB in all;
# the records take ~24 MB of it and a packed kvq bundle 38-40 MB, so a call that carries .device does not fit
# with every record in place. The moved folders stay tracked: `git status` shows them deleted until `back`.
#   scripts/device_records_aside.sh out [KEEP] [NAME...]   move every record folder but the newest KEEP (default 2)
#                                                and the named ones (folders whose scripts the call runs)
#   scripts/device_records_aside.sh back         put them back (also after an interrupted call)
#   scripts/device_records_aside.sh size         bytes the device tool would copy (tracked + untracked, not ignored)
# Where they wait: $KVQ_RECORDS_ASIDE (default /tmp/kvq-records-aside, outside the repository).
set -euo pipefail
cd "$(dirname "$0")/.."
aside="${KVQ_RECORDS_ASIDE:-/tmp/kvq-records-aside}"
case "${1:-}" in
  out)
    keep="${2:-2}"; shift $(( $# > 1 ? 2 : 1 )); also=" $* "
    [[ $keep =~ ^[0-9]+$ ]] || { echo "KEEP must be a number of folders, got '$keep'" >&2; exit 2; }
    if [[ -d $aside ]] && [[ -n $(ls -A "$aside" 2>/dev/null) ]]; then
      echo "$aside already holds records: run '$0 back' first" >&2; exit 1
    fi
    mkdir -p "$aside"
    mapfile -t dirs < <(find bench/results -mindepth 1 -maxdepth 1 -type d | sort)
    n=$(( ${#dirs[@]} - keep )); (( n > 0 )) || { echo "nothing to move (${#dirs[@]} folders, keeping $keep)"; exit 0; }
    moved=0
    for d in "${dirs[@]:0:n}"; do
      [[ $also == *" $(basename "$d") "* ]] && continue
      mv "$d" "$aside/"; moved=$((moved + 1))
    done
    echo "moved $moved record folders to $aside; kept: ${dirs[*]:n} $*"
    ;;
  back)
    [[ -d $aside ]] || { echo "nothing aside in $aside"; exit 0; }
    for d in "$aside"/*/; do
      [[ -d $d ]] || continue
      name=$(basename "$d")
      [[ -e bench/results/$name ]] && { echo "bench/results/$name exists; left $d where it is" >&2; continue; }
      mv "$d" bench/results/
    done
    rmdir "$aside" 2>/dev/null || true
    echo "records back; git status: $(git status --porcelain bench/results | grep -c '^ D' || true) deleted paths"
    ;;
  size)
    git ls-files -z --cached --others --exclude-standard | xargs -0 -r du -cb 2>/dev/null | tail -1 | cut -f1
    ;;
  *) sed -n '2,9p' "$0" >&2; exit 2 ;;
esac
