#!/usr/bin/env bash
# Fetch, where PyPI is reachable, the wheels a bare GPU machine needs to run this project: one that has
# torch, accelerate, transformers, peft and the usual scientific stack (a bare GPU machine without
# network, as many CUDA images are) but not the packages below. scripts/gpu_suite.py
# installs them there with `pip install --no-index --no-deps --target ...`.
#
#   scripts/gpu_wheels.sh [DIR]         # default DIR: .whl (git-ignored); PYTHON=... picks the interpreter
#
# Versions are the ones installed here (the project's venv), so the GPU runs what the CPU tests ran.
# The GPU machine runs Python 3.12 on x86-64: compiled wheels are fetched for it, not for this
# machine. deepspeed and snownlp publish source only: pip builds their pure-Python wheels here
# (deepspeed compiles its ops at first use, on the machine that uses them).
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-.whl}
PYTHON=${PYTHON:-.venv/bin/python}
[ -x "$PYTHON" ] || PYTHON=python3
# Missing from the image: the project's datasets, evaluate, deepspeed and snownlp, and what they need
# that the image lacks (datasets: dill, multiprocess; deepspeed: hjson, pydantic and its parts).
PACKAGES="datasets evaluate deepspeed snownlp dill multiprocess hjson pydantic pydantic-core annotated-types typing-inspection"
PLATFORMS="--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64"
# A size cap, in MiB, so the wheels travel with the working tree in one small copy (the tree is under 1 MiB).
LIMIT_MIB=60

mkdir -p "$DIR"
for name in $PACKAGES; do
  version=$("$PYTHON" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name")
  stem=$(echo "$name" | tr - _)
  if ls "$DIR" | grep -qi "^${stem}-${version}-"; then
    echo "have $name==$version"
  # shellcheck disable=SC2086
  elif "$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      $PLATFORMS -d "$DIR" "$name==$version" 2>/dev/null; then
    echo "fetched $name==$version"
  else  # source only: a pure-Python wheel, built here
    "$PYTHON" -m pip wheel --quiet --no-deps -w "$DIR" "$name==$version"
    built=$(ls "$DIR" | grep -i "^${stem}-${version}-" | head -1)
    case "$built" in
      *-py3-none-any.whl) echo "built $built" ;;
      *) echo "error: $name==$version has no wheel for CPython 3.12 on x86-64 and built as '$built'" >&2; exit 1 ;;
    esac
  fi
done
# One version of each package: two would stop the install on the GPU machine.
dupes=$(ls "$DIR"/*.whl | xargs -n1 basename | cut -d- -f1 | tr A-Z a-z | sort | uniq -d)
[ -z "$dupes" ] || { echo "error: several versions of: $dupes (empty $DIR and fetch again)" >&2; exit 1; }
size=$(du -sm "$DIR" | cut -f1)
echo "$DIR: $(ls "$DIR"/*.whl | wc -l) wheels, ${size} MiB"
[ "$size" -le "$LIMIT_MIB" ] || { echo "error: over ${LIMIT_MIB} MiB, more than the cap allows (LIMIT_MIB)" >&2; exit 1; }
