"""The flash-attn backend: `flash_attn_varlen_func` / `flash_attn_with_kvcache` over the paged cache.

Chosen first by "auto" when the `flash_attn` package imports on CUDA. K/V go into the cache with our
Triton store kernel (skips slot -1). flash-attn 2 pages only by multiples of 256 tokens, so with a
smaller block size the paged parts (decode, prefix hits, chunks) fall back to our Triton kernels.
Not installed on our H200, so this file is written against flash-attn 2.x's API but not exercised.
"""

from __future__ import annotations

import torch

from executor_service.attention.triton_paged import TritonPagedBackend, kernels
from executor_service.context import Context

try:
    from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache
except ImportError:
    flash_attn_varlen_func = flash_attn_with_kvcache = None

FLASH_PAGE_MULTIPLE = 256


class FlashAttnBackend(TritonPagedBackend):
    name = "flash"
    # flash-attn reads 16-bit caches only (TritonPagedBackend's fp8 support is not inherited): for an
    # e4m3 cache `auto` picks triton, and `flash` is refused (ExecutorConfig).
    fp8_kv = False

    @staticmethod
    def supports(device: torch.device) -> bool:
        return device.type == "cuda" and flash_attn_varlen_func is not None and kernels is not None

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
        # The KV cache is the model dtype here (fp8_kv is False): the scales are 1.
        plan = self.prepared(context)
        if plan.no_prefix and not plan.decode_only:
            if k_cache.numel() and not kv_stored:
                kernels.store_kv(k, v, k_cache, v_cache, context.slot_mapping)
            cu = context.cu_seqlens_q
            m = context.max_seqlen_q
            return flash_attn_varlen_func(q, k, v, cu, cu, m, m, softmax_scale=scale, causal=True)
        if k_cache.shape[1] % FLASH_PAGE_MULTIPLE:
            return super().forward(q, k, v, k_cache, v_cache, context, scale, kv_stored=kv_stored, out=out)
        if not kv_stored:
            kernels.store_kv(k, v, k_cache, v_cache, context.slot_mapping)
        if plan.decode_only:
            # q: [batch, 1, num_heads, head_dim]; context length 0 rows attend to nothing.
            out = flash_attn_with_kvcache(
                q.unsqueeze(1),
                k_cache,
                v_cache,
                cache_seqlens=context.context_lens,
                block_table=context.block_tables,
                softmax_scale=scale,
                causal=True,
            )
            return out.squeeze(1)
        # Prefix hits, chunks and mixed batches in one call: causal is aligned to the end of each
        # sequence's keys, so query i of n sees keys 0 .. context_len - n + i.
        return flash_attn_varlen_func(
            q,
            k_cache,
            v_cache,
            context.cu_seqlens_q,
            context.cu_seqlens_k,
            context.max_seqlen_q,
            context.max_seqlen_k,
            softmax_scale=scale,
            causal=True,
            block_table=context.block_tables,
        )
