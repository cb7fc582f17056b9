# One image for every role: `specdec serve coordinator|draft|target`.
#   CPU:  docker build -t specdec:0.1.0-cpu .
#   CUDA: docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 -t specdec:0.1.0-cuda .
# The CUDA wheels bundle the CUDA runtime; GPU nodes only need the NVIDIA driver and device plugin.
ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG TORCH_VERSION=2.13.0
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
RUN python -m venv /opt/specdec \
 && /opt/specdec/bin/pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"
COPY pyproject.toml README.md ./
COPY specdec ./specdec
COPY coordinator ./coordinator
COPY draft_worker ./draft_worker
COPY target_worker ./target_worker
# torch is already there (from the chosen index), so this adds only specdec and its other deps.
# The gateway extra adds smg, the OpenAI-compatible gateway run beside the coordinator.
RUN /opt/specdec/bin/pip install ".[gateway]" \
 && /opt/specdec/bin/specdec serve coordinator --help > /dev/null \
 && /opt/specdec/bin/smg launch --help > /dev/null

FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="specdec" \
      org.opencontainers.image.description="Exact, distributed, pipelined speculative decoding over gRPC" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --gid 10001 specdec \
 && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin specdec
COPY --from=build /opt/specdec /opt/specdec
# Models and caches go to /models (a writable volume); the root filesystem can stay read-only.
ENV PATH=/opt/specdec/bin:${PATH} \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HF_HOME=/models/hf \
    TMPDIR=/tmp
USER 10001:10001
# 50051 gRPC API, 8081 plaintext gRPC health (probes), 9090 Prometheus /metrics
EXPOSE 50051 8081 9090
ENTRYPOINT ["specdec"]
CMD ["serve", "coordinator", "--help"]
