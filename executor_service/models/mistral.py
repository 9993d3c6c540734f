"""Mistral: Llama's layout with a sliding attention window. The window is not implemented:
CausalLM.check_serving refuses a max_model_len over it, so that no request ever crosses it (within
the window, sliding and full attention are the same)."""

from __future__ import annotations

from executor_service.models.base import CausalLM


class MistralForCausalLM(CausalLM):
    pass
