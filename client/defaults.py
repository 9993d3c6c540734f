"""Defaults of the client, the CLI, `tandem up`, the tests and the benchmarks; what the services
share with them comes from protos/defaults.py."""

from __future__ import annotations

import socket

from protos.defaults import (
    DEFAULT_HOST,
    DEFAULT_MODEL,
    EXECUTOR_METRICS_PORT,
    EXECUTOR_PORT,
    MAX_MESSAGE_BYTES,
    REPO_ROOT,
    SCHEDULER_METRICS_PORT,
    SCHEDULER_PORT,
    default_model,
    env,
)

__all__ = [
    "CHANNEL_OPTIONS",
    "DEFAULT_HOST",
    "DEFAULT_MODEL",
    "DEFAULT_RETRIES",
    "DEFAULT_SERVER",
    "EXECUTOR_METRICS_PORT",
    "EXECUTOR_PORT",
    "MAX_MESSAGE_BYTES",
    "REPO_ROOT",
    "SCHEDULER_METRICS_PORT",
    "SCHEDULER_PORT",
    "default_model",
    "env",
    "free_port",
]

DEFAULT_SERVER = f"{DEFAULT_HOST}:{SCHEDULER_PORT}"
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]

# Retries of a request refused UNAVAILABLE before its first response (client.client).
DEFAULT_RETRIES = 4


def free_port(host: str = DEFAULT_HOST) -> int:
    """A TCP port that nothing listens on right now (another process may still take it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
