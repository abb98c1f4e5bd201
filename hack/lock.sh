#!/usr/bin/env bash
# Regenerate the images' lock files from pyproject.toml with uv's resolver: pinned versions + sha256
# hashes for manylinux x86_64, one lock per CPython an image can be built on:
#   requirements/py3.12/  the registry bases (nvidia/cuda:*-ubuntu24.04, ubuntu:24.04, python:3.12-slim)
#   requirements/py3.11/  the local base hack/build-base-image.sh makes from Debian bookworm
# requirements/build.lock: setuptools and wheel (pure Python) that build the kascade wheel in the images.
# Each directory holds
#   operator.lock  Dockerfile.operator (kascade[operator,router]: no torch)
#   engine.lock    Dockerfile          (kascade[operator,router,engine]: torch from PyPI, CUDA 12 wheels)
# The Dockerfiles pick the lock of the interpreter their base image has. The first Python (PRIMARY) is
# resolved on its own; another Python's first lock starts from the primary's pins (uv keeps them where
# they support that interpreter, e.g. numpy 2.5 needs 3.12 so py3.11 gets the newest numpy that runs).
# uv prefers the versions already in an output file: re-running changes nothing unless pyproject.toml
# did; LOCK_UPGRADE=1 resolves the newest versions. tests/chart/test_image_locks.py checks the locks.
set -euo pipefail
cd "$(dirname "$0")/.."
UV=${UV:-.venv/bin/uv}
[ -x "$UV" ] || UV=uv
PYTHONS=${LOCK_PYTHONS:-3.12 3.11}
PRIMARY=${PYTHONS%% *}
common=(--generate-hashes --python-platform x86_64-manylinux_2_28 --no-header)
[ "${LOCK_UPGRADE:-0}" = 1 ] && common+=(--upgrade)
declare -A extras=([operator]="--extra operator --extra router" [engine]="--extra operator --extra router --extra engine")

for py in $PYTHONS; do
  mkdir -p "requirements/py$py"
  for image in operator engine; do
    out=requirements/py$py/$image.lock
    # uv prefers the versions in the existing output file: seed a new Python's lock with the primary's
    [ -s "$out" ] || [ "$py" = "$PRIMARY" ] || cp "requirements/py$PRIMARY/$image.lock" "$out"
    # shellcheck disable=SC2086  # the extras are words
    "$UV" pip compile --quiet pyproject.toml ${extras[$image]} --python-version "$py" "${common[@]}" -o "$out"
  done
done
# the build backend pyproject.toml names, hashed too (the images build the kascade wheel without isolation)
printf 'setuptools>=77\nwheel\n' | "$UV" pip compile --quiet - --python-version "$PRIMARY" "${common[@]}" -o requirements/build.lock
