"""ExecutorConfig: the executor's settings, validated once at construction."""

from __future__ import annotations

import importlib.util
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from executor_service.attention import BACKENDS
from executor_service.kv_cache import block_bytes, num_blocks_for_bytes
from executor_service.loader import SAFETENSORS_INDEX
from executor_service.model_config import MissingConfigKeys, ModelConfig, load_model_config
from executor_service.models import get_model_class
from executor_service.parallel import check_tp_layout, num_kv_heads_per_rank, rank_device
from executor_service.quantization import AT_LOAD_METHODS, BlockFP8Config
from protos.defaults import INT32_MAX, MAX_NUM_BATCHED_TOKENS, MAX_NUM_SEQS
from protos.hub import resolve_model

DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}
# --kv-cache-dtype: "auto" (the model's dtype), one of DTYPES, or e4m3 under vLLM's names.
FP8_KV_NAMES = ("fp8", "fp8_e4m3")
DEFAULT_BLOCK_SIZE = 16
# An e4m3 cache's decode kernel reads its V cache a block at a time, along the keys (fp8.py): at 16
# keys a block its loads are 16-byte runs and it reads 2.9 TB/s, at 32 3.5-3.6, at 64 3.7 (H200,
# bench/attention.py --sweep-layout; W1 with fp8 KV +16% from 16 to 32). At 64 FP8_MMA's 64-key
# tiles lie within one block: with it and the tiled V store, W1 fp8 +3.9% over 32 without them (H100,
# 2026-12-06; bench/RESULTS.md).
FP8_DEFAULT_BLOCK_SIZE = 64
# Checked first, so that an argument of another type (LLM(...) passes its engine arguments here)
# is a TypeError naming it, not whatever its first use would raise.
_INT_FIELDS = ("block_size", "num_kv_blocks", "max_num_seqs", "max_num_batched_tokens", "max_model_len",
               "seed", "tensor_parallel_size", "tp_master_port")  # fmt: skip
_STR_FIELDS = ("device", "revision", "dtype", "attention_backend", "kv_cache_dtype", "quantization",
               "fused_ops", "tp_master_addr", "served_model_name")  # fmt: skip
_FLOAT_FIELDS = ("kv_cache_gb", "gpu_memory_utilization")
_OPTIONAL_FIELDS = ("block_size", "num_kv_blocks", "max_model_len", "revision", "dtype", "quantization",
                    "served_model_name")  # fmt: skip


def check_kv_blocks_hold(
    num_blocks: int, block_size: int, max_model_len: int, raise_what: str, where: str = ""
) -> None:
    """ValueError unless num_blocks KV blocks hold max_model_len tokens, naming the count, `where`
    it comes from (e.g. " in kv_cache_gb 2") and what to raise (`raise_what`) to make it larger."""
    if num_blocks * block_size < max_model_len:
        raise ValueError(
            f"the KV cache holds {num_blocks * block_size} tokens ({num_blocks} blocks of {block_size}{where}), "
            f"fewer than max_model_len ({max_model_len}): raise {raise_what}, or lower max_model_len"
        )


