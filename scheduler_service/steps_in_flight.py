"""Two plans in flight, the scheduler's side: step N+1 is scheduled and sent before step N's
result is back, counting on one more token for every sequence step N samples.

A plan's lifecycle here (the executor's side: executor_service/steps_in_flight.py):

1. **scheduled** (`Scheduler.schedule` -> `PlansInFlight.scheduled`): blocks are allocated and
   num_computed_tokens advanced as if the plan had run; each sequence it samples counts one more
   `Sequence.num_pending_tokens` (the number of plans in flight that sample it: at most three);
2. **sent** (`LLMEngine` -> `sent`, then `Executor.send`): the plan goes to the executor and the
   clock starts; a plan with nothing for the executor is not sent and gets an empty result. A
   remote executor's plans go onto one Step stream (`RemoteExecutor`, executor_client.py), opened
   by the first plan after the last stream closed;
3. **collected** (`LLMEngine.step` -> `Executor.receive`): the executor's result for the oldest
   plan is read. The Step stream's results come in plan order (one of an older step, sent before
   a reset, is dropped), each within its `ResultDeadline`: an overdue one cancels the stream, and
   the executor is taken for hung, as after a crash;
4. **applied** (`Scheduler.update` -> `applied`): its tokens are appended, each sampled sequence
   counts one pending token less; or **abandoned** (`abandon`, every plan in flight at once, when
   the executor failed one): schedule()'s bookkeeping is undone, newest first (the blocks it put
   in the prefix cache leave it again), and the executor is told to forget them
   (`Executor.discard`: RemoteExecutor closes the Step stream, dropping the plans in it).

Plans are applied oldest first. The pending counts are raised and lowered inline, in schedule()'s
and update()'s loops over the batch: a second pass over 256 sequences costs 8-23 us, 2-7% of a
decode step's scheduling (bench/scheduler_overhead.py)."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from protos.plan import StepPlan
from scheduler_service.block_manager import BlockManager
from scheduler_service.sequence import Sequence, SequenceStatus

_RUNNING = SequenceStatus.RUNNING
# Steps of this many tokens or more teach ResultDeadline what a token costs.
_LARGE_STEP_TOKENS = 256


@dataclass(slots=True)
class PlanInFlight:
    """A plan scheduled and not yet applied."""

    plan: StepPlan
    # The scheduled sequences that sample, and those that do not (prefill chunks, each with the
    # number of positions whose KV the step writes).
    sampling: list[Sequence]
    partial: list[tuple[Sequence, int]]
    # The blocks it put in the prefix cache, taken out again if it is abandoned.
    registered: list[int]
    # When it was sent to the executor; None before, and for a plan with nothing for it.
    sent_at: float | None = None


class PlansInFlight:
    """The plans scheduled and not yet applied, oldest first."""

    def __init__(self) -> None:
        self._plans: deque[PlanInFlight] = deque()

    def __len__(self) -> int:
        return len(self._plans)

    def __bool__(self) -> bool:
        return bool(self._plans)

    def oldest(self) -> PlanInFlight:
        return self._plans[0]

    def scheduled(
        self,
        plan: StepPlan,
        sampling: list[Sequence],
        partial: list[tuple[Sequence, int]],
        registered: list[int],
    ) -> None:
        self._plans.append(PlanInFlight(plan, sampling, partial, registered))

    def sent(self, plan: StepPlan) -> None:
        """The newest plan went to the executor."""
        entry = self._plans[-1]
        assert entry.plan is plan, "plans are sent in the order they are scheduled"
        entry.sent_at = time.perf_counter()

    def applied(self, plan: StepPlan) -> PlanInFlight:
        """Take the oldest plan, whose result is being applied."""
        if not self._plans or self._plans[0].plan.step_id != plan.step_id:
            raise RuntimeError(f"plan {plan.step_id} is not the oldest plan in flight")
        return self._plans.popleft()

    def abandon(
        self,
        seqs: dict[int, Sequence],
        running: list[Sequence],
        waiting: deque[Sequence],
        block_manager: BlockManager,
        finished_ids: list[int],
    ) -> list[int]:
        """Undo schedule()'s bookkeeping for every plan in flight, which the executor did not run
        (a refused plan and the one sent behind it; a refused plan changes no executor state), so
        that failing the first plan's requests leaves all consistent. Sequences the plans admitted
        go back to the front of `waiting`. Returns the ids the next plan must tell the executor to
        drop: exactly the sequences it still holds that are no longer running."""
        plans = [entry.plan for entry in self._plans]
        # Whether the executor held each sequence before the oldest plan: not if that plan (or a
        # later one, before any other mention) sent it as new.
        held: dict[int, bool] = {}
        for plan in plans:
            new_ids = {s.seq_id for s in plan.new_seqs}
            for seq_id in plan.finished_seq_ids + plan.preempted_seq_ids:
                held.setdefault(seq_id, True)
            for seq_id in plan.seq_ids:
                held.setdefault(seq_id, seq_id not in new_ids)
        bs = block_manager.block_size
        while self._plans:
            entry = self._plans.pop()
            plan = entry.plan
            block_manager.uncache(entry.registered)
            for seq in entry.sampling:
                seq.num_pending_tokens = max(0, seq.num_pending_tokens - 1)
            new_ids = {s.seq_id for s in plan.new_seqs}
            for seq_id, computed, num_new in zip(
                plan.seq_ids, plan.num_computed_tokens, plan.num_new_blocks, strict=True
            ):
                seq = seqs.get(seq_id)
                if seq is None or seq_id in new_ids:
                    continue
                seq.num_computed_tokens = computed
                seq.num_registered_blocks = min(seq.num_registered_blocks, computed // bs)
                if num_new and seq.status is _RUNNING:  # the executor never got these blocks
                    block_manager.release_tail(seq, num_new)
            for new in reversed(plan.new_seqs):
                seq = seqs.get(new.seq_id)
                if seq is None or seq.status is not _RUNNING:
                    continue
                running.remove(seq)
                block_manager.free(seq)
                seq.status = SequenceStatus.WAITING
                seq.num_computed_tokens = seq.num_kv_written = seq.num_pending_tokens = 0
                waiting.appendleft(seq)
        to_drop = set(finished_ids)
        for seq_id, was_held in held.items():
            seq = seqs.get(seq_id)
            is_running = seq is not None and seq.status is _RUNNING
            if seq is not None:
                seq.sent = was_held and is_running
            if was_held and not is_running:
                to_drop.add(seq_id)
            else:
                to_drop.discard(seq_id)
        return sorted(to_drop)


class ResultDeadline:
    """How long the result of a plan sent to a remote executor may be awaited before the executor
    is taken for hung: `timeout` (--executor-step-timeout) plus ten times what its scheduled tokens
    took, per token, in the slowest recent large step (256 tokens or more, whose time is mostly
    per token): an 8,192-token prefill of a large model on CPU that takes 30 s is a step of its
    kind, not a hang. An overdue result doubles `timeout` for the results after it (up to 64x)
    until one is answered, so that a first step longer than the flag is recomputed a few times at
    most, never forever. Times are time.monotonic()."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._awaited_since = 0.0
        self._num_tokens = 0
        self._seconds_per_token = 0.0  # the slowest recent large step's, decaying 0.1% a step
        self._backoff = 1

    def awaited(self, num_tokens: int, now: float) -> float:
        """The result of a step of `num_tokens` scheduled tokens is awaited from `now`: the seconds
        it may take."""
        self._awaited_since, self._num_tokens = now, num_tokens
        return self.timeout * self._backoff + 10 * self._seconds_per_token * num_tokens

    def answered(self, now: float) -> None:
        self._backoff = 1
        per_token = 0.0
        if self._num_tokens >= _LARGE_STEP_TOKENS:
            per_token = (now - self._awaited_since) / self._num_tokens
        self._seconds_per_token = max(per_token, 0.999 * self._seconds_per_token)

    def overdue(self) -> None:
        self._backoff = min(64, 2 * self._backoff)
