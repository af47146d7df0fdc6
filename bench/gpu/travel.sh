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
# A device call sends tracked files whatever the ignore rules say, so a tracked file stays behind
# only out of the index. While slim, `git status` shows the fixtures as deleted, and a pre-commit
# hook that slim installs (and restore removes) refuses every commit, so a forgotten restore
# cannot commit their deletion.
set -euo pipefail
cd "$(dirname "$0")/../.."
LIMIT_MIB=64
TRAVEL_LEFT_OUT=(models/toma-sdxl-matched-fixture.safetensors
                 models/toma-flux-matched-fixture.safetensors)
EXCLUDE=$(git rev-parse --git-path info/exclude)
HOOK=$(git rev-parse --git-path hooks/pre-commit)
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
    if [ -e "$HOOK" ] && ! grep -qxF "$MARK" "$HOOK"; then
      echo "travel.sh: $HOOK is another pre-commit hook; slim needs that place for its guard" >&2
      exit 1
    fi
    mkdir -p "$(dirname "$EXCLUDE")" "$(dirname "$HOOK")"
    printf '#!/bin/sh\n%s\necho "%s" >&2\nexit 1\n' "$MARK" \
      "travel.sh slim is in effect: run 'bash bench/gpu/travel.sh restore' before committing" \
      >"$HOOK"
    chmod +x "$HOOK"
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
    if [ -e "$HOOK" ] && grep -qxF "$MARK" "$HOOK"; then rm -f "$HOOK"; fi
    git status --short -- "${TRAVEL_LEFT_OUT[@]}"
    ;;
  size) size ;;
  *) echo "usage: bash bench/gpu/travel.sh slim|restore|size" >&2; exit 2 ;;
esac
