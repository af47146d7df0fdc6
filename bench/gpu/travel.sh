#!/usr/bin/env bash
# What a device `run` call sends: the checkout's tracked and untracked-not-ignored files plus the
# carried folders, at most 64 MiB. The lab's trained fixtures that the GPU run can do without
# (TRAVEL_LEFT_OUT: the two proportion-matched quality fixtures, 98 MB together) are tracked, so
# they would travel and put the call over the limit; for the device session only, `slim` takes
# them out of git's index (`git rm --cached`, the files stay on disk) and ignores them
# (.git/info/exclude), `restore` undoes both. bench/gpu/run.sh runs the quality section on the
# fixtures that are there.
#
#   bash bench/gpu/travel.sh slim       # before prepare.sh and the run call
#   bash bench/gpu/travel.sh restore    # right after it: the index as it was, nothing to commit
#   bash bench/gpu/travel.sh size       # what a call would send now, against the limit
#
# While slim, `git status` shows the fixtures as deleted: commit nothing until restored.
set -euo pipefail
cd "$(dirname "$0")/../.."
LIMIT_MIB=64
TRAVEL_LEFT_OUT=(models/toma-sdxl-matched-fixture.safetensors
                 models/toma-flux-matched-fixture.safetensors)
EXCLUDE=$(git rev-parse --git-path info/exclude)
MARK="# bench/gpu/travel.sh slim"

size() {  # what a call sends: working tree (tracked + untracked-not-ignored) and the carried
  local tracked carried=0
  tracked=$(git ls-files -z --cached --others --exclude-standard |
            xargs -0 -r du -cb 2>/dev/null | tail -1 | cut -f1)
  for dir in .device .whl; do
    [ -e "$dir" ] && carried=$((carried + $(du -sb "$dir" | cut -f1)))
  done
  awk -v t="${tracked:-0}" -v c="$carried" -v l="$LIMIT_MIB" 'BEGIN {
    printf "  working tree %.1f MiB + carried (.device, .whl) %.1f MiB = %.1f MiB of %d MiB\n",
           t / 2^20, c / 2^20, (t + c) / 2^20, l; exit (t + c > l * 2^20) }'
}

case ${1:-} in
  slim)
    mkdir -p "$(dirname "$EXCLUDE")"
    for path in "${TRAVEL_LEFT_OUT[@]}"; do
      git rm -q --cached --ignore-unmatch -- "$path"
      # a pattern line can hold no comment: the mark goes on the line before it
      grep -qxF "/$path" "$EXCLUDE" 2>/dev/null || printf '%s\n/%s\n' "$MARK" "$path" >>"$EXCLUDE"
    done
    size
    ;;
  restore)
    git reset -q -- "${TRAVEL_LEFT_OUT[@]}"
    [ ! -f "$EXCLUDE" ] || sed -i "\|^$MARK\$|{N;d}" "$EXCLUDE"
    git status --short -- "${TRAVEL_LEFT_OUT[@]}"
    ;;
  size) size ;;
  *) echo "usage: bash bench/gpu/travel.sh slim|restore|size" >&2; exit 2 ;;
esac
