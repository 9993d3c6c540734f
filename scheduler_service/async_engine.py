"""The engine thread: a synchronous LLMEngine stepping in its own thread.

Requests and aborts arrive through a thread-safe inbox; each step's outputs go to the asyncio
side in one batch (one `call_soon_threadsafe` per step). The loop never waits on a client:
streams pick up whatever accumulated whenever they are ready to write.
"""

from __future__ import annotations

import asyncio
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
from scheduler_service.sampling_params import SamplingParams
from scheduler_service.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

Failures = dict[int, RequestFailure]


class QueueFullError(Exception):
    """More requests are waiting than --max-queue allows."""


@dataclass
class EngineOptions:
    config: SchedulerConfig
    # Named in UNAVAILABLE messages.
    executor_address: str = "in-process"
    max_queue: int | None = None
    # Idle probe of the executor, and reconnect backoff (seconds).
    heartbeat_s: float = 2.0
    backoff_min_s: float = 0.1
    backoff_max_s: float = 5.0


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
        self._adds: list[tuple[int, list[int], SamplingParams, float]] = []
        self._aborts: list[int] = []
        self._arrivals: dict[int, float] = {}
        self._stopping = False
        self._admitting = True
        self._last_connect_error: str | None = None
        self._next_id = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)

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
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, arrival: float
    ) -> RequestStream:
        """Validate and queue; raises InvalidRequestError, QueueFullError or ExecutorUnavailable."""
        engine = self.engine
        if not self._admitting:
            raise ExecutorUnavailable("the scheduler is shutting down")
        if engine is None:
            raise ExecutorUnavailable(f"executor at {self.options.executor_address} is not connected")
        engine.validate_request(prompt_token_ids, params)
        max_queue = self.options.max_queue
        with self._cond:
            if max_queue is not None:
                # Requests that will have to wait: beyond the free places in the running batch.
                scheduler = engine.scheduler
                free = engine.limits.max_num_seqs - len(scheduler.running)
                num_waiting = max(0, len(self._adds) + len(scheduler.waiting) - free)
                if num_waiting >= max_queue:
                    raise QueueFullError(
                        f"queue full: {num_waiting} requests waiting (--max-queue {max_queue})"
                    )
            self._next_id += 1
            stream = RequestStream(request_id, self._next_id, len(prompt_token_ids), params, arrival)
            self.streams.add(stream)
            self._adds.append((stream.engine_id, prompt_token_ids, params, arrival))
            self._cond.notify()
        return stream

    def abort(self, stream: RequestStream) -> None:
        self.streams.remove(stream)
        with self._cond:
            self._aborts.append(stream.engine_id)
            self._cond.notify()

    # -- engine thread --------------------------------------------------------------------

    def _post(self, outputs: Sequence[RequestOutput], failures: Failures | None = None) -> None:
        if self._loop is not None and (outputs or failures):
            self._loop.call_soon_threadsafe(self.streams.dispatch, outputs, failures, time.perf_counter())

    def _run(self) -> None:
        delay = self.options.backoff_min_s
        while not self._stopping:
            if self.engine is None:
                if not self._connect():
                    with self._cond:
                        self._cond.wait_for(lambda: self._stopping, delay)
                    delay = min(2 * delay, self.options.backoff_max_s)
                    continue
                delay = self.options.backoff_min_s
            self._drain_inbox(self.engine)
            if self.engine.has_unfinished_requests():
                self._step(self.engine)
                continue
            with self._cond:
                woken = self._cond.wait_for(lambda: self._adds or self._stopping, self.options.heartbeat_s)
            if not woken:
                self._heartbeat()

    def _connect(self) -> bool:
        try:
            engine = LLMEngine(self.executor, self.options.config)
            # A previous scheduler incarnation may have left sequences behind.
            self.executor.reset()
            self.tokenizer = self.tokenizer_for(engine.info)
        except Exception as e:
            # Once per distinct error: retries every few seconds would flood the log.
            log = logger.debug if str(e) == self._last_connect_error else logger.warning
            self._last_connect_error = str(e)
            log("executor at %s not connected: %s", self.options.executor_address, e)
            return False
        self._last_connect_error = None
        logger.info("connected to executor at %s: %s", self.options.executor_address, engine.info)
        self.metrics.reset_stats_baseline()
        self.metrics.executor_up.set(1)
        self.metrics.update_from_stats(engine.scheduler.stats)
        self.engine = engine
        self._set_health(True)
        return True

    def _disconnect(self, failure: RequestFailure) -> None:
        """Drop the engine: fail every request it holds and every queued one, then reconnect."""
        engine = self.engine
        self.engine = None
        self.metrics.executor_up.set(0)
        self._set_health(False)
        with self._cond:
            adds, self._adds, self._aborts = self._adds, [], []
        ids = [a[0] for a in adds] + (list(engine.scheduler.seqs) if engine is not None else [])
        self._arrivals.clear()
        logger.error("%s; failing %d requests", failure.message, len(ids))
        self._post([], dict.fromkeys(ids, failure))

    def _set_health(self, serving: bool) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self.on_health, serving)

    def _heartbeat(self) -> None:
        try:
            info = self.executor.describe()
        except Exception as e:
            self._disconnect(RequestFailure(grpc.StatusCode.UNAVAILABLE, str(e)))
            return
        if info != self.engine.info:  # restarted with other settings: our block tables are void
            message = f"executor at {self.options.executor_address} changed: {info}"
            self._disconnect(RequestFailure(grpc.StatusCode.UNAVAILABLE, message))

    def _drain_inbox(self, engine: LLMEngine) -> None:
        with self._cond:
            adds, self._adds = self._adds, []
            aborts, self._aborts = self._aborts, []
        failures: Failures = {}
        for engine_id, prompt, params, arrival in adds:
            try:
                engine.add_request(prompt, params, request_id=engine_id)
                self._arrivals[engine_id] = arrival
            except ValueError as e:  # the limits changed since the asyncio side validated
                failures[engine_id] = RequestFailure(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        for engine_id in aborts:
            engine.abort_request(engine_id)
            self._arrivals.pop(engine_id, None)
        if aborts:
            self.metrics.update_from_stats(engine.scheduler.stats)
        if failures:
            self._post([], failures)

    def _step(self, engine: LLMEngine) -> None:
        try:
            outputs = engine.step()
        except (PlanRejected, ValueError) as e:
            # The executor refused this plan and changed no state: fail only its requests.
            plan = engine.last_plan
            failed = engine.fail_requests(plan.seq_ids, str(e))
            logger.error("step %d rejected (%s); failed %d requests", plan.step_id, e, len(failed))
            failure = RequestFailure(grpc.StatusCode.INTERNAL, str(e))
            self._post([], {out.request_id: failure for out in failed})
            self.metrics.update_from_stats(engine.scheduler.stats)
            return
        except ExecutorUnavailable as e:
            self._disconnect(RequestFailure(grpc.StatusCode.UNAVAILABLE, str(e)))
            return
        except Exception as e:
            # The executor's state (or ours) is unknown: start over from a reset.
            if not isinstance(e, ExecutorError):
                logger.exception("engine step failed")
            self._disconnect(RequestFailure(grpc.StatusCode.INTERNAL, f"engine step failed: {e}"))
            return
        self._record_step(engine)
        self._post(outputs)

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
