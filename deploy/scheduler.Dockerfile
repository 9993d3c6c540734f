# syntax=docker/dockerfile:1
# The scheduler service: CPU only, no torch, no CUDA. Build from the repository root:
#
#   docker build -f deploy/scheduler.Dockerfile -t tandem-scheduler .
#
# Expected size: about 200 MB uncompressed, 70 MB compressed. python:3.12-slim is ~125 MB of it;
# `pip install` without extras adds only grpcio (+ health, reflection), protobuf,
# prometheus-client, tokenizers (+ huggingface-hub), tqdm, fastapi, uvicorn and jinja2, ~70 MB; the code ~1 MB.
#
# Every setting is a flag or a TANDEM_* variable (`docker run tandem-scheduler --help`); the
# ENV below are the container's defaults, overridden by `-e` / compose / Kubernetes.
ARG PYTHON_IMAGE=python:3.12-slim
FROM ${PYTHON_IMAGE}

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1

RUN useradd --create-home --uid 10001 --shell /usr/sbin/nologin tandem

# Editable install: the CLI finds the embedded model's tokenizer next to the code, as it does
# in a checkout (the scheduler uses it when the executor serves tandem-tiny-pydoc).
WORKDIR /opt/tandem
COPY pyproject.toml setup.py README.md ./
COPY protos protos
COPY scheduler_service scheduler_service
COPY client client
COPY models/tandem-tiny-pydoc/tokenizer.json models/tandem-tiny-pydoc/tokenizer.json
RUN pip install -e . \
    && python -c "import importlib.util as u, sys; sys.exit(u.find_spec('torch') is not None)"
COPY --chmod=755 deploy/healthcheck.py /usr/local/bin/tandem-healthcheck

# Bind every interface inside the container (the CLI's default is 127.0.0.1).
ENV TANDEM_SCHEDULER_HOST=0.0.0.0 \
    TANDEM_SCHEDULER_PORT=50051 \
    TANDEM_SCHEDULER_METRICS_PORT=9101 \
    TANDEM_HTTP_PORT=8000 \
    TANDEM_EXECUTOR_ADDRESS=executor:50052 \
    TANDEM_LOG_LEVEL=INFO
EXPOSE 50051 8000 9101

USER tandem
WORKDIR /home/tandem
HEALTHCHECK --interval=10s --timeout=5s --start-period=10s --retries=3 \
    CMD ["tandem-healthcheck", "scheduler"]
# Exec form: tandem is PID 1 and gets SIGTERM itself (health NOT_SERVING, drain, stop).
ENTRYPOINT ["tandem", "scheduler"]
