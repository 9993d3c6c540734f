"""Prompt logprobs (vLLM's `prompt_logprobs`): each prompt token's logprob given the tokens before
it, its rank and the top-N alternatives, scored from the hidden states a prefill computes anyway.

A step that computes positions [c, c + n) of a sequence scores the prompt tokens that follow them,
token_ids[c + 1 : min(c + n, num_prompt_tokens - 1) + 1]: chunked prefill scores each prompt token
once, in the chunk that computes the position before it. A position served by the prefix cache is
not computed, so the scheduler does not look up the cache for a sequence whose prompt logprobs are
not all in. Every tensor-parallel rank runs the LM head over the scored rows (a collective); rank 0
alone takes the log-softmax."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from executor_service.sequence import SequenceState
from protos.plan import PromptLogprobs

# Rows of the LM head at a time: a long prompt's [num_tokens, vocab] logits at once would need
# gigabytes (8,192 tokens of a 151,936-token vocabulary in fp32: 5 GB).
CHUNK_ROWS = 256


@dataclass
class PromptLogprobsBatch:
    """The rows of one step's flattened batch whose next token is a prompt token to score."""

    rows: torch.Tensor  # [k] int64
    target_ids: torch.Tensor  # [k] int64, the prompt token each row scores
    # (seq id, index of its first scored token, number scored, its top-N), in batch order.
    spans: list[tuple[int, int, int, int]]

    @property
    def max_num_top(self) -> int:
        return max(span[3] for span in self.spans)


@dataclass
class PromptLogprobsOutput:
    token_logprobs: torch.Tensor  # [k] fp32
    ranks: torch.Tensor  # [k] int64
    top_logprobs: torch.Tensor  # [k, max_num_top] fp32
    top_token_ids: torch.Tensor  # [k, max_num_top] int64


def prompt_logprobs_batch(
    seqs: list[SequenceState], num_scheduled_tokens: list[int], cu_q: np.ndarray, device: torch.device
) -> PromptLogprobsBatch | None:
    """The scored rows of a batch (cu_q: cumulative query lengths); None when there are none."""
    rows: list[int] = []
    targets: list[int] = []
    spans = []
    for i, (seq, n) in enumerate(zip(seqs, num_scheduled_tokens, strict=True)):
        num_top = seq.sampling_params.prompt_logprobs
        if num_top is None:
            continue
        c = seq.num_computed_tokens
        end = min(c + n, seq.num_prompt_tokens - 1)  # positions [c, end) score tokens [c + 1, end + 1)
        if end <= c:
            continue
        first_row = int(cu_q[i])
        rows.extend(range(first_row, first_row + end - c))
        targets.extend(seq.token_ids[c + 1 : end + 1])
        spans.append((seq.seq_id, c + 1, end - c, num_top))
    if not rows:
        return None
    host = torch.tensor([rows, targets], dtype=torch.int64)
    if device.type == "cuda":  # pinned: the copy does not wait for the steps queued before it
        host = host.pin_memory()
    on_device = host.to(device, non_blocking=True)
    return PromptLogprobsBatch(on_device[0], on_device[1], spans)


def compute_prompt_logprobs(
    model: torch.nn.Module, hidden: torch.Tensor, batch: PromptLogprobsBatch
) -> PromptLogprobsOutput | None:
    """hidden: [num_tokens, hidden] of the whole step -> the scores (None on ranks other than 0)."""
    num_top = batch.max_num_top
    parts: list[tuple[torch.Tensor, ...]] = []
    for start in range(0, len(batch.rows), CHUNK_ROWS):
        rows = batch.rows[start : start + CHUNK_ROWS]
        logits = model.compute_logits(hidden[rows])
        if logits is None:
            continue
        logprobs = logits.float().log_softmax(-1)
        target = logprobs.gather(-1, batch.target_ids[start : start + CHUNK_ROWS, None]).squeeze(-1)
        ranks = (logprobs > target[:, None]).sum(-1) + 1
        top = logprobs.topk(num_top, dim=-1)
        parts.append((target, ranks, top.values, top.indices))
    if not parts:
        return None
    return PromptLogprobsOutput(*(torch.cat(column) for column in zip(*parts, strict=True)))


def prompt_logprobs_results(batch: PromptLogprobsBatch, out: PromptLogprobsOutput) -> list[PromptLogprobs]:
    """Host lists of `out` (on the host), one entry per scored sequence."""
    token_lp = out.token_logprobs.tolist()
    ranks = out.ranks.tolist()
    top_lp = out.top_logprobs.tolist()
    top_ids = out.top_token_ids.tolist()
    results = []
    offset = 0
    for seq_id, first, count, num_top in batch.spans:
        span = slice(offset, offset + count)
        results.append(
            PromptLogprobs(
                seq_id,
                first,
                token_lp[span],
                ranks[span],
                [t for row in top_ids[span] for t in row[:num_top]],
                [v for row in top_lp[span] for v in row[:num_top]],
            )
        )
        offset += count
    return results
