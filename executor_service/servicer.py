"""ExecutorService's RPCs (Describe, the Step stream, Reset) over one executor, and their method
handlers, whose request deserializers turn undecodable bytes into INVALID_ARGUMENT.

Reset and Step belong to the executor's owner (ownership.py: FAILED_PRECONDITION for anyone
else); Describe is open. On a Step stream step ids must increase (INVALID_ARGUMENT otherwise):
a repeated or older plan is a replay or a second writer, never the scheduler's."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Protocol

import grpc

from executor_service.executor_thread import ExecutorThread
from executor_service.metrics import ExecutorMetrics
from executor_service.ownership import LogThrottle, NotOwner, Ownership, Session, TooManyStreams, session_of
from executor_service.plan_validation import (
    HELD_SEQS_PER_BATCH_SEQ,
    PlanError,
    StepOrderError,
    check_num_new_seqs,
    check_step_order,
)
from executor_service.steps_in_flight import END, StreamSteps
from protos.executor import Executor
from protos.parsing import MalformedMessage, deserializer
from protos.plan import StepPlan, StepResult, info_to_proto, plan_from_proto, result_to_proto
from protos.tandem.v1 import executor_pb2 as pb
from protos.tandem.v1 import executor_pb2_grpc as pb_grpc


class ServedExecutor(Executor, Protocol):
    """What the servicer needs of its executor beyond protos.executor.Executor (LocalExecutor and
    the test fakes declare all of it). `overlaps_steps`: a step sent behind a running one overlaps
    it, so the Step handler launches each plan as it arrives; `ready()`: the oldest step sent is
    done; `tp_size`: ranks behind it; `failed_ranks()`: (rank, exit code) of ranks 1.. that
    exited; `num_graph_steps`: steps replayed from a CUDA graph; `seqs`: the sequences held;
    `device_timeline`: its device's time in steps and between them (device_timeline.py), or None."""

    overlaps_steps: bool
    tp_size: int
    seqs: dict
    device_timeline: object | None

    @property
    def num_graph_steps(self) -> int: ...

    def ready(self) -> bool: ...

    def failed_ranks(self) -> list[tuple[int, int | None]]: ...


logger = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["ExecutorService"].full_name
# A diagnostic: log each wait of the device for a plan of at least this many milliseconds (the
# tandem_executor_idle_seconds histogram counts them; this says which steps they came before).
LOG_IDLE_MS_ENV = "TANDEM_LOG_IDLE_MS"


def _refuse_malformed(message: object, context: grpc.ServicerContext) -> None:
    if isinstance(message, MalformedMessage):
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, message.error)


class _Refusal(Exception):
    """A plan the stream refuses before it reaches the executor: the status to end the stream with."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class _StreamAdmission:
    """What a Step stream lets through to the executor: well-formed plans of the executor's owner,
    with step ids that increase (they continue across reconnects, so only within a stream), and no
    more new sequences than the executor may hold (`max_held_seqs`: refused before they are read)."""

    def __init__(
        self,
        ownership: Ownership,
        session: Session,
        resets: Callable[[], int],
        resets_at_open: int,
        max_held_seqs: int,
    ) -> None:
        self._ownership = ownership
        self._session = session
        self._max_held_seqs = max_held_seqs
        self._last_step_id: int | None = None
        # The executor's resets so far, and when the stream opened: a plan after another is stale.
        self._resets = resets
        self._resets_at_open = resets_at_open

    def admit(self, msg: object) -> StepPlan:
        """The plan in `msg`, or _Refusal."""
        if isinstance(msg, MalformedMessage):
            raise _Refusal(grpc.StatusCode.INVALID_ARGUMENT, msg.error)
        try:
            check_step_order(msg.step_id, self._last_step_id)
            self._ownership.check_plan(self._session, msg.step_id)
            check_num_new_seqs(msg.step_id, len(msg.new_seqs), self._max_held_seqs)
        except PlanError as e:
            raise _Refusal(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        except NotOwner as e:
            raise _Refusal(grpc.StatusCode.FAILED_PRECONDITION, str(e)) from None
        self._last_step_id = msg.step_id
        return plan_from_proto(msg)

    def recheck(self, step_id: int) -> None:
        """Under the executor lock, just before the plan runs: the owner may have changed while it
        waited (a Reset that took the executor over runs between the two), and a Reset since the
        stream opened makes its plans stale: a scheduler resets only after closing its stream, and
        a plan read before the stream's cancellation was seen must not run on the reset state."""
        try:
            self._ownership.check_plan(self._session, step_id)
        except NotOwner as e:
            raise _Refusal(grpc.StatusCode.FAILED_PRECONDITION, str(e)) from None
        if self._resets() != self._resets_at_open:
            raise _Refusal(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"step {step_id} refused: the executor was reset after its Step stream opened "
                "(open a new stream for the plans after a Reset)",
            )


