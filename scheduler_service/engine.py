"""The synchronous engine: requests in, schedule -> execute -> update, outputs out.

With an executor that takes a plan before answering the last one (`takes_plans_ahead`,
protos/executor.py: RemoteExecutor and LocalExecutor), two plans are in flight: step N+1 is
scheduled and sent before step N's result is read, so the executor never waits for the scheduler
or the network between steps (the plans' lifecycle: steps_in_flight.py)."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable as Iter
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from protos.executor import Executor
from protos.plan import StepPlan, StepResult
from scheduler_service.config import SchedulerConfig, SchedulerLimits
from scheduler_service.sampling_params import InvalidRequestError, SamplingParams, verify_request
from scheduler_service.scheduler import Scheduler
from scheduler_service.sequence import Sequence, SequenceStatus, TokenLogprob

_FINISHED = SequenceStatus.FINISHED
logger = logging.getLogger(__name__)
STATUS_INTERVAL_S = 10.0


@dataclass(slots=True)
class RequestOutput:
    request_id: int
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    error: str | None = None
    # Present when the request asked for logprobs: one entry per new token.
    new_logprobs: list[TokenLogprob] | None = None
    # With the first tokens of a request that asked for prompt logprobs: one entry per prompt
    # token from the second (the first has none).
    prompt_logprobs: list[TokenLogprob] | None = None
    # token_ids and logprobs are slices taken on demand: copying every sequence's output
    # every step would make a step O(total tokens).
    _all_token_ids: list[int] = field(default_factory=list, repr=False)
    _end: int = 0
    _all_logprobs: list[TokenLogprob] | None = field(default=None, repr=False)

    @property
    def token_ids(self) -> list[int]:
        """All generated tokens up to and including this step."""
        return self._all_token_ids[self.num_prompt_tokens : self._end]

    @property
    def logprobs(self) -> list[TokenLogprob] | None:
        """One entry per generated token so far, when the request asked for logprobs."""
        if self._all_logprobs is None:
            return None
        return self._all_logprobs[: self._end - self.num_prompt_tokens]

    @property
    def num_output_tokens(self) -> int:
        return self._end - self.num_prompt_tokens


class LLMEngine:
    def __init__(
        self, executor: Executor, config: SchedulerConfig | None = None, first_step_id: int = 1
    ) -> None:
        self.executor = executor
        self.config = config if config is not None else SchedulerConfig()
        self.info = executor.describe()
        self.scheduler = Scheduler(self.config, self.info, first_step_id)
        self.limits = self.scheduler.limits
        depth = self.config.max_plans_in_flight
        if depth is None:  # two where the executor works while the next plan travels
            depth = 2 if executor.takes_plans_ahead else 1
        limit = executor.max_plans_in_flight  # None: it queues what it cannot run yet
        if limit is not None and depth > limit:
            raise ValueError(
                f"max_plans_in_flight {depth}: this executor takes at most {limit} plans in flight "
                "(3 needs a remote executor, whose service queues the plan behind its two)"
            )
        self.max_plans_in_flight = depth
        # The plans scheduled and not yet applied (steps_in_flight.py).
        self._in_flight = self.scheduler.in_flight
        self._next_request_id = 0
        self._last_status = (time.monotonic(), 0, 0)
        # The plan whose result the last step() applied (or that failed), when it was sent
        # (perf_counter; None when it had nothing for the executor), and the seconds from sending
        # it to its result (0 when it had nothing for the executor).
        self.last_plan: StepPlan | None = None
        self.last_plan_sent_at: float | None = None
        self.last_step_seconds = 0.0

    def add_request(
        self,
        prompt_token_ids: Seq[int],
        sampling_params: SamplingParams | None = None,
        request_id: int | None = None,
        name: str | None = None,
        client: object | None = None,
        validated: bool = False,
    ) -> int:
        """Queue a request; raises InvalidRequestError if it can never run. `name`: its id in the
        logs, the one its client knows (default: the engine's request id); `client`: see
        Sequence.client; `validated`: the caller checked it with validate_request (the offline LLM
        checks a batch before admitting any of it)."""
        params = sampling_params if sampling_params is not None else SamplingParams()
        if not validated:
            self.validate_request(prompt_token_ids, params)
        if request_id is None:
            while self._next_request_id in self.scheduler.seqs:
                self._next_request_id += 1
            request_id = self._next_request_id
            self._next_request_id += 1
        elif request_id in self.scheduler.seqs:
            raise ValueError(f"request id {request_id} is already in use")
        self.scheduler.add(Sequence(request_id, list(prompt_token_ids), params, name=name, client=client))
        return request_id

    def adopt(self, seq: Sequence) -> None:
        """Take over a sequence from an engine whose executor was lost: it is recomputed from its
        prompt and the tokens it already generated. Raises InvalidRequestError when it no longer
        fits this executor's limits."""
        self._verify(seq.prompt_token_ids, seq.sampling_params)
        if any(not 0 <= t < self.limits.vocab_size for t in seq.output_token_ids):
            raise InvalidRequestError(
                f"generated tokens fall outside the vocabulary ({self.limits.vocab_size})"
            )
        seq.reset_for_recompute()
        self.scheduler.add(seq)

    def validate_request(self, prompt_token_ids: Seq[int], sampling_params: SamplingParams) -> None:
        """The checks of add_request without admitting anything (to check a batch first)."""
        validate_request(prompt_token_ids, sampling_params, self.limits)

    def _verify(self, prompt_token_ids: Seq[int], sampling_params: SamplingParams) -> None:
        limits = self.limits
        verify_request(
            prompt_token_ids, sampling_params, limits.vocab_size, limits.max_model_len, limits.max_logprobs
        )

    def abort_request(self, request_id: int) -> bool:
        """Abort between steps; returns whether the request was still unfinished."""
        return self.scheduler.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._in_flight)

    def step(self) -> list[RequestOutput]:
        """Send plans until max_plans_in_flight are out, then apply the oldest one's result. On
        an executor error every plan in flight is abandoned (none of them changed our state)
        and the error raised, with last_plan the oldest."""
        return [to_output(seq) for seq in self.step_sequences()]

    def step_sequences(self) -> list[Sequence]:
        """step(), returning the sequences it updated (each with num_new_tokens set) rather than
        their outputs: for a caller that reads them before the next step (engine_core.py)."""
        in_flight = self._in_flight
        scheduler = self.scheduler
        try:
            if not in_flight:
                self._send(scheduler.schedule())
            while len(in_flight) < self.max_plans_in_flight and scheduler.can_schedule_ahead():
                self._send(scheduler.schedule())
            oldest = in_flight.oldest()
            plan, sent_at = oldest.plan, oldest.sent_at
            self.last_plan, self.last_plan_sent_at = plan, sent_at
            self.last_step_seconds = 0.0
            if sent_at is None:
                result = StepResult(step_id=plan.step_id)
            else:
                result = self.executor.receive(plan)
                self.last_step_seconds = time.perf_counter() - sent_at
        except BaseException:
            self._abandon_in_flight()
            raise
        updated = scheduler.update(plan, result)
        if time.monotonic() - self._last_status[0] >= STATUS_INTERVAL_S:
            self._log_status()
        return updated

    def _send(self, plan: StepPlan) -> None:
        if plan.seq_ids or plan.finished_seq_ids or plan.preempted_seq_ids:
            self._in_flight.sent(plan)
            self.executor.send(plan)

    def _abandon_in_flight(self) -> None:
        """Undo the bookkeeping of every plan in flight, newest first; the executor forgets them."""
        if self._in_flight:
            self.last_plan = self._in_flight.oldest().plan
        self.scheduler.abandon()
        self.executor.discard()

    def fail_requests(self, request_ids: Iter[int], error: str) -> list[RequestOutput]:
        """Finish unfinished requests with "abort" and `error` (e.g. the plan they were in was
        rejected); returns their final outputs. Call between steps."""
        scheduler = self.scheduler
        outputs = []
        for rid in request_ids:
            seq = scheduler.seqs.get(rid)
            if seq is None or not scheduler.abort(rid):
                continue
            seq.error = error
            seq.num_new_tokens = 0
            outputs.append(to_output(seq))
        return outputs

    def _log_status(self) -> None:
        """One line of throughput and occupancy, quiet when idle."""
        stats = self.scheduler.stats
        now = time.monotonic()
        t0, prompt0, gen0 = self._last_status
        self._last_status = (now, stats.num_prompt_tokens, stats.num_generation_tokens)
        if stats.num_generation_tokens == gen0 and stats.num_prompt_tokens == prompt0:
            return
        dt = now - t0
        logger.info(
            "prompt %.0f tok/s, generation %.0f tok/s, running %d, waiting %d, "
            "KV usage %.1f%%, prefix hit rate %.1f%%, preemptions %d",
            (stats.num_prompt_tokens - prompt0) / dt,
            (stats.num_generation_tokens - gen0) / dt,
            stats.num_running,
            stats.num_waiting,
            100 * stats.kv_usage,
            100 * stats.prefix_hit_rate,
            stats.num_preemptions,
        )


