#!/usr/bin/env bash
# The test command (README, Development; .ci/run runs exactly this). Sets up what is missing
# (scripts/setup.sh: venvs rebuilt only when their inputs change), then runs
#   ruff, actionlint (.github/workflows), the unit tests, the integration/server/frontend tests
#   once per ComfyUI source tree in ../shared/comfyui (each in its own venv).
# On the older trees the tests marked newest_tree (tests/pytest.ini: the lab's code, inductor
# compilation) are deselected; the newest tree runs them all.
#
# The suites run side by side, TOMA_TEST_JOBS at a time (default: one per core). Every
# integration test runs torch on one thread (tests/integration/conftest.py), so a single suite
# leaves the second core of a 2-core machine idle. Each suite's output is printed whole when it
# ends, after a line saying it started; output stays quiet unless something fails; skipped
# tests are listed with their reasons.
#
# The tests marked `rounding` (tests/pytest.ini: bounds the CPU's float rounding could move) run
# a second time on the newest tree with torch's baseline kernels and MKL's SSE4.2 ones
# (ATEN_CPU_CAPABILITY=default, MKL_ENABLE_INSTRUCTIONS=SSE4_2), whatever this CPU's own are: a
# bound that holds only with one machine's kernels fails here, not on the next machine.
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
JOBS=${TOMA_TEST_JOBS:-$(nproc)}
if ! [[ $JOBS =~ ^[1-9][0-9]*$ ]]; then
  echo "TOMA_TEST_JOBS must be a whole number of suites at a time, 1 or more; got '$JOBS'" >&2
  exit 2
fi
bash scripts/setup.sh >/dev/null

only=""
if [ $# -gt 0 ] && [ -d "$TREES/$1" ]; then
  only=$1
  shift
fi
PYTEST=(-q -rs -p no:cacheprovider)
OTHER_KERNELS=(ATEN_CPU_CAPABILITY=default MKL_ENABLE_INSTRUCTIONS=SSE4_2)
targets=("$@")
deselect=()
if [ ${#targets[@]} -eq 0 ]; then
  targets=(tests/integration)
  deselect=(-m "not newest_tree")  # asked for by name, a newest_tree test runs on any tree
fi
started=$SECONDS
logs=$(mktemp -d)
touch "$logs/started"  # what this run wrote is newer
# torch.compile's cache (the compile tests' C++ kernels) lives and goes with this run, and so do
# the precompiled headers torch keeps in its default folder whatever the cache's folder is (keyed
# by the venv's path: 0.4 GB more with every clone on a machine whose /tmp outlives its runs).
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$logs/inductor}
headers=$(.venv/bin/python -c 'import os, tempfile, getpass; print(os.path.join(
  tempfile.gettempdir(), "torchinductor_" + getpass.getuser(), "precompiled_headers"))')
cleanup() {
  [ ! -d "$headers" ] || find "$headers" -type f -newer "$logs/started" -delete 2>/dev/null || true
  rm -rf "$logs"
}
trap cleanup EXIT

labels=()
commands=()
job() {  # job LABEL COMMAND...: queue a suite; the longest go first
  labels+=("$1")
  shift
  commands+=("$(printf '%q ' "$@")")
}

if [ -d "$TREES" ]; then
  mapfile -t versions < <(find "$TREES" -mindepth 1 -maxdepth 1 -name 'v*' -printf '%f\n' \
    | sort -rV)
  for version in "${versions[@]}"; do  # newest first: it runs every test
    [ -z "$only" ] || [ "$only" = "$version" ] || continue
    extra=()
    [ "$version" = "${versions[0]}" ] || extra=("${deselect[@]}")
    job "integration tests on ComfyUI $version" \
      env TOMA_REQUIRE_COMFYUI=1 COMFYUI_PATH="$TREES/$version" \
      "$(bash scripts/venv-for.sh "$version")/bin/python" -m pytest "${PYTEST[@]}" \
      "${extra[@]}" "${targets[@]}"
  done
else
  job "integration tests (no ComfyUI source trees at $TREES)" \
    .venv/bin/python -m pytest "${PYTEST[@]}" tests/integration
fi
if [ -z "$only" ]; then
  job "unit tests" env TOMA_REQUIRE_TRITON=1 .venv/bin/python -m pytest "${PYTEST[@]}" tests/unit
  job "ruff" .venv/bin/ruff check --quiet .
  job "actionlint" .cache/tools/bin/actionlint -no-color .github/workflows/*.yml
  if [ -d "$TREES" ] && [ ${#versions[@]} -gt 0 ]; then
    job "rounding-sensitive tests on ComfyUI ${versions[0]} under other CPU kernels" \
      env TOMA_REQUIRE_COMFYUI=1 COMFYUI_PATH="$TREES/${versions[0]}" "${OTHER_KERNELS[@]}" \
      "$(bash scripts/venv-for.sh "${versions[0]}")/bin/python" -m pytest "${PYTEST[@]}" \
      -m rounding tests/integration
  fi
fi

failed=()
declare -A running=()  # pid -> job index
finish() {  # wait for one job; print its output whole
  local pid status=0
  wait -n -p pid || status=$?
  local i=${running[$pid]}
  unset "running[$pid]"
  echo "== ${labels[$i]} ($((SECONDS - started)) s)"
  cat "$logs/$i.log"
  [ "$status" = 0 ] || failed+=("${labels[$i]}")
}

for i in "${!commands[@]}"; do
  while [ ${#running[@]} -ge "$JOBS" ]; do finish; done
  echo "== started: ${labels[$i]}"
  bash -c "${commands[$i]}" >"$logs/$i.log" 2>&1 &
  running[$!]=$i
done
while [ ${#running[@]} -gt 0 ]; do finish; done

if [ ${#failed[@]} -gt 0 ]; then
  echo "== FAILED after $((SECONDS - started)) s: ${failed[*]}"
  df -h "$ROOT" "$logs"  # a full disk fails tests far from their cause
  exit 1
fi
echo "== all tests passed in $((SECONDS - started)) s"
