"""Two steps in flight, the executor's side: a step is launched on the device before the one
before it has been collected, so the host prepares step N+1 while the device runs step N.

A step's lifecycle here (the scheduler's side: scheduler_service/steps_in_flight.py):

1. **read** (the Step stream, servicer.py): plans are read on a thread of their own
   (`StreamSteps`) and admitted: well-formed, from the executor's owner, step ids increasing;
2. **applied** (`apply_plan`, on every rank): the plan's drops, new sequences and new blocks change
   the per-sequence state;
3. **launched** (`launch_batch`, on every rank): the forward pass and sampling are queued on the
   device; each sampling sequence's next token is a `PLACEHOLDER` (-1) on the host, and a step
   launched meanwhile reads that token from the device instead (`SequenceState.pending_row`).
   On CUDA (`overlaps_steps`) the stream sends each plan as it comes, so a step is launched
   while the one before it runs; on the CPU a step is done when it is sent;
4. **collected** (`ModelRunner.collect`, rank 0): the sampled ids reach the host and
   `fill_placeholders` puts them in place; ranks 1..N-1 fill theirs when rank 0's next message
   brings the ids (tp_worker.py keeps their `Unfilled` placeholders, oldest first);
5. **received** (`LocalExecutor.receive`): the step's `StepResult` goes back to the scheduler,
   in plan order. The stream answers its oldest step at once when it has two in flight (the plan
   that makes two is sent and the oldest received in one call on the executor's thread) and, with
   one, as soon as the step is done, unless a plan comes first (`StreamSteps.next_request`); or
   **discarded** (a reset, a broken stream, or the scheduler abandoning its plans): the device
   work completes and its tokens are kept, the result is dropped.

A step sent after one that failed is not run (`StepInFlight.error`). The executor keeps one
stream's steps in flight at a time: a second stream's plans wait until the first's are answered."""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from executor_service.sequence import SequenceState
from protos.plan import StepPlan, StepResult

if TYPE_CHECKING:  # the servicer imports this module, and it must not load torch
    import torch

    from executor_service.model_runner import Launch, ModelRunner, RunOutput

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


# The Step stream's requests are over.
END = object()
# How often a stream with one step in flight looks whether it is done while it waits for the next
# plan: a CUDA event has no host-side callback to block on.
POLL_S = 0.0002


@dataclass(slots=True)
class StepSent:
    """A plan a Step stream sent to the executor and has not answered yet."""

    plan: StepPlan
    sent_at: float  # time.perf_counter()
    num_graph_steps: int  # the executor's CUDA-graph steps before it ran


class StreamSteps:
    """One Step stream's side of stages 1 and 5 on CUDA: the plans it reads ahead, on a thread of
    their own, so that it can wait for the next plan or for the step in flight, whichever comes
    first; and the steps it sent and has not answered, oldest first. While it has steps in flight
    the stream holds `lock`."""

    def __init__(self, requests: Iterator, lock: threading.Lock) -> None:
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = lock
        self._sent: deque[StepSent] = deque()
        # When the last step was answered: a step's time runs from its send or from then,
        # whichever is later, so that overlapped steps are not counted twice.
        self._last_answered = 0.0
        threading.Thread(target=self._read, args=(requests,), name="step-plans", daemon=True).start()

    def __len__(self) -> int:
        return len(self._sent)

    def __bool__(self) -> bool:
        return bool(self._sent)

    def _read(self, requests: Iterator) -> None:
        try:
            for msg in requests:
                self._requests.put(msg)
        except Exception:  # the RPC ended (cancelled, or aborted by the handler)
            pass
        self._requests.put(END)

    def next_request(self, ready: Callable[[], bool]) -> object | None:
        """The next request (a plan, or END), or None when the oldest step is to be answered: at
        once with two in flight, with one as soon as ready() holds and no plan came first."""
        if not self._sent:
            return self._requests.get()
        if len(self._sent) >= 2:
            return None
        while not ready():
            try:
                return self._requests.get(timeout=POLL_S)
            except queue.Empty:
                continue
        try:
            return self._requests.get_nowait()
        except queue.Empty:
            return None

    def sending(self, plan: StepPlan, num_graph_steps: int) -> float | None:
        """`plan` is about to be sent; waits while another stream has steps in flight. Returns the
        seconds the stream had no step in flight before it (since its last answer; None for its
        first plan or behind a step in flight): the device waited that long on the scheduler (or,
        rarely, ran another stream's steps meanwhile)."""
        idle = None
        if not self._sent:
            self._lock.acquire()
        now = time.perf_counter()
        if not self._sent and self._last_answered:
            idle = now - self._last_answered
        self._sent.append(StepSent(plan, now, num_graph_steps))
        return idle

    def oldest(self) -> StepSent:
        return self._sent[0]

    def answered(self) -> tuple[StepSent, float]:
        """Take the oldest step, whose result was just received, and the seconds it ran."""
        step = self._sent.popleft()
        if not self._sent:
            self._lock.release()
        now = time.perf_counter()
        seconds = now - max(step.sent_at, self._last_answered)
        self._last_answered = now
        return step, seconds

    def clear(self) -> None:
        """Forget the steps not answered (the executor discards them)."""
        if self._sent:
            self._sent.clear()
            self._lock.release()


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
