"""Qwen2 / Qwen2.5: Llama's layout with a bias on q, k and v (none on o), no q/k norm."""

from __future__ import annotations

from executor_service.layers.self_attention import AttentionOptions
from executor_service.model_config import ModelConfig
from executor_service.models.base import CausalLM


class Qwen2ForCausalLM(CausalLM):
    @classmethod
    def attention_options(cls, config: ModelConfig) -> AttentionOptions:
        return AttentionOptions(qkv_bias=True, o_bias=False)
