"""RemoteExecutor: the Executor protocol over gRPC, one long-lived Step stream (torch-free).

Every call carries this scheduler's session (protos/session.py: a random id drawn per
RemoteExecutor, and a name such as `scheduler 0.0.0.0:50051 on host-1 pid 42`), by which the
executor knows its owner, and the executor's API key when one is given. An executor that
another session owns answers FAILED_PRECONDITION naming it: ExecutorOwned, an
ExecutorUnavailable, so that the engine keeps its requests and retries as for an executor away."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from pathlib import Path

import grpc
from google.protobuf.message import DecodeError
from grpc._common import CYGRPC_STATUS_CODE_TO_STATUS_CODE as _STATUS_CODES
from grpc._cython import cygrpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos.api_keys import bearer_metadata
from protos.defaults import MAX_MESSAGE_BYTES, read_pem
from protos.plan import ExecutorInfo, StepPlan, StepResult, info_from_proto, plan_to_proto, result_from_proto
from protos.session import default_owner_name, new_session_id, session_metadata
from protos.tandem.v1 import executor_pb2 as pb
from protos.tandem.v1 import executor_pb2_grpc as pb_grpc
from scheduler_service.steps_in_flight import ResultDeadline

logger = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["ExecutorService"].full_name
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # Notice an executor host that vanished without closing the connection within ~40 s,
    # even while the Step stream idles.
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.max_pings_without_data", 0),
    # Reconnect within ~2 s of an executor (re)starting, not after grpc's default of up to 120 s.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2_000),
]
_UNAVAILABLE_CODES = (
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.DEADLINE_EXCEEDED,
)
_STEP_METHOD = f"/{SERVICE_NAME}/Step".encode()
# The tags of a Step call's sends and reads (_StepStream).
_SENT, _RECEIVED = object(), object()
_RECEIVE_MESSAGE = cygrpc.OperationType.receive_message
_RECEIVE_STATUS = cygrpc.OperationType.receive_status_on_client
# The default of --executor-step-timeout: the longest a step's result may be awaited before the
# executor is taken for hung. A decode step takes milliseconds and the largest prefill chunk well
# under a second on a GPU; a stopped process (SIGSTOP) or a wedged device would otherwise be
# noticed only by keepalive (about 40-60 s).
DEFAULT_STEP_TIMEOUT_S = 10.0
# How often the watchdog looks at the result awaited.
_WATCHDOG_POLL_S = 0.1


class ExecutorError(Exception):
    """The executor failed a call (base class of the errors below)."""


class ExecutorUnavailable(ExecutorError):
    """The executor cannot be reached, is not ready, or the stream broke."""


class ExecutorOwned(ExecutorUnavailable):
    """Another scheduler owns the executor (FAILED_PRECONDITION); the message names it."""


class PlanRejected(ExecutorError):
    """The executor refused a plan (INVALID_ARGUMENT); its state is unchanged."""

    def __init__(self, address: str, step_id: int, message: str) -> None:
        super().__init__(f"executor at {address} rejected step {step_id}: {message}")
        self.step_id = step_id
        self.message = message


class _StepWatchdog:
    """Cancels the Step stream whose awaited result is past its ResultDeadline
    (steps_in_flight.py), so that `receive` fails with ExecutorUnavailable and the engine recovers
    as from a crash (a hung executor's process may come back later: the next connect resets it and
    recomputes). One thread polls the deadline."""

    def __init__(self, timeout: float) -> None:
        self.deadline = ResultDeadline(timeout)
        self._lock = threading.Lock()
        # (when, stream, seconds allowed) of the result awaited.
        self._armed: tuple[float, _StepStream, float] | None = None
        self._closed = threading.Event()
        threading.Thread(target=self._watch, name="step-watchdog", daemon=True).start()

    @property
    def timeout(self) -> float:
        return self.deadline.timeout

    def arm(self, stream: _StepStream, num_tokens: int) -> None:
        now = time.monotonic()
        allowed = self.deadline.awaited(num_tokens, now)
        with self._lock:
            self._armed = (now + allowed, stream, allowed)

    def disarm(self, answered: bool) -> None:
        with self._lock:
            self._armed = None
        if answered:
            self.deadline.answered(time.monotonic())

    def close(self) -> None:
        self._closed.set()

    def _watch(self) -> None:
        while not self._closed.wait(_WATCHDOG_POLL_S):
            with self._lock:
                armed = self._armed
                if armed is None or time.monotonic() <= armed[0]:
                    continue
                self._armed = None
                self.deadline.overdue()
            armed[1].expire(armed[2])


class _StreamError(grpc.RpcError):
    """How a Step call ended, as grpc's errors read (code(), details())."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class _StepStream:
    """One Step call: plans go out in order, results come back in plan order (stages 2 and 3 of
    steps_in_flight.py), on a call polled by the thread that steps.

    grpc's synchronous stream-stream call hands every plan and result through two Python threads
    of its own (one pulls the request iterator and waits for each send, one polls the channel and
    wakes every waiter of the call on each completion): two wake-ups and GIL hand-overs each way,
    about a third of the split engine core's CPU. This is the call grpc's blocking unary calls
    make instead, a "segregated" call with its own completion queue (grpc._cython.cygrpc, grpcio
    1.84 or later): `receive` starts a read and waits for the call's events itself, without the GIL,
    and a plan sent while the one before it is still on its way (one send at a time) is started
    there when that send completes. `send` and `receive` run on one thread (under
    RemoteExecutor's lock); `expire` may come from the watchdog's."""

    def __init__(self, channel: grpc.Channel, metadata: tuple[tuple[str, str], ...]) -> None:
        operations = (
            (
                (cygrpc.SendInitialMetadataOperation(metadata, 0), cygrpc.ReceiveStatusOnClientOperation(0)),
                None,
            ),
            ((cygrpc.ReceiveInitialMetadataOperation(0),), None),
        )
        self._call = channel._channel.segregated_call(
            cygrpc.PropagationConstants.GRPC_PROPAGATE_DEFAULTS, _STEP_METHOD, None, None, metadata,
            None, operations, None, None,
        )  # fmt: skip
        # Batches started and not yet taken from the call's queue: grpc frees the queue when the
        # last is taken, so it is never polled past that.
        self._num_due = len(operations)
        self._sending = False
        self._unsent: deque[bytes] = deque()
        self._status: tuple[grpc.StatusCode, str] | None = None
        # Set by the watchdog when it cancelled the stream: the result was overdue (after `allowed` s).
        self.expired = False
        self.allowed = 0.0

    def expire(self, allowed: float) -> None:
        self.expired, self.allowed = True, allowed
        self._call.cancel(cygrpc.StatusCode.cancelled, "the step's result is overdue")

    def send(self, msg: pb.StepPlan) -> None:
        data = msg.SerializeToString()
        if self._sending:
            self._unsent.append(data)
        else:
            self._start_send(data)

    def _start_send(self, data: bytes) -> None:
        if self._call.operate((cygrpc.SendMessageOperation(data, 0),), _SENT):
            self._num_due += 1
            self._sending = True
        # (else the call is over: the next receive says how)

    def receive(self, step_id: int) -> pb.StepResult:
        """The result of `step_id`; StopIteration if the executor ended the stream, or the call's
        error (a grpc.RpcError)."""
        while True:
            if self._status is not None or not self._call.operate(
                (cygrpc.ReceiveMessageOperation(0),), _RECEIVED
            ):
                raise self._ended()
            self._num_due += 1
            data = self._next_message()
            if data is None:
                raise self._ended()
            try:
                out = pb.StepResult.FromString(data)
            except DecodeError as e:  # (as grpc's own call reports it; the caller closes the stream)
                raise _StreamError(
                    grpc.StatusCode.INTERNAL, f"the executor's result for step {step_id} does not parse: {e}"
                ) from e
            # Results come in plan order; one for an older step (a plan sent before a reset) is stale.
            if out.step_id >= step_id:
                return out
            logger.warning("discarding the result of old step %d (waiting for %d)", out.step_id, step_id)

    def _next_message(self) -> bytes | None:
        """The events of the call up to its read's: the message read, or None at its end."""
        while True:
            tag, message = self._take_event()
            if tag is _RECEIVED:
                return message
            if tag is _SENT:
                self._sending = False
                if self._unsent and self._status is None:
                    self._start_send(self._unsent.popleft())

    def _ended(self) -> Exception:
        """The stream's end (its status, once its call's events are all taken), as `receive` raises it."""
        while self._status is None and self._num_due:
            self._take_event()
        code, details = self._status or (grpc.StatusCode.UNKNOWN, "the step stream ended without a status")
        return StopIteration() if code is grpc.StatusCode.OK else _StreamError(code, details)

    def _take_event(self) -> tuple[object, bytes | None]:
        """The call's next event, its status recorded if it brings it: (its tag, the message it read
        or None)."""
        try:
            event = self._call.next_event()
        except BaseException:
            # (a signal handler's exception, on the main thread: grpc freed the call's queue)
            self._num_due = 0
            self._status = self._status or (grpc.StatusCode.CANCELLED, "interrupted")
            raise
        self._num_due -= 1
        message = None
        for op in event.batch_operations:
            kind = op.type()
            if kind == _RECEIVE_MESSAGE:
                message = op.message()
            elif kind == _RECEIVE_STATUS:
                self._status = (_STATUS_CODES.get(op.code(), grpc.StatusCode.UNKNOWN), op.details())
        return event.tag, message

    def close(self) -> None:
        """Cancel the call and take its remaining events, so that grpc frees it."""
        self._unsent.clear()
        if self._num_due:
            self._call.cancel(cygrpc.StatusCode.cancelled, "the scheduler closed the step stream")
        while self._num_due:
            self._take_event()


