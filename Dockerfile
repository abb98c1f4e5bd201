# One image for the operator and the engine (`kascade operator run` / `kascade engine serve`).
# Build: make images (docker build -t $(IMAGE) .). Not built on the dev machines (no Docker there);
# e2e/kind/run.sh builds and uses it.
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY cli cli
COPY operator operator
COPY engine engine
COPY sim sim
COPY e2e/kascade_devcluster e2e/kascade_devcluster
# torch from PyPI is the CUDA build (what GPU nodes need); ucxx-cu12 brings UCX for the data plane
RUN pip install --no-cache-dir --prefix=/install ".[operator,engine]"

FROM python:3.11-slim
COPY --from=build /install /usr/local
# the operator's Deployment runs as this user with a read-only root filesystem (see the chart)
RUN useradd --uid 65532 --no-create-home --shell /usr/sbin/nologin kascade
USER 65532
# no ENTRYPOINT: the chart's `args` start with `kascade`
CMD ["kascade", "--help"]
