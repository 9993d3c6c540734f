"""Model classes by the architecture name in config.json: one file per family, one line here."""

from __future__ import annotations

from executor_service.models.base import CausalLM
from executor_service.models.llama import LlamaForCausalLM
from executor_service.models.mistral import MistralForCausalLM
from executor_service.models.qwen2 import Qwen2ForCausalLM
from executor_service.models.qwen3 import Qwen3ForCausalLM
from executor_service.models.qwen3_moe import Qwen3MoeForCausalLM

MODELS: dict[str, type[CausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
}


def get_model_class(architecture: str) -> type[CausalLM]:
    if architecture not in MODELS:
        raise ValueError(f"architecture {architecture!r} is not supported; supported: {', '.join(MODELS)}")
    return MODELS[architecture]
