# syntax=docker/dockerfile:1
# The executor service: model weights, paged KV cache, attention kernels, on one CUDA GPU
# (tensor parallelism: several, with /dev/shm as shared memory). Build from the repository root:
#
#   docker build -f deploy/executor.Dockerfile -t tandem-executor .
#
# Expected size: about 8 GB uncompressed, nearly all of it the PyTorch / CUDA / cuDNN base
# (torch and triton come with it); tandem, safetensors and flash-attn add ~0.5 GB.
#
# The model is a volume: mount a Hugging Face checkpoint directory and point TANDEM_MODEL at it,
#
#   docker run --gpus 1 --shm-size 8g -v /data/Qwen3-8B:/models/Qwen3-8B:ro \
#       -e TANDEM_MODEL=/models/Qwen3-8B -p 50052:50052 -p 9102:9102 tandem-executor
#
# Without TANDEM_MODEL it serves the embedded tandem-tiny-pydoc. Every setting is a flag or a
# TANDEM_* variable (`docker run tandem-executor --help`).
ARG BASE_IMAGE=pytorch/pytorch:2.7.1-cuda12.8-cudnn9-runtime
FROM ${BASE_IMAGE}

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1

RUN useradd --create-home --uid 10001 --shell /usr/sbin/nologin tandem

# flash-attn only where a prebuilt wheel matches this torch / CUDA / Python (the runtime base has
# no nvcc to compile one); otherwise "auto" picks our Triton kernels. FLASH_ATTN_VERSION= skips it.
ARG FLASH_ATTN_VERSION=2.8.3
RUN if [ -n "${FLASH_ATTN_VERSION}" ]; then \
        pip install -q packaging wheel ninja \
        && { pip install --no-build-isolation "flash-attn==${FLASH_ATTN_VERSION}" \
                && python -c "import flash_attn_2_cuda" \
             || { echo "flash-attn: no prebuilt wheel for this base image; the triton backend will be used"; \
                  pip uninstall -y -q flash-attn || true; }; }; \
    fi

# The base image's torch satisfies `.[gpu]`; pip adds safetensors and the service's gRPC stack.
WORKDIR /opt/tandem
COPY pyproject.toml setup.py README.md ./
COPY protos protos
COPY executor_service executor_service
COPY scheduler_service scheduler_service
COPY client client
COPY models/tandem-tiny-pydoc models/tandem-tiny-pydoc
RUN pip install -e ".[gpu]"
COPY --chmod=755 deploy/healthcheck.py /usr/local/bin/tandem-healthcheck

# Bind every interface inside the container (the CLI's default is 127.0.0.1).
ENV TANDEM_EXECUTOR_HOST=0.0.0.0 \
    TANDEM_EXECUTOR_PORT=50052 \
    TANDEM_EXECUTOR_METRICS_PORT=9102 \
    TANDEM_DEVICE=cuda \
    TANDEM_LOG_LEVEL=INFO \
    TRITON_CACHE_DIR=/home/tandem/.triton
VOLUME ["/models"]
EXPOSE 50052 9102

USER tandem
WORKDIR /home/tandem
# Loading a large checkpoint and capturing CUDA graphs takes a while: health is NOT_SERVING until done.
HEALTHCHECK --interval=10s --timeout=5s --start-period=600s --retries=3 \
    CMD ["tandem-healthcheck", "executor"]
# Exec form: tandem is PID 1 and gets SIGTERM itself (NOT_SERVING, finish the running step, stop).
ENTRYPOINT ["tandem", "executor"]
