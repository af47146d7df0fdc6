#!/usr/bin/env bash
# The first GPU run in two commands: the bench sections that matter on the lent GPU machine, in
# bf16, each under its own time limit, every result under $OUT. The first decides within 6
# minutes (a machine's start and the first command twice fit the 15 minutes of device time);
# the second, the compiled cases and the block sections, only if time is left.
#
# The device tool's `run` calls, as they are (timeout_s: 30 s and a minute above each command's
# budget):
# run: {"command": "bash bench/gpu/run.sh", "carry": [".device", ".whl"], "timeout_s": 330}
# run: {"command": "bash bench/gpu/run.sh --second", "carry": [".device", ".whl"], "timeout_s": 525}
#
# Before them, in the checkout the calling session was started in (the one a call sends, also
# when a helper calls from another worktree): `bash bench/gpu/travel.sh slim` (the large
# quality fixtures out of what the call sends), then `bash bench/gpu/prepare.sh` (ComfyUI
# v0.33.0's code in .device/comfyui, the missing wheels in .whl; it checks the 64 MiB the call
# may send); after them, `bash bench/gpu/travel.sh restore`. A rehearsal on a CPU, in a
# venv holding only the device's packages: `bash bench/gpu/rehearsal.sh`, which runs this
# script with `--device cpu` (gpu-call at reduced sizes, the other sections as they run on a
# CPU). The device's python3 (Python 3.12, torch 2.11 + CUDA 13) is used unless $PYTHON says
# otherwise.
#
# What it does:
#  1. installs the carried wheels into $TOMA_SITE (default /tmp/site; PYTHONPATH), ComfyUI
#     from .device/comfyui; where PyAV is missing (it does not travel: 35 MB), the stand-in in
#     bench/gpu/stubs, so that comfy_api.latest and ComfyUI's V3 nodes (EasyCache) import;
#  2. runs the sections in order, each with `timeout` at the smaller of its cap and what is
#     left of the command's budget. First command: ceilings (versions, bandwidth, GEMM, SDPA
#     backend, the plan kernel at real shapes), gpu-call's eager cases (the measurement that
#     matters; it stops its own cases inside its budget and keeps the finished ones if it is
#     killed), whole 20-step SDXL runs (unmerged, ToMA, EasyCache, both), then quality (on the
#     trained fixtures that travelled, --quick). Second command
#     (--second): gpu-call's compiled cases, then kernels, unet and flux (--quick);
#  3. prints a summary table (bench/gpu/summary.py: the measured calls beside the projection)
#     and leaves in $OUT, flat: gpu.log (all output), summary.md, one JSON per section, and
#     extras.tar.gz (the Markdown reports, the quality pictures, partial results).
#
#   bash bench/gpu/run.sh [--second] [--device cuda|cpu]     # OUT defaults to .cache/gpu-out
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
DEVICE=cuda
SECOND=
while [ $# -gt 0 ]; do
  case $1 in
    --device) DEVICE=$2; shift 2 ;;
    --second) SECOND=1; shift ;;
    *) echo "gpu.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
# Whole-command budgets (seconds): every section's limit is cut to what is left of its
# command's, so the command ends within it however the sections go (the install and the summary
# take a few seconds of the rest). name:cap_seconds, in order.
FIRST_TOTAL_S=300
FIRST_SECTIONS=(
  "ceilings:30"
  "gpu-call:180"
  "gpu-runs:50"
  "quality:40"
)
SECOND_TOTAL_S=465
SECOND_SECTIONS=(
  "gpu-call:330"
  "kernels,unet,flux:120"
)
if [ -z "$SECOND" ]; then
  TOTAL_S=$FIRST_TOTAL_S SECTIONS=("${FIRST_SECTIONS[@]}")
  export TOMA_GPU_CALL_CASES=eager
else
  TOTAL_S=$SECOND_TOTAL_S SECTIONS=("${SECOND_SECTIONS[@]}")
  export TOMA_GPU_CALL_CASES=compiled
fi
MIN_SECTION_S=20   # a section is not started with less than this left

