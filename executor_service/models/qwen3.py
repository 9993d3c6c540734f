"""Qwen3: Llama's layout with a per-head RMSNorm of q and k before rotary; `attention_bias` puts a
bias on q, k, v and o."""

from __future__ import annotations

from typing import ClassVar

from executor_service.layers.self_attention import AttentionOptions
from executor_service.model_config import ModelConfig
from executor_service.models.base import CausalLM


class Qwen3ForCausalLM(CausalLM):
    fused_ops: ClassVar[frozenset[str]] = frozenset({"rms_norm", "silu_and_mul", "qk_norm_rope"})

    @classmethod
    def attention_options(cls, config: ModelConfig) -> AttentionOptions:
        bias = config.attention_bias
        return AttentionOptions(qkv_bias=bias, o_bias=bias, qk_norm=True)