@dataclass
class ExecutorConfig:
    # A checkpoint directory, or a Hugging Face hub id already in the local cache (hub.py).
    model: str
    device: str = "cpu"
    # The hub id's branch, tag or commit (with a directory: ignored).
    revision: str | None = None
    # The name Describe gives the model (clients send it as "model"); None: the hub id as given,
    # or the directory's name.
    served_model_name: str | None = None
    dtype: str | None = None
    # Tokens per KV block; None: DEFAULT_BLOCK_SIZE, or FP8_DEFAULT_BLOCK_SIZE for an e4m3 cache.
    block_size: int | None = None
    num_kv_blocks: int | None = None
    kv_cache_gb: float = 1.0
    # Fraction of the GPU's memory the executor may use (the KV cache is sized from it on CUDA).
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = MAX_NUM_SEQS
    max_num_batched_tokens: int = MAX_NUM_BATCHED_TOKENS
    max_model_len: int | None = None
    attention_backend: str = "auto"
    # The KV cache's element type: auto (the model dtype), a dtype name, or fp8 / fp8_e4m3 (e4m3
    # with a per-layer scale, fp8.py). Resolved to "fp8_e4m3" or a torch dtype name.
    kv_cache_dtype: str = "auto"
    # "fp8": serve an unquantized checkpoint as its FP8 block-scaled form, quantized at load
    # (quantization.py); None: as the checkpoint is. An FP8 checkpoint is fp8 either way.
    quantization: str | None = None
    # Triton kernels for residual + RMSNorm, SiLU-and-mul and q/k norm + rotary: auto (on CUDA
    # with triton), on, off. Resolved to "on" or "off" at construction.
    fused_ops: str = "auto"
    enforce_eager: bool = False
    seed: int = 0
    # Ranks behind this executor (one GPU each on CUDA); rank 0 spawns the others.
    tensor_parallel_size: int = 1
    # Rendezvous of the tensor-parallel ranks (torch.distributed TCP init).
    tp_master_addr: str = "127.0.0.1"
    tp_master_port: int = 29500
    # Resolved at construction.
    model_config: ModelConfig = field(init=False, repr=False)
    torch_dtype: torch.dtype = field(init=False)
    kv_torch_dtype: torch.dtype = field(init=False)
    model_class: type = field(init=False, repr=False)
    model_name: str = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._check_types()
        given = self.model
        try:
            self.model = resolve_model(self.model, self.revision)
        except FileNotFoundError as e:
            raise ValueError(str(e)) from None
        path = Path(self.model)
        # What Describe and the metrics call the model: the hub id, or the directory's name.
        self.model_name = given if self.model != given else path.resolve().name
        if self.served_model_name is not None:
            if not self.served_model_name.strip():
                raise ValueError("served_model_name must not be empty")
            self.model_name = self.served_model_name
        if not (path / "config.json").is_file():
            raise ValueError(f"model {self.model!r} must be a checkpoint directory with a config.json")
        if not (path / SAFETENSORS_INDEX).is_file() and not any(path.glob("*.safetensors")):
            raise ValueError(f"no *.safetensors files in {self.model}")  # else found while loading
        try:
            self.model_config = load_model_config(path)
        except MissingConfigKeys as e:
            get_model_class(e.architecture)  # another family's config is named as such
            raise
        self._check_quantization()
        self.model_class = get_model_class(self.model_config.architecture)
        self._check_device()
        dtype = self.dtype or self.model_config.dtype or "float32"
        if dtype not in DTYPES:
            raise ValueError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
        self.torch_dtype = DTYPES[dtype]
        self.dtype = str(self.torch_dtype).removeprefix("torch.")
        self._check_kv_cache_dtype()
        if self.block_size is None:
            fp8 = self.kv_torch_dtype == torch.float8_e4m3fn
            self.block_size = FP8_DEFAULT_BLOCK_SIZE if fp8 else DEFAULT_BLOCK_SIZE
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} ({getattr(self, name)}) must be positive")
        if self.num_kv_blocks is not None and self.num_kv_blocks <= 0:
            raise ValueError(
                f"num_kv_blocks ({self.num_kv_blocks}) must be positive, or None to use kv_cache_gb"
            )
        # Past int32 Describe failed ("Value out of range"): the executor served, but no scheduler
        # could ever connect to it.
        for name in ("block_size", "num_kv_blocks", "max_num_seqs", "max_num_batched_tokens"):
            if (value := getattr(self, name)) is not None and value > INT32_MAX:
                raise ValueError(f"{name} ({value}) must be at most {INT32_MAX} (Describe's int32)")
        if self.num_kv_blocks is None and not 0 < self.kv_cache_gb < math.inf:  # NaN too
            raise ValueError(f"kv_cache_gb ({self.kv_cache_gb}) must be a positive, finite number")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization ({self.gpu_memory_utilization}) must be in (0, 1]")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs}): every running sequence needs at least one token per step"
            )
        limit = self.model_config.max_context_len
        window = self.model_config.sliding_window
        if self.max_model_len is None:
            # A sliding window caps the default: no request may cross it (CausalLM.check_serving).
            self.max_model_len = min(limit, window) if window else limit
        elif not 0 < self.max_model_len <= limit:
            raise ValueError(
                f"max_model_len ({self.max_model_len}) must be in [1, {limit}], the model's "
                + ("context with its rope scaling" if limit > self.model_config.max_position_embeddings
                   else "max_position_embeddings")
            )  # fmt: skip
        if self.num_kv_blocks is not None:  # (kv_cache_sizing checks a computed count after the load)
            check_kv_blocks_hold(self.num_kv_blocks, self.block_size, self.max_model_len, "num_kv_blocks")
        self.model_class.check_serving(self.model_config, self.max_model_len)
        self._check_backend()
        self._check_fused_ops()
        self._check_tensor_parallel()
        self._check_kv_cache_gb()

    def kv_block_bytes(self) -> int:
        """Bytes of one KV block on one rank: every layer's K and V of its KV heads."""
        mc = self.model_config
        heads = num_kv_heads_per_rank(mc.num_key_value_heads, self.tensor_parallel_size)
        return block_bytes(mc.num_hidden_layers, self.block_size, heads, mc.head_dim, self.kv_torch_dtype)

    def kv_cache_gb_blocks(self) -> int:
        """The blocks kv_cache_gb holds on one rank (the cache's size off CUDA)."""
        return num_blocks_for_bytes(self.kv_cache_gb * 2**30, self.kv_block_bytes())

    def _check_kv_cache_gb(self) -> None:
        """Off CUDA kv_cache_gb gives the block count before the load (kv_cache_sizing): a cache too
        small for max_model_len, or of more blocks than Describe carries, was a traceback once the
        weights were loaded."""
        if self.num_kv_blocks is not None or self.device.startswith("cuda"):
            return
        num_blocks = self.kv_cache_gb_blocks()
        where = f" in kv_cache_gb {self.kv_cache_gb:g}"
        check_kv_blocks_hold(num_blocks, self.block_size, self.max_model_len, "kv_cache_gb", where)
        if num_blocks > INT32_MAX:
            raise ValueError(
                f"kv_cache_gb ({self.kv_cache_gb:g}) makes {num_blocks} KV blocks of {self.block_size}, "
                f"more than Describe carries ({INT32_MAX}): lower kv_cache_gb"
            )

    def _check_types(self) -> None:
        if not isinstance(self.model, (str, os.PathLike)):
            raise TypeError(
                f"model must be a checkpoint directory or a hub id (a string), got {self.model!r}"
            )
        self.model = os.fspath(self.model)
        for name in (*_INT_FIELDS, *_STR_FIELDS, *_FLOAT_FIELDS):
            value = getattr(self, name)
            if value is None and name in _OPTIONAL_FIELDS:
                continue
            if name in _STR_FIELDS:
                ok, kind = isinstance(value, str), "a string"
            elif name in _INT_FIELDS:
                ok, kind = isinstance(value, int) and not isinstance(value, bool), "an integer"
            else:
                ok, kind = isinstance(value, (int, float)) and not isinstance(value, bool), "a number"
            if not ok:
                raise TypeError(f"{name} must be {kind}, got {value!r}")

    def _check_quantization(self) -> None:
        if self.quantization is None:
            return
        if self.quantization not in AT_LOAD_METHODS:
            raise ValueError(
                f"quantization {self.quantization!r} is not supported: {', '.join(AT_LOAD_METHODS)} (quantized "
                "at load), or none for the checkpoint as it is"
            )
        if self.model_config.quantization is None:
            self.model_config.quantization = BlockFP8Config(at_load=True)

    def _check_kv_cache_dtype(self) -> None:
        name = self.kv_cache_dtype
        if name == "auto":
            self.kv_torch_dtype = self.torch_dtype
        elif name in FP8_KV_NAMES:
            self.kv_torch_dtype = torch.float8_e4m3fn
        elif name in DTYPES:
            self.kv_torch_dtype = DTYPES[name]
        else:
            raise ValueError(
                f"kv_cache_dtype {name!r} is not one of auto, {', '.join(FP8_KV_NAMES)}, {', '.join(DTYPES)}"
            )
        fp8 = self.kv_torch_dtype == torch.float8_e4m3fn
        self.kv_cache_dtype = "fp8_e4m3" if fp8 else str(self.kv_torch_dtype).removeprefix("torch.")

    def _check_device(self) -> None:
        if self.device != "cpu" and not self.device.startswith("cuda"):
            raise ValueError(f"device {self.device!r} must be 'cpu' or 'cuda'")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device {self.device!r} was asked for but torch sees no CUDA device")

    def _check_tensor_parallel(self) -> None:
        tp = self.tensor_parallel_size
        if tp <= 0:
            raise ValueError(f"tensor_parallel_size ({tp}) must be positive")
        if not 0 < self.tp_master_port < 65536:
            raise ValueError(f"tp_master_port ({self.tp_master_port}) must be in [1, 65535]")
        if tp == 1:
            return
        mc = self.model_config
        check_tp_layout(
            mc.num_attention_heads, mc.num_key_value_heads, self.model_class.tensor_parallel_sizes(mc), tp
        )
        if self.device.startswith("cuda"):
            last = rank_device(self.device, tp - 1)
            if int(last.partition(":")[2]) >= torch.cuda.device_count():
                raise ValueError(
                    f"tensor_parallel_size {tp} on {self.device} needs {last}, but torch sees "
                    f"{torch.cuda.device_count()} CUDA devices"
                )

    def _check_fused_ops(self) -> None:
        if self.fused_ops not in ("auto", "on", "off"):
            raise ValueError(f"fused_ops {self.fused_ops!r} is not one of auto, on, off")
        head_dim = self.model_config.head_dim
        why_not = None
        if not self.device.startswith("cuda"):
            why_not = f"they are Triton kernels for CUDA, and the device is {self.device}"
        elif importlib.util.find_spec("triton") is None:
            why_not = "triton is not installed"
        elif head_dim & (head_dim - 1):
            why_not = f"the q/k kernel needs a power-of-two head_dim, and it is {head_dim}"
        if self.fused_ops == "on" and why_not:
            raise ValueError(f"fused_ops 'on' cannot be used: {why_not}")
        self.fused_ops = "off" if why_not or self.fused_ops == "off" else "on"

    def _check_backend(self) -> None:
        device, fp8 = torch.device(self.device), self.kv_cache_dtype == "fp8_e4m3"
        if self.attention_backend == "auto":
            self.attention_backend = next(
                name
                for name, backend in BACKENDS.items()
                if backend.supports(device) and (backend.fp8_kv or not fp8)
            )
        elif self.attention_backend not in BACKENDS:
            raise ValueError(
                f"attention_backend {self.attention_backend!r} is not one of auto, {', '.join(BACKENDS)}"
            )
        elif not BACKENDS[self.attention_backend].supports(device):
            raise ValueError(f"attention_backend {self.attention_backend!r} does not run on {self.device}")
        elif fp8 and not BACKENDS[self.attention_backend].fp8_kv:
            raise ValueError(
                f"attention_backend {self.attention_backend!r} cannot read an fp8 KV cache: use triton or "
                "torch, or kv_cache_dtype auto"
            )