class RemoteExecutor:
    """The Executor protocol (protos/executor.py) against an executor service.

    `step(plan)` is `send(plan)` then `receive(plan)`; the engine sends the next plan before it
    receives the last result (two in flight), and the executor answers in order. Any error
    closes the Step stream, dropping the plans in it; the next `send()` opens a new one.
    """

    takes_plans_ahead = True  # the executor runs a plan while the next one travels
    max_plans_in_flight = None  # the service queues plans behind the two steps it runs

    def __init__(
        self,
        address: str,
        *,
        connect_timeout: float = 10.0,
        tls_ca: str | Path | bytes | None = None,
        tls_cert: str | Path | bytes | None = None,
        tls_key: str | Path | bytes | None = None,
        tls_server_name: str | None = None,
        step_timeout: float | None = DEFAULT_STEP_TIMEOUT_S,
        api_key: str | None = None,
        owner_name: str | None = None,
    ) -> None:
        """`tls_ca` turns on TLS (the executor's certificate must be signed by that CA);
        `tls_cert` / `tls_key` add this scheduler's client certificate (mutual TLS).
        `step_timeout`: seconds a step's result may be awaited before the executor is taken for
        hung (None: no limit). `api_key` is sent on every ExecutorService call; `owner_name` is how
        the executor names this session to the others it refuses (default: `scheduler on <host> pid
        <pid>`)."""
        self.address = address
        self.connect_timeout = connect_timeout
        if step_timeout is not None and step_timeout <= 0:
            raise ValueError(f"the step timeout must be > 0 seconds (or None: no limit), got {step_timeout}")
        self._watchdog = _StepWatchdog(step_timeout) if step_timeout is not None else None
        self.session_id = new_session_id()
        self.owner_name = owner_name or default_owner_name()
        self._metadata = session_metadata(self.session_id, self.owner_name)
        if api_key:
            self._metadata.append(bearer_metadata(api_key))
        if (tls_cert is None) != (tls_key is None):
            raise ValueError("the executor TLS client certificate and key go together: give both or neither")
        if tls_ca is None and tls_cert is not None:
            raise ValueError("a client certificate for the executor needs its CA too (--executor-tls-ca)")
        if tls_ca is not None:
            credentials = grpc.ssl_channel_credentials(
                root_certificates=read_pem(tls_ca),
                private_key=read_pem(tls_key) if tls_key is not None else None,
                certificate_chain=read_pem(tls_cert) if tls_cert is not None else None,
            )
            options = list(CHANNEL_OPTIONS)
            if tls_server_name:
                options.append(("grpc.ssl_target_name_override", tls_server_name))
            self._channel = grpc.secure_channel(address, credentials, options=options)
        else:
            self._channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        self._stub = pb_grpc.ExecutorServiceStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._stream: _StepStream | None = None
        self._lock = threading.Lock()

    def wait_ready(self, timeout: float) -> None:
        """Poll grpc.health.v1 until the executor is SERVING; ExecutorUnavailable after `timeout`."""
        deadline = time.monotonic() + timeout
        last = "no answer"
        request = health_pb2.HealthCheckRequest(service=SERVICE_NAME)
        while True:
            remaining = deadline - time.monotonic()
            try:
                response = self._health.Check(request, timeout=max(0.05, min(1.0, remaining)))
                if response.status == health_pb2.HealthCheckResponse.SERVING:
                    return
                last = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
            except grpc.RpcError as e:
                last = f"{e.code().name}: {e.details()}"
            if remaining <= 0:
                raise ExecutorUnavailable(
                    f"executor at {self.address} not ready after {timeout:.1f} s ({last})"
                )
            time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))

    def describe(self) -> ExecutorInfo:
        try:
            return info_from_proto(
                self._stub.Describe(
                    pb.DescribeRequest(), timeout=self.connect_timeout, metadata=self._metadata
                )
            )
        except grpc.RpcError as e:
            raise self._error(e, "Describe") from e

    def reset(self) -> int:
        """Drop every sequence the executor holds, and the plans in flight: the Step stream is
        closed first (the executor refuses a stream's plans after a Reset), the next send() opens
        a new one."""
        with self._lock:
            self._close_stream()
        try:
            response = self._stub.Reset(
                pb.ResetRequest(), timeout=self.connect_timeout, metadata=self._metadata
            )
            return response.num_dropped_seqs
        except grpc.RpcError as e:
            raise self._error(e, "Reset") from e

    def step(self, plan: StepPlan) -> StepResult:
        self.send(plan)
        return self.receive(plan)

    def send(self, plan: StepPlan) -> None:
        msg = plan_to_proto(plan)
        with self._lock:
            if self._stream is None:
                self._stream = _StepStream(self._channel, tuple(self._metadata))
            self._stream.send(msg)

    def discard(self) -> None:
        """Forget the plans sent and not received: their stream is closed."""
        with self._lock:
            self._close_stream()

    def receive(self, plan: StepPlan) -> StepResult:
        with self._lock:
            if self._stream is None:
                raise ExecutorUnavailable(
                    f"executor at {self.address}: the step stream closed before the result of step {plan.step_id}"
                )
            stream = self._stream
            if self._watchdog is not None:
                self._watchdog.arm(stream, sum(plan.num_scheduled_tokens))
            answered = False
            try:
                out = stream.receive(plan.step_id)
            except grpc.RpcError as e:
                self._close_stream()
                if stream.expired:
                    raise ExecutorUnavailable(
                        f"executor at {self.address} did not answer step {plan.step_id} within "
                        f"{stream.allowed:.1f} s (--executor-step-timeout {self._watchdog.timeout:g} s, "
                        "plus what its tokens took in recent steps): taking it for hung"
                    ) from e
                if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                    raise PlanRejected(self.address, plan.step_id, e.details()) from e
                raise self._error(e, f"Step {plan.step_id}") from e
            except StopIteration:
                self._close_stream()
                raise ExecutorUnavailable(
                    f"executor at {self.address} closed the step stream at step {plan.step_id}"
                ) from None
            else:
                answered = True
            finally:
                if self._watchdog is not None:
                    self._watchdog.disarm(answered)
            if out.step_id != plan.step_id:
                self._close_stream()
                raise ExecutorError(
                    f"executor at {self.address} answered step {plan.step_id} with the result of step {out.step_id}"
                )
        return result_from_proto(out)

    def release(self, timeout: float | None = None) -> bool:
        """Give the executor up, so that another scheduler may take over at once; whether this
        session owned it."""
        try:
            timeout = self.connect_timeout if timeout is None else timeout
            response = self._stub.Release(pb.ReleaseRequest(), timeout=timeout, metadata=self._metadata)
            return response.released
        except grpc.RpcError as e:
            raise self._error(e, "Release") from e

    def close(self) -> None:
        """Close the Step stream and release the executor (best effort: an executor that is away
        lets the lease run out instead)."""
        with self._lock:
            self._close_stream()
        try:
            self.release(timeout=min(2.0, self.connect_timeout))
        except ExecutorError as e:
            logger.debug("release on close: %s", e)
        if self._watchdog is not None:
            self._watchdog.close()
        self._channel.close()

    def __enter__(self) -> RemoteExecutor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _close_stream(self) -> None:
        if self._stream is not None:
            self._stream.close()
            self._stream = None

    def _error(self, e: grpc.RpcError, what: str) -> ExecutorError:
        code = e.code()
        if code == grpc.StatusCode.FAILED_PRECONDITION:
            return ExecutorOwned(f"executor at {self.address} refused {what}: {e.details()}")
        if code in _UNAVAILABLE_CODES:
            return ExecutorUnavailable(f"executor at {self.address} is unavailable ({what}): {e.details()}")
        return ExecutorError(f"executor at {self.address} failed {what}: {code.name}: {e.details()}")
