"""The paged KV cache: one tensor for all layers, sliced per attention layer.

Layout: (2, num_layers, num_blocks, block_size, num_kv_heads, head_dim); index 0 = K, 1 = V.
Slot s of a layer lives at [:, layer, s // block_size, s % block_size]. The element type is the
model's dtype or e4m3 (kv_cache_dtype fp8: half the bytes of bf16, so twice the blocks in the same
memory; each attention layer holds its k_scale / v_scale). An e4m3 layer's V slice is viewed as
[num_blocks, num_kv_heads, head_dim, block_size], each block transposed (fp8.v_cache_slots)."""

from __future__ import annotations

import torch
from torch import nn

from executor_service.fp8 import FP8_DTYPE
from executor_service.layers.attention import Attention


def block_bytes(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    """Bytes of one block across all layers, K and V."""
    return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype.itemsize


def num_blocks_for_bytes(budget_bytes: float, bytes_per_block: int) -> int:
    return int(budget_bytes // bytes_per_block)


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.block_bytes = block_bytes(num_layers, block_size, num_kv_heads, head_dim, dtype)
        try:
            self.tensor = torch.zeros(
                2, num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device
            )
        except (torch.OutOfMemoryError, RuntimeError) as e:  # (the CPU allocator raises RuntimeError)
            if not isinstance(e, torch.OutOfMemoryError) and "allocate" not in str(e):
                raise
            total = num_blocks * self.block_bytes
            raise MemoryError(
                f"the KV cache does not fit on {device}: {num_blocks} blocks of {block_size} tokens, "
                f"{total / 2**30:,.1f} GiB; lower num_kv_blocks or kv_cache_gb"
            ) from e

    def bind(self, model: nn.Module) -> None:
        """Give each attention layer, in order, its K and V slices."""
        layers = [m for m in model.modules() if isinstance(m, Attention)]
        if len(layers) != self.tensor.shape[1]:
            raise ValueError(f"model has {len(layers)} attention layers, KV cache {self.tensor.shape[1]}")
        for i, layer in enumerate(layers):
            layer.k_cache = self.tensor[0, i]
            v = self.tensor[1, i]
            if v.dtype == FP8_DTYPE:  # the same bytes, each block [num_kv_heads, head_dim, block_size]
                num_blocks, block_size, num_kv_heads, head_dim = v.shape
                v = v.view(num_blocks, num_kv_heads, head_dim, block_size)
            layer.v_cache = v
