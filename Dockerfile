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
# the base's CPython (3.12 on the Ubuntu 24.04 bases, 3.11 on Debian bookworm). PyPI's only Linux torch
# wheel is the CUDA build, which needs ~4 GB of CUDA 12 wheels even to import on a CPU; VARIANT=cpu makes it
# a CPU torch (hack/torch-cuda-stub.py: libtorch_cuda.so becomes a stub of the ~120 symbols the rest of torch
# takes from it, the nvidia-* wheels but the CUDA runtime and triton are removed; docs/adr/0017): ~1.6 GB
# instead of 5.8. The CUDA base adds the driver-compat layer and NVIDIA_* environment the NVIDIA container
# toolkit reads.
ARG BASE=nvidia/cuda:12.8.1-base-ubuntu24.04
# the runtime dependencies the final stage starts from: the `deps` stage below, or an image of it
# (hack/build-images.sh builds `--target deps` once per lock and base, keeps it, and passes it here: a code
# change then builds the small project stage only, not the multi-GB dependency layer)
ARG DEPS=deps

# Python with venv from the base when it has one (python:*, kascade/base), else from the distribution;
# the build venv /opt/build with the hashed build backend (setuptools, wheel)
FROM ${BASE} AS pybase
RUN python3 -m venv /opt/build 2>/dev/null || { rm -rf /opt/build && apt-get update \
      && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
      && rm -rf /var/lib/apt/lists/* && python3 -m venv /opt/build; }
WORKDIR /src
COPY requirements requirements
# PEM certificates pip must trust on the way to PyPI (a TLS-intercepting proxy); build stages only: the
# bundle pip uses is /opt/build/ca.pem, which no runtime stage copies
ARG EXTRA_CA_CERTS=""
ENV PIP_CERT=/opt/build/ca.pem
RUN cat /etc/ssl/certs/ca-certificates.crt > /opt/build/ca.pem \
 && if [ -n "$EXTRA_CA_CERTS" ]; then printf '%s\n' "$EXTRA_CA_CERTS" >> /opt/build/ca.pem; fi \
 && /opt/build/bin/pip install --no-cache-dir --disable-pip-version-check --require-hashes -r requirements/build.lock

# the dependencies: a pip-less venv, installed by the build venv's pip
FROM pybase AS build
RUN set -eu; py=$(python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])'); \
    lock=requirements/py$py/engine.lock; \
    [ -f "$lock" ] || { echo "no $lock: this base has CPython $py; add it to LOCK_PYTHONS in hack/lock.sh" >&2; exit 1; }; \
    python3 -m venv --without-pip /opt/kascade; \
    /opt/build/bin/pip --python /opt/kascade/bin/python install --no-cache-dir --disable-pip-version-check \
      --no-deps --only-binary :all: --require-hashes -r "$lock"
ARG VARIANT=cuda
COPY hack/torch-cuda-stub.py hack/
RUN set -eu; case "$VARIANT" in \
      cuda) ;; \
      cpu) sp=$(/opt/kascade/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'); \
        pip="/opt/build/bin/pip --python /opt/kascade/bin/python"; $pip uninstall -y -q triton; \
        command -v gcc >/dev/null || { apt-get update \
          && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends gcc libc6-dev \
          && rm -rf /var/lib/apt/lists/*; }; \
        python3 hack/torch-cuda-stub.py "$sp" --pip "$pip" --check --python /opt/kascade/bin/python ;; \
      *) echo "VARIANT=$VARIANT: cuda or cpu" >&2; exit 1 ;; \
    esac
# the venv finds the project in /opt/kascade-app (a .pth): the project is its own small layer
RUN sp=$(/opt/kascade/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') \
 && echo /opt/kascade-app > "$sp/kascade-app.pth"

# the runtime's dependency layer: the base, the user, the venv (no pip, no compiler, no build venv)
FROM ${BASE} AS deps
RUN { command -v python3 >/dev/null || { apt-get update \
      && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3 ca-certificates \
      && rm -rf /var/lib/apt/lists/*; }; } \
 && useradd --uid 65532 --user-group --no-create-home --home-dir /tmp --shell /usr/sbin/nologin kascade
COPY --from=build /opt/kascade /opt/kascade

# the project itself, pure Python, --no-deps: the lock decided every dependency. The context is an
# allowlist (.dockerignore): the package directories pyproject.toml names, nothing else. It does not need
# the dependencies (a code change builds this stage and the last one only); the empty venv /opt/kascade
# gives the console scripts the runtime's interpreter.
FROM pybase AS project
COPY . .
RUN python3 -m venv --without-pip /opt/kascade \
 && /opt/build/bin/pip wheel --no-cache-dir --disable-pip-version-check --no-deps --no-build-isolation -w /tmp/wheels . \
 && /opt/build/bin/pip --python /opt/kascade/bin/python install --no-cache-dir --disable-pip-version-check \
      --no-deps --no-compile --target /opt/kascade-app /tmp/wheels/kascade-*.whl \
 && /opt/kascade/bin/python -m compileall -q /opt/kascade-app \
 && rm -rf /tmp/wheels

FROM ${DEPS}
COPY --from=project /opt/kascade-app /opt/kascade-app
# HOME=/tmp: the chart runs every container as this user with a read-only root filesystem and a /tmp
# emptyDir (caches: HF_HOME, torch); the .pyc files were compiled at install, none are written
ENV PATH=/opt/kascade-app/bin:/opt/kascade/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 HOME=/tmp
# the project imports with the dependencies it was locked with
RUN python -c 'import kascade_cli.main, kascade_engine.http.server'
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
