"""Qwen3 for causal LM over a flattened mixed batch (prefill chunks and decode tokens together)."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from executor_service.layers.activation import SiluAndMul
from executor_service.layers.attention import Attention
from executor_service.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from executor_service.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from executor_service.layers.norm import RMSNorm
from executor_service.layers.rotary import RotaryEmbedding
from executor_service.loader import ModelConfig
from executor_service.parallel import num_kv_heads_per_rank


class Qwen3Attention(nn.Module):
    # Set by the model runner (CUDA with triton): q/k norm and rotary in one Triton kernel.
    fused = False

    def __init__(self, config: ModelConfig, tp_rank: int, tp_size: int) -> None:
        super().__init__()
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
            bias=config.attention_bias,
            tp_rank=tp_rank,
            tp_size=tp_size,
        )
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * self.head_dim, config.hidden_size, False, tp_rank, tp_size
        )
        self.rotary_emb = RotaryEmbedding(self.head_dim, config.max_position_embeddings, config.rope_theta)
        self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        # [num_tokens, heads, head_dim]
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.fused:
            from executor_service.layers import triton_ops

            q, k = triton_ops.qk_norm_rope(
                qkv,
                positions,
                self.q_norm.weight,
                self.k_norm.weight,
                self.rotary_emb.cos_sin_cache,
                self.q_norm.eps,
                self.num_heads,
                self.num_kv_heads,
                self.head_dim,
            )
        else:
            q = self.q_norm(q.view(-1, self.num_heads, self.head_dim))
            k = self.k_norm(k.view(-1, self.num_kv_heads, self.head_dim))
            q, k = self.rotary_emb(positions, q, k)
        o = self.attn(q, k, v)
        return self.o_proj(o.flatten(1))


class Qwen3MLP(nn.Module):
    def __init__(self, config: ModelConfig, tp_rank: int, tp_size: int) -> None:
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [size, size], False, tp_rank, tp_size
        )
        self.down_proj = RowParallelLinear(size, config.hidden_size, False, tp_rank, tp_size)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, tp_rank: int, tp_size: int) -> None:
        super().__init__()
        self.self_attn = Qwen3Attention(config, tp_rank, tp_size)
        self.mlp = Qwen3MLP(config, tp_rank, tp_size)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class Qwen3Model(nn.Module):
    def __init__(self, config: ModelConfig, tp_rank: int, tp_size: int) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp_rank, tp_size)
        self.layers = nn.ModuleList(
            [Qwen3DecoderLayer(config, tp_rank, tp_size) for _ in range(config.num_hidden_layers)]
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class Qwen3ForCausalLM(nn.Module):
    # checkpoint name -> (packed parameter name, shard id for its weight_loader)
    packed_modules_mapping: ClassVar[dict[str, tuple[str, str | int]]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(
        self, config: ModelConfig, tie_word_embeddings: bool, tp_rank: int = 0, tp_size: int = 1
    ) -> None:
        super().__init__()
        self.model = Qwen3Model(config, tp_rank, tp_size)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp_rank, tp_size)
        if tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [num_tokens] -> hidden states [num_tokens, hidden]."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """hidden_states of the sampling tokens only: [n, hidden] -> [n, vocab_size] on rank 0,
        None on the other ranks."""
        return self.lm_head(hidden_states)
