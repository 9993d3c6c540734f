"""Self-attention of the dense decoder families: packed q/k/v projection (with or without bias),
optional per-head q/k RMSNorm (Qwen3), rotary, paged attention, output projection. Heads are split
over tensor-parallel ranks (q/k/v column-parallel, o row-parallel)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from executor_service.context import get_context, recording
from executor_service.layers.attention import Attention
from executor_service.layers.fusable import Fusable
from executor_service.layers.linear import QKVParallelLinear, RowParallelLinear
from executor_service.layers.norm import RMSNorm
from executor_service.layers.rotary import RotaryEmbedding
from executor_service.model_config import ModelConfig
from executor_service.parallel import num_kv_heads_per_rank


@dataclass(frozen=True)
class AttentionOptions:
    """What differs between the families' attention blocks."""

    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False  # per-head RMSNorm of q and k before rotary (Qwen3)


class SelfAttention(Fusable, nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        options: AttentionOptions,
        rotary_emb: RotaryEmbedding,
        tp_rank: int,
        tp_size: int,
    ) -> None:
        super().__init__()
        # Fused: q/k norm (where the family has it) and rotary in one Triton kernel.
        self.fused_op = "qk_norm_rope" if options.qk_norm else "rope"
        # This rank's heads.
        self.num_heads = config.num_attention_heads // tp_size
        self.num_kv_heads = num_kv_heads_per_rank(config.num_key_value_heads, tp_size)
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            self.head_dim,
            config.num_attention_heads,
            config.num_key_value_heads,
            bias=options.qkv_bias,
            tp_rank=tp_rank,
            tp_size=tp_size,
        )
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * self.head_dim, config.hidden_size, options.o_bias, tp_rank, tp_size
        )
        # One table shared by every layer of the model (its cos/sin cache is the biggest buffer).
        self.rotary_emb = rotary_emb
        self.q_norm = self.k_norm = None
        if options.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        # [num_tokens, heads, head_dim]
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        kv_cache = None
        if self.fused and (rope := self._decode_rope()) is not None:
            # The decode kernel normalises, rotates and stores q and k itself: no rotary kernel.
            q = q.view(-1, self.num_heads, self.head_dim)
            k = k.view(-1, self.num_kv_heads, self.head_dim)
            return self.o_proj(self.attn(q, k, v, rope=rope).flatten(1))
        if self.fused:
            from executor_service.layers import triton_ops

            kv_cache = self._cache_to_store()
            q, k = triton_ops.qk_norm_rope(
                qkv,
                positions,
                self.q_norm.weight if self.q_norm is not None else None,
                self.k_norm.weight if self.k_norm is not None else None,
                self.rotary_emb.cos_sin_cache,
                self.q_norm.eps if self.q_norm is not None else 0.0,
                self.num_heads,
                self.num_kv_heads,
                self.head_dim,
                kv_cache=kv_cache,
            )
        else:
            q = q.view(-1, self.num_heads, self.head_dim)
            k = k.view(-1, self.num_kv_heads, self.head_dim)
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = self.rotary_emb(positions, q, k)
        o = self.attn(q, k, v, kv_stored=kv_cache is not None)
        return self.o_proj(o.flatten(1))

    def _decode_rope(self):
        """A DecodeRope when the backend's decode kernel normalises and rotates this step's q and k
        itself (decode_fuses_rope: a decode step, DECODE_FUSES_ROPE), else None."""
        attn = self.attn
        if not attn.k_cache.numel() or recording() is not None:
            return None
        if not attn.backend.decode_fuses_rope(attn.k_cache, get_context()):
            return None
        from executor_service.attention.triton_kernels import DecodeRope

        q_norm, k_norm = self.q_norm, self.k_norm
        return DecodeRope(
            self.rotary_emb.cos_sin_cache,
            q_norm.weight if q_norm is not None else None,
            k_norm.weight if k_norm is not None else None,
            q_norm.eps if q_norm is not None else 0.0,
        )

    def _cache_to_store(self) -> tuple | None:
        """What the fused rotary kernel needs to write this step's K/V into the cache itself: with
        a backend whose store it is (fused_store), the cache bound, and outside a piecewise-graph
        capture (MixedGraphs puts the store in its graphs); None otherwise, and None where the
        backend's decode kernel stores them (decode_stores_kv)."""
        attn = self.attn
        if not attn.backend.fused_store or not attn.k_cache.numel() or recording() is not None:
            return None
        context = get_context()
        slot_mapping = context.slot_mapping
        if slot_mapping is None or attn.backend.decode_stores_kv(attn.k_cache, context):
            return None
        return attn.k_cache, attn.v_cache, slot_mapping, attn.k_scale, attn.v_scale
