#!/usr/bin/env bash
# Fills what bench/gpu/run.sh needs on the lent GPU machine and cannot find there, in folders git
# ignores (.gitignore) that a `run` call carries:
#
#   .device/comfyui   ComfyUI v0.33.0 (the newest of the project's source trees, the one the
#                     gpu-model projection ran on): its Python code only, without .git, tests,
#                     workflow blueprints, API nodes, server and database code, and the tokenizer
#                     and vocabulary files (no text encoder is built); about 9 MiB
#   .whl              wheels for Python 3.12 manylinux x86_64 of what ComfyUI's modules imported
#                     by the bench need and the device lacks (bench/gpu/device_packages.txt lists
#                     what it has); each wheel's own requirements are checked against that list
#
# Then it measures what a `run` call would send (tracked and untracked-not-ignored files plus
# the carried folders: bench/gpu/travel.sh size) against the 64 MiB limit, and fails above it.
#
#   bash bench/gpu/prepare.sh                   # tree from ../shared/comfyui/v0.33.0
#   COMFY_TREE=/path/to/ComfyUI bash bench/gpu/prepare.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
PY=${PYTHON:-python3}
COMFY_TREE=${COMFY_TREE:-$ROOT/../shared/comfyui/v0.33.0}
# name==version: ComfyUI v0.33.0's requirements.txt pins (comfy-kitchen, comfy-aimdo) or, where
# it pins nothing, the newest release at the time this was written; what each is for:
WHEELS=(
  "torchsde==0.2.6"       # comfy/k_diffusion/sampling.py imports it (every sampler)
  "trampoline==0.1.2"     # torchsde's requirement
  "comfy-aimdo==0.4.13"   # comfy/model_management.py, model_patcher.py, ops.py import it
  "comfy-kitchen==0.2.31" # comfy/ldm/modules/attention.py, quant_ops.py (Flux's RoPE goes
                          # through it): the pure-Python wheel, see below
  "tomesd==0.1.3"         # the ToMeSD baseline of the quality and kernels sections
)
# comfy-kitchen's manylinux wheel carries a 176 MB CUDA extension (58 MB compressed, over the
# whole limit with the tree); its py3-none-any wheel has the same API on its eager backend.
PURE=(comfy-kitchen)
# Not carried, though ComfyUI's requirements name them: av (PyAV: its wheel is 35 MB, which with
# the tree and the pack's own 22 MiB is over the limit; only comfy_api.latest imports it, for its
# video types: run.sh puts the stand-in in bench/gpu/stubs on the path instead, so that
# comfy_extras' V3 nodes, EasyCache and TorchCompileModel among them, import), kornia and spandrel (no module the bench imports uses them), alembic, SQLAlchemy, blake3,
# simpleeval, pydantic and the frontend packages (server only).

echo "== ComfyUI tree: $COMFY_TREE -> .device/comfyui"
[ -d "$COMFY_TREE/comfy" ] || { echo "no ComfyUI tree at $COMFY_TREE" >&2; exit 1; }
chmod -R u+w .device/comfyui 2>/dev/null || true
rm -rf .device/comfyui
mkdir -p .device/comfyui
tar -C "$COMFY_TREE" -cf - \
  --exclude=.git --exclude=.github --exclude=.ci --exclude=__pycache__ \
  --exclude=./tests --exclude=./tests-unit --exclude=./blueprints --exclude=./comfy_api_nodes \
  --exclude=./app --exclude=./api_server --exclude=./alembic_db --exclude=./middleware \
  --exclude=./script_examples --exclude=./openapi.yaml --exclude='*.md' \
  --exclude='*tokenizer*.json' --exclude='*vocab*.json' --exclude='*merges*.txt' \
  --exclude='*.model' --exclude='*.tiktoken' --exclude='*.safetensors' . |
  tar -C .device/comfyui -xf -
chmod -R u+w .device/comfyui
cp "$COMFY_TREE/LICENSE" .device/comfyui/LICENSE   # GPL-3.0, travels with the code

echo "== wheels -> .whl"
rm -rf .whl
mkdir -p .whl
platforms=()
for tag in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 \
           manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_12_x86_64 \
           manylinux2010_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$tag")
done
for spec in "${WHEELS[@]}"; do
  name=${spec%%==*}
  if printf '%s\n' "${PURE[@]}" | grep -qx "$name"; then
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation py --platform any -d .whl "$spec"
  else
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp "${platforms[@]}" -d .whl "$spec"
  fi
done

echo "== their requirements against the device's packages and the carried wheels"
"$PY" - bench/gpu/device_packages.txt .whl <<'EOF'
import re
import sys
import zipfile
from pathlib import Path


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


have = {norm(line.strip().split("==")[0]) for line in open(sys.argv[1])
        if line.strip() and not line.startswith("#")}
wheels = sorted(Path(sys.argv[2]).glob("*.whl"))
carried = {norm(w.name.split("-")[0]) for w in wheels}
missing = []
for wheel in wheels:
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        for line in z.read(meta).decode().splitlines():
            if not line.startswith("Requires-Dist:") or "extra ==" in line:
                continue
            req = norm(re.split(r"[\s<>=!~;\[(]", line.split(":", 1)[1].strip())[0])
            if req not in have | carried:
                missing.append(f"{wheel.name} needs {req}")
    print(f"  {wheel.name} ({wheel.stat().st_size / 2**20:.2f} MiB)")
if missing:
    sys.exit("missing on the device and not carried: " + "; ".join(missing))
print("  every requirement is on the device or carried")
EOF

echo "== what a run call sends"
if ! bash bench/gpu/travel.sh size; then
  echo "over the limit: 'bash bench/gpu/travel.sh slim' first leaves the large quality" \
       "fixtures behind (and 'restore' after the run call)" >&2
  exit 1
fi
