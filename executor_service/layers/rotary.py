"""Rotary position embedding, neox style (rotate halves), as Hugging Face's Qwen3."""

from __future__ import annotations

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, base: float) -> None:
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float), inv_freq)
        # [max_position, head_dim]: cos of both halves then sin of both halves, in fp32.
        cos_sin = torch.cat([freqs.cos().repeat(1, 2), freqs.sin().repeat(1, 2)], dim=-1)
        self.register_buffer("cos_sin_cache", cos_sin, persistent=False)

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
