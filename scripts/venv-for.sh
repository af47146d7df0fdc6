#!/usr/bin/env bash
# The venv (folder) that scripts/setup.sh built for ComfyUI source tree <version>, e.g. v0.8.0:
# .venv for the newest tree, .cache/venvs/<version> for the others.
set -euo pipefail
cd "$(dirname "$0")/.."
TREES=${TOMA_COMFY_TREES:-$PWD/../shared/comfyui}
newest=$(find "$TREES" -mindepth 1 -maxdepth 1 -name 'v*' -printf '%f\n' | sort -V | tail -n 1)
if [ "$1" = "$newest" ]; then echo .venv; else echo ".cache/venvs/$1"; fi
