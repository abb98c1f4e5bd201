# The ENGINE image: `kascade engine serve` (warm pool and fallback pods), `kascade model download` (the
# pool's init container); it also carries the operator, so one image can run everything.
# The operator's own image is the slim Dockerfile.operator (no torch). `make images` builds both
# (hack/build-images.sh: tags from the chart's appVersion, a local Debian base when no registry answers).
#
#   docker build -t ghcr.io/kascade/kascade-engine:0.1.0 .                                  # CUDA base
#   docker build -t ghcr.io/kascade/kascade-engine:0.1.0-cpu --build-arg BASE=ubuntu:24.04 \
#     --build-arg VARIANT=cpu .                                                            # CPU nodes
#   docker build --build-arg BASE=kascade/base:bookworm ...   # no registry: hack/build-base-image.sh
#
# Dependencies: requirements/py<X.Y>/engine.lock (hack/lock.sh, hashed, manylinux x86_64), the one for
# the base's CPython (3.12 on the Ubuntu 24.04 bases, 3.11 on Debian bookworm). PyPI's Linux torch wheel
# needs its CUDA 12 runtime wheels even to import on a CPU; VARIANT=cpu drops the parts torch loads only
# on use with a GPU (triton, cuSOLVER, NVRTC, cuDNN's engine libraries): ~2 GB less. The CUDA base adds
# the driver-compat layer and NVIDIA_* environment the NVIDIA container toolkit reads.
ARG BASE=nvidia/cuda:12.8.1-base-ubuntu24.04

FROM ${BASE} AS build
# Python with venv from the base when it has one (python:*, kascade/base), else from the distribution
RUN python3 -m venv /opt/build 2>/dev/null || { rm -rf /opt/build && apt-get update \
      && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
      && rm -rf /var/lib/apt/lists/* && python3 -m venv /opt/build; }
WORKDIR /src
COPY requirements requirements
# PEM certificates pip must trust on the way to PyPI (a TLS-intercepting proxy); build stage only
ARG EXTRA_CA_CERTS=""
# the runtime venv has no pip: the build venv's pip (hashed setuptools/wheel too) installs into it
RUN set -eu; py=$(python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])'); \
    lock=requirements/py$py/engine.lock; \
    [ -f "$lock" ] || { echo "no $lock: this base has CPython $py; add it to LOCK_PYTHONS in hack/lock.sh" >&2; exit 1; }; \
    if [ -n "$EXTRA_CA_CERTS" ]; then cat /etc/ssl/certs/ca-certificates.crt > /tmp/ca.pem; \
      printf '%s\n' "$EXTRA_CA_CERTS" >> /tmp/ca.pem; export PIP_CERT=/tmp/ca.pem; fi; \
    /opt/build/bin/pip install --no-cache-dir --disable-pip-version-check --require-hashes -r requirements/build.lock; \
    python3 -m venv --without-pip /opt/kascade; \
    /opt/build/bin/pip --python /opt/kascade/bin/python install --no-cache-dir --disable-pip-version-check \
      --no-deps --only-binary :all: --require-hashes -r "$lock"; \
    rm -f /tmp/ca.pem
ARG VARIANT=cuda
RUN set -eu; case "$VARIANT" in \
      cuda) ;; \
      cpu) sp=$(/opt/kascade/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'); \
        /opt/build/bin/pip --python /opt/kascade/bin/python uninstall -y -q \
          triton nvidia-cusolver-cu12 nvidia-cuda-nvrtc-cu12; \
        rm -f "$sp"/nvidia/cudnn/lib/libcudnn_*.so.9 ;; \
      *) echo "VARIANT=$VARIANT: cuda or cpu" >&2; exit 1 ;; \
    esac
# the venv finds the project in /opt/kascade-app (a .pth): the project is its own small layer, so a
# code change rebuilds seconds of the image, not the multi-GB dependency layer
RUN sp=$(/opt/kascade/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') \
 && echo /opt/kascade-app > "$sp/kascade-app.pth"

# the project itself, pure Python, --no-deps: the lock decided every dependency. The context is an
# allowlist (.dockerignore): the package directories pyproject.toml names, nothing else.
FROM build AS project
COPY . .
RUN /opt/build/bin/pip wheel --no-cache-dir --disable-pip-version-check --no-deps --no-build-isolation -w /tmp/wheels . \
 && /opt/build/bin/pip --python /opt/kascade/bin/python install --no-cache-dir --disable-pip-version-check \
      --no-deps --no-compile --target /opt/kascade-app /tmp/wheels/kascade-*.whl \
 && /opt/kascade/bin/python -m compileall -q /opt/kascade-app \
 && PATH=/opt/kascade-app/bin:$PATH /opt/kascade/bin/python -c 'import kascade_cli.main, kascade_engine.server' \
 && rm -rf /tmp/wheels

FROM ${BASE}
RUN { command -v python3 >/dev/null || { apt-get update \
      && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3 ca-certificates \
      && rm -rf /var/lib/apt/lists/*; }; } \
 && useradd --uid 65532 --user-group --no-create-home --home-dir /tmp --shell /usr/sbin/nologin kascade
COPY --from=build /opt/kascade /opt/kascade
COPY --from=project /opt/kascade-app /opt/kascade-app
# HOME=/tmp: the chart runs every container as this user with a read-only root filesystem and a /tmp
# emptyDir (caches: HF_HOME, torch); the .pyc files were compiled at install, none are written
ENV PATH=/opt/kascade-app/bin:/opt/kascade/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 HOME=/tmp
ARG VERSION=dev
ARG VARIANT=cuda
LABEL org.opencontainers.image.title="kascade-engine" org.opencontainers.image.version="$VERSION" \
      org.opencontainers.image.source="https://github.com/kascade/kascade" io.kascade.variant="$VARIANT" \
      org.opencontainers.image.description="Kascade inference engine (kascade engine serve)"
USER 65532:65532
# engine HTTP (OpenAI + control API + /metrics), weight data plane, activations (chart: pool.*Port)
EXPOSE 8000 18515 18516
# no ENTRYPOINT: the chart's `args` start with `kascade`
CMD ["kascade", "--help"]