class ExecutorServicer(pb_grpc.ExecutorServiceServicer):
    """ExecutorService over one executor; steps from any number of streams are serialised.

    Every call into the executor (loading included) runs on its own thread (executor_thread.py)."""

    def __init__(self, metrics: ExecutorMetrics, ownership: Ownership | None = None) -> None:
        self.executor: ServedExecutor | None = None
        self.metrics = metrics
        self.ownership = ownership if ownership is not None else Ownership()
        self._lock = threading.Lock()
        # Resets and Releases so far (each drops every sequence), counted under _lock.
        self._num_resets = 0
        # Held by the Step stream that has steps in flight: another waits until they are answered.
        self._in_flight_lock = threading.Lock()
        self._closed = False
        self._worker = ExecutorThread("executor-step")
        self._log_refusal = LogThrottle()
        log_idle_ms = os.environ.get(LOG_IDLE_MS_ENV)
        self._log_idle_s = float(log_idle_ms) / 1e3 if log_idle_ms else None

    def run_on_worker(self, fn, *args):
        """fn(*args) on the executor's own thread; returns its result or raises its exception."""
        return self._worker.run(fn, *args)

    def submit_to_worker(self, fn, *args) -> Future:
        """fn(*args) on the executor's own thread, without waiting for it."""
        return self._worker.submit(fn, *args)

    def close(self, timeout: float) -> None:
        """Refuse further steps, and let the running step finish (up to `timeout`)."""
        # Closed first: a plan that arrives while the running step finishes is refused, even if
        # its stream takes the lock before this thread does (a lock is not fair).
        self._closed = True
        # threading's longest wait (~292 years): past it acquire() raised OverflowError (--grace 1e10).
        acquired = self._lock.acquire(timeout=min(timeout, threading.TIMEOUT_MAX))
        if acquired:
            self._lock.release()
        else:
            logger.warning("a step still runs after %.1f s; stopping anyway", timeout)

    def _executor(self, context: grpc.ServicerContext) -> ServedExecutor:
        if self._closed:
            context.abort(grpc.StatusCode.UNAVAILABLE, "the executor is shutting down")
        if self.executor is None:
            context.abort(grpc.StatusCode.UNAVAILABLE, "the executor is still loading its model")
        return self.executor

    def Describe(self, request: pb.DescribeRequest, context: grpc.ServicerContext) -> pb.DescribeResponse:
        _refuse_malformed(request, context)
        self.ownership.touch(session_of(context))
        return info_to_proto(self.run_on_worker(self._executor(context).describe))

    def Step(
        self, request_iterator: Iterator[pb.StepPlan], context: grpc.ServicerContext
    ) -> Iterator[pb.StepResult]:
        """Plans in, results out in plan order. A plan is launched as it arrives, while the step
        before it may still run on the device (two in flight: steps_in_flight.py)."""
        executor = self._executor(context)
        session = session_of(context)
        try:
            self.ownership.open_stream(session)
        except NotOwner as e:  # (a step refused as its stream opens counts as one refused later)
            self._refuse(_Refusal(grpc.StatusCode.FAILED_PRECONDITION, str(e)), context)
        except TooManyStreams as e:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        resets_at_open = self._num_resets
        try:
            max_held_seqs = HELD_SEQS_PER_BATCH_SEQ * self.run_on_worker(executor.describe).max_num_seqs
            admission = _StreamAdmission(
                self.ownership, session, lambda: self._num_resets, resets_at_open, max_held_seqs
            )
            if executor.overlaps_steps:
                yield from self._step_overlapped(executor, request_iterator, admission, context)
            else:
                yield from self._step_one_at_a_time(request_iterator, admission, context)
        finally:
            self.ownership.close_stream(session)

    def _refuse(self, refusal: _Refusal, context: grpc.ServicerContext) -> None:
        self.metrics.step_failed(refusal.code.name)
        context.abort(refusal.code, refusal.message)

    def _step_overlapped(
        self,
        executor: ServedExecutor,
        request_iterator: Iterator[pb.StepPlan],
        admission: _StreamAdmission,
        context: grpc.ServicerContext,
    ) -> Iterator[pb.StepResult]:
        in_flight = StreamSteps(request_iterator, self._in_flight_lock)
        try:
            while True:
                msg = in_flight.next_request(executor.ready)
                if msg is None:  # the oldest step is done, or two are out
                    yield self._receive(executor, in_flight, admission, context)
                    continue
                if msg is END:
                    break
                try:
                    plan = admission.admit(msg)
                except _Refusal as refusal:
                    while in_flight:  # answer what ran, then refuse
                        yield self._receive(executor, in_flight, admission, context)
                    self._refuse(refusal, context)
                if not context.is_active():  # cancelled: a plan read ahead is not launched
                    break
                if self._closed:  # answer the steps that ran, then refuse
                    while in_flight:
                        yield self._receive(executor, in_flight, admission, context)
                    context.abort(grpc.StatusCode.UNAVAILABLE, "the executor is shutting down")
                # Waits, outside the executor lock, while another stream has steps in flight.
                idle = in_flight.sending(plan, _num_graph_steps(executor))
                if idle is not None:
                    self.metrics.idle.observe(idle)
                    if self._log_idle_s is not None and idle >= self._log_idle_s:
                        logger.info(
                            "device idle %.2f ms before step %d: %d sequences (%d new, %d finished), %d tokens",
                            idle * 1e3, plan.step_id, len(plan.seq_ids), len(plan.new_seqs),
                            len(plan.finished_seq_ids), sum(plan.num_scheduled_tokens),
                        )  # fmt: skip
                with self._lock:
                    if self._closed:  # (closed since: what is in flight is discarded)
                        context.abort(grpc.StatusCode.UNAVAILABLE, "the executor is shutting down")
                    if not context.is_active():  # cancelled while it waited (a Reset may have run)
                        return  # not sent, nothing more answered; `finally` discards what was
                    try:
                        admission.recheck(plan.step_id)
                    except _Refusal as refusal:  # `finally` discards what was not answered
                        self._refuse(refusal, context)
                    if len(in_flight) < 2:
                        self.run_on_worker(executor.send, plan)
                        continue
                    # Two in flight: the oldest is answered next, so the worker receives it right
                    # after the launch, in the same hand-off (one round trip to it per step).
                    oldest = in_flight.oldest().plan
                    send_error, result = self._run_step(_send_then_receive(executor, plan), oldest, context)
                if send_error is not None:
                    raise send_error
                yield self._answered(executor, in_flight, oldest, result)
            while in_flight:
                yield self._receive(executor, in_flight, admission, context)
        finally:
            if in_flight:  # the stream broke or a step failed: forget what was not answered
                try:
                    with self._lock:
                        self.run_on_worker(executor.discard)
                finally:
                    in_flight.clear()

    def _receive(
        self,
        executor: ServedExecutor,
        in_flight: StreamSteps,
        admission: _StreamAdmission,
        context: grpc.ServicerContext,
    ) -> pb.StepResult:
        plan = in_flight.oldest().plan
        with self._lock:
            try:  # a Reset since the stream opened dropped the step (`finally` discards the rest)
                admission.recheck(plan.step_id)
            except _Refusal as refusal:
                self._refuse(refusal, context)
            result = self._run_step(executor.receive, plan, context)
        return self._answered(executor, in_flight, plan, result)

    def _answered(
        self, executor: ServedExecutor, in_flight: StreamSteps, plan: StepPlan, result: StepResult
    ) -> pb.StepResult:
        """The oldest step's result, just received, as the stream's answer."""
        step, seconds = in_flight.answered()
        self.metrics.observe_step(plan, seconds, _num_graph_steps(executor) > step.num_graph_steps)
        timeline = executor.device_timeline
        if timeline is not None:
            self.metrics.observe_device(*timeline.take())
        return result_to_proto(result)

    def _run_step(self, fn, plan: StepPlan, context: grpc.ServicerContext):
        """fn(plan) on the worker; a refused plan aborts the stream with INVALID_ARGUMENT, any
        other failure with INTERNAL."""
        try:
            return self.run_on_worker(fn, plan)
        except PlanError as e:
            self.metrics.step_failed("INVALID_ARGUMENT")
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except Exception as e:
            # (An out-of-order receive, as after a Reset between a stream's steps, is no rank's.)
            if not isinstance(e, StepOrderError) and (dead := self._dead_ranks()):
                # Not this plan's fault: the group lost a rank (the serve loop takes the executor
                # down). UNAVAILABLE, so that the scheduler keeps the requests for the next executor.
                logger.error(
                    "step %d failed: tensor-parallel rank(s) died (rank, exit code): %s", plan.step_id, dead
                )
                self.metrics.step_failed("UNAVAILABLE")
                context.abort(
                    grpc.StatusCode.UNAVAILABLE,
                    f"step {plan.step_id} failed: tensor-parallel rank(s) {[r for r, _ in dead]} died; "
                    "the executor is going down",
                )
            logger.exception("step %d failed", plan.step_id)
            self.metrics.step_failed("INTERNAL")
            context.abort(grpc.StatusCode.INTERNAL, f"step {plan.step_id} failed: {type(e).__name__}: {e}")

    def _dead_ranks(self, wait: float = 2.0) -> list[tuple[int, int | None]]:
        """The ranks that exited; a collective can fail a moment before its peer's exit is seen."""
        executor = self.executor
        if executor.tp_size == 1:
            return []
        deadline = time.monotonic() + wait
        while not (dead := executor.failed_ranks()) and time.monotonic() < deadline:
            time.sleep(0.05)
        return dead

    def _step_one_at_a_time(
        self,
        request_iterator: Iterator[pb.StepPlan],
        admission: _StreamAdmission,
        context: grpc.ServicerContext,
    ) -> Iterator[pb.StepResult]:
        for msg in request_iterator:
            try:
                plan = admission.admit(msg)
            except _Refusal as refusal:
                self._refuse(refusal, context)
            with self._lock:
                # A stream cancelled while this plan waited for the lock (the scheduler gave up on
                # it, and may have called Reset since) must not run it on the reset state.
                if not context.is_active():
                    return
                try:
                    admission.recheck(plan.step_id)
                except _Refusal as refusal:
                    self._refuse(refusal, context)
                executor = self._executor(context)
                graph_steps = _num_graph_steps(executor)
                t0 = time.perf_counter()
                result = self._run_step(executor.step, plan, context)
                seconds = time.perf_counter() - t0
                self.metrics.observe_step(plan, seconds, _num_graph_steps(executor) > graph_steps)
            yield result_to_proto(result)

    def Reset(self, request: pb.ResetRequest, context: grpc.ServicerContext) -> pb.ResetResponse:
        _refuse_malformed(request, context)
        executor = self._executor(context)
        session = session_of(context)
        try:
            self.ownership.claim(session)
        except NotOwner as e:
            if self._log_refusal(session.name):
                logger.warning("%s (logged once a minute per caller)", e)
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        with self._lock:
            dropped = self.run_on_worker(executor.reset)
            self._num_resets += 1
        logger.info("reset by %s: dropped %d sequences", session, dropped)
        return pb.ResetResponse(num_dropped_seqs=dropped)

    def Release(self, request: pb.ReleaseRequest, context: grpc.ServicerContext) -> pb.ReleaseResponse:
        _refuse_malformed(request, context)
        executor = self._executor(context)
        session = session_of(context)
        # What the owner left behind is dropped: the next owner starts from an empty executor. Under
        # the lock, behind the step that may still run: released before, the executor could be
        # claimed meanwhile, and the drop would take the next owner's sequences.
        with self._lock:
            if not self.ownership.release(session):
                return pb.ReleaseResponse(released=False)
            dropped = self.run_on_worker(executor.reset)
            self._num_resets += 1
        logger.info("released by %s: dropped %d sequences", session, dropped)
        return pb.ReleaseResponse(released=True)


