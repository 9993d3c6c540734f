"""The interface every attention backend implements."""

from __future__ import annotations

import torch

from executor_service.context import Context


class AttentionBackend:
    name: str = ""
    # Whether a decode step can be captured in a CUDA graph: no host-side per-step values.
    graph_safe: bool = False
    # Whether it stores and reads an e4m3 KV cache (kv_cache_dtype fp8).
    fp8_kv: bool = False
    # Whether its store is attention/triton_kernels.store_kv (layers/triton_ops.qk_norm_rope can
    # write the cache for it, the same bytes, and forward is then called with kv_stored=True).
    fused_store: bool = False

    @staticmethod
    def supports(device: torch.device) -> bool:
        raise NotImplementedError

    def variant_batch_sizes(
        self, max_num_seqs: int, num_kv_heads: int, device: torch.device, kv_dtype: torch.dtype | None = None
    ) -> list[int]:
        """Batch sizes (sequences per step) that between them reach every kernel variant the backend
        can launch over a cache of kv_dtype: the start-up warm-up runs a step of each, so nothing
        compiles while serving."""
        return [min(2, max_num_seqs)]

    def decode_stores_kv(self, k_cache: torch.Tensor, context: Context) -> bool:
        """Whether forward stores this step's K/V from its decode kernel (each program its head's
        bytes) rather than with a store before attention: then a caller that would store them
        beforehand (the fused rotary kernel) stores nothing and passes kv_stored=False. The Triton
        backend's decode-only steps over an e4m3 cache, where a separate store is costly."""
        return False

    def decode_fuses_rope(self, k_cache: torch.Tensor, context: Context) -> bool:
        """Whether forward can take this step's q and k straight from the qkv projection, with a
        DecodeRope (attention/triton_kernels.py) to normalise and rotate them in its decode kernel, so
        that the layer runs no rotary kernel: a decode step where decode_stores_kv holds, and the
        Triton backend's DECODE_FUSES_ROPE."""
        return False

    def prepare(self, context: Context) -> object:
        """Once per step, before the first layer: derive per-step metadata (routing, split counts)
        from the context. Backends that need none keep this no-op; the model runner may call it after
        building the context, and backends that need it also call it lazily on a new context."""
        return None

    def prepared(self, context: Context):
        """prepare()'s result for this step: computed by the first layer, reused by the others
        (backends whose prepare() stores it in `self._plan`, with the context it was made for)."""
        plan = getattr(self, "_plan", None)
        if plan is None or plan.context is not context:
            plan = self.prepare(context)
        return plan

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
        """Store this step's K/V at `context.slot_mapping`, then attend over each sequence's paged KV.

        q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim];
        k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], of the model dtype or
        e4m3 (then K is stored as e4m3(k / k_scale) and read back times k_scale, V alike: fp8.py).
        Returns [num_tokens, num_heads, head_dim]: `out` where the backend can write into it (a
        buffer of q's shape), else a new tensor. kv_stored: the caller has stored K/V already
        (store_kv, inside a piecewise CUDA graph), so only attend.
        """
        raise NotImplementedError

    def store_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> None:
        """forward's store alone, for a CUDA graph to capture: graph-safe backends (no host sync,
        slot -1 skipped) implement it."""
        raise NotImplementedError(f"the {self.name} backend's store cannot be captured in a CUDA graph")
