"""Two steps in flight, the executor's side: a step is launched on the device before the one
before it has been collected, so the host prepares step N+1 while the device runs step N.

A step's lifecycle here (the scheduler's side: scheduler_service/steps_in_flight.py):

1. **applied** (`apply_plan`, on every rank): the plan's drops, new sequences and new blocks change
   the per-sequence state;
2. **launched** (`launch_batch`, on every rank): the forward pass and sampling are queued on the
   device; each sampling sequence's next token is a `PLACEHOLDER` (-1) on the host, and a step
   launched meanwhile reads that token from the device instead (`SequenceState.pending_row`);
3. **collected** (`ModelRunner.collect`, rank 0): the sampled ids reach the host and
   `fill_placeholders` puts them in place; ranks 1..N-1 fill theirs when rank 0's next message
   brings the ids (tp_worker.py keeps their `Unfilled` placeholders, oldest first);
4. **received** (`LocalExecutor.receive`): the step's `StepResult` goes back to the scheduler,
   in plan order; or **discarded** (a reset, or the scheduler abandoning its plans): the device
   work completes and its tokens are kept, the result is dropped.

A step sent after one that failed is not run (`StepInFlight.error`)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from executor_service.model_runner import Launch, ModelRunner, RunOutput
from executor_service.sequence import SequenceState
from protos.plan import StepPlan, StepResult

# A sampled token not yet on the host.
PLACEHOLDER = -1
# Where a launched step's sampled tokens go: (sequence, index of its placeholder), batch order.
Placeholders = list[tuple[SequenceState, int]]


@dataclass
class StepInFlight:
    """A step sent and not yet received: its result, its error, or its launch on the device."""

    plan: StepPlan
    result: StepResult | None = None
    error: BaseException | None = None
    launch: Launch | None = None
    placeholders: Placeholders = field(default_factory=list)


class Unfilled:
    """Ranks 1..N-1: the placeholders of each launched step whose tokens rank 0 has not sent yet,
    oldest first (rank 0 sends them, in step order, with a later message)."""

    def __init__(self) -> None:
        self._steps: deque[Placeholders] = deque()

    def launched(self, placeholders: Placeholders) -> None:
        self._steps.append(placeholders)

    def fill(self, sampled_token_ids: list[list[int]]) -> None:
        for token_ids in sampled_token_ids:
            fill_placeholders(self._steps.popleft(), token_ids)


def step_result(plan: StepPlan, sampling_seqs: list[SequenceState], out: RunOutput) -> StepResult:
    return StepResult(
        step_id=plan.step_id,
        seq_ids=[s.seq_id for s in sampling_seqs],
        token_ids=out.sampled_token_ids,
        num_tokens=[1] * len(out.sampled_token_ids),
        logprobs=out.logprobs,
        prepare_seconds=out.prepare_seconds,
        forward_seconds=out.forward_seconds,
        sample_seconds=out.sample_seconds,
        prompt_logprobs=out.prompt_logprobs,
    )


def apply_plan(runner: ModelRunner, seqs: dict[int, SequenceState], plan: StepPlan) -> list[SequenceState]:
    """Steps 1-3 of StepPlan on a validated plan: drop, register, extend block tables; returns
    the scheduled sequences in batch order. Every tensor-parallel rank does this."""
    for seq_id in (*plan.finished_seq_ids, *plan.preempted_seq_ids):
        seq = seqs.pop(seq_id, None)
        if seq is not None:
            runner.remove_sequence(seq)
    for new in plan.new_seqs:
        seq = seqs[new.seq_id] = SequenceState.from_new(new)
        runner.add_sequence(seq)
    batch: list[SequenceState] = []
    offset = 0
    for seq_id, num_new in zip(plan.seq_ids, plan.num_new_blocks, strict=True):
        seq = seqs[seq_id]
        if num_new:
            runner.append_blocks(seq, plan.new_block_ids[offset : offset + num_new])
        offset += num_new
        batch.append(seq)
    return batch


def launch_batch(
    runner: ModelRunner,
    batch: list[SequenceState],
    plan: StepPlan,
    pending: torch.Tensor | None,
    all_logits: bool,
) -> tuple[Launch, Placeholders]:
    """Steps 3-4 of StepPlan on every rank, from the compute on: launch the batch and advance its
    sequences. Each sampling sequence gets a PLACEHOLDER in place of its next token until the step's tokens
    are on the host (the returned placeholders); a step launched meanwhile takes it from the
    device (row `pending_row` of `pending`)."""
    launch = runner.launch(batch, plan.num_scheduled_tokens, pending, all_logits)
    for seq, n in zip(batch, plan.num_scheduled_tokens, strict=True):
        seq.num_computed_tokens += n
    placeholders = []
    for row, seq in enumerate(launch.batch.sampling_seqs):
        placeholders.append((seq, len(seq.token_ids)))
        seq.token_ids.append(PLACEHOLDER)
        seq.pending_row = row
    return launch, placeholders


def fill_placeholders(placeholders: Placeholders, token_ids: list[int]) -> None:
    for (seq, index), token_id in zip(placeholders, token_ids, strict=True):
        seq.token_ids[index] = token_id


def drop_all(runner: ModelRunner, seqs: dict[int, SequenceState]) -> int:
    dropped = len(seqs)
    for seq in seqs.values():
        runner.remove_sequence(seq)
    seqs.clear()
    return dropped
