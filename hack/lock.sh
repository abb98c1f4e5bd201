#!/usr/bin/env bash
# Regenerate the images' lock files from pyproject.toml with uv's resolver (pinned versions + sha256
# hashes for the images' platform: CPython 3.12, manylinux x86_64). Run after changing dependencies;
# tests/chart/test_images.py checks every dependency of the extras is pinned.
#   requirements/operator.lock  Dockerfile.operator (kascade[operator,router]: no torch)
#   requirements/engine.lock    Dockerfile          (kascade[operator,router,engine]: torch from PyPI, CUDA 12 wheels)
set -euo pipefail
cd "$(dirname "$0")/.."
UV=${UV:-.venv/bin/uv}
[ -x "$UV" ] || UV=uv
common=(--generate-hashes --python-version 3.12 --python-platform x86_64-manylinux_2_28 --no-header)
"$UV" pip compile pyproject.toml --extra operator --extra router "${common[@]}" -o requirements/operator.lock
"$UV" pip compile pyproject.toml --extra operator --extra router --extra engine "${common[@]}" -o requirements/engine.lock
