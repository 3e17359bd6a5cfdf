# syntax=docker/dockerfile:1
# The Flashgate appliance image: the console (`flashgate console`, the default) with the engine as its child
# process, or the engine container of the docker driver (`flashgate engine`). CI has no Docker daemon, so the image
# is not built there: `docker compose build`, or
#   docker build --build-arg FLASHGATE_COMMIT="$(git rev-parse --short HEAD)" -t flashgate:local .
# docs/deploy.md has the rest.
#
# Base and torch are one pairing: torch 2.11.0's Linux wheels on PyPI declare `cuda-toolkit==13.0.2` and
# `triton==3.6.0` (Requires-Dist in the wheel's metadata), so the base is NVIDIA's CUDA 13.0.2 runtime, and Ubuntu
# 24.04 is the release whose Python is 3.12. The host needs an NVIDIA driver for CUDA 13.0 (580 or newer). Another
# pairing is three build args, e.g. CUDA 12.8 for older drivers:
#   --build-arg BASE_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04
#   --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
ARG BASE_IMAGE=nvidia/cuda:13.0.2-runtime-ubuntu24.04

# Apt pins: Ubuntu's archive keeps only the newest update of a package, so an exact pin would break the build at
# the next security fix. Each package is pinned to its upstream release and Ubuntu revision series (a glob), and
# takes the security updates of that series. They are the versions of Ubuntu 24.04 (noble): a base on another
# release needs these pins changed with it.

FROM ${BASE_IMAGE} AS build
ARG TORCH_VERSION=2.11.0
ARG TRITON_VERSION=3.6.0
ARG TORCH_INDEX_URL=https://pypi.org/simple
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV DEBIAN_FRONTEND=noninteractive \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        'python3.12=3.12.3-1ubuntu0.*' \
        'python3.12-venv=3.12.3-1ubuntu0.*' \
    && rm -rf /var/lib/apt/lists/* \
    && python3.12 -m venv /opt/venv
# torch and its triton first, from the index of the chosen CUDA build: the largest layer, rebuilt only when they
# change.
RUN /opt/venv/bin/pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" \
        "torch==${TORCH_VERSION}" "triton==${TRITON_VERSION}"
WORKDIR /opt/flashgate
# Then the rest of the dependencies, as pyproject.toml declares them for `.[server,console]`: a layer that changes
# when they do, not with every source edit.
COPY pyproject.toml README.md ./
RUN /opt/venv/bin/python -c 'import tomllib; p = tomllib.load(open("pyproject.toml", "rb"))["project"]; extra = p["optional-dependencies"]; print("\n".join(p["dependencies"] + extra["server"] + extra["console"]))' > /tmp/requirements.txt \
    && /opt/venv/bin/pip install --no-cache-dir -r /tmp/requirements.txt
COPY engine ./engine
COPY app ./app
COPY console ./console
COPY profiles ./profiles
COPY bin ./bin
# An editable install: the console finds its templates, static files and seed profiles beside its package.
# The entrypoint loses any CR a Windows checkout added (Docker Desktop is a supported host).
RUN /opt/venv/bin/pip install --no-cache-dir --no-deps -e . \
    && sed -i 's/\r$//' bin/flashgate \
    && chmod 0755 bin/flashgate

FROM ${BASE_IMAGE} AS runtime
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# Python 3.12 for the venv. gcc, libc6-dev and the Python headers only because Triton compiles its launcher (a C
# file that includes Python.h) when the engine starts.
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        'python3.12=3.12.3-1ubuntu0.*' \
        'python3.12-dev=3.12.3-1ubuntu0.*' \
        'gcc=4:13.2.0-7ubuntu1' \
        'libc6-dev=2.39-0ubuntu8.*' \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --create-home --uid 10001 --user-group --shell /usr/sbin/nologin flashgate \
    && mkdir -p /data /models \
    && chown flashgate:flashgate /data /models
COPY --from=build /opt/venv /opt/venv
COPY --from=build /opt/flashgate /opt/flashgate

# The build id both planes report (the engine's /server_info `build`, the console's footer and /healthz header).
ARG FLASHGATE_VERSION=0.1.0
ARG FLASHGATE_COMMIT=unknown
LABEL org.opencontainers.image.title="Flashgate" \
      org.opencontainers.image.description="DeepSeek-V4-Flash appliance: Triton-kernel engine and operator console" \
      org.opencontainers.image.version="${FLASHGATE_VERSION}" \
      org.opencontainers.image.revision="${FLASHGATE_COMMIT}"
ENV FLASHGATE_BUILD="${FLASHGATE_VERSION}+${FLASHGATE_COMMIT}" \
    FLASHGATE_PYTHON=/opt/venv/bin/python \
    FLASHGATE_DATA_DIR=/data \
    FLASHGATE_MODELS_DIR=/models \
    FLASHGATE_HOST=0.0.0.0 \
    FLASHGATE_LOG_JSON=1 \
    TRITON_CACHE_DIR=/data/cache/triton \
    PYTHONUNBUFFERED=1 \
    PATH=/opt/flashgate/bin:/opt/venv/bin:$PATH

USER 10001:10001
WORKDIR /opt/flashgate
# The database, evidence, engine logs and Triton's kernel cache. Models come read-only at /models (compose.yaml);
# without a mount, /models is the container's own, where the console can make the tiny CPU demo checkpoint.
VOLUME ["/data"]
# The console and the agents' route; the engine's port (30000) stays inside.
EXPOSE 8080
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 CMD ["flashgate", "healthcheck"]
ENTRYPOINT ["/opt/flashgate/bin/flashgate"]
CMD ["console"]
