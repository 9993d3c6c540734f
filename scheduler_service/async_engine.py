"""The engine thread: a synchronous LLMEngine stepping in its own thread.

Requests and aborts arrive through a thread-safe inbox (request_tracker.py); each step's outputs
go to the asyncio side in one batch (one `call_soon_threadsafe` per step), or, in the engine core
of a split service, through its `step_outputs` hook, which sends them to the API servers itself
and hands the loop only a step's bookkeeping (engine_core.py). The loop never waits on a client:
streams pick up whatever accumulated whenever they are ready to write.

When the executor is lost, accepted requests are kept and re-run by recompute on the next one
(executor_recovery.py).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Sequence

from protos.plan import ExecutorInfo
from protos.service_main import freeze_startup_heap
from scheduler_service.config import EngineOptions
from scheduler_service.engine import Executor, LLMEngine, RequestOutput, to_output
from scheduler_service.errors import ErrorCode, InvalidRequestError, QueueFullError, TandemRequestError
from scheduler_service.executor_client import ExecutorError, ExecutorUnavailable, PlanRejected
from scheduler_service.executor_recovery import ExecutorRecovery
from scheduler_service.metrics import SchedulerMetrics
from scheduler_service.request_stream import RequestStream, StreamTable
from scheduler_service.request_tracker import Failures, RequestTracker, some
from scheduler_service.sampling_params import SamplingParams
from scheduler_service.sequence import Sequence as Seq
from scheduler_service.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


# The characters of a request's `user` the log shows (the field has no limit of its own, as OpenAI's).
MAX_LOGGED_USER_CHARS = 256


def _shown(user: str) -> str:
    """`user` as the log shows it: quoted and escaped (repr), at most MAX_LOGGED_USER_CHARS of it."""
    if len(user) <= MAX_LOGGED_USER_CHARS:
        return repr(user)
    return f"{user[:MAX_LOGGED_USER_CHARS]!r}... ({len(user)} characters)"


class AsyncEngine:
    """Owns the engine thread. Public methods run on the asyncio loop given to start()."""

    def __init__(
        self,
        executor: Executor,
        options: EngineOptions,
        metrics: SchedulerMetrics,
        tokenizer_for: Callable[[ExecutorInfo], Tokenizer | None] = lambda info: None,
        on_health: Callable[[bool], None] = lambda serving: None,
    ) -> None:
        self.executor = executor
        self.options = options
        self.metrics = metrics
        self.tokenizer_for = tokenizer_for
        self.on_health = on_health
        self.streams = StreamTable(metrics)
        # Set by the engine core (engine_core.py): called on the engine thread with each step's
        # updated sequences instead of posting their RequestOutputs to the loop.
        self.step_outputs: Callable[[list[Seq]], None] | None = None
        self._admitting = True
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._tracker = RequestTracker(self.streams, metrics, self._post)
        self._recovery = ExecutorRecovery(executor, options, metrics, self._tracker, self._set_health)

    @property
    def engine(self) -> LLMEngine | None:
        """The connected engine (None while the executor is lost); set by the engine thread."""
        return self._recovery.engine

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self._recovery.tokenizer

    @property
    def _held(self) -> dict[int, Seq]:
        """Accepted requests kept while no executor is connected, by engine id."""
        return self._recovery.held

    # -- asyncio side ---------------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread.start()

    def not_connected_message(self) -> str:
        return self._recovery.not_connected_message()

    @property
    def admitting(self) -> bool:
        """False once stop_admitting() was called (shutting down)."""
        return self._admitting

    def stop_admitting(self) -> None:
        self._admitting = False

    @property
    def num_pending_admissions(self) -> int:
        """Requests submitted and not yet admitted or refused: none here (submit admits at once)."""
        return 0

    def shutdown(self, timeout: float = 10.0) -> None:
        self._tracker.stop()
        self._thread.join(timeout)

    async def aclose(self) -> None:
        await asyncio.to_thread(self.shutdown)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival: float,
        timeout: float | None = None,
        user: str | None = None,
    ) -> RequestStream:
        """Validate and queue one sample (params.n must be 1); see add_requests."""
        if params.n != 1:
            raise ValueError(f"add_request takes one sample (n = 1), got n = {params.n}: use add_requests")
        return self.add_requests(request_id, prompt_token_ids, params, arrival, timeout, user)[0]

    def add_requests(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival: float,
        timeout: float | None = None,
        user: str | None = None,
        peer: bytes | None = None,
    ) -> list[RequestStream]:
        """Validate and queue the request's params.n samples (one stream each, all or none);
        raises TandemRequestError (InvalidRequestError, QueueFullError, or UNAVAILABLE while
        shutting down or without an executor). `timeout`: seconds left until the call's deadline
        (None: no deadline); `user`: the end user it is for, logged; `peer`: the API server it
        came from (the engine core's, whose `step_outputs` then takes its outputs)."""
        engine = self.check_admitting()
        samples = params.for_samples()
        engine.validate_request(prompt_token_ids, samples[0])
        self._check_queue(engine, len(prompt_token_ids), len(samples))
        deadline = time.monotonic() + timeout if timeout is not None else None
        # In the engine's logs, a sample of several is the request's id and its index.
        names = [request_id] if len(samples) == 1 else [f"{request_id}/{j}" for j in range(len(samples))]
        streams = [
            self._tracker.add(request_id, prompt_token_ids, sample, arrival, deadline, j, name, peer)
            for j, (sample, name) in enumerate(zip(samples, names, strict=True))
        ]
        logger.info(
            "request %s%s: %d prompt tokens, %s",
            request_id,
            f" (user {_shown(user)})" if user else "",
            len(prompt_token_ids),
            params.summary(),
        )
        return streams

    async def submit(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival: float,
        timeout: float | None = None,
        user: str | None = None,
    ) -> list[RequestStream]:
        """add_requests, for the front ends: API server processes admit over IPC (api_server.py)."""
        return self.add_requests(request_id, prompt_token_ids, params, arrival, timeout, user)

    def check_admitting(self) -> LLMEngine:
        """The connected engine; TandemRequestError (UNAVAILABLE) while shutting down or without an executor
        (checked before a prompt is tokenized, and again when it is added)."""
        engine = self.engine
        if not self._admitting:
            raise TandemRequestError(
                "the scheduler is shutting down: send the request to another replica", ErrorCode.UNAVAILABLE
            )
        if engine is None:
            raise TandemRequestError(self.not_connected_message(), ErrorCode.UNAVAILABLE)
        return engine

    def _check_queue(self, engine: LLMEngine, num_tokens: int, num_samples: int = 1) -> None:
        max_queue = self.options.max_queue
        if max_queue is not None:
            # Requests that will have to wait: beyond the free places in the running batch.
            scheduler = engine.scheduler
            free = engine.limits.max_num_seqs - len(scheduler.running)
            num_waiting = max(0, self._tracker.num_adds + len(scheduler.waiting) + num_samples - 1 - free)
            if num_waiting >= max_queue:
                raise QueueFullError(f"queue full: {num_waiting} requests waiting (--max-queue {max_queue})")
        max_tokens = self.options.max_queued_tokens
        if max_tokens is not None:
            adding = num_tokens * num_samples  # each sample counts its prompt
            if adding > max_tokens:  # no retry can admit it
                samples = f" x {num_samples} samples (n)" if num_samples > 1 else ""
                raise InvalidRequestError(
                    f"prompt ({num_tokens} tokens){samples} exceeds --max-queued-tokens ({max_tokens})"
                )
            queued = self.streams.num_queued_tokens
            if queued + adding > max_tokens:
                raise QueueFullError(
                    f"queue full: {queued} prompt tokens waiting + {adding} would exceed "
                    f"--max-queued-tokens {max_tokens}"
                )

    def abort(self, stream: RequestStream) -> None:
        self._tracker.abort(stream)

    def abort_all(self, failure: TandemRequestError) -> int:
        """End every live stream with `failure` (shutdown timeout); returns how many."""
        return self._tracker.abort_all(failure)

    # -- engine thread --------------------------------------------------------------------

    def call_soon(self, callback: Callable[..., object], *args: object) -> None:
        """Run callback(*args) on the asyncio loop, after what the engine thread posted before."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(callback, *args)

    def _post(self, outputs: Sequence[RequestOutput], failures: Failures | None = None) -> None:
        if outputs or failures:
            self.call_soon(self.streams.dispatch, outputs, failures, time.perf_counter())

    def _set_health(self, serving: bool) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self.on_health, serving)

    def _run(self) -> None:
        tracker, recovery = self._tracker, self._recovery
        delay = self.options.backoff_min_s
        while not tracker.stopping:
            if recovery.engine is None:
                recovery.while_lost()
                if not recovery.connect(self.tokenizer_for):
                    tracker.wait_to_reconnect(delay)
                    delay = min(2 * delay, self.options.backoff_max_s)
                    continue
                # The engine just built (its block manager holds an object per KV block) joins the
                # frozen start-up heap; an engine replaced by a reconnect is freed by refcount.
                freeze_startup_heap()
                delay = self.options.backoff_min_s
            engine = recovery.engine
            tracker.drain_into(engine)
            tracker.expire(engine)
            if engine.has_unfinished_requests() or engine.scheduler.has_finished_to_send():
                self._step(engine)
                continue
            if not tracker.wait_for_adds(self.options.heartbeat_s):
                recovery.heartbeat()

    def _step(self, engine: LLMEngine) -> None:
        try:
            updated = engine.step_sequences()
        except (PlanRejected, ValueError) as e:
            # The executor refused this plan and changed no state: fail only its requests.
            self._fail_plan(engine, e)
            self.metrics.update_from_stats(engine.scheduler.stats)
            return
        except ExecutorUnavailable as e:
            self._recovery.lose(engine, str(e))
            return
        except Exception as e:
            # The executor's state (or ours) is unknown: fail this plan's requests (one of them
            # may be what broke the step), keep the others and start over from a reset.
            if not isinstance(e, ExecutorError):
                logger.exception("engine step failed")
            self._fail_plan(engine, e)
            self._recovery.lose(engine, f"engine step failed: {e}")
            return
        self._record_step(engine)
        step_outputs = self.step_outputs
        if step_outputs is None:
            self._post([to_output(seq) for seq in updated])
            return
        try:
            step_outputs(updated)
        except Exception:
            # (a bug there must not stop the engine thread: this step's outputs take the general path)
            logger.exception("step_outputs failed: the step's outputs go through the stream table")
            self._post([to_output(seq) for seq in updated])

    def _fail_plan(self, engine: LLMEngine, error: Exception) -> None:
        plan = engine.last_plan
        if plan is None:
            return
        names = [engine.scheduler.seqs[i].name for i in plan.seq_ids if i in engine.scheduler.seqs]
        failed = engine.fail_requests(plan.seq_ids, str(error))
        for seq_id in plan.seq_ids:  # admitted by no plan that ran: no queue time to observe
            self._tracker.arrivals.pop(seq_id, None)
        logger.error(
            "step %d failed (%s); failed its %d requests: %s", plan.step_id, error, len(failed), some(names)
        )
        failure = TandemRequestError(str(error), ErrorCode.INTERNAL)
        self._post([], {out.request_id: failure for out in failed})

    def _record_step(self, engine: LLMEngine) -> None:
        metrics = self.metrics
        metrics.update_from_stats(engine.scheduler.stats)
        plan = engine.last_plan
        if plan.seq_ids:
            metrics.tokens_per_step.observe(sum(plan.num_scheduled_tokens))
        if engine.last_step_seconds > 0:
            metrics.executor_round_trip.observe(engine.last_step_seconds)
        if plan.new_seqs:
            # Queueing ends when the plan that admits a request is sent, not when its result is
            # back (a long prefill, or the plan ahead of it, is no time in the queue).
            scheduled = engine.last_plan_sent_at or time.perf_counter()
            arrivals = self._tracker.arrivals
            for new in plan.new_seqs:
                arrival = arrivals.pop(new.seq_id, None)
                if arrival is not None:
                    metrics.queue_time.observe(scheduled - arrival)
