#!/usr/bin/env bash
# The images' tag: the chart's appVersion, which is the tag the chart pulls when image.tag is empty.
# One place for `make images`, hack/build-images.sh and the kind e2e (tests/chart/test_images.py checks).
set -euo pipefail
cd "$(dirname "$0")/.."
tag=$(sed -n 's/^appVersion:[[:space:]]*"\{0,1\}\([^"[:space:]]*\)"\{0,1\}.*/\1/p' charts/kascade/Chart.yaml)
[ -n "$tag" ] || { echo "no appVersion in charts/kascade/Chart.yaml" >&2; exit 1; }
echo "$tag"
