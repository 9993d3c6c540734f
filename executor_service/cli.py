"""`tandem executor`: serve a checkpoint as the executor service. Every flag has a TANDEM_* twin."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from executor_service.ownership import DEFAULT_OWNER_LEASE_SECONDS
from executor_service.server import DEFAULT_HOST, DEFAULT_METRICS_PORT, DEFAULT_PORT, GRACE_SECONDS
from protos.defaults import DEFAULT_MODEL
from protos.defaults import env as _env

logger = logging.getLogger(__name__)

_TRUE = {"1", "true", "yes", "on"}
DEFAULT_TP_MASTER_PORT = 29500


def _env_flag(name: str) -> bool:
    return os.environ.get(f"TANDEM_{name}", "").strip().lower() in _TRUE


DESCRIPTION = (
    "Serve a checkpoint as the executor service. Every flag can also be set by the environment "
    "variable in brackets."
)


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the `executor` verb; its `func` takes the parsed Namespace and returns an exit code."""
    p = subparsers.add_parser(
        "executor", help="serve a model as the executor service (gRPC step stream)", description=DESCRIPTION
    )
    add_arguments(p)
    return p


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The executor's flags, and `func=run`."""
    p.add_argument(
        "--model",
        default=_env("MODEL", str(DEFAULT_MODEL)),
        help="checkpoint directory (HF format, safetensors), or ORG/NAME already in the Hugging Face cache "
        "[TANDEM_MODEL; default: the embedded tandem-tiny-pydoc]",
    )
    p.add_argument(
        "--revision",
        default=_env("REVISION"),
        help="branch, tag or commit of an ORG/NAME --model in the cache (default main) [TANDEM_REVISION]",
    )
    p.add_argument("--device", default=_env("DEVICE", "cpu"), help="cpu, cuda or cuda:N [TANDEM_DEVICE]")
    p.add_argument(
        "--host", default=_env("EXECUTOR_HOST", DEFAULT_HOST), help="address to bind [TANDEM_EXECUTOR_HOST]"
    )
    p.add_argument(
        "--port",
        type=int,
        default=_env("EXECUTOR_PORT", DEFAULT_PORT),
        help=f"gRPC port (default {DEFAULT_PORT}) [TANDEM_EXECUTOR_PORT]",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=_env("EXECUTOR_METRICS_PORT", DEFAULT_METRICS_PORT),
        help=f"Prometheus /metrics port, 0 = off (default {DEFAULT_METRICS_PORT}) [TANDEM_EXECUTOR_METRICS_PORT]",
    )
    p.add_argument(
        "--dtype",
        default=_env("DTYPE"),
        help="weights and KV dtype (default: the checkpoint's) [TANDEM_DTYPE]",
    )
    p.add_argument(
        "--kv-cache-dtype",
        choices=("auto", "bfloat16", "float16", "float32", "fp8", "fp8_e4m3"),
        default=_env("KV_CACHE_DTYPE", "auto"),
        help="KV cache element type: auto (the model dtype), or fp8 (= fp8_e4m3: half the bytes of bf16, "
        "twice the blocks; per-layer k/v scales from the checkpoint, else 1.0) [TANDEM_KV_CACHE_DTYPE]",
    )
    p.add_argument(
        "--block-size",
        type=int,
        default=_env("BLOCK_SIZE", 16),
        help="tokens per KV block (default 16) [TANDEM_BLOCK_SIZE]",
    )
    p.add_argument(
        "--kv-cache-gb",
        type=float,
        default=_env("KV_CACHE_GB", 1.0),
        help="KV cache size in GiB when --num-kv-blocks is not given (default 1) [TANDEM_KV_CACHE_GB]",
    )
    p.add_argument(
        "--num-kv-blocks",
        type=int,
        default=_env("NUM_KV_BLOCKS"),
        help="number of KV blocks, overrides --kv-cache-gb [TANDEM_NUM_KV_BLOCKS]",
    )
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=_env("GPU_MEMORY_UTILIZATION", 0.9),
        help="fraction of GPU memory the executor may use, in (0, 1] (default 0.9) [TANDEM_GPU_MEMORY_UTILIZATION]",
    )
    p.add_argument(
        "--max-num-seqs",
        type=int,
        default=_env("MAX_NUM_SEQS", 256),
        help="most sequences in one step (default 256) [TANDEM_MAX_NUM_SEQS]",
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=_env("MAX_NUM_BATCHED_TOKENS", 8192),
        help="most tokens in one step (default 8192) [TANDEM_MAX_NUM_BATCHED_TOKENS]",
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        default=_env("MAX_MODEL_LEN"),
        help="context limit in tokens (default: the model's) [TANDEM_MAX_MODEL_LEN]",
    )
    p.add_argument(
        "--enforce-eager",
        action="store_true",
        default=_env_flag("ENFORCE_EAGER"),
        help="never use CUDA graphs [TANDEM_ENFORCE_EAGER=1]",
    )
    p.add_argument(
        "--attention-backend",
        default=_env("ATTENTION_BACKEND", "auto"),
        help="auto, flash, triton or torch (default auto: flash if installed, else triton on CUDA, torch on "
        "CPU) [TANDEM_ATTENTION_BACKEND]",
    )
    p.add_argument(
        "--fused-ops",
        choices=("auto", "on", "off"),
        default=_env("FUSED_OPS", "auto"),
        help="Triton kernels for residual + RMSNorm, SiLU-and-mul, q/k norm + rotary and temperature-only "
        "sampling (default auto: on with CUDA and triton) [TANDEM_FUSED_OPS]",
    )
    p.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=_env("TENSOR_PARALLEL_SIZE", 1),
        help="ranks behind this executor, one GPU each on CUDA (default 1) [TANDEM_TENSOR_PARALLEL_SIZE]",
    )
    p.add_argument(
        "--tp-master-addr",
        default=_env("TP_MASTER_ADDR", "127.0.0.1"),
        help="rendezvous address of the tensor-parallel ranks (default 127.0.0.1) [TANDEM_TP_MASTER_ADDR]",
    )
    p.add_argument(
        "--tp-master-port",
        type=int,
        default=_env("TP_MASTER_PORT", DEFAULT_TP_MASTER_PORT),
        help=f"rendezvous port of the tensor-parallel ranks (default {DEFAULT_TP_MASTER_PORT}, torch's own; "
        "two TP executors on one host need different ports) [TANDEM_TP_MASTER_PORT]",
    )
    p.add_argument(
        "--grace",
        type=float,
        default=_env("EXECUTOR_GRACE", GRACE_SECONDS),
        help=f"seconds a running step may take to finish on SIGTERM (default {GRACE_SECONDS:g}) "
        "[TANDEM_EXECUTOR_GRACE]",
    )
    p.add_argument(
        "--owner-lease-seconds",
        type=float,
        default=_env("EXECUTOR_OWNER_LEASE_SECONDS", DEFAULT_OWNER_LEASE_SECONDS),
        help="the scheduler that called Reset owns the executor while its Step stream is open and for "
        "this long after its last call; until then Reset and Step from anyone else are refused "
        f"(default {DEFAULT_OWNER_LEASE_SECONDS:g}) [TANDEM_EXECUTOR_OWNER_LEASE_SECONDS]",
    )
    # Not TANDEM_EXECUTOR_TLS_*: the scheduler reads those for its client certificate. The API key
    # variables are the scheduler's too, on purpose: the same secret on both sides.
    security = p.add_argument_group(
        "security (who may drive the executor)",
        "Beyond loopback, require mutual TLS (--tls-ca) or an API key: anyone else who reaches the "
        "port could reset the executor or step it.",
    )
    security.add_argument(
        "--api-key",
        default=_env("EXECUTOR_API_KEY"),
        help="Describe, Step and Reset need 'authorization: Bearer <key>' (the scheduler's "
        "--executor-api-key; health and reflection excepted); prefer --api-key-file or the "
        "environment, which other users cannot read from the process list [TANDEM_EXECUTOR_API_KEY]",
    )
    security.add_argument(
        "--api-key-file",
        default=_env("EXECUTOR_API_KEY_FILE"),
        help="file of accepted API keys, one a line [TANDEM_EXECUTOR_API_KEY_FILE]",
    )
    security.add_argument(
        "--tls-cert",
        default=_env("EXECUTOR_SERVER_TLS_CERT"),
        help="serve TLS: this executor's certificate chain, PEM [TANDEM_EXECUTOR_SERVER_TLS_CERT]",
    )
    security.add_argument(
        "--tls-key",
        default=_env("EXECUTOR_SERVER_TLS_KEY"),
        help="its private key, PEM [TANDEM_EXECUTOR_SERVER_TLS_KEY]",
    )
    security.add_argument(
        "--tls-ca",
        default=_env("EXECUTOR_SERVER_TLS_CA"),
        help="mutual TLS: accept only clients whose certificate this CA signed, PEM "
        "[TANDEM_EXECUTOR_SERVER_TLS_CA]",
    )
    p.set_defaults(func=run)


