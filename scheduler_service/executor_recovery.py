"""The engine thread's executor connection: connect, heartbeat, loss and recovery by recompute.

When the executor is lost (its process died, the stream broke, it restarted with other
settings), every accepted request is kept: the engine goes NOT_SERVING, reconnects with
backoff, and on a new executor calls Describe and Reset, builds a new scheduler for the new
capacity and re-runs the kept requests by recompute (prompt + tokens already streamed, sent as
one NewSequence). Their streams carry on where they stopped; no token is sent twice. A kept
request ends with DEADLINE_EXCEEDED at its deadline, or with UNAVAILABLE after
`recovery_timeout_s` without an executor.

An executor that another scheduler owns (FAILED_PRECONDITION on Reset, naming the owner;
executor_service/ownership.py) is treated as one that is away: this scheduler stays NOT_SERVING,
logs the owner, and retries with backoff until the owner is gone, at start as after a loss. So
two schedulers pointed at one executor never both serve, and a replacement scheduler takes over
as soon as the old one's stream has closed and its lease has run out.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from protos.plan import ExecutorInfo
from scheduler_service.config import EngineOptions
from scheduler_service.engine import Executor, LLMEngine
from scheduler_service.errors import ErrorCode, TandemRequestError
from scheduler_service.executor_client import ExecutorOwned
from scheduler_service.metrics import SchedulerMetrics
from scheduler_service.request_tracker import Failures, RequestTracker, some
from scheduler_service.sequence import Sequence as Seq
from scheduler_service.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class ExecutorRecovery:
    """Holds the LLMEngine while an executor is connected, and the accepted requests while not.
    Engine thread only, but for `engine` and `tokenizer`, which the asyncio side reads."""

    def __init__(
        self,
        executor: Executor,
        options: EngineOptions,
        metrics: SchedulerMetrics,
        tracker: RequestTracker,
        set_health: Callable[[bool], None],
    ) -> None:
        self.executor = executor
        self.options = options
        self.metrics = metrics
        self.tracker = tracker
        self.set_health = set_health
        self.engine: LLMEngine | None = None
        self.tokenizer: Tokenizer | None = None
        # Accepted requests kept while no executor is connected, by engine id.
        self.held: dict[int, Seq] = {}
        self._lost_at: float | None = None
        self._next_step_id = 1
        self._last_connect_error: str | None = None

    def connect(self, tokenizer_for: Callable[[ExecutorInfo], Tokenizer | None]) -> bool:
        try:
            engine = LLMEngine(self.executor, self.options.config, self._next_step_id)
            # A previous scheduler incarnation (or our own, before the executor was lost) may
            # have left sequences behind.
            self.executor.reset()
            tokenizer = tokenizer_for(engine.info)
        except Exception as e:
            # Once per distinct error: retries every few seconds would flood the log.
            log = logger.debug if str(e) == self._last_connect_error else logger.warning
            self._last_connect_error = str(e)
            if isinstance(e, ExecutorOwned):
                log("another scheduler owns the executor; retrying until it is released: %s", e)
            else:
                log("executor at %s not connected: %s", self.options.executor_address, e)
            return False
        self._last_connect_error = None
        self.tokenizer = tokenizer
        failures: Failures = {}
        held = sorted(self.held.values(), key=lambda s: s.arrival)
        self.held = {}
        for seq in held:
            try:
                engine.adopt(seq)
            except ValueError as e:
                message = f"executor at {self.options.executor_address} came back with other limits: {e}"
                failures[seq.seq_id] = TandemRequestError(message, ErrorCode.UNAVAILABLE)
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
        self.metrics.set_executor(engine.info, engine.limits.max_model_len)
        self.metrics.update_from_stats(engine.scheduler.stats)
        self.engine = engine
        self.set_health(True)
        self.tracker.post([], failures)
        return True

    def not_connected_message(self) -> str:
        """For UNAVAILABLE while no executor is connected: why, when a connect attempt said."""
        message = f"executor at {self.options.executor_address} is not connected"
        return f"{message} ({self._last_connect_error})" if self._last_connect_error else message

    def lose(self, engine: LLMEngine, reason: str) -> None:
        """Drop the engine but keep its requests (to recompute on the next executor)."""
        self.engine = None
        # What its last plans counted (admissions, preemptions) before the gauges go to zero.
        self.metrics.update_from_stats(engine.scheduler.stats)
        self.metrics.executor_up.set(0)
        self.set_health(False)
        # Plans of the dropped engine may still be in flight (a result it could not apply):
        # forget them now (RemoteExecutor closes their Step stream), or one could run after the
        # Reset of the next connect and its error or result would be taken for a new plan's.
        try:
            self.executor.discard()
        except Exception:
            logger.exception("discarding the plans in flight failed")
        self._next_step_id = engine.scheduler.next_step_id
        for seq in engine.scheduler.unfinished():
            seq.reset_for_recompute()
            self.held[seq.seq_id] = seq
        if self._lost_at is None:
            self._lost_at = time.monotonic()
        logger.error(
            "%s; keeping %d requests until an executor is back: %s",
            reason,
            len(self.held),
            some([seq.name for seq in self.held.values()]),
        )
        self.metrics.executor_lost(len(self.held))

    def heartbeat(self) -> None:
        """Idle probe: lose the executor if it does not answer or came back changed."""
        engine = self.engine
        try:
            info = self.executor.describe()
        except Exception as e:
            self.lose(engine, f"heartbeat failed: {e}")
            return
        if info != engine.info:  # restarted with other settings: our block accounting is void
            self.lose(engine, f"executor at {self.options.executor_address} changed: {info}")

    def while_lost(self) -> None:
        """Without an executor: aborts, deadlines, and the recovery timeout of kept requests."""
        tracker = self.tracker
        tracker.drop_aborted(self.held)
        now = time.monotonic()
        failures = tracker.expire_held(self.held, now)
        timeout = self.options.recovery_timeout_s
        if timeout is not None and self._lost_at is not None and now - self._lost_at >= timeout:
            ids = tracker.take_adds() + list(self.held)
            self.held = {}
            if ids:
                message = (
                    f"executor at {self.options.executor_address} has been unavailable for "
                    f"{now - self._lost_at:.0f} s (--executor-recovery-timeout {timeout:g})"
                )
                logger.error("%s: failing %d requests", message, len(ids))
                failures.update(dict.fromkeys(ids, TandemRequestError(message, ErrorCode.UNAVAILABLE)))
        self.metrics.requests_waiting.set(len(self.held))
        tracker.post([], failures)
