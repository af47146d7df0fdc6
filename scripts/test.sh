#!/usr/bin/env bash
# The test command (README, Development; .ci/run runs exactly this). Sets up what is missing
# (scripts/setup.sh: venvs rebuilt only when their inputs change), then runs
#   ruff, actionlint (.github/workflows), the unit tests, the integration/server/frontend tests
#   once per ComfyUI source tree in ../shared/comfyui (each in its own venv).
# Output stays quiet unless something fails; skipped tests are listed with their reasons.
#
# Where ../shared/comfyui exists, nothing may skip for want of ComfyUI: TOMA_REQUIRE_COMFYUI=1
# turns such a skip into a failure (tests/integration/conftest.py). Likewise the unit tests may
# not skip the Triton plan kernel's checks (setup.sh installs triton from requirements-dev.txt):
# TOMA_REQUIRE_TRITON=1 (tests/unit/test_plan_op.py).
#
#   bash scripts/test.sh                 everything
#   bash scripts/test.sh v0.8.0 [pytest arguments]    integration tests on one version only
#                                   (default tests/integration), e.g. tests/integration/test_flux.py
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
TREES=${TOMA_COMFY_TREES:-$ROOT/../shared/comfyui}
bash scripts/setup.sh >/dev/null

only=""
if [ $# -gt 0 ] && [ -d "$TREES/$1" ]; then
  only=$1
  shift
fi
PYTEST=(-q -rs -p no:cacheprovider)
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(tests/integration)
started=$SECONDS

failed=()
run() {  # run LABEL COMMAND...: keep going after a failure, report every failure at the end
  local label=$1
  shift
  echo "== $label"
  "$@" || failed+=("$label")
}

if [ -z "$only" ]; then
  run "ruff" .venv/bin/ruff check --quiet .
  run "actionlint" .cache/tools/bin/actionlint -no-color .github/workflows/*.yml
  run "unit tests" env TOMA_REQUIRE_TRITON=1 .venv/bin/python -m pytest "${PYTEST[@]}" tests/unit
fi

if [ -d "$TREES" ]; then
  for version in $(find "$TREES" -mindepth 1 -maxdepth 1 -name 'v*' -printf '%f\n' | sort -V); do
    [ -z "$only" ] || [ "$only" = "$version" ] || continue
    run "integration tests on ComfyUI $version" \
      env TOMA_REQUIRE_COMFYUI=1 COMFYUI_PATH="$TREES/$version" \
      "$(bash scripts/venv-for.sh "$version")/bin/python" -m pytest "${PYTEST[@]}" "${targets[@]}"
  done
else
  run "integration tests (no ComfyUI source trees at $TREES)" \
    .venv/bin/python -m pytest "${PYTEST[@]}" tests/integration
fi

if [ ${#failed[@]} -gt 0 ]; then
  echo "== FAILED after $((SECONDS - started)) s: ${failed[*]}"
  exit 1
fi
echo "== all tests passed in $((SECONDS - started)) s"
