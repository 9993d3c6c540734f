"""Quantized checkpoints: which schemes the loader reads, from config.json's `quantization_config`.

One scheme: fp8 block-scaled weights, the Qwen3-*-FP8 format (`quant_method: fp8`,
`weight_block_size: [128, 128]`, `activation_scheme: dynamic`): every quantized linear weight is
e4m3 with `weight_scale_inv`, one fp32 scale per 128 x 128 block (fp8.py). On the CPU the loader
dequantizes them to the compute dtype (the model is then exactly transformers' on the dequantized
weights); with tensor parallelism each rank reads whole blocks of its shard. Anything else (another
method, block size, static activation scales) is refused, naming what was found."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SUPPORTED_BLOCK = (128, 128)


@dataclass(frozen=True)
class BlockFP8Config:
    block: tuple[int, int] = SUPPORTED_BLOCK  # (output rows, input columns) per scale


def parse_quantization(cfg: dict[str, Any] | None) -> BlockFP8Config | None:
    """The checkpoint's quantization, or None for an unquantized one; ValueError for what tandem
    does not read."""
    if not cfg:
        return None
    method = cfg.get("quant_method")
    if method != "fp8":
        raise ValueError(
            f"quantization_config.quant_method {method!r} is not supported: tandem reads fp8 checkpoints "
            "with weight_block_size [128, 128] (the Qwen3-*-FP8 format)"
        )
    block = cfg.get("weight_block_size")
    if block is None or tuple(block) != SUPPORTED_BLOCK:
        raise ValueError(
            f"fp8 checkpoint with weight_block_size {block}: tandem reads only [128, 128] blocks "
            "(per-tensor or other block sizes are not supported)"
        )
    scheme = cfg.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise ValueError(
            f"fp8 checkpoint with activation_scheme {scheme!r}: only 'dynamic' (activations quantized "
            "per token in groups of 128 at run time) is supported"
        )
    fmt = cfg.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"fp8 checkpoint with fmt {fmt!r}: only e4m3 weights are supported")
    return BlockFP8Config(tuple(block))
