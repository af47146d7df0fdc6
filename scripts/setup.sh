#!/usr/bin/env bash
# One-time development setup: .venv with CPU torch and the test/benchmark tools.
# TORCH_SPEC overrides the torch requirement (default: the CPU build 2.13.0).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# torch first and pinned: an unpinned torch (or one pulled by a dependency) is a multi-GB CUDA build.
.venv/bin/python -m pip install -q "${TORCH_SPEC:-torch==2.13.0}"
.venv/bin/python -m pip install -q -r requirements-dev.txt
.venv/bin/python -c "import torch; print('torch', torch.__version__)"
