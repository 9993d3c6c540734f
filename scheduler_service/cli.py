"""`tandem scheduler`: serve GenerationService in front of an executor. Every flag has a TANDEM_* twin."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path

from protos.plan import ExecutorInfo
from scheduler_service.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

DEFAULT_MODEL = Path(__file__).resolve().parents[1] / "models" / "tandem-tiny-pydoc"
DEFAULT_PORT = 50051
DEFAULT_METRICS_PORT = 9101
DESCRIPTION = (
    "Serve tandem.v1.GenerationService: requests, continuous batching, streaming. The executor "
    "may start later; health is NOT_SERVING until it is connected. Every flag can also be set by "
    "the environment variable in brackets."
)


def _env(name: str, default: object = None) -> object:
    # argparse applies `type` to string defaults, so environment values are parsed like flags.
    return os.environ.get(f"TANDEM_{name}", default)


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the `scheduler` verb; its `func` takes the parsed Namespace and returns an exit code."""
    p = subparsers.add_parser(
        "scheduler", help="run the scheduler service (client-facing gRPC)", description=DESCRIPTION
    )
    add_arguments(p)
    return p


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The scheduler's flags, and `func=run`."""
    address = _env("EXECUTOR_ADDRESS")
    p.add_argument(
        "--executor",
        default=address,
        required=address is None,
        metavar="HOST:PORT",
        help="executor service address [TANDEM_EXECUTOR_ADDRESS]",
    )
    p.add_argument(
        "--host", default=_env("SCHEDULER_HOST", "127.0.0.1"), help="address to bind [TANDEM_SCHEDULER_HOST]"
    )
    p.add_argument(
        "--port",
        type=int,
        default=_env("SCHEDULER_PORT", DEFAULT_PORT),
        help=f"gRPC port (default {DEFAULT_PORT}) [TANDEM_SCHEDULER_PORT]",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=_env("SCHEDULER_METRICS_PORT", DEFAULT_METRICS_PORT),
        help=f"Prometheus /metrics port, 0 = off (default {DEFAULT_METRICS_PORT}) [TANDEM_SCHEDULER_METRICS_PORT]",
    )
    p.add_argument(
        "--max-num-seqs",
        type=int,
        default=_env("MAX_NUM_SEQS", 256),
        help="most running requests (default 256; capped by the executor's) [TANDEM_MAX_NUM_SEQS]",
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=_env("MAX_NUM_BATCHED_TOKENS", 8192),
        help="most tokens in one step (default 8192; capped by the executor's) [TANDEM_MAX_NUM_BATCHED_TOKENS]",
    )
    p.add_argument(
        "--max-queue",
        type=int,
        default=_env("MAX_QUEUE"),
        help="most waiting requests before RESOURCE_EXHAUSTED (default: no limit) [TANDEM_MAX_QUEUE]",
    )
    p.add_argument(
        "--stream-interval",
        type=int,
        default=_env("STREAM_INTERVAL", 1),
        help="fewest tokens per streamed chunk, except the last (default 1) [TANDEM_STREAM_INTERVAL]",
    )
    p.add_argument(
        "--tokenizer",
        default=_env("TOKENIZER"),
        help="directory with tokenizer.json (default: the embedded model's when the executor serves it) "
        "[TANDEM_TOKENIZER]",
    )
    p.add_argument(
        "--grace",
        type=float,
        default=_env("SCHEDULER_GRACE", 5.0),
        help="seconds streams may take to finish on SIGTERM (default 5) [TANDEM_SCHEDULER_GRACE]",
    )
    p.set_defaults(func=run)


def tokenizer_resolver(explicit: Tokenizer | None) -> Callable[[ExecutorInfo], Tokenizer | None]:
    """--tokenizer if given, else the embedded model's when the executor serves that model."""

    def resolve(info: ExecutorInfo) -> Tokenizer | None:
        if explicit is not None:
            return explicit
        if info.model == DEFAULT_MODEL.name and Tokenizer.exists(DEFAULT_MODEL):
            return Tokenizer(DEFAULT_MODEL)
        logger.warning(
            "no tokenizer for model %r: text prompts are refused and responses carry token ids only "
            "(start with --tokenizer DIR)",
            info.model,
        )
        return None

    return resolve


def run(args: argparse.Namespace) -> int:
    """Validate the flags, then serve until SIGTERM / SIGINT."""
    from scheduler_service.async_engine import EngineOptions
    from scheduler_service.config import SchedulerConfig
    from scheduler_service.executor_client import RemoteExecutor
    from scheduler_service.server import SchedulerServer, serve_until_signal

    try:
        if args.stream_interval < 1:
            raise ValueError(f"--stream-interval must be >= 1, got {args.stream_interval}")
        if args.max_queue is not None and args.max_queue < 0:
            raise ValueError(f"--max-queue must be >= 0, got {args.max_queue}")
        config = SchedulerConfig(
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens
        )
        tokenizer = Tokenizer(args.tokenizer) if args.tokenizer else None
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    executor = RemoteExecutor(args.executor)
    server = SchedulerServer(
        executor,
        EngineOptions(config, executor_address=args.executor, max_queue=args.max_queue),
        tokenizer_for=tokenizer_resolver(tokenizer),
        host=args.host,
        port=args.port,
        metrics_port=args.metrics_port or None,
        stream_interval=args.stream_interval,
    )
    try:
        asyncio.run(serve_until_signal(server, args.grace))
    except (OSError, RuntimeError) as e:  # a port already in use
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        executor.close()
    return 0
