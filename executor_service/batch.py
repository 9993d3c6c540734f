"""Batch preparation: a scheduled mixed batch (prefill chunks and decodes) flattened into the
device tensors and attention context of one forward."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from executor_service.block_tables import BlockTables
from executor_service.context import Context
from executor_service.prompt_logprobs import PromptLogprobsBatch, prompt_logprobs_batch
from executor_service.sampling_metadata import SamplingMetadata
from executor_service.sequence import SequenceState


@dataclass
class PreparedBatch:
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    context: Context
    logits_indices: torch.Tensor  # [num_sampling_seqs], rows of the flattened batch that sample
    sampling_seqs: list[SequenceState]  # the sequences that sample, in batch order
    sampling: SamplingMetadata | None
    decode_only: bool = False
    # The prompt tokens this step scores for prompt logprobs (prompt_logprobs.py), if any.
    prompt_logprobs: PromptLogprobsBatch | None = None


def prepare_batch(
    seqs: list[SequenceState],
    num_scheduled_tokens: list[int],
    block_tables: BlockTables,
    block_size: int,
    vocab_size: int,
    device: torch.device,
    is_driver: bool,
    pending: torch.Tensor | None = None,
    score_prompts: bool = False,
    bias_logits: bool = False,
    previous_sampling: SamplingMetadata | None = None,
) -> PreparedBatch:
    """Flatten a mixed batch (prefill chunks and decodes): sequence i computes tokens
    [c, c + n) with c = its num_computed_tokens and n = num_scheduled_tokens[i]. Sampling
    metadata is built only on the driver (rank 0), the one rank that samples.

    `pending`: the token ids sampled by the step still in flight, on the device. An input token
    still a -1 placeholder is taken from it (row `pending_row` of its sequence) by a device-side
    copy, so this step is launched before that step's tokens reach the host.

    `score_prompts`: some sequence held asks for prompt logprobs (every rank looks for the rows
    they score: the LM head over them is a collective); `bias_logits`: some sequence held has a
    logit bias or min_tokens (otherwise the sampling metadata does not look for them);
    `previous_sampling`: the sampling metadata of the batch before (SamplingMetadata.build)."""
    bs = block_size
    num_seqs = len(seqs)
    q_lens = np.asarray(num_scheduled_tokens, dtype=np.int64)
    starts = np.fromiter((s.num_computed_tokens for s in seqs), np.int64, num_seqs)
    ends = starts + q_lens
    num_tokens = int(q_lens.sum())
    if num_tokens == num_seqs:  # decode only: one token per sequence
        positions = starts
        input_ids = np.fromiter((s.token_ids[s.num_computed_tokens] for s in seqs), np.int64, num_seqs)
        token_seq = np.arange(num_seqs)
    else:
        positions = np.concatenate([np.arange(a, b) for a, b in zip(starts.tolist(), ends.tolist())])
        input_ids = np.fromiter(
            itertools.chain.from_iterable(
                s.token_ids[s.num_computed_tokens : s.num_computed_tokens + n]
                for s, n in zip(seqs, num_scheduled_tokens)
            ),
            np.int64,
            num_tokens,
        )
        token_seq = np.repeat(np.arange(num_seqs), q_lens)
    rows = np.fromiter((s.row for s in seqs), np.int64, num_seqs)
    width = int(-(-ends.max() // bs))
    tables = block_tables.gather(rows, width)  # [num_seqs, width] int32
    slot_mapping = tables[token_seq, positions // bs].astype(np.int64) * bs + positions % bs
    cu_q = np.zeros(num_seqs + 1, dtype=np.int64)
    np.cumsum(q_lens, out=cu_q[1:])
    cu_k = np.zeros(num_seqs + 1, dtype=np.int64)
    np.cumsum(ends, out=cu_k[1:])
    samples = ends == np.fromiter((len(s.token_ids) for s in seqs), np.int64, num_seqs)
    logits_indices = cu_q[1:][samples] - 1
    sampling_seqs = [s for s, m in zip(seqs, samples.tolist()) if m]

    holes = np.flatnonzero(input_ids < 0)
    if holes.size and pending is None:
        raise RuntimeError("an input token is sampled by a step in flight, but none is in flight")
    sources = np.fromiter((seqs[i].pending_row for i in token_seq[holes].tolist()), np.int64, holes.size)

    # Two host-to-device copies per step: the int64 columns and the int32 ones.
    input_ids_d, positions_d, slot_mapping_d, logits_indices_d, holes_d, sources_d = _packed_to_device(
        [input_ids, positions, slot_mapping, logits_indices, holes, sources], np.int64, device
    )
    if holes.size:
        input_ids_d[holes_d] = pending[sources_d]
    order = np.argsort(-ends, kind="stable")  # Context.seq_order: longest context first
    context_lens_d, cu_q_d, cu_k_d, order_d, tables_d = _packed_to_device(
        [ends, cu_q, cu_k, order, tables.ravel()], np.int32, device
    )
    context_lens_host = ends.tolist()
    context = Context(
        slot_mapping=slot_mapping_d,
        block_tables=tables_d.view(num_seqs, width),
        context_lens=context_lens_d,
        cu_seqlens_q=cu_q_d,
        cu_seqlens_k=cu_k_d,
        seq_order=order_d,
        max_seqlen_q=int(q_lens.max()),
        max_seqlen_k=max(context_lens_host),
        query_lens_host=list(num_scheduled_tokens),
        context_lens_host=context_lens_host,
    )
    return PreparedBatch(
        input_ids=input_ids_d,
        positions=positions_d,
        context=context,
        logits_indices=logits_indices_d,
        sampling_seqs=sampling_seqs,
        sampling=SamplingMetadata.build(sampling_seqs, vocab_size, device, bias_logits, previous_sampling)
        if sampling_seqs and is_driver
        else None,
        decode_only=num_tokens == num_seqs,
        prompt_logprobs=prompt_logprobs_batch(seqs, num_scheduled_tokens, cu_q, device)
        if score_prompts
        else None,
    )


def _packed_to_device(arrays: list[np.ndarray], dtype: type, device: torch.device) -> list[torch.Tensor]:
    """The arrays in one host-to-device copy, each view starting on a 16-byte boundary: Triton
    compiles a kernel variant for each alignment of its pointer arguments, and a view whose offset
    followed the batch size would compile new variants mid-serving."""
    per_16_bytes = 16 // np.dtype(dtype).itemsize
    sizes = [a.size for a in arrays]
    starts = np.zeros(len(arrays) + 1, dtype=np.int64)
    np.cumsum([-(-n // per_16_bytes) * per_16_bytes for n in sizes], out=starts[1:])
    packed = np.zeros(int(starts[-1]), dtype=dtype)
    for array, start in zip(arrays, starts[:-1].tolist(), strict=True):
        packed[start : start + array.size] = array.ravel()
    on_device = _to_device(packed, device)
    return [on_device[start : start + n] for start, n in zip(starts[:-1].tolist(), sizes, strict=True)]


def _to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    tensor = torch.from_numpy(array)
    if device.type == "cpu":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)
