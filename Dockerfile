# The Flashgate appliance image: the console (`flashgate console`, the default) with the engine as its child
# process, or the engine container of the docker driver (`flashgate engine`). docs/deploy.md has the builds:
#   docker build --build-arg FLASHGATE_COMMIT="$(git rev-parse --short HEAD)" -t flashgate:local .
# No `# syntax=` line: BuildKit would pull its frontend image from Docker Hub, which an air-gapped host cannot.
#
# One file, two bases; the base-specific steps are build args, not a fork:
#   - the production default (below): NVIDIA's CUDA runtime on Ubuntu 24.04 with its Python 3.12. Torch 2.11.0's
#     Linux wheels on PyPI declare `cuda-toolkit==13.0.2` and `triton==3.6.0` (Requires-Dist in the wheel's
#     metadata), so the base is CUDA 13.0.2; the host needs an NVIDIA driver for CUDA 13.0 (580 or newer). Not built
#     in CI (no GPU, no registry there).
#   - CI's CPU build (`make image-cpu`): a Debian 12 root made with mmdebstrap, its Python 3.11, torch's CPU wheel.
# Another CUDA pairing is three build args, e.g. CUDA 12.8 for older drivers:
#   --build-arg BASE_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04
#   --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
ARG BASE_IMAGE=nvidia/cuda:13.0.2-runtime-ubuntu24.04
ARG PYTHON=python3.12
ARG SYSTEM_PACKAGES="python3.12=3.12.3-1ubuntu0.* python3.12-venv=3.12.3-1ubuntu0.* python3.12-dev=3.12.3-1ubuntu0.* gcc=4:13.2.0-7ubuntu1 libc6-dev=2.39-0ubuntu8.*"

# The distribution's packages, one stage that both others start from: Python and its venv module, and gcc, libc6-dev
# and the Python headers because Triton compiles its launcher (a C file that includes Python.h) when the engine
# starts. Apt pins: Ubuntu's archive keeps only the newest update of a package, so an exact pin would break the build
# at the next security fix; each package is pinned to its upstream release and revision series (a glob) and takes
# the security updates of that series. The defaults are Ubuntu 24.04's (noble); another base passes its own
# PYTHON and SYSTEM_PACKAGES (the Makefile's DEBIAN12_* for Debian 12).
# A base that already holds every package at its pinned series (docs/deploy.md, "Air-gapped hosts") is used as it is:
# apt is not asked, so such a build needs no network.
FROM ${BASE_IMAGE} AS system
ARG SYSTEM_PACKAGES
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# The pins are in SYSTEM_PACKAGES, where hadolint cannot see them; each is a glob, matched against what dpkg has.
# hadolint ignore=DL3008,SC2053
RUN missing=(); \
    for pin in ${SYSTEM_PACKAGES}; do \
        installed=$(dpkg-query -W -f='${db:Status-Status} ${Version}' "${pin%%=*}" 2>/dev/null || true); \
        [[ ${installed} == "installed "${pin#*=} ]] || missing+=("${pin}"); \
    done; \
    if (( ${#missing[@]} )); then \
        apt-get update \
        && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${missing[@]}" \
        && rm -rf /var/lib/apt/lists/*; \
    fi

FROM system AS build
ARG PYTHON
ARG TORCH_VERSION=2.11.0
ARG TRITON_VERSION=3.6.0
ARG TORCH_INDEX_URL=https://pypi.org/simple
# WHEELHOUSE=1 installs every Python package from ./wheelhouse (`make wheelhouse`) and asks no index: the offline
# build. The default asks PyPI and TORCH_INDEX_URL.
ARG WHEELHOUSE=0
ENV PIP_DISABLE_PIP_VERSION_CHECK=1
COPY wheelhouse /opt/wheelhouse
# The pip settings of this stage only (the runtime stage copies /opt/venv, not /etc).
RUN if [ "${WHEELHOUSE}" = 1 ]; then printf '[global]\nno-index = true\nfind-links = /opt/wheelhouse\n' > /etc/pip.conf; \
    elif [ "${WHEELHOUSE}" != 0 ]; then echo "WHEELHOUSE is 0 or 1, got ${WHEELHOUSE}" >&2; exit 1; fi \
    && "${PYTHON}" -m venv /opt/venv
# torch and its triton first, from the index of the chosen CUDA build: the largest layer, rebuilt only when they
# change.
RUN /opt/venv/bin/pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" \
        "torch==${TORCH_VERSION}" "triton==${TRITON_VERSION}"
WORKDIR /opt/flashgate
# Then the rest of the dependencies, as pyproject.toml declares them for `.[server,console]`: a layer that changes
# when they do, not with every source edit.
COPY pyproject.toml README.md ./
COPY deploy/requirements.py ./deploy/
RUN /opt/venv/bin/python deploy/requirements.py > /tmp/requirements.txt \
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

FROM system AS runtime
RUN useradd --create-home --uid 10001 --user-group --shell /usr/sbin/nologin flashgate \
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
# without a mount, /models is the container's own, where the console can install the shipped demo model.
VOLUME ["/data"]
# The console and the agents' route; the engine's port (30000) stays inside.
EXPOSE 8080
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 CMD ["flashgate", "healthcheck"]
ENTRYPOINT ["/opt/flashgate/bin/flashgate"]
CMD ["console"]
