"""Llama 2 / 3.x: the base layout itself (tied or untied head, `attention_bias` on q/k/v/o,
`mlp_bias`, any rope scaling, llama3's included)."""

from __future__ import annotations

from executor_service.models.base import CausalLM


class LlamaForCausalLM(CausalLM):
    pass