command_for() {  # the `python -m` arguments of section $1 on $DEVICE (then --device, --out)
  case $1:$DEVICE in
    # quality: python -m bench.quality (the section alone, same rows); on a CPU one fixture at
    # a small latent, to show it runs within the budget (at full size it takes ~8 min there)
    quality:cpu) echo "bench.quality --quick --layouts flux --side 8 --threads 2" ;;
    # (the fixtures in models/: bench/gpu/travel.sh slim leaves the two large ones behind)
    quality:*) echo "bench.quality --quick --layouts present" ;;
    kernels*) echo "bench --quick --sections $1" ;;
    *) echo "bench --sections $1" ;;
  esac
}
OUT=${OUT:-$PWD/.cache/gpu-out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/gpu.log") 2>&1
started=$SECONDS
PY=${PYTHON:-python3}
RES=$(mktemp -d /tmp/gpu-results.XXXXXX)
export PYTHONUNBUFFERED=1
touch "$RES/.started"

echo "== gpu.sh on $(hostname) at $(date -u '+%F %T UTC'): device $DEVICE, $("$PY" --version)"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version \
  --format=csv,noheader
# the wheels' folder: /tmp/site on the device (a fresh machine), the rehearsal's own elsewhere
SITE=${TOMA_SITE:-/tmp/site}
"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target "$SITE" .whl/*.whl || { echo "!! wheels did not install (run bench/gpu/prepare.sh)"; exit 1; }
export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
"$PY" -c "import av" 2>/dev/null || export PYTHONPATH=$PYTHONPATH:$PWD/bench/gpu/stubs
export COMFYUI_PATH=$PWD/.device/comfyui
[ -d "$COMFYUI_PATH/comfy" ] || { echo "!! no ComfyUI at $COMFYUI_PATH (run bench/gpu/prepare.sh)"; exit 1; }
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
echo "== setup done in $((SECONDS - started)) s"

printf 'section\tstatus\tseconds\tlimit\n' >"$RES/status.tsv"
for spec in "${SECTIONS[@]}"; do
  IFS=: read -r name cap <<<"$spec"
  file=${name//,/-}
  left=$((TOTAL_S - (SECONDS - started)))
  limit=$((cap < left ? cap : left))
  if [ "$limit" -lt "$MIN_SECTION_S" ]; then
    echo "== $name: not run ($left s left of $TOTAL_S)"
    printf '%s\tnot run\t0\t%s\n' "$name" "$limit" >>"$RES/status.tsv"
    continue
  fi
  echo "== $name (limit ${limit}s) -> $file.json"
  # gpu-call keeps 15 s of its limit for its start (imports, CUDA) and the report
  export TOMA_GPU_CALL_BUDGET_S=$((limit - 15)) TOMA_GPU_CALL_PARTIAL=$RES/$file.partial.json
  export TOMA_GPU_RUNS_BUDGET_S=$((limit - 20))   # gpu-runs: its start and the model build
  t0=$SECONDS
  # shellcheck disable=SC2046  # command_for prints whole arguments
  timeout -k 5 "$limit" "$PY" -m $(command_for "$name") --device "$DEVICE" \
    --out "$RES/$file.json"
  rc=$?
  case $rc in
    0) status=ok ;;
    124|137) status="timed out" ;;
    *) status="failed ($rc)" ;;
  esac
  echo "== $name: $status after $((SECONDS - t0)) s"
  printf '%s\t%s\t%s\t%s\n' "$name" "$status" "$((SECONDS - t0))" "$limit" >>"$RES/status.tsv"
done

echo "== summary"
"$PY" -m bench.gpu.summary "$RES" --out "$OUT/summary.md"
for f in "$RES"/*.json; do
  [ -e "$f" ] || continue
  case $f in *.partial.json) continue ;; esac
  cp "$f" "$OUT/"
done
# a section killed before writing its JSON: its partial rows stand in for it
for f in "$RES"/*.partial.json; do
  [ -e "$f" ] || continue
  whole=${f%.partial.json}.json
  [ -e "$whole" ] || cp "$f" "$OUT/$(basename "$whole")"
done
# the quality section's pictures (written into docs/ during this run) go with the reports
find docs -maxdepth 1 -name 'quality-*.png' -newer "$RES/.started" -exec mv {} "$RES/" \;
(cd "$RES" && find . -maxdepth 1 -type f ! -name '.*' ! -name '*.json' -o -name '*.partial.json' |
   tar -czf "$OUT/extras.tar.gz" -T -)
echo "== done in $((SECONDS - started)) s; in $OUT:"
find "$OUT" -maxdepth 1 -type f -printf '  %f (%s bytes)\n'
