#!/usr/bin/env bash
# The real-model benchmark's own environment (the lab's, never the product's or CI's): a venv
# that sees the project's torch and adds onnx, onnxruntime (the reference the conversion is
# checked against), tomesd (the ToMeSD baseline) and adaptive-terrain-diffusion 0.4.2 (MIT: the
# model and its sampling), installed without their dependencies (the package asks for
# onnxruntime-gpu). Usage: bash bench/realmodel/setup.sh   (REALMODEL_DIR moves it; default
# .cache/realmodel). Then: $REALMODEL_DIR/venv/bin/python -m bench.realmodel --help
set -euo pipefail
cd "$(dirname "$0")/../.."
dir="${REALMODEL_DIR:-.cache/realmodel}"
base="${PROJECT_VENV:-.venv}"
[ -x "$base/bin/python" ] || { echo "no project venv at $base (run scripts/setup.sh)" >&2; exit 1; }
mkdir -p "$dir"
if [ ! -x "$dir/venv/bin/python" ]; then
  "$base/bin/python" -m venv "$dir/venv"
  site_base=$("$base/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  site_new=$("$dir/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  echo "$(cd "$site_base" && pwd)" > "$site_new/project_venv.pth"
fi
pip=("$dir/venv/bin/python" -m pip install -q --disable-pip-version-check)
"${pip[@]}" "onnx==1.23.2" "onnxruntime==1.32.0" "numpy<3" "Pillow"
"${pip[@]}" --no-deps "tomesd==0.1.3" "adaptive-terrain-diffusion==0.4.2"
"$dir/venv/bin/python" -c 'import onnx, onnxruntime, tomesd, terrain_diffusion, torch; print("realmodel venv ready:", torch.__version__, onnxruntime.__version__)'
