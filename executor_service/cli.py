"""`tandem executor`: serve a checkpoint as the executor service. Every flag has a TANDEM_* twin."""

from __future__ import annotations

import argparse
import logging
import math
import sys

from executor_service.ownership import DEFAULT_OWNER_LEASE_SECONDS
from executor_service.quantization import AT_LOAD_METHODS
from executor_service.server import GRACE_SECONDS
from protos.defaults import (
    DEFAULT_HOST,
    DEFAULT_MODEL,
    EXECUTOR_METRICS_PORT,
    EXECUTOR_PORT,
    MAX_NUM_BATCHED_TOKENS,
    MAX_NUM_SEQS,
    check_tls_ca,
    check_tls_pair,
)
from protos.flags import Group, add_flags, flag
from protos.vllm_flags import ENGINE, add_foreign_flags

logger = logging.getLogger(__name__)

DEFAULT_TP_MASTER_PORT = 29500

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


# Not TANDEM_EXECUTOR_TLS_*: the scheduler reads those for its client certificate. The API key
# variables are the scheduler's too, on purpose: the same secret on both sides.
SECURITY = Group(
    "security (who may drive the executor)",
    "Beyond loopback, require mutual TLS (--tls-ca) or an API key: anyone else who reaches the "
    "port could reset the executor or step it.",
)

