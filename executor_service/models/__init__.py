"""Model classes by the architecture name in config.json."""

from __future__ import annotations

from torch import nn

from executor_service.models.qwen3 import Qwen3ForCausalLM

MODELS: dict[str, type[nn.Module]] = {
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}


def get_model_class(architecture: str) -> type[nn.Module]:
    if architecture not in MODELS:
        raise ValueError(f"architecture {architecture!r} is not supported; supported: {', '.join(MODELS)}")
    return MODELS[architecture]
