"""The engine thread: a synchronous LLMEngine stepping in its own thread.

Requests and aborts arrive through a thread-safe inbox; each step's outputs go to the asyncio
side in one batch (one `call_soon_threadsafe` per step). The loop never waits on a client:
streams pick up whatever accumulated whenever they are ready to write.

When the executor is lost (its process died, the stream broke, it restarted with other
settings), every accepted request is kept: the engine goes NOT_SERVING, reconnects with
backoff, and on a new executor calls Describe and Reset, builds a new scheduler for the new
capacity and re-runs the kept requests by recompute (prompt + tokens already streamed, sent as
one NewSequence). Their streams carry on where they stopped; no token is sent twice. A kept
request ends with DEADLINE_EXCEEDED at its deadline, or with UNAVAILABLE after
`recovery_timeout_s` without an executor.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc

from protos.plan import ExecutorInfo
from scheduler_service.config import SchedulerConfig
from scheduler_service.engine import Executor, LLMEngine, RequestOutput
from scheduler_service.executor_client import ExecutorError, ExecutorUnavailable, PlanRejected
from scheduler_service.metrics import SchedulerMetrics
from scheduler_service.request_stream import RequestFailure, RequestStream, StreamTable
from scheduler_service.sampling_params import InvalidRequestError, SamplingParams
from scheduler_service.sequence import Sequence as Seq
from scheduler_service.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

Failures = dict[int, RequestFailure]
# (engine id, prompt token ids, sampling params, arrival (perf_counter), deadline (monotonic) or None)
Add = tuple[int, list[int], SamplingParams, float, float | None]


class QueueFullError(Exception):
    """More requests (or prompt tokens) are waiting than --max-queue (--max-queued-tokens) allows."""


@dataclass
class EngineOptions:
    config: SchedulerConfig
    # Named in UNAVAILABLE messages.
    executor_address: str = "in-process"
    max_queue: int | None = None
    # Prompt tokens of admitted requests that have not produced a token yet.
    max_queued_tokens: int | None = None
    # Idle probe of the executor, and reconnect backoff (seconds).
    heartbeat_s: float = 2.0
    backoff_min_s: float = 0.1
    backoff_max_s: float = 2.0
    # How long accepted requests wait for a lost executor before failing UNAVAILABLE (None: forever).
    recovery_timeout_s: float | None = 300.0

    def __post_init__(self) -> None:
        for name in ("max_queue", "max_queued_tokens"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be >= 0 (or None for no limit), got {value}")


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
        # Set by the engine thread when connected; read by the asyncio side.
        self.engine: LLMEngine | None = None
        self.tokenizer: Tokenizer | None = None
        self.streams = StreamTable(metrics)
        self._cond = threading.Condition()
        self._adds: list[Add] = []
        self._aborts: list[int] = []
        self._stopping = False
        self._admitting = True
        self._next_id = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        # Engine thread only below.
        self._arrivals: dict[int, float] = {}
        # Accepted requests kept while no executor is connected, by engine id.
        self._held: dict[int, Seq] = {}
        self._lost_at: float | None = None
        self._next_step_id = 1
        self._deadlines: list[tuple[float, int]] = []  # a heap of (deadline, engine id)
        self._last_connect_error: str | None = None

    # -- asyncio side ---------------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread.start()

    def stop_admitting(self) -> None:
        self._admitting = False

    def shutdown(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival: float,
        timeout: float | None = None,
    ) -> RequestStream:
        """Validate and queue; raises InvalidRequestError, QueueFullError or ExecutorUnavailable.
        `timeout`: seconds left until the call's deadline (None: no deadline)."""
        engine = self.engine
        if not self._admitting:
            raise ExecutorUnavailable("the scheduler is shutting down: send the request to another replica")
        if engine is None:
            raise ExecutorUnavailable(f"executor at {self.options.executor_address} is not connected")
        engine.validate_request(prompt_token_ids, params)
        self._check_queue(engine, len(prompt_token_ids))
        deadline = time.monotonic() + timeout if timeout is not None else None
        with self._cond:
            self._next_id += 1
            stream = RequestStream(request_id, self._next_id, len(prompt_token_ids), params, arrival)
            self.streams.add(stream)
            self._adds.append((stream.engine_id, prompt_token_ids, params, arrival, deadline))
            self._cond.notify()
        return stream

    def _check_queue(self, engine: LLMEngine, num_tokens: int) -> None:
        max_queue = self.options.max_queue
        if max_queue is not None:
            # Requests that will have to wait: beyond the free places in the running batch.
            scheduler = engine.scheduler
            free = engine.limits.max_num_seqs - len(scheduler.running)
            num_waiting = max(0, len(self._adds) + len(scheduler.waiting) - free)
            if num_waiting >= max_queue:
                raise QueueFullError(f"queue full: {num_waiting} requests waiting (--max-queue {max_queue})")
        max_tokens = self.options.max_queued_tokens
        if max_tokens is not None:
            if num_tokens > max_tokens:
                raise InvalidRequestError(
                    f"prompt ({num_tokens} tokens) exceeds --max-queued-tokens ({max_tokens})"
                )
            queued = self.streams.num_queued_tokens
            if queued + num_tokens > max_tokens:
                raise QueueFullError(
                    f"queue full: {queued} prompt tokens waiting + {num_tokens} would exceed "
                    f"--max-queued-tokens {max_tokens}"
                )

    def abort(self, stream: RequestStream) -> None:
        self.streams.remove(stream)
        with self._cond:
            self._aborts.append(stream.engine_id)
            self._cond.notify()

    def abort_all(self, failure: RequestFailure) -> int:
        """End every live stream with `failure` (shutdown timeout); returns how many."""
        streams = self.streams.drain()
        for stream in streams:
            stream.fail(failure)
        with self._cond:
            self._aborts.extend(s.engine_id for s in streams)
            self._cond.notify()
        return len(streams)

    # -- engine thread --------------------------------------------------------------------

    def _post(self, outputs: Sequence[RequestOutput], failures: Failures | None = None) -> None:
        if self._loop is not None and (outputs or failures):
            self._loop.call_soon_threadsafe(self.streams.dispatch, outputs, failures, time.perf_counter())

    def _run(self) -> None:
        delay = self.options.backoff_min_s
        while not self._stopping:
            if self.engine is None:
                self._while_lost()
                if not self._connect():
                    with self._cond:
                        self._cond.wait_for(lambda: self._stopping or self._aborts, self._backoff(delay))
                    delay = min(2 * delay, self.options.backoff_max_s)
                    continue
                delay = self.options.backoff_min_s
            engine = self.engine
            self._drain_inbox(engine)
            self._expire(engine)
            if engine.has_unfinished_requests() or engine.scheduler.has_finished_to_send():
                self._step(engine)
                continue
            with self._cond:
                woken = self._cond.wait_for(lambda: self._adds or self._stopping, self.options.heartbeat_s)
            if not woken:
                self._heartbeat()

    def _backoff(self, delay: float) -> float:
        """The reconnect delay, cut short by the next deadline of a kept request."""
        if self._deadlines:
            return max(0.0, min(delay, self._deadlines[0][0] - time.monotonic()))
        return delay

    def _connect(self) -> bool:
        try:
            engine = LLMEngine(self.executor, self.options.config, self._next_step_id)
            # A previous scheduler incarnation (or our own, before the executor was lost) may
            # have left sequences behind.
            self.executor.reset()
            tokenizer = self.tokenizer_for(engine.info)
        except Exception as e:
            # Once per distinct error: retries every few seconds would flood the log.
            log = logger.debug if str(e) == self._last_connect_error else logger.warning
            self._last_connect_error = str(e)
            log("executor at %s not connected: %s", self.options.executor_address, e)
            return False
        self._last_connect_error = None
        self.tokenizer = tokenizer
        failures: Failures = {}
        held = sorted(self._held.values(), key=lambda s: s.arrival)
        self._held = {}
        for seq in held:
            try:
                engine.adopt(seq)
            except ValueError as e:
                message = f"executor at {self.options.executor_address} came back with other limits: {e}"
                failures[seq.seq_id] = RequestFailure(grpc.StatusCode.UNAVAILABLE, message)
        if held:
            logger.warning(
                "executor at %s is back after %.1f s: re-running %d requests by recompute (%d failed)",
                self.options.executor_address,
                time.monotonic() - (self._lost_at or time.monotonic()),
                len(held) - len(failures),
                len(failures),
            )
        self._lost_at = None
        logger.info("connected to executor at %s: %s", self.options.executor_address, engine.info)
        self.metrics.reset_stats_baseline()
        self.metrics.executor_up.set(1)
        self.metrics.update_from_stats(engine.scheduler.stats)
        self.engine = engine
        self._set_health(True)
        self._post([], failures)
        return True

    def _lose_executor(self, engine: LLMEngine, reason: str) -> None:
        """Drop the engine but keep its requests (to recompute on the next executor)."""
        self.engine = None
        self.metrics.executor_up.set(0)
        self._set_health(False)
        self._next_step_id = engine.scheduler.next_step_id
        for seq in engine.scheduler.unfinished():
            seq.reset_for_recompute()
            self._held[seq.seq_id] = seq
        if self._lost_at is None:
            self._lost_at = time.monotonic()
        logger.error("%s; keeping %d requests until an executor is back", reason, len(self._held))
        metrics = self.metrics
        metrics.requests_running.set(0)
        metrics.requests_waiting.set(len(self._held))
        metrics.kv_blocks_used.set(0)
        metrics.kv_usage.set(0)

    def _while_lost(self) -> None:
        """Without an executor: aborts, deadlines, and the recovery timeout of kept requests."""
        with self._cond:
            aborts, self._aborts = self._aborts, []
        for engine_id in aborts:
            self._held.pop(engine_id, None)
            self._arrivals.pop(engine_id, None)
        failures: Failures = {}
        now = time.monotonic()
        while self._deadlines and self._deadlines[0][0] <= now:
            _, engine_id = heapq.heappop(self._deadlines)
            if self._held.pop(engine_id, None) is not None or self._remove_add(engine_id):
                failures[engine_id] = _expired("while the executor was unavailable")
        with self._cond:  # requests queued just before the loss have no heap entry yet
            expired = [a for a in self._adds if a[4] is not None and a[4] <= now]
            if expired:
                self._adds = [a for a in self._adds if a[4] is None or a[4] > now]
        for add in expired:
            failures[add[0]] = _expired("while the executor was unavailable")
        timeout = self.options.recovery_timeout_s
        if timeout is not None and self._lost_at is not None and now - self._lost_at >= timeout:
            with self._cond:
                ids = [a[0] for a in self._adds] + list(self._held)
                self._adds = []
            self._held = {}
            if ids:
                message = (
                    f"executor at {self.options.executor_address} has been unavailable for "
                    f"{now - self._lost_at:.0f} s (--executor-recovery-timeout {timeout:g})"
                )
                logger.error("%s: failing %d requests", message, len(ids))
                failures.update(dict.fromkeys(ids, RequestFailure(grpc.StatusCode.UNAVAILABLE, message)))
        self.metrics.requests_waiting.set(len(self._held))
        self._post([], failures)

    def _remove_add(self, engine_id: int) -> bool:
        with self._cond:
            for i, add in enumerate(self._adds):
                if add[0] == engine_id:
                    del self._adds[i]
                    return True
        return False

    def _set_health(self, serving: bool) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self.on_health, serving)

    def _heartbeat(self) -> None:
        engine = self.engine
        try:
            info = self.executor.describe()
        except Exception as e:
            self._lose_executor(engine, f"heartbeat failed: {e}")
            return
        if info != engine.info:  # restarted with other settings: our block accounting is void
            self._lose_executor(engine, f"executor at {self.options.executor_address} changed: {info}")

    def _drain_inbox(self, engine: LLMEngine) -> None:
        with self._cond:
            adds, self._adds = self._adds, []
            aborts, self._aborts = self._aborts, []
        failures: Failures = {}
        for engine_id, prompt, params, arrival, deadline in adds:
            try:
                engine.add_request(prompt, params, request_id=engine_id)
                self._arrivals[engine_id] = arrival
                if deadline is not None:
                    heapq.heappush(self._deadlines, (deadline, engine_id))
            except ValueError as e:  # the limits changed since the asyncio side validated
                failures[engine_id] = RequestFailure(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        for engine_id in aborts:
            engine.abort_request(engine_id)
            self._arrivals.pop(engine_id, None)
        if aborts:
            self.metrics.update_from_stats(engine.scheduler.stats)
        if failures:
            self._post([], failures)

    def _expire(self, engine: LLMEngine) -> None:
        """Drop requests past their gRPC deadline (freeing their blocks): DEADLINE_EXCEEDED."""
        deadlines = self._deadlines
        if not deadlines:
            return
        now = time.monotonic()
        seqs = engine.scheduler.seqs
        failures: Failures = {}
        while deadlines and deadlines[0][0] <= now:
            _, engine_id = heapq.heappop(deadlines)
            seq = seqs.get(engine_id)
            if seq is not None and engine.abort_request(engine_id):
                self._arrivals.pop(engine_id, None)
                where = "while queued" if seq.num_output_tokens == 0 else "while generating"
                failures[engine_id] = _expired(where)
        # Entries of requests that finished long before their deadline: drop them now and then.
        if len(deadlines) > 1024 and len(deadlines) > 4 * len(seqs):
            self._deadlines = [d for d in deadlines if d[1] in seqs]
            heapq.heapify(self._deadlines)
        if failures:
            self.metrics.update_from_stats(engine.scheduler.stats)
            self._post([], failures)

    def _step(self, engine: LLMEngine) -> None:
        try:
            outputs = engine.step()
        except (PlanRejected, ValueError) as e:
            # The executor refused this plan and changed no state: fail only its requests.
            self._fail_plan(engine, e)
            self.metrics.update_from_stats(engine.scheduler.stats)
            return
        except ExecutorUnavailable as e:
            self._lose_executor(engine, str(e))
            return
        except Exception as e:
            # The executor's state (or ours) is unknown: fail this plan's requests (one of them
            # may be what broke the step), keep the others and start over from a reset.
            if not isinstance(e, ExecutorError):
                logger.exception("engine step failed")
            self._fail_plan(engine, e)
            self._lose_executor(engine, f"engine step failed: {e}")
            return
        self._record_step(engine)
        self._post(outputs)

    def _fail_plan(self, engine: LLMEngine, error: Exception) -> None:
        plan = engine.last_plan
        if plan is None:
            return
        failed = engine.fail_requests(plan.seq_ids, str(error))
        logger.error("step %d failed (%s); failed its %d requests", plan.step_id, error, len(failed))
        failure = RequestFailure(grpc.StatusCode.INTERNAL, str(error))
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
            now = time.perf_counter()
            for new in plan.new_seqs:
                arrival = self._arrivals.pop(new.seq_id, None)
                if arrival is not None:
                    metrics.queue_time.observe(now - arrival)


def _expired(where: str) -> RequestFailure:
    return RequestFailure(grpc.StatusCode.DEADLINE_EXCEEDED, f"the request's deadline passed {where}")
