"""The forward context: attention metadata for the current step, read by every attention layer, and
the piecewise CUDA-graph capture in progress, if any (cuda_graph.MixedGraphs), to which attention
layers hand their q/k/v instead of attending.

Both are per thread: a model runs its step in the thread that set them, so two executors stepping in
one process (two offline LLMs in two threads, or one beside an in-process server) each read their
own. As module globals they were shared, and one's step read the other's metadata."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch


@dataclass
class Context:
    # Device tensors, one entry per token or per sequence of the mixed batch.
    slot_mapping: torch.Tensor | None = None  # [num_tokens], -1 = do not store
    block_tables: torch.Tensor | None = None  # [num_seqs, max_num_blocks], padded with -1
    context_lens: torch.Tensor | None = None  # [num_seqs], KV length after this step
    cu_seqlens_q: torch.Tensor | None = None  # [num_seqs + 1]
    cu_seqlens_k: torch.Tensor | None = None  # [num_seqs + 1]
    # [num_seqs] int32, the sequences longest context first: the order the decode kernel's programs
    # take them in (so the longest are not left for last); None: the batch's order.
    seq_order: torch.Tensor | None = None
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    # The same lengths on the host, known when the batch is built (no device sync to read them).
    query_lens_host: list[int] = field(default_factory=list)
    context_lens_host: list[int] = field(default_factory=list)


class _ThreadState(threading.local):
    def __init__(self) -> None:
        self.context = Context()
        self.recording = None


_STATE = _ThreadState()


def get_context() -> Context:
    return _STATE.context


def set_context(context: Context) -> None:
    _STATE.context = context


def reset_context() -> None:
    _STATE.context = Context()


def recording():
    """The MixedGraphs recording in progress (cuda_graph._Recording), or None."""
    return _STATE.recording


def set_recording(recording) -> None:
    _STATE.recording = recording