def tls_credentials(args: argparse.Namespace):
    """grpc.ServerCredentials from --tls-cert/--tls-key/--tls-ca, or None for plaintext;
    ValueError for half a configuration or an unreadable file."""
    from executor_service.server import server_credentials

    if (args.tls_cert is None) != (args.tls_key is None):
        raise ValueError("--tls-cert and --tls-key go together: give both or neither")
    if args.tls_ca is not None and args.tls_cert is None:
        raise ValueError("--tls-ca (mutual TLS) needs this executor's own --tls-cert and --tls-key")
    if args.tls_cert is None:
        return None
    return server_credentials(args.tls_cert, args.tls_key, args.tls_ca)


def run(args: argparse.Namespace) -> int:
    """Validate the configuration, then serve until SIGTERM / SIGINT."""
    from executor_service.config import ExecutorConfig
    from executor_service.server import serve
    from protos.api_keys import load_api_keys

    try:
        config = ExecutorConfig(
            model=args.model,
            revision=args.revision,
            device=args.device,
            dtype=args.dtype,
            block_size=args.block_size,
            num_kv_blocks=args.num_kv_blocks,
            kv_cache_gb=args.kv_cache_gb,
            gpu_memory_utilization=args.gpu_memory_utilization,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_model_len,
            attention_backend=args.attention_backend,
            kv_cache_dtype=args.kv_cache_dtype,
            fused_ops=args.fused_ops,
            enforce_eager=args.enforce_eager,
            tensor_parallel_size=args.tensor_parallel_size,
            tp_master_addr=args.tp_master_addr,
            tp_master_port=args.tp_master_port,
        )
        credentials = tls_credentials(args)
        api_keys = load_api_keys(args.api_key, args.api_key_file)
        if args.owner_lease_seconds < 0:
            raise ValueError(f"--owner-lease-seconds must be >= 0, got {args.owner_lease_seconds}")
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        return serve(
            config,
            args.host,
            args.port,
            args.metrics_port,
            args.grace,
            credentials,
            mutual_tls=args.tls_ca is not None,
            api_keys=api_keys,
            owner_lease_s=args.owner_lease_seconds,
        )
    except OSError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
