#!/usr/bin/env bash
# Fetch, where PyPI is reachable, the wheels a bare GPU machine needs to run this project: one that has
# torch, accelerate, transformers, peft and the usual scientific stack (a bare GPU machine without
# network, as many CUDA images are) but not the rest. scripts/gpu_suite.py installs them there with
# `pip install --no-index --no-deps --target ...`.
#
#   scripts/gpu_wheels.sh [DIR]         # default DIR: .whl (git-ignored); PYTHON=... picks the interpreter
#   scripts/gpu_wheels.sh --plan        # what it would fetch, offline: one `name version` line each
#
# Which packages: scripts/wheel_plan.py, from the project's own dependencies (pyproject.toml) and what they need,
# less what the GPU image has. Versions are the ones installed here (the project's venv), so the GPU runs what the
# CPU tests ran. The GPU machine runs Python 3.12 on x86-64: compiled wheels are fetched for it, not for this
# machine. A package that publishes source only (deepspeed, snownlp) is built here as a pure-Python wheel
# (deepspeed compiles its ops at first use, on the machine that uses them).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
[ -x "$PYTHON" ] || PYTHON=python3
if [ "${1:-}" = "--plan" ]; then
  exec "$PYTHON" scripts/wheel_plan.py
fi
DIR=${1:-.whl}
PLATFORMS="--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64"
# A size cap, in MiB, so the wheels travel with the working tree in one small copy (the tree is under 1 MiB).
LIMIT_MIB=60
PLAN=$("$PYTHON" scripts/wheel_plan.py)

mkdir -p "$DIR"
while read -r name version; do
  stem=$(echo "$name" | tr - _)
  spec="$name==$version"
  if [ "$version" = "-" ]; then  # not installed here (an extra for GPUs only): its newest wheel
    spec=$name version="[0-9]*"
  fi
  if ls "$DIR" | grep -qi "^${stem}-${version}-"; then
    echo "have $name==$version"
  # shellcheck disable=SC2086
  elif "$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      $PLATFORMS -d "$DIR" "$spec" 2>/dev/null; then
    echo "fetched $name==$version"
  else  # source only: a pure-Python wheel, built here
    "$PYTHON" -m pip wheel --quiet --no-deps -w "$DIR" "$spec"
    built=$(ls "$DIR" | grep -i "^${stem}-${version}-" | head -1)
    case "$built" in
      *-py3-none-any.whl) echo "built $built" ;;
      *) echo "error: $name==$version has no wheel for CPython 3.12 on x86-64 and built as '$built'" >&2; exit 1 ;;
    esac
  fi
done <<< "$PLAN"
# One version of each package: two would stop the install on the GPU machine.
dupes=$(ls "$DIR"/*.whl | xargs -n1 basename | cut -d- -f1 | tr A-Z a-z | sort | uniq -d)
[ -z "$dupes" ] || { echo "error: several versions of: $dupes (empty $DIR and fetch again)" >&2; exit 1; }
size=$(du -sm "$DIR" | cut -f1)
echo "$DIR: $(ls "$DIR"/*.whl | wc -l) wheels, ${size} MiB"
[ "$size" -le "$LIMIT_MIB" ] || { echo "error: over ${LIMIT_MIB} MiB, more than the cap allows (LIMIT_MIB)" >&2; exit 1; }
