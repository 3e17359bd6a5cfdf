# syntax=docker/dockerfile:1
# The Flashgate appliance image: console + engine. The packaging issue completes it (multi-stage, build id).
ARG BASE_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04
FROM ${BASE_IMAGE}

# A C compiler only because Triton compiles its launcher at run time.
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/flashgate
COPY pyproject.toml README.md ./
COPY engine ./engine
COPY app ./app
COPY console ./console
COPY profiles ./profiles
RUN python3 -m venv /opt/venv \
    && /opt/venv/bin/pip install --no-cache-dir "torch==2.11.*" \
    && /opt/venv/bin/pip install --no-cache-dir ".[server,console]"

RUN useradd --create-home --uid 10001 flashgate && mkdir -p /data && chown flashgate /data
USER flashgate
ENV FLASHGATE_DATA_DIR=/data FLASHGATE_HOST=0.0.0.0 FLASHGATE_LOG_JSON=1 PATH=/opt/venv/bin:$PATH
VOLUME ["/data"]
EXPOSE 8080
CMD ["python", "-m", "app"]
