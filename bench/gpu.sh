#!/usr/bin/env bash
# The first GPU run in one command: the speed sections and the quality section in bf16, each
# under its own time limit so that the whole stays within 8 minutes and a slow section cannot
# take the others' results with it. Reports land in bench/results/<date>-cuda-*.{json,md}
# and docs/quality-*-cuda.png.
#
#   COMFYUI_PATH=/path/to/ComfyUI bash bench/gpu.sh          # python from $PYTHON or PATH
set -uo pipefail
cd "$(dirname "$0")/.."
: "${COMFYUI_PATH:?set COMFYUI_PATH to a ComfyUI checkout whose requirements are installed}"
PY=${PYTHON:-python}
day=$(date +%F)
status=0
# section(s), seconds: 150 + 150 + 60 + 100 = 460 s of the 480 allowed.
for spec in quality:150 kernels,unet:150 flux:60 model:100; do
  sections=${spec%%:*}
  limit=${spec##*:}
  out="bench/results/${day}-cuda-${sections//,/-}.json"
  echo "== $sections (limit ${limit}s) -> $out"
  timeout "$limit" "$PY" -m bench --device cuda --sections "$sections" --out "$out" || {
    echo "!! $sections did not finish (exit $?)"; status=1; }
done
exit $status
