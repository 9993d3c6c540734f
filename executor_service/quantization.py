"""Quantized checkpoints: which schemes the loader reads, from config.json's `quantization_config`.

One scheme: fp8 block-scaled weights, the Qwen3-*-FP8 format (`quant_method: fp8`,
`weight_block_size: [128, 128]`, `activation_scheme: dynamic`): every quantized linear weight is
e4m3 with `weight_scale_inv`, one fp32 scale per 128 x 128 block (fp8.py). On the CPU the loader
dequantizes them to the compute dtype (the model is then exactly transformers' on the dequantized
weights); with tensor parallelism each rank reads whole blocks of its shard. Anything else (another
method, block size, static activation scales) is refused, naming what was found.

`--quantization fp8` serves a 16- or 32-bit checkpoint as if it were that FP8 checkpoint: at load
every weight such a checkpoint quantizes (the decoder layers' `*_proj.weight`: attention, MLP and
MoE experts; not embeddings, the LM head, norms or the MoE router) is quantized in 128 x 128
blocks (fp8.quantize_weight_blocks), whole, before any rank takes its shard, and then goes the
way of a checkpoint's e4m3 weight and scales (at_load)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SUPPORTED_BLOCK = (128, 128)
# --quantization's choices: methods that quantize an unquantized checkpoint at load.
AT_LOAD_METHODS = ("fp8",)


@dataclass(frozen=True)
class BlockFP8Config:
    block: tuple[int, int] = SUPPORTED_BLOCK  # (output rows, input columns) per scale
    # The checkpoint holds 16/32-bit weights that the loader quantizes (--quantization fp8).
    at_load: bool = False


def quantized_at_load(name: str) -> bool:
    """Whether --quantization fp8 quantizes this checkpoint weight: what a Qwen3-*-FP8 checkpoint
    stores in e4m3 (every linear projection of the decoder layers, the experts' included)."""
    return name.startswith("model.layers.") and name.endswith("_proj.weight")


def scale_names(names, quantization: BlockFP8Config | None) -> list[str]:
    """The checkpoint's block scales, and with at_load the scales its quantized weights will have."""
    scales = [n for n in names if n.endswith(".weight_scale_inv")]
    if quantization is not None and quantization.at_load:
        scales += [n + "_scale_inv" for n in names if quantized_at_load(n)]
    return scales


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
    if not isinstance(block, list | tuple) or tuple(block) != SUPPORTED_BLOCK:
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
