"""The attention layer: holds its slices of the paged KV cache and delegates to the backend."""

from __future__ import annotations

import torch
from torch import nn

from executor_service.attention import AttentionBackend, get_backend
from executor_service.context import get_context, recording


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        # Set by the model runner: the cache by KVCache.bind(), the backend from --attention-backend.
        self.k_cache = self.v_cache = torch.tensor([])
        # Per-layer scales of an fp8 KV cache: the checkpoint's k_scale / v_scale (the loader), else 1.
        self.k_scale = self.v_scale = 1.0
        self.backend: AttentionBackend = get_backend("torch")

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_stored: bool = False,
        out: torch.Tensor | None = None,
        rope=None,
    ) -> torch.Tensor:
        # q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim].
        # kv_stored, out: AttentionBackend.forward's (MixedGraphs.run passes them). rope: a
        # DecodeRope where the backend's decode_fuses_rope said so (q, k not yet normalised, rotated).
        capture = recording()
        if capture is not None:  # a piecewise capture: attention runs between the graphs
            if rope is not None:
                raise ValueError("rope: a piecewise capture stores this step's K/V itself")
            return capture.attention(self, q, k, v)
        extra = {} if rope is None else {"rope": rope}  # (only backends whose decode_fuses_rope can hold)
        return self.backend.forward(
            q, k, v, self.k_cache, self.v_cache, get_context(), self.scale, self.k_scale, self.v_scale,
            kv_stored=kv_stored, out=out, **extra,
        )  # fmt: skip
