"""Defaults shared by the client, the CLI, `tandem up`, the tests and the benchmarks."""

from __future__ import annotations

import importlib.util
import os
import random
import socket
from pathlib import Path

SCHEDULER_PORT = 50051
EXECUTOR_PORT = 50052
SCHEDULER_METRICS_PORT = 9101
EXECUTOR_METRICS_PORT = 9102
DEFAULT_HOST = "127.0.0.1"
DEFAULT_SERVER = f"{DEFAULT_HOST}:{SCHEDULER_PORT}"

# Explicit on both ends: gRPC's default receive limit is 4 MiB, and a long prompt as token ids
# or a response with top-k logprobs can come near it.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]

# Retries of a request refused UNAVAILABLE before its first response (client.client).
DEFAULT_RETRIES = 4

REPO_ROOT = Path(__file__).resolve().parents[1]


def _embedded_model(name: str = "tandem-tiny-pydoc") -> Path:
    """models/NAME of the source tree; in a wheel install, the data package `tandem_models` (setup.py)."""
    in_tree = REPO_ROOT / "models" / name
    if in_tree.is_dir():
        return in_tree
    spec = importlib.util.find_spec("tandem_models")
    if spec is not None and spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations))) / name
    return in_tree  # not installed: the commands that need it say so, naming this path


DEFAULT_MODEL = _embedded_model()


def env(name: str, default: str | None = None) -> str | None:
    """The TANDEM_<NAME> environment twin of a flag."""
    return os.environ.get(f"TANDEM_{name}", default)


def default_model() -> str:
    """The embedded checkpoint shipped with the repository (TANDEM_MODEL overrides it)."""
    return env("MODEL") or str(DEFAULT_MODEL)


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
