"""The reference backend: gather K/V through the block table and run SDPA, one sequence at a time.

Runs anywhere torch runs; every other backend is tested against it."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from executor_service.attention.base import AttentionBackend
from executor_service.context import Context
from executor_service.fp8 import FP8_DTYPE, dequantize_kv, quantize_kv, v_cache_slots


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    # k_cache viewed as [num_slots, num_kv_heads, head_dim] (an e4m3 V cache through its slot view,
    # fp8.v_cache_slots); slot -1 is padding and is skipped.
    # The boolean mask syncs on CUDA: fine for the reference, the GPU backends' store kernels skip -1.
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k, v = k[keep], v[keep]
    if k_cache.dtype == FP8_DTYPE:
        k, v = quantize_kv(k, k_scale), quantize_kv(v, v_scale)
    k_cache.view(-1, *k_cache.shape[2:])[slots] = k
    block_size = k_cache.shape[1]
    v_slots = v_cache_slots(v_cache)
    v_slots[slots // block_size, slots % block_size] = v
    if v_cache.dtype == FP8_DTYPE:
        # As the Triton store: a block's first slot written zeroes the slots after it that this
        # call does not write (the attention kernels read an e4m3 V cache by whole blocks).
        starts = slots[slots % block_size == 0]
        after = starts[:, None] + torch.arange(1, block_size, device=slots.device)[None, :]
        unwritten = after[~torch.isin(after, slots)]
        v_slots[unwritten // block_size, unwritten % block_size] = 0


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    context: Context,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    block_size = k_cache.shape[1]
    out = torch.empty_like(q)
    start = 0
    for i, (n, kv_len) in enumerate(zip(context.query_lens_host, context.context_lens_host, strict=True)):
        num_blocks = (kv_len + block_size - 1) // block_size
        blocks = context.block_tables[i, :num_blocks]
        # [kv_len, num_kv_heads, head_dim] -> [num_kv_heads, kv_len, head_dim]
        k = k_cache[blocks].flatten(0, 1)[:kv_len].transpose(0, 1)
        v = v_cache_slots(v_cache)[blocks].flatten(0, 1)[:kv_len].transpose(0, 1)
        if k_cache.dtype == FP8_DTYPE:  # only this sequence's blocks are dequantized
            k, v = dequantize_kv(k, k_scale, q.dtype), dequantize_kv(v, v_scale, q.dtype)
        qi = q[start : start + n].transpose(0, 1)  # [num_heads, n, head_dim]
        # Query j sits at position kv_len - n + j and sees keys 0..that position.
        q_pos = torch.arange(kv_len - n, kv_len, device=q.device)
        mask = torch.arange(kv_len, device=q.device)[None, :] <= q_pos[:, None]
        # 4-D, as transformers' sdpa calls it: SDPA takes its math kernel for 3-D inputs (on CPU
        # in fp32 throughout) and its fused flash kernel for 4-D ones, which rounds the
        # (unnormalised) probabilities to bf16 for P @ V: about a third of the bf16 outputs differ.
        o = F.scaled_dot_product_attention(
            qi[None], k[None], v[None], attn_mask=mask, scale=scale, enable_gqa=True
        )[0]
        out[start : start + n] = o.transpose(0, 1)
        start += n
    return out


class TorchRefBackend(AttentionBackend):
    name = "torch"
    fp8_kv = True

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
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        kv_stored: bool = False,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if k_cache.numel() and not kv_stored:
            store_kv(k, v, k_cache, v_cache, context.slot_mapping, k_scale, v_scale)
        return paged_attention(q, k_cache, v_cache, context, scale, k_scale, v_scale)
