"""What both services and the client agree on: ports, the default model, batch limits, gRPC
message sizes, and the TANDEM_* environment twin of a flag. Defined here once; client/defaults.py
re-exports it for the client's users."""

from __future__ import annotations

import importlib.util
import os
import ssl
from pathlib import Path

SCHEDULER_PORT = 50051
EXECUTOR_PORT = 50052
SCHEDULER_METRICS_PORT = 9101
EXECUTOR_METRICS_PORT = 9102
# The scheduler's OpenAI-compatible HTTP API (vLLM's port).
HTTP_PORT = 8000
DEFAULT_HOST = "127.0.0.1"

# The protos' int32 fields' largest value (limits in Describe, sampling integers in the plans).
INT32_MAX = 2**31 - 1

# max_num_seqs and max_num_batched_tokens of both services (vLLM's defaults).
MAX_NUM_SEQS = 256
MAX_NUM_BATCHED_TOKENS = 8192
# The offline LLM class's step budget on a GPU of 70 GiB or more other than an A100 (vLLM's offline
# default there): a batch's prompts prefill in half the steps. Elsewhere, and for the services, the
# servers' MAX_NUM_BATCHED_TOKENS (a longer step stretches the streams' inter-token latency).
OFFLINE_MAX_NUM_BATCHED_TOKENS = 16384
OFFLINE_BUDGET_MIN_GPU_BYTES = 70 * 2**30


def offline_max_num_batched_tokens(gpu_total_bytes: int | None, gpu_name: str = "") -> int:
    """The LLM class's default max_num_batched_tokens: OFFLINE_MAX_NUM_BATCHED_TOKENS on a GPU of at
    least 70 GiB that is not an A100 (where vLLM measured the larger budget slower), else
    MAX_NUM_BATCHED_TOKENS (gpu_total_bytes None: no GPU)."""
    if (
        gpu_total_bytes is not None
        and gpu_total_bytes >= OFFLINE_BUDGET_MIN_GPU_BYTES
        and "a100" not in gpu_name.lower()
    ):
        return OFFLINE_MAX_NUM_BATCHED_TOKENS
    return MAX_NUM_BATCHED_TOKENS


# Explicit on both ends: gRPC's default receive limit is 4 MiB, and a long prompt as token ids,
# a plan of many sequences or a response with top-k logprobs can come near it. Between the
# scheduler and the executor, and on the client's channel:
MAX_MESSAGE_BYTES = 64 * 2**20
# The scheduler's GenerationService, each way, per message: a prompt of max_model_len token ids
# is a few hundred KiB; this leaves room for long contexts.
GENERATION_MAX_MESSAGE_BYTES = 16 * 2**20

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


def read_pem(source: str | Path | bytes, what: str = "") -> bytes:
    """PEM bytes, given as bytes or as the path of a file that holds them (`what` names it in the
    error). The client's TLS options and the services' TLS flags read their files through this."""
    if isinstance(source, bytes):
        return source
    try:
        return Path(source).read_bytes()
    except OSError as e:
        raise ValueError(f"cannot read {what + ' ' if what else ''}{source}: {e.strerror}") from None


def check_tls_pair(cert: str | Path, key: str | Path, flags: str) -> None:
    """ValueError unless the PEM files `cert` and `key` are a certificate chain and its private key
    (`flags` names them in the error): gRPC would only say that it failed to bind the port."""
    read_pem(cert, "the TLS certificate"), read_pem(key, "the TLS key")  # unreadable: said as elsewhere
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert, key, password="")
    except ssl.SSLError as e:
        why = "the key is not the certificate's" if e.reason == "KEY_VALUES_MISMATCH" else "not PEM"
        raise ValueError(f"{flags} are not a PEM certificate chain and its private key ({why})") from None


def check_tls_ca(ca: str | Path | bytes, what: str) -> None:
    """ValueError unless `ca` (PEM bytes or a file) holds a CA certificate: gRPC would take it and
    fail every handshake."""
    pem = read_pem(ca, "the CA certificate")
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cadata=pem.decode("ascii", "replace"))
    except (ssl.SSLError, ValueError):  # ValueError: an empty file
        raise ValueError(f"{what} holds no PEM CA certificate") from None
