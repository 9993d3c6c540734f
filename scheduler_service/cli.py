"""`tandem scheduler`: serve GenerationService in front of an executor. Every flag has a TANDEM_* twin."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import re
import socket
import sys
from pathlib import Path

from protos.defaults import (
    DEFAULT_HOST,
    HTTP_PORT,
    MAX_NUM_BATCHED_TOKENS,
    MAX_NUM_SEQS,
    SCHEDULER_METRICS_PORT,
    SCHEDULER_PORT,
    check_tls_ca,
    check_tls_pair,
)
from protos.flags import Group, add_flags, flag
from protos.hub import resolve_model
from protos.vllm_flags import FRONTEND, add_foreign_flags
from scheduler_service.config import DEFAULT_MAX_LOGPROBS, DEFAULT_MAX_QUEUE, DEFAULT_MAX_QUEUED_TOKENS
from scheduler_service.executor_client import DEFAULT_STEP_TIMEOUT_S
from scheduler_service.tokenizer import Tokenizer, tokenizer_resolver
from scheduler_service.tool_call_formats import AUTO as AUTO_TOOL_CALL_PARSER
from scheduler_service.tool_call_formats import CHOICES as TOOL_CALL_PARSER_CHOICES

logger = logging.getLogger(__name__)

DESCRIPTION = (
    "Serve tandem.v1.GenerationService: requests, continuous batching, streaming. The executor "
    "may start later; health is NOT_SERVING until it is connected. Every flag can also be set by "
    "the environment variable in brackets."
)

# Each API server is a process of its own (tens of MB); --api-server-count 10**12 spawned them
# until the machine ran out of memory.
MAX_API_SERVER_COUNT = 64


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the `scheduler` verb; its `func` takes the parsed Namespace and returns an exit code."""
    p = subparsers.add_parser(
        "scheduler", help="run the scheduler service (client-facing gRPC)", description=DESCRIPTION
    )
    add_arguments(p)
    return p


SECURITY = Group(
    "security",
    "--api-key, --tls-cert and --tls-key guard the client-facing port. The scheduler's side of "
    "mutual TLS with the executor (the executor's --tls-ca) is --executor-tls-ca with "
    "--executor-tls-cert and --executor-tls-key: a client certificate signed by the CA that the "
    "executor's --tls-ca names.",
)

