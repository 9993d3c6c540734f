"""ExecutorService's RPCs (Describe, the Step stream, Reset) over one executor, and their method
handlers, whose request deserializers turn undecodable bytes into INVALID_ARGUMENT."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import grpc
from google.protobuf.message import DecodeError

from executor_service.metrics import ExecutorMetrics
from executor_service.plan_validation import PlanError
from protos.plan import info_to_proto, plan_from_proto, result_to_proto
from protos.tandem.v1 import executor_pb2 as pb
from protos.tandem.v1 import executor_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from executor_service.executor import LocalExecutor

logger = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["ExecutorService"].full_name


class MalformedMessage:
    """What a request deserializer returns for bytes that are no valid message."""

    def __init__(self, error: str) -> None:
        self.error = error


def _deserializer(message_type):
    """A request deserializer whose parse error becomes INVALID_ARGUMENT in the handler (gRPC
    would answer INTERNAL for an exception raised in the deserializer)."""
    name = message_type.DESCRIPTOR.full_name

    def parse(data: bytes):
        try:
            return message_type.FromString(data)
        except DecodeError as e:
            return MalformedMessage(f"the message is not a valid {name} ({len(data)} bytes): {e}")

    return parse


def _refuse_malformed(message: object, context: grpc.ServicerContext) -> None:
    if isinstance(message, MalformedMessage):
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, message.error)


class ExecutorServicer(pb_grpc.ExecutorServiceServicer):
    """ExecutorService over one executor; steps from any number of streams are serialised.

    Every call into the executor (loading included) runs on one dedicated thread: torch's
    OpenMP thread team belongs to the calling thread, and gRPC worker threads taking turns
    would each start a team of their own, all spinning on the same cores (a 5x slower step on
    2 cores, measured with bench/throughput.py)."""

    def __init__(self, metrics: ExecutorMetrics) -> None:
        self.executor: LocalExecutor | None = None
        self.metrics = metrics
        self._lock = threading.Lock()
        self._closed = False
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="executor-step")

    def run_on_worker(self, fn, *args):
        """fn(*args) on the executor's own thread; returns its result or raises its exception."""
        return self._worker.submit(fn, *args).result()

    def close(self, timeout: float) -> None:
        """Let the running step finish (up to `timeout`), then refuse further steps."""
        acquired = self._lock.acquire(timeout=timeout)
        self._closed = True
        if acquired:
            self._lock.release()
        else:
            logger.warning("a step still runs after %.1f s; stopping anyway", timeout)

    def _executor(self, context: grpc.ServicerContext) -> LocalExecutor:
        if self._closed:
            context.abort(grpc.StatusCode.UNAVAILABLE, "the executor is shutting down")
        if self.executor is None:
            context.abort(grpc.StatusCode.UNAVAILABLE, "the executor is still loading its model")
        return self.executor

    def Describe(self, request: pb.DescribeRequest, context: grpc.ServicerContext) -> pb.DescribeResponse:
        _refuse_malformed(request, context)
        return info_to_proto(self.run_on_worker(self._executor(context).describe))

    def Step(
        self, request_iterator: Iterator[pb.StepPlan], context: grpc.ServicerContext
    ) -> Iterator[pb.StepResult]:
        for msg in request_iterator:
            if isinstance(msg, MalformedMessage):
                self.metrics.step_failed("INVALID_ARGUMENT")
                _refuse_malformed(msg, context)
            plan = plan_from_proto(msg)
            with self._lock:
                executor = self._executor(context)
                graph_steps = _num_graph_steps(executor)
                t0 = time.perf_counter()
                try:
                    result = self.run_on_worker(executor.step, plan)
                except PlanError as e:
                    self.metrics.step_failed("INVALID_ARGUMENT")
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
                except Exception as e:
                    logger.exception("step %d failed", plan.step_id)
                    self.metrics.step_failed("INTERNAL")
                    context.abort(
                        grpc.StatusCode.INTERNAL, f"step {plan.step_id} failed: {type(e).__name__}: {e}"
                    )
                seconds = time.perf_counter() - t0
                self.metrics.observe_step(plan, seconds, _num_graph_steps(executor) > graph_steps)
            yield result_to_proto(result)

    def Reset(self, request: pb.ResetRequest, context: grpc.ServicerContext) -> pb.ResetResponse:
        _refuse_malformed(request, context)
        with self._lock:
            dropped = self.run_on_worker(self._executor(context).reset)
        logger.info("reset: dropped %d sequences", dropped)
        return pb.ResetResponse(num_dropped_seqs=dropped)


def executor_handler(servicer: ExecutorServicer) -> grpc.GenericRpcHandler:
    """ExecutorService's methods, with deserializers that turn undecodable bytes into
    INVALID_ARGUMENT."""
    return grpc.method_handlers_generic_handler(
        SERVICE_NAME,
        {
            "Describe": grpc.unary_unary_rpc_method_handler(
                servicer.Describe,
                request_deserializer=_deserializer(pb.DescribeRequest),
                response_serializer=pb.DescribeResponse.SerializeToString,
            ),
            "Step": grpc.stream_stream_rpc_method_handler(
                servicer.Step,
                request_deserializer=_deserializer(pb.StepPlan),
                response_serializer=pb.StepResult.SerializeToString,
            ),
            "Reset": grpc.unary_unary_rpc_method_handler(
                servicer.Reset,
                request_deserializer=_deserializer(pb.ResetRequest),
                response_serializer=pb.ResetResponse.SerializeToString,
            ),
        },
    )


def _num_graph_steps(executor: LocalExecutor) -> int:
    """Steps the model runner replayed from a CUDA graph (0 for executors without one)."""
    return getattr(getattr(executor, "runner", None), "num_graph_steps", 0)
