"""The reference backend: gather K/V through the block table and run SDPA, one sequence at a time.

Runs anywhere torch runs; every other backend is tested against it."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from executor_service.attention.base import AttentionBackend
from executor_service.context import Context


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    # k_cache viewed as [num_slots, num_kv_heads, head_dim]; slot -1 is padding and is skipped.
    # The boolean mask syncs on CUDA: fine for the reference, the GPU backends' store kernels skip -1.
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k_cache.view(-1, *k_cache.shape[2:])[slots] = k[keep]
    v_cache.view(-1, *v_cache.shape[2:])[slots] = v[keep]


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, context: Context, scale: float
) -> torch.Tensor:
    block_size = k_cache.shape[1]
    out = torch.empty_like(q)
    start = 0
    for i, (n, kv_len) in enumerate(zip(context.query_lens_host, context.context_lens_host, strict=True)):
        num_blocks = (kv_len + block_size - 1) // block_size
        blocks = context.block_tables[i, :num_blocks]
        # [kv_len, num_kv_heads, head_dim] -> [num_kv_heads, kv_len, head_dim]
        k = k_cache[blocks].flatten(0, 1)[:kv_len].transpose(0, 1)
        v = v_cache[blocks].flatten(0, 1)[:kv_len].transpose(0, 1)
        qi = q[start : start + n].transpose(0, 1)  # [num_heads, n, head_dim]
        # Query j sits at position kv_len - n + j and sees keys 0..that position.
        q_pos = torch.arange(kv_len - n, kv_len, device=q.device)
        mask = torch.arange(kv_len, device=q.device)[None, :] <= q_pos[:, None]
        o = F.scaled_dot_product_attention(qi, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        out[start : start + n] = o.transpose(0, 1)
        start += n
    return out


class TorchRefBackend(AttentionBackend):
    name = "torch"

    @staticmethod
    def supports(device: torch.device) -> bool:
        return True

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        context: Context,
        scale: float,
    ) -> torch.Tensor:
        if k_cache.numel():
            store_kv(k, v, k_cache, v_cache, context.slot_mapping)
        return paged_attention(q, k_cache, v_cache, context, scale)