FLAGS = (
    flag(
        "--executor",
        env="EXECUTOR_ADDRESS",
        required=True,
        metavar="HOST:PORT",
        help="executor service address",
    ),
    flag("--host", env="SCHEDULER_HOST", default=DEFAULT_HOST, help="address to bind"),
    flag(
        "--port",
        env="SCHEDULER_PORT",
        type=int,
        default=SCHEDULER_PORT,
        help=f"gRPC port (default {SCHEDULER_PORT})",
    ),
    flag(
        "--http-port",
        env="HTTP_PORT",
        type=int,
        default=HTTP_PORT,
        help=f"OpenAI-compatible HTTP API port (/v1/completions, /v1/chat/completions, /v1/models, /health), "
        f"0 = off (default {HTTP_PORT})",
    ),
    flag(
        "--metrics-port",
        env="SCHEDULER_METRICS_PORT",
        type=int,
        default=SCHEDULER_METRICS_PORT,
        help=f"Prometheus /metrics port, 0 = off (default {SCHEDULER_METRICS_PORT})",
    ),
    flag(
        "--max-num-seqs",
        env="MAX_NUM_SEQS",
        type=int,
        default=MAX_NUM_SEQS,
        help=f"most running requests (default {MAX_NUM_SEQS}; capped by the executor's)",
    ),
    flag(
        "--max-num-batched-tokens",
        env="MAX_NUM_BATCHED_TOKENS",
        type=int,
        default=MAX_NUM_BATCHED_TOKENS,
        help=f"most tokens in one step (default {MAX_NUM_BATCHED_TOKENS}; capped by the executor's)",
    ),
    flag(
        "--enable-prefix-caching",
        env="ENABLE_PREFIX_CACHING",
        switch=True,
        negatable=True,
        default=True,
        help="reuse the KV blocks of prompts' common prefixes (default on, as vLLM; "
        "--no-enable-prefix-caching computes every prompt whole)",
    ),
    flag(
        "--max-prefill-tokens-while-decoding",
        env="MAX_PREFILL_TOKENS_WHILE_DECODING",
        type=int,
        default=0,
        help="while requests decode, most prefill tokens in one step, for a steady inter-token latency "
        "(vLLM's --long-prefill-token-threshold; default 0 = max-num-batched-tokens)",
    ),
    flag(
        "--max-queue",
        env="MAX_QUEUE",
        type=int,
        default=DEFAULT_MAX_QUEUE,
        help="most requests waiting beyond the free batch slots; one more is refused with "
        f"RESOURCE_EXHAUSTED (default {DEFAULT_MAX_QUEUE}; 0 = no limit)",
    ),
    flag(
        "--max-plans-in-flight",
        env="MAX_PLANS_IN_FLIGHT",
        type=int,
        choices=(1, 2, 3),
        default=3,
        help="step plans sent before the oldest result is back (default 3: the executor runs two steps "
        "and keeps the third plan queued, so that the scheduler's round trip is not between two steps; "
        "2: the next step is scheduled and on its way while the executor runs one; 1: no overlap)",
    ),
    flag(
        "--max-queued-tokens",
        env="MAX_QUEUED_TOKENS",
        type=int,
        default=DEFAULT_MAX_QUEUED_TOKENS,
        help="most prompt tokens of requests waiting for their first output; a request that would "
        f"go over is refused with RESOURCE_EXHAUSTED (default {DEFAULT_MAX_QUEUED_TOKENS}; 0 = no limit)",
    ),
    flag(
        "--max-logprobs",
        env="MAX_LOGPROBS",
        type=int,
        default=DEFAULT_MAX_LOGPROBS,
        help="most top logprobs per token a request may ask for; more is refused with "
        f"INVALID_ARGUMENT (default {DEFAULT_MAX_LOGPROBS}, as vLLM)",
    ),
    flag(
        "--api-server-count",
        env="API_SERVER_COUNT",
        type=int,
        default=None,
        help="API server processes for the client-facing work (gRPC, HTTP, tokenization, "
        "streaming) beside the engine core's process, all on one client port; 0 = everything in one "
        f"process (default: from the cores, 0 below 8 and a quarter of them from 8 on, at most 4; "
        f"{MAX_API_SERVER_COUNT} at most)",
    ),
    flag(
        "--stream-interval",
        env="STREAM_INTERVAL",
        type=int,
        default=1,
        help="fewest tokens per streamed chunk, except the last (default 1)",
    ),
    flag(
        "--tool-call-parser",
        env="TOOL_CALL_PARSER",
        choices=TOOL_CALL_PARSER_CHOICES,
        default=AUTO_TOOL_CALL_PARSER,
        help="the format of the tool calls read from chat answers when a request gives tools, as "
        "vLLM's flag names them: hermes (Qwen's <tool_call>), llama3_json (Llama 3.x), mistral "
        "([TOOL_CALLS]); default auto: the one the chat template writes, else the architecture's "
        "(Qwen: hermes, Mistral: mistral), else hermes. Tool calls are always on: vLLM's "
        "--enable-auto-tool-choice is not needed",
    ),
    flag(
        "--tokenizer",
        env="TOKENIZER",
        help="directory with tokenizer.json, or a Hugging Face id in the local cache (default: the "
        "embedded model's when the executor serves it)",
    ),
    flag(
        "--shutdown-timeout",
        "--grace",
        env="SHUTDOWN_TIMEOUT",
        env_fallbacks=("SCHEDULER_GRACE",),
        dest="shutdown_timeout",
        type=float,
        default=30.0,
        help="on SIGTERM, seconds the requests in flight may take to finish (default 30)",
    ),
    flag(
        "--executor-recovery-timeout",
        env="EXECUTOR_RECOVERY_TIMEOUT",
        type=float,
        default=300.0,
        help="seconds accepted requests wait for a lost executor to come back before failing "
        "UNAVAILABLE (default 300; 0 = no limit)",
    ),
    flag(
        "--executor-step-timeout",
        env="EXECUTOR_STEP_TIMEOUT",
        type=float,
        default=DEFAULT_STEP_TIMEOUT_S,
        help="seconds a step's result may be awaited before the executor is taken for hung (a stopped "
        "process, a wedged device): NOT_SERVING, then recovery as after a crash; raise it for models "
        f"whose largest prefill step takes longer (default {DEFAULT_STEP_TIMEOUT_S:g}; 0 = no limit)",
    ),
    flag(
        "--api-key",
        env="API_KEY",
        group=SECURITY,
        help="clients must send it as 'authorization: Bearer <key>' (health checks excepted); "
        "prefer --api-key-file or the environment, which other users cannot read from the process list",
    ),
    flag("--api-key-file", env="API_KEY_FILE", group=SECURITY, help="file of accepted API keys, one a line"),
    flag(
        "--allowed-origins",
        env="ALLOWED_ORIGINS",
        group=SECURITY,
        default="",
        help="browser origins the HTTP API answers cross-origin requests from (CORS), comma-separated "
        "or a JSON list as vLLM's, e.g. https://app.example.com; * for any (any web page a user opens "
        "could then call this server); default none",
    ),
    flag(
        "--tls-cert",
        "--ssl-certfile",
        env="TLS_CERT",
        group=SECURITY,
        help="serve TLS (gRPC and HTTP): certificate chain, PEM (vLLM's --ssl-certfile)",
    ),
    flag(
        "--tls-key",
        "--ssl-keyfile",
        env="TLS_KEY",
        group=SECURITY,
        help="its private key, PEM (vLLM's --ssl-keyfile)",
    ),
    flag(
        "--executor-tls-ca",
        env="EXECUTOR_TLS_CA",
        group=SECURITY,
        help="the scheduler's --tls-ca: talk TLS to the executor, trusting this CA (PEM) for the "
        "executor's certificate; one CA may sign both sides",
    ),
    flag(
        "--executor-tls-cert",
        env="EXECUTOR_TLS_CERT",
        group=SECURITY,
        help="client certificate for mutual TLS with the executor (PEM), signed by the CA of the "
        "executor's --tls-ca",
    ),
    flag("--executor-tls-key", env="EXECUTOR_TLS_KEY", group=SECURITY, help="its private key, PEM"),
    flag(
        "--executor-api-key",
        env="EXECUTOR_API_KEY",
        group=SECURITY,
        help="the executor's --api-key, sent to it on every call (the variable is the executor's too)",
    ),
    flag(
        "--executor-api-key-file",
        env="EXECUTOR_API_KEY_FILE",
        group=SECURITY,
        help="file holding the executor's API key; the first key in it is sent, so that a file of "
        "keys being rotated serves both services",
    ),
    flag(
        "--executor-tls-server-name",
        env="EXECUTOR_TLS_SERVER_NAME",
        group=SECURITY,
        help="name to expect in the executor's certificate (default: the host of --executor)",
    ),
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The scheduler's flags (FLAGS), and `func=run`."""
    add_flags(p, FLAGS)
    add_foreign_flags(p, FRONTEND)
    p.set_defaults(func=run)


def available_cores() -> int:
    """The cores this process may run on: its CPU affinity, and a container's CPU quota
    (cgroup v2 cpu.max) where one is set (os.cpu_count() is the host's)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
        if quota != "max":
            cores = min(cores, max(1, int(quota) // int(period)))
    except (OSError, ValueError):
        pass
    return cores


def default_api_server_count(cores: int | None = None) -> int:
    """A quarter of the cores from 8 on (at most 4); below 8 the processes would share cores
    with the engine core and the executor's client."""
    cores = cores or available_cores()
    return 0 if cores < 8 else min(4, cores // 4)


# gRPC targets other than HOST:PORT (dns:///host:port, unix:/path, ...), taken as given.
_GRPC_SCHEMES = ("dns:", "unix:", "unix-abstract:", "ipv4:", "ipv6:", "vsock:")


def check_executor_address(address: str) -> None:
    """ValueError unless --executor is HOST:PORT with a usable port (or a gRPC target with a
    scheme): a malformed one would be retried for ever, the scheduler NOT_SERVING all along."""
    if address.startswith(_GRPC_SCHEMES):
        return
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(
            "--executor must be HOST:PORT with a port in [1, 65535] (or a gRPC target such as "
            f"dns:///host:port), got {address!r}"
        )


def parse_origins(value: str) -> list[str]:
    """--allowed-origins: comma-separated origins, or a JSON list of them (vLLM's form); each `*`
    or scheme://host[:port], without a path (what a browser sends as Origin)."""
    text = value.strip()
    if text.startswith("["):
        try:
            origins = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--allowed-origins: not a JSON list ({e}): {value!r}") from None
        if not isinstance(origins, list) or not all(isinstance(o, str) for o in origins):
            raise ValueError(f"--allowed-origins: a JSON list must hold strings, got {value!r}")
    else:
        origins = [o for o in (part.strip() for part in text.split(",")) if o]
    for origin in origins:
        if origin != "*" and not re.fullmatch(r"[a-z][a-z0-9+.-]*://[^/\s]+", origin):
            raise ValueError(
                f"--allowed-origins: {origin!r} is not an origin (scheme://host[:port], no path; or *)"
            )
    return origins


def run(args: argparse.Namespace) -> int:
    """Validate the flags, then serve until SIGTERM / SIGINT."""
    from scheduler_service.config import EngineOptions, SchedulerConfig
    from scheduler_service.executor_client import RemoteExecutor
    from scheduler_service.security import load_api_keys, server_credentials
    from scheduler_service.server import SchedulerServer, serve_until_signal

    try:
        check_executor_address(args.executor)
        if args.stream_interval < 1:
            raise ValueError(f"--stream-interval must be >= 1, got {args.stream_interval}")
        for flag, value in (("--max-queue", args.max_queue), ("--max-queued-tokens", args.max_queued_tokens)):
            if value < 0:
                raise ValueError(f"{flag} must be >= 0 (0 = no limit), got {value}")
        if args.max_logprobs < 0:
            raise ValueError(f"--max-logprobs must be >= 0, got {args.max_logprobs}")
        args.allowed_origins = parse_origins(args.allowed_origins)
        for flag, value, zero in (
            ("--port", args.port, "any free port"),
            ("--http-port", args.http_port, "off"),
            ("--metrics-port", args.metrics_port, "off"),
        ):
            if not 0 <= value < 65536:
                raise ValueError(f"{flag} must be in [0, 65535] (0 = {zero}), got {value}")
        if args.api_server_count is None:
            args.api_server_count = default_api_server_count()
        if not 0 <= args.api_server_count <= MAX_API_SERVER_COUNT:
            raise ValueError(
                f"--api-server-count must be in [0, {MAX_API_SERVER_COUNT}] (0 = one process), "
                f"got {args.api_server_count}"
            )
        for flag, value, zero in (
            ("--shutdown-timeout", args.shutdown_timeout, ""),
            ("--executor-recovery-timeout", args.executor_recovery_timeout, " (0 = no limit)"),
            ("--executor-step-timeout", args.executor_step_timeout, " (0 = no limit)"),
        ):
            if not 0 <= value < math.inf:  # NaN too
                raise ValueError(f"{flag} must be a finite number of seconds >= 0{zero}, got {value}")
        for cert, key in (("tls_cert", "tls_key"), ("executor_tls_cert", "executor_tls_key")):
            if (getattr(args, cert) is None) != (getattr(args, key) is None):
                cert, key = (f"--{name.replace('_', '-')}" for name in (cert, key))
                raise ValueError(f"{cert} and {key} go together: give both or neither")
        if args.executor_tls_server_name and not args.executor_tls_ca:
            raise ValueError(
                "--executor-tls-server-name is the name in the executor's TLS certificate: it needs "
                "--executor-tls-ca (TLS to the executor)"
            )
        config = SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            enable_prefix_caching=args.enable_prefix_caching,
            max_plans_in_flight=args.max_plans_in_flight,
            max_logprobs=args.max_logprobs,
            max_prefill_tokens_while_decoding=args.max_prefill_tokens_while_decoding,
        )
        options = EngineOptions(
            config,
            executor_address=args.executor,
            max_queue=args.max_queue,
            max_queued_tokens=args.max_queued_tokens,
            recovery_timeout_s=args.executor_recovery_timeout if args.executor_recovery_timeout > 0 else None,
        )
        tokenizer = Tokenizer(resolve_model(args.tokenizer)) if args.tokenizer else None
        api_keys = load_api_keys(args.api_key, args.api_key_file)
        tls = server_credentials(args.tls_cert, args.tls_key) if args.tls_cert else None
        if args.tls_cert:
            check_tls_pair(args.tls_cert, args.tls_key, "--tls-cert and --tls-key")
        if args.executor_tls_ca:
            check_tls_ca(args.executor_tls_ca, f"--executor-tls-ca {args.executor_tls_ca}")
        if args.executor_tls_cert and args.executor_tls_key:
            check_tls_pair(
                args.executor_tls_cert, args.executor_tls_key, "--executor-tls-cert and --executor-tls-key"
            )
        executor_keys = load_api_keys(args.executor_api_key, args.executor_api_key_file)
        executor = RemoteExecutor(
            args.executor,
            tls_ca=args.executor_tls_ca,
            tls_cert=args.executor_tls_cert,
            tls_key=args.executor_tls_key,
            tls_server_name=args.executor_tls_server_name,
            step_timeout=args.executor_step_timeout or None,
            api_key=executor_keys[0] if executor_keys else None,
            owner_name=f"scheduler {args.host}:{args.port} on {socket.gethostname()} pid {os.getpid()}",
        )
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.api_server_count:
        from scheduler_service import engine_core

        try:
            return asyncio.run(
                engine_core.serve(
                    args, args.api_server_count, executor, options, tokenizer_resolver(tokenizer)
                )
            )
        except (OSError, RuntimeError) as e:  # a port already in use
            print(f"error: {e}", file=sys.stderr)
            return 2
        finally:
            executor.close()
    server = SchedulerServer(
        executor,
        options,
        tokenizer_for=tokenizer_resolver(tokenizer),
        host=args.host,
        port=args.port,
        metrics_port=args.metrics_port or None,
        stream_interval=args.stream_interval,
        api_keys=api_keys,
        tls_credentials=tls,
        http_port=args.http_port or None,
        http_tls=(args.tls_cert, args.tls_key) if args.tls_cert else None,
        allowed_origins=args.allowed_origins,
        tool_call_parser=args.tool_call_parser,
    )
    try:
        asyncio.run(serve_until_signal(server, args.shutdown_timeout))
    except (OSError, RuntimeError) as e:  # a port already in use
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        executor.close()
    return 0