FLAGS = (
    flag(
        "--model",
        env="MODEL",
        default=str(DEFAULT_MODEL),
        help="checkpoint directory (HF format, safetensors), or ORG/NAME already in the Hugging Face cache "
        "(default: the embedded tandem-tiny-pydoc)",
    ),
    flag(
        "--revision",
        env="REVISION",
        help="branch, tag or commit of an ORG/NAME --model in the cache (default main)",
    ),
    flag(
        "--served-model-name",
        env="SERVED_MODEL_NAME",
        help="the model's name in the API (/v1/models; requests' \"model\"), as vLLM's flag; one name "
        "(default: the hub id as given, or the checkpoint directory's name)",
    ),
    flag("--device", env="DEVICE", default="cpu", help="cpu, cuda or cuda:N"),
    flag("--host", env="EXECUTOR_HOST", default=DEFAULT_HOST, help="address to bind"),
    flag(
        "--port",
        env="EXECUTOR_PORT",
        type=int,
        default=EXECUTOR_PORT,
        help=f"gRPC port (default {EXECUTOR_PORT})",
    ),
    flag(
        "--metrics-port",
        env="EXECUTOR_METRICS_PORT",
        type=int,
        default=EXECUTOR_METRICS_PORT,
        help=f"Prometheus /metrics port, 0 = off (default {EXECUTOR_METRICS_PORT})",
    ),
    flag(
        "--dtype",
        env="DTYPE",
        help="weights and KV dtype: bfloat16, float16 (half), float32 (float), or auto (default: the "
        "checkpoint's)",
    ),
    flag(
        "--kv-cache-dtype",
        env="KV_CACHE_DTYPE",
        choices=("auto", "bfloat16", "float16", "float32", "fp8", "fp8_e4m3"),
        default="auto",
        help="KV cache element type: auto (the model dtype), or fp8 (= fp8_e4m3: half the bytes of bf16, "
        "twice the blocks; per-layer k/v scales from the checkpoint, else 1.0)",
    ),
    flag(
        "--quantization",
        env="QUANTIZATION",
        choices=AT_LOAD_METHODS,
        default=None,
        help="fp8: serve an unquantized checkpoint as its FP8 form (the Qwen3-*-FP8 format: e4m3 weights in "
        "128x128 blocks, W8A8 on CUDA), quantized at load (default: the checkpoint as it is)",
    ),
    flag(
        "--block-size",
        env="BLOCK_SIZE",
        type=int,
        default=None,
        help="tokens per KV block (default 16; 64 with --kv-cache-dtype fp8, where the decode kernel reads "
        "longer runs of a block and its e4m3 MMAs take a block a tile)",
    ),
    flag(
        "--kv-cache-gb",
        env="KV_CACHE_GB",
        type=float,
        default=1.0,
        help="KV cache size in GiB off CUDA, when --num-kv-blocks is not given (default 1); on CUDA "
        "the cache takes what --gpu-memory-utilization leaves",
    ),
    flag(
        "--num-kv-blocks", env="NUM_KV_BLOCKS", type=int, help="number of KV blocks, overrides --kv-cache-gb"
    ),
    flag(
        "--gpu-memory-utilization",
        env="GPU_MEMORY_UTILIZATION",
        type=float,
        default=0.9,
        help="fraction of GPU memory the executor may use, in (0, 1] (default 0.9)",
    ),
    flag(
        "--max-num-seqs",
        env="MAX_NUM_SEQS",
        type=int,
        default=MAX_NUM_SEQS,
        help=f"most sequences in one step (default {MAX_NUM_SEQS})",
    ),
    flag(
        "--max-num-batched-tokens",
        env="MAX_NUM_BATCHED_TOKENS",
        type=int,
        default=MAX_NUM_BATCHED_TOKENS,
        help=f"most tokens in one step (default {MAX_NUM_BATCHED_TOKENS})",
    ),
    flag(
        "--max-model-len",
        env="MAX_MODEL_LEN",
        type=int,
        help="context limit in tokens (default: the model's)",
    ),
    flag("--enforce-eager", env="ENFORCE_EAGER", switch=True, help="never use CUDA graphs"),
    flag(
        "--seed",
        env="SEED",
        type=int,
        default=0,
        help="seed of the sampler's generator for requests without a seed of their own (default 0, as vLLM)",
    ),
    flag(
        "--attention-backend",
        env="ATTENTION_BACKEND",
        default="auto",
        help="auto, flash, triton or torch (default auto: flash if installed, else triton on CUDA, torch on CPU)",
    ),
    flag(
        "--fused-ops",
        env="FUSED_OPS",
        choices=("auto", "on", "off"),
        default="auto",
        help="Triton kernels for residual + RMSNorm, SiLU-and-mul, q/k norm + rotary and temperature-only "
        "sampling (default auto: on with CUDA and triton)",
    ),
    flag(
        "--tensor-parallel-size",
        "-tp",
        env="TENSOR_PARALLEL_SIZE",
        type=int,
        default=1,
        help="ranks behind this executor, one GPU each on CUDA (default 1)",
    ),
    flag(
        "--tp-master-addr",
        env="TP_MASTER_ADDR",
        default="127.0.0.1",
        help="rendezvous address of the tensor-parallel ranks (default 127.0.0.1)",
    ),
    flag(
        "--tp-master-port",
        env="TP_MASTER_PORT",
        type=int,
        default=DEFAULT_TP_MASTER_PORT,
        help=f"rendezvous port of the tensor-parallel ranks (default {DEFAULT_TP_MASTER_PORT}, torch's own; "
        "two TP executors on one host need different ports)",
    ),
    flag(
        "--grace",
        env="EXECUTOR_GRACE",
        type=float,
        default=GRACE_SECONDS,
        help=f"seconds a running step may take to finish on SIGTERM (default {GRACE_SECONDS:g})",
    ),
    flag(
        "--owner-lease-seconds",
        env="EXECUTOR_OWNER_LEASE_SECONDS",
        type=float,
        default=DEFAULT_OWNER_LEASE_SECONDS,
        help="the scheduler that called Reset owns the executor while its Step stream is open and for "
        "this long after its last call; until then Reset and Step from anyone else are refused "
        f"(default {DEFAULT_OWNER_LEASE_SECONDS:g})",
    ),
    flag(
        "--api-key",
        env="EXECUTOR_API_KEY",
        group=SECURITY,
        help="Describe, Step, Reset and Release need 'authorization: Bearer <key>' (the scheduler's "
        "--executor-api-key; health and reflection excepted); prefer --api-key-file or the "
        "environment, which other users cannot read from the process list",
    ),
    flag(
        "--api-key-file",
        env="EXECUTOR_API_KEY_FILE",
        group=SECURITY,
        help="file of accepted API keys, one a line",
    ),
    flag(
        "--tls-cert",
        env="EXECUTOR_SERVER_TLS_CERT",
        group=SECURITY,
        help="serve TLS: this executor's certificate chain, PEM",
    ),
    flag("--tls-key", env="EXECUTOR_SERVER_TLS_KEY", group=SECURITY, help="its private key, PEM"),
    flag(
        "--tls-ca",
        env="EXECUTOR_SERVER_TLS_CA",
        group=SECURITY,
        help="mutual TLS: accept only clients whose certificate this CA signed, PEM",
    ),
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The executor's flags (FLAGS), and `func=run`."""
    add_flags(p, FLAGS)
    add_foreign_flags(p, ENGINE)
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
    credentials = server_credentials(args.tls_cert, args.tls_key, args.tls_ca)
    check_tls_pair(args.tls_cert, args.tls_key, "--tls-cert and --tls-key")
    if args.tls_ca is not None:
        check_tls_ca(args.tls_ca, f"--tls-ca {args.tls_ca}")
    return credentials


def run(args: argparse.Namespace) -> int:
    """Validate the configuration, then serve until SIGTERM / SIGINT."""
    from executor_service.config import ExecutorConfig
    from executor_service.server import serve
    from protos.api_keys import load_api_keys

    try:
        for flag, value, zero in (
            ("--port", args.port, "any free port"),
            ("--metrics-port", args.metrics_port, "off"),
        ):
            if not 0 <= value < 65536:
                raise ValueError(f"{flag} must be in [0, 65535] (0 = {zero}), got {value}")
        config = ExecutorConfig(
            model=args.model,
            revision=args.revision,
            served_model_name=args.served_model_name,
            device=args.device,
            dtype=None if args.dtype == "auto" else args.dtype,
            block_size=args.block_size,
            num_kv_blocks=args.num_kv_blocks,
            kv_cache_gb=args.kv_cache_gb,
            gpu_memory_utilization=args.gpu_memory_utilization,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_model_len,
            attention_backend=args.attention_backend,
            kv_cache_dtype=args.kv_cache_dtype,
            quantization=args.quantization,
            fused_ops=args.fused_ops,
            enforce_eager=args.enforce_eager,
            seed=args.seed,
            tensor_parallel_size=args.tensor_parallel_size,
            tp_master_addr=args.tp_master_addr,
            tp_master_port=args.tp_master_port,
        )
        credentials = tls_credentials(args)
        api_keys = load_api_keys(args.api_key, args.api_key_file)
        for flag, value in (("--grace", args.grace), ("--owner-lease-seconds", args.owner_lease_seconds)):
            if not 0 <= value < math.inf:  # NaN too
                raise ValueError(f"{flag} must be a finite number of seconds >= 0, got {value}")
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
