"""Rotary position embedding, neox style (rotate halves), with the rope scalings of transformers'
modeling_rope_utils.py: default, linear, dynamic NTK, llama3 and YaRN.

Every scaling is a change of the inverse frequencies (and, for YaRN, an attention factor that
multiplies cos and sin), so one table of cos/sin per model, computed once in fp32, serves them all;
the fused q/k kernel (triton_ops.py) reads the same table. Dynamic NTK rescales only for sequences
longer than max_position_embeddings; positions are capped there (ModelConfig.max_context_len), so its
table is the default one, exactly as transformers computes it within that length."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


def _default_inv_freq(head_dim: int, base: float) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


def _llama3_inv_freq(inv_freq: torch.Tensor, rope: dict[str, Any]) -> torch.Tensor:
    factor = rope["factor"]
    low_freq_factor, high_freq_factor = rope["low_freq_factor"], rope["high_freq_factor"]
    old_context_len = rope["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(head_dim: int, rope: dict[str, Any]) -> tuple[torch.Tensor, float]:
    base, factor = rope["rope_theta"], rope["factor"]
    original = rope["original_max_position_embeddings"]
    attention_factor = rope.get("attention_factor")
    mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast = rope.get("beta_fast") or 32
    beta_slow = rope.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (head_dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # no singularity
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, head_dim, 2).float() / head_dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv_freq, float(attention_factor)


def rope_inv_freq(head_dim: int, rope: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [head_dim // 2] in fp32, attention factor) for normalised rope
    parameters (model_config.rope_parameters_of), as transformers' ROPE_INIT_FUNCTIONS give them."""
    rope_type = rope.get("rope_type", "default")
    if rope_type == "yarn":
        return _yarn(head_dim, rope)
    inv_freq = _default_inv_freq(head_dim, rope["rope_theta"])
    if rope_type == "linear":
        inv_freq = inv_freq / rope["factor"]
    elif rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, rope)
    elif rope_type not in ("default", "dynamic"):
        raise ValueError(f"rope_type {rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}")
    return inv_freq, 1.0


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, rope: dict[str, Any] | float) -> None:
        """`rope`: normalised rope parameters, or a bare rope_theta for the default rope."""
        super().__init__()
        if not isinstance(rope, dict):
            rope = {"rope_type": "default", "rope_theta": float(rope)}
        inv_freq, attention_factor = rope_inv_freq(head_dim, rope)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float), inv_freq.float())
        # [max_position, head_dim]: cos of both halves then sin of both halves, in fp32, each times
        # the attention factor (transformers multiplies before casting to the model dtype).
        cos = freqs.cos().repeat(1, 2) * attention_factor
        sin = freqs.sin().repeat(1, 2) * attention_factor
        self.register_buffer("cos_sin_cache", torch.cat([cos, sin], dim=-1), persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # q: [num_tokens, num_heads, head_dim]; k: [num_tokens, num_kv_heads, head_dim]
        cos, sin = self.cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)
