# syntax=docker/dockerfile:1
# The ENGINE image: `kascade engine serve` (warm pool and fallback pods), `kascade model download` (the
# pool's init container); it also carries the operator, so one image can run everything (e2e/kind).
# The operator's own image is the slim Dockerfile.operator (no torch).
#
#   docker build -t ghcr.io/kascade/kascade-engine:dev .                          # CUDA base (default)
#   docker build -t ghcr.io/kascade/kascade-engine:dev-cpu --build-arg BASE=ubuntu:24.04 .   # CPU nodes
#
# Dependencies are pinned with hashes by requirements/engine.lock (hack/lock.sh; CPython 3.12, x86_64).
# PyPI's Linux torch wheel carries its CUDA 12 runtime libraries, so the CPU variant runs the same
# wheels (larger than a CPU-only torch, which is not on PyPI); the CUDA base adds the driver-compat
# layer and NVIDIA_* environment the NVIDIA container toolkit reads. Not built on the dev machines (no
# Docker): tests/chart/test_images.py checks what can be checked without it.
ARG BASE=nvidia/cuda:12.8.1-base-ubuntu24.04

FROM ${BASE} AS build
RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      python3 python3-venv ca-certificates && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/kascade
ENV PATH=/opt/kascade/bin:$PATH
WORKDIR /src
COPY requirements/engine.lock requirements/engine.lock
RUN pip install --no-cache-dir --require-hashes -r requirements/engine.lock
COPY pyproject.toml README.md LICENSE ./
COPY planner planner
COPY cli cli
COPY operator operator
COPY engine engine
COPY sim sim
COPY e2e e2e
COPY router router
RUN pip install --no-cache-dir --no-deps .

FROM ${BASE}
RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      python3 ca-certificates && rm -rf /var/lib/apt/lists/* \
 && useradd --uid 65532 --user-group --no-create-home --shell /usr/sbin/nologin kascade
COPY --from=build /opt/kascade /opt/kascade
ENV PATH=/opt/kascade/bin:$PATH PYTHONUNBUFFERED=1 HOME=/tmp
# the chart runs every container as this user with a read-only root filesystem and a /tmp emptyDir
USER 65532:65532
# engine HTTP (OpenAI + control API + /metrics), weight data plane, activations (chart: pool.*Port)
EXPOSE 8000 18515 18516
# no ENTRYPOINT: the chart's `args` start with `kascade`
CMD ["kascade", "--help"]