def executor_handler(servicer: ExecutorServicer) -> grpc.GenericRpcHandler:
    """ExecutorService's methods, with deserializers that turn undecodable bytes into
    INVALID_ARGUMENT."""
    return grpc.method_handlers_generic_handler(
        SERVICE_NAME,
        {
            "Describe": grpc.unary_unary_rpc_method_handler(
                servicer.Describe,
                request_deserializer=deserializer(pb.DescribeRequest),
                response_serializer=pb.DescribeResponse.SerializeToString,
            ),
            "Step": grpc.stream_stream_rpc_method_handler(
                servicer.Step,
                request_deserializer=deserializer(pb.StepPlan),
                response_serializer=pb.StepResult.SerializeToString,
            ),
            "Reset": grpc.unary_unary_rpc_method_handler(
                servicer.Reset,
                request_deserializer=deserializer(pb.ResetRequest),
                response_serializer=pb.ResetResponse.SerializeToString,
            ),
            "Release": grpc.unary_unary_rpc_method_handler(
                servicer.Release,
                request_deserializer=deserializer(pb.ReleaseRequest),
                response_serializer=pb.ReleaseResponse.SerializeToString,
            ),
        },
    )


def _send_then_receive(executor: ServedExecutor, plan: StepPlan):
    """fn(oldest) for the worker: send `plan`, then receive `oldest`. A send that raises (it
    records a refused plan's error for its receive instead) is returned as (error, None), so that
    it leaves the stream as it would alone; otherwise (None, the oldest's result)."""

    def send_then_receive(oldest: StepPlan) -> tuple[BaseException | None, StepResult | None]:
        try:
            executor.send(plan)
        except Exception as e:
            return e, None
        return None, executor.receive(oldest)

    return send_then_receive


def _num_graph_steps(executor: ServedExecutor) -> int:
    """Steps the model runner replayed from a CUDA graph (0 for executors without one)."""
    return executor.num_graph_steps