def validate_request(
    prompt_token_ids: Seq[int], sampling_params: SamplingParams, limits: SchedulerLimits
) -> None:
    """The request on its own, then against the executor's limits; InvalidRequestError naming the
    limit (also an API server's check, before the engine core admits it: api_server.py)."""
    sampling_params.verify()
    verify_request(
        prompt_token_ids, sampling_params, limits.vocab_size, limits.max_model_len, limits.max_logprobs
    )


def to_output(seq: Sequence) -> RequestOutput:
    """The step's news of a sequence that update() returned."""
    # Positional arguments: this runs once per sequence per step.
    tokens = seq.token_ids
    k = seq.num_new_tokens
    return RequestOutput(
        seq.seq_id,
        tokens[-k:] if k else [],
        seq.status is _FINISHED,
        seq.finish_reason,
        seq.num_prompt_tokens,
        seq.num_cached_tokens if seq.num_cached_tokens > 0 else 0,
        seq.error,
        seq.logprobs[-k:] if k and seq.logprobs is not None else None,
        # (the first output: as many generated tokens as new ones)
        seq.prompt_logprobs
        if k and seq.prompt_logprobs is not None and len(tokens) - k == seq.num_prompt_tokens
        else None,
        tokens,
        len(tokens),
        seq.logprobs,
    )
