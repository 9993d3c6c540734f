"""Defaults of the client, the CLI, `tandem up`, the tests and the benchmarks; what the services
share with them comes from protos/defaults.py."""

from __future__ import annotations

import random
import socket

from protos.defaults import (
    DEFAULT_HOST,
    DEFAULT_MODEL,
    EXECUTOR_METRICS_PORT,
    EXECUTOR_PORT,
    HTTP_PORT,
    MAX_MESSAGE_BYTES,
    REPO_ROOT,
    SCHEDULER_METRICS_PORT,
    SCHEDULER_PORT,
    default_model,
    env,
)
from protos.flags import add_flags, flag

__all__ = [
    "CHANNEL_OPTIONS",
    "DEFAULT_HOST",
    "DEFAULT_MODEL",
    "DEFAULT_RETRIES",
    "DEFAULT_SERVER",
    "EXECUTOR_METRICS_PORT",
    "EXECUTOR_PORT",
    "HTTP_PORT",
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


# free_port's range: below Linux's ephemeral ports (32768-60999), which servers bound to port 0
# and outgoing connections draw from, so that a port handed out here is not taken meanwhile by
# one of those (a test's subprocess binds it a moment later, exclusively).
_FREE_PORT_RANGE = (20000, 32767)
_handed_out: set[int] = set()


def free_port(host: str = DEFAULT_HOST) -> int:
    """A TCP port that nothing listens on right now, drawn at random below the ephemeral range and
    never the same twice in this process (another process may still take it)."""
    rng = random.Random()
    for _ in range(1000):
        port = rng.randint(*_FREE_PORT_RANGE)
        if port in _handed_out:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # the range is full: any port
        s.bind((host, 0))
        return s.getsockname()[1]


def add_connection_flags(group) -> None:
    """A server's connection flags (`tandem generate --server`, `tandem chat`): the deadline,
    retries, the API key and TLS."""
    group.add_argument(
        "--timeout",
        type=float,
        default=env("TIMEOUT"),
        help="deadline per request, seconds (env TANDEM_TIMEOUT)",
    )
    group.add_argument(
        "--retries",
        type=int,
        default=env("RETRIES", str(DEFAULT_RETRIES)),  # a string: argparse applies `type`, or errors
        help=f"retries of a request refused UNAVAILABLE before its first token (0-4, jittered backoff; "
        f"default {DEFAULT_RETRIES}; env TANDEM_RETRIES)",
    )
    group.add_argument(
        "--api-key", default=env("API_KEY"), help="sent as a bearer token (env TANDEM_API_KEY)"
    )
    # TANDEM_TLS is on for 1 / true / yes / on, as the services' switches (protos.flags).
    add_flags(
        group, [flag("--tls", env="TLS", switch=True, help="connect over TLS, trusting the system's CAs")]
    )
    group.add_argument(
        "--tls-ca", default=env("TLS_CA"), help="connect over TLS, trusting this CA (PEM; env TANDEM_TLS_CA)"
    )
    group.add_argument(
        "--tls-server-name",
        default=env("TLS_SERVER_NAME"),
        help="name the server's certificate must carry (default: the host of the server's address)",
    )
