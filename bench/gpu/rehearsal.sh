#!/usr/bin/env bash
# A rehearsal of bench/gpu/run.sh on this (GPU-less) machine, as close to the lent GPU machine as
# a CPU allows: a venv of Python 3.12 holding torch 2.11.0 (PyPI's build, the device's
# 2.11.0+cu130 with its CUDA libraries, which imports and runs on a CPU) and ONLY packages
# that bench/gpu/device_packages.txt lists for that machine (at its versions where it gives them),
# then gpu.sh run on the CPU at reduced sizes, installing the carried wheels (.whl) into a
# folder of its own and importing the carried ComfyUI tree exactly as on the device.
#
#   bash bench/gpu/prepare.sh          # first: fills .device/comfyui and .whl
#   bash bench/gpu/rehearsal.sh        # builds the venv if missing, then runs gpu.sh
#   bash bench/gpu/rehearsal.sh --second   # the second command the same way
#   REHEARSAL_BUILD_ONLY=1 bash bench/gpu/rehearsal.sh
#
# The venv: .cache/venvs/device-rehearsal (ignored by git; rebuilt when this script's package
# list changes). Python: $REHEARSAL_PYTHON (default /root/.pyenv/versions/3.12.1/bin/python,
# this workplace's nearest to the device's 3.12.3). Results: $OUT (default: a new folder
# /tmp/gpu-rehearsal.XXXXXX).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${REHEARSAL_PYTHON:-/root/.pyenv/versions/3.12.1/bin/python}
VENV=.cache/venvs/device-rehearsal
LIST=bench/gpu/device_packages.txt
# What the bench and ComfyUI's modules it imports need from the device's packages (names as
# the list spells them); the versions come from the list where it has one.
NEEDED=(torch torchvision torchaudio triton numpy safetensors transformers tokenizers
        sentencepiece einops scipy pillow pyyaml psutil tqdm aiohttp yarl requests filelock
        scikit-image)

pin() {  # pin NAME: NAME==VERSION when the device list gives a version, else NAME
  local line
  line=$(grep -i -E "^$1(==|$)" "$LIST") || { echo "device_rehearsal: $1 is not in $LIST" >&2; exit 1; }
  echo "$line"
}

stamp=$({ "$PY" --version; cat "$LIST"; printf '%s\n' "${NEEDED[@]}"; } | sha256sum | cut -d' ' -f1)
if [ ! -f "$VENV/.stamp" ] || [ "$(cat "$VENV/.stamp")" != "$stamp" ]; then
  echo "device_rehearsal: building $VENV with $("$PY" --version)"
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
  specs=()
  for name in "${NEEDED[@]}"; do specs+=("$(pin "$name")"); done
  # The workplace's pip configuration may pin a local find-links folder and a torch cap; PyPI
  # holds every release named here.
  "$VENV/bin/python" -m pip install -q "${specs[@]}"
  # The newest typer (pulled by transformers) requires pydantic, which the device's list does
  # not have (its typer is another version): removed, as the device lacks them.
  "$VENV/bin/python" -m pip uninstall -q -y pydantic pydantic-core annotated-types \
    typing-inspection
  echo "$stamp" >"$VENV/.stamp"
fi

# Nothing the device lacks may be in the venv (pip, setuptools and the venv's own tools aside):
# a package that is only here would hide a missing wheel.
"$VENV/bin/python" - "$LIST" <<'EOF'
import re
import sys
from importlib import metadata

def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()

listed = {norm(line.strip().split("==")[0]) for line in open(sys.argv[1])
          if line.strip() and not line.startswith("#")}
extra = sorted({norm(d.metadata["Name"]) for d in metadata.distributions()}
               - listed - {"pip", "setuptools", "wheel"})
if extra:
    sys.exit(f"device_rehearsal: the venv holds packages the device lacks: {', '.join(extra)}")
print(f"device_rehearsal: every package in the venv is on the device's list ({len(listed)} there)")
EOF
[ -z "${REHEARSAL_BUILD_ONLY:-}" ] || exit 0

# Results in $OUT (default: a new folder) and the wheels in a folder of this run's own: nothing
# outside them is written or deleted.
export OUT=${OUT:-$(mktemp -d /tmp/gpu-rehearsal.XXXXXX)}
mkdir -p "$OUT"
TOMA_SITE=$(mktemp -d /tmp/gpu-rehearsal-site.XXXXXX)
export TOMA_SITE
trap 'rm -rf "$TOMA_SITE"' EXIT
PATH="$PWD/$VENV/bin:$PATH" PYTHON=python3 bash bench/gpu/run.sh --device cpu "$@"
