"""Attention backends, chosen by name. `BACKENDS` is in priority order for `attention_backend="auto"`:
the first whose `supports(device)` is true wins: flash (flash-attn installed, CUDA), triton (CUDA),
torch (anywhere)."""

from __future__ import annotations

from executor_service.attention.base import AttentionBackend
from executor_service.attention.flash import FlashAttnBackend
from executor_service.attention.torch_ref import TorchRefBackend
from executor_service.attention.triton_paged import TritonPagedBackend

BACKENDS: dict[str, type[AttentionBackend]] = {
    "flash": FlashAttnBackend,
    "triton": TritonPagedBackend,
    "torch": TorchRefBackend,
}


def get_backend(name: str) -> AttentionBackend:
    if name not in BACKENDS:
        raise ValueError(f"attention backend {name!r} is not one of {', '.join(BACKENDS)}")
    return BACKENDS[name]()


__all__ = ["BACKENDS", "AttentionBackend", "get_backend"]
