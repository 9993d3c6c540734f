"""The executor's gRPC server: ExecutorService (Describe, the Step stream, Reset), grpc.health.v1
and server reflection, in plaintext on loopback by default or behind (mutual) TLS. It listens before
the model is loaded (health NOT_SERVING) so that probes and the scheduler can tell "loading" from
"down"."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from executor_service.metrics import ExecutorMetrics, start_metrics_server
from executor_service.plan_validation import PlanError
from protos.plan import info_to_proto, plan_from_proto, result_to_proto
from protos.tandem.v1 import executor_pb2 as pb
from protos.tandem.v1 import executor_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from executor_service.config import ExecutorConfig
    from executor_service.executor import LocalExecutor

logger = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["ExecutorService"].full_name
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 50052
DEFAULT_METRICS_PORT = 9102
# A 256-sequence plan with new 8k-token prompts is ~8 MB; 64 MiB leaves room and fails loudly beyond.
MAX_MESSAGE_BYTES = 64 * 2**20
GRACE_SECONDS = 5.0
# How often the server checks that its tensor-parallel ranks are alive.
RANK_POLL_SECONDS = 0.2
# After the running step has finished, how long its result may take to reach the scheduler
# before idle streams are cancelled.
FLUSH_SECONDS = 0.5
# Tests only: seconds to wait (health NOT_SERVING) before loading the model.
LOAD_DELAY_ENV = "TANDEM_TEST_LOAD_DELAY"

SERVER_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # A second executor on the same port must fail to bind, not share the port silently.
    ("grpc.so_reuseport", 0),
    # The scheduler pings an idle Step stream every 30 s (executor_client.py); allow it.
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
]


def _read_pem(source: str | Path | bytes, what: str) -> bytes:
    if isinstance(source, bytes):
        return source
    try:
        return Path(source).read_bytes()
    except OSError as e:
        raise ValueError(f"cannot read the {what} {source}: {e.strerror}") from None


def server_credentials(
    cert: str | Path | bytes, key: str | Path | bytes, ca: str | Path | bytes | None = None
) -> grpc.ServerCredentials:
    """TLS with this executor's certificate chain and private key (PEM, bytes or file paths).
    With `ca`, mutual TLS: only clients presenting a certificate signed by that CA (the
    scheduler) complete the handshake; every service, health included, sits behind it."""
    pair = (_read_pem(key, "TLS key"), _read_pem(cert, "TLS certificate"))
    if ca is None:
        return grpc.ssl_server_credentials([pair])
    return grpc.ssl_server_credentials(
        [pair], root_certificates=_read_pem(ca, "TLS CA"), require_client_auth=True
    )


def _is_loopback(host: str) -> bool:
    return host in ("localhost", "::1", "[::1]") or host.startswith("127.")


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


def _executor_handler(servicer: ExecutorServicer) -> grpc.GenericRpcHandler:
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


class ExecutorServer:
    """The gRPC server. It listens from `start()` with health NOT_SERVING and serves steps once
    `set_executor()` has been given the loaded executor."""

    def __init__(
        self,
        host: str = DEFAULT_HOST,
        port: int = DEFAULT_PORT,
        metrics: ExecutorMetrics | None = None,
        max_workers: int = 16,
        credentials: grpc.ServerCredentials | None = None,
    ) -> None:
        """`credentials` (see `server_credentials`) serves TLS; without them the port is plaintext."""
        self.metrics = metrics if metrics is not None else ExecutorMetrics()
        self.servicer = ExecutorServicer(self.metrics)
        # Health Watch streams must not hold the workers that Step streams need.
        self.health = health.HealthServicer(experimental_non_blocking=True)
        self._server = grpc.server(
            ThreadPoolExecutor(max_workers, thread_name_prefix="executor-grpc"), options=SERVER_OPTIONS
        )
        self._server.add_generic_rpc_handlers((_executor_handler(self.servicer),))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        health_name = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_name, reflection.SERVICE_NAME), self._server
        )
        for name in ("", SERVICE_NAME):
            self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        try:
            if credentials is None:
                self.port = self._server.add_insecure_port(f"{host}:{port}")
            else:
                self.port = self._server.add_secure_port(f"{host}:{port}", credentials)
        except RuntimeError as e:
            raise OSError(f"cannot listen on {host}:{port} (is the port in use?)") from e
        self.address = f"{host}:{self.port}"
        self.tls = credentials is not None
        if not self.tls and not _is_loopback(host):
            logger.warning(
                "listening on %s without TLS: anyone who reaches this address can drive the executor "
                "(--tls-cert, --tls-key and --tls-ca turn on mutual TLS)",
                self.address,
            )

    def start(self) -> None:
        self._server.start()
        logger.info(
            "listening on %s%s (NOT_SERVING until the model is loaded)",
            self.address,
            " (TLS)" if self.tls else "",
        )

    def set_executor(self, executor: LocalExecutor) -> None:
        self.servicer.executor = executor
        self.metrics.set_executor(executor.describe())
        for name in ("", SERVICE_NAME):
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        logger.info("serving on %s", self.address)

    def stop(self, grace: float = GRACE_SECONDS) -> None:
        """Health NOT_SERVING, let the running step finish (up to `grace`), then close every stream."""
        self.health.enter_graceful_shutdown()
        self.servicer.close(timeout=grace)
        self._server.stop(FLUSH_SECONDS).wait()
        logger.info("stopped")


def serve(
    config: ExecutorConfig,
    host: str = DEFAULT_HOST,
    port: int = DEFAULT_PORT,
    metrics_port: int = DEFAULT_METRICS_PORT,
    grace: float = GRACE_SECONDS,
    credentials: grpc.ServerCredentials | None = None,
) -> int:
    """Run the executor service until SIGTERM or SIGINT; returns the process exit code.
    `metrics_port` 0 serves no /metrics; `credentials` serve (mutual) TLS."""
    from executor_service.executor import LocalExecutor

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: stop.set())

    server = ExecutorServer(host, port, credentials=credentials)
    metrics_http = start_metrics_server(server.metrics, host, metrics_port) if metrics_port else None
    server.start()
    exit_code = 0
    executor = None
    try:
        if delay := float(os.environ.get(LOAD_DELAY_ENV, "0")):
            stop.wait(delay)
        if not stop.is_set():
            executor = server.servicer.run_on_worker(LocalExecutor, config)
            server.set_executor(executor)
        while not stop.wait(RANK_POLL_SECONDS):
            if failed := executor.failed_ranks():
                # A rank is gone: the group cannot step any more. NOT_SERVING, then exit non-zero.
                logger.error("tensor-parallel rank(s) died (rank, exit code): %s; shutting down", failed)
                exit_code = 1
                break
        else:
            logger.info("signal received, shutting down")
    except Exception:
        logger.exception("the executor failed to load %s", config.model)
        exit_code = 1
    finally:
        server.stop(grace)
        if metrics_http is not None:
            metrics_http.shutdown()
        if executor is not None:
            _close(server, executor, exit_code)
    return exit_code


def _close(server: ExecutorServer, executor: LocalExecutor, exit_code: int) -> None:
    """Stop the other tensor-parallel ranks. After a failure the executor thread may still wait
    in a collective: leave it (the ranks are killed) rather than wait for it."""
    if exit_code:
        if executor.workers is not None:
            executor.workers.kill()
        return
    try:
        server.servicer.run_on_worker(executor.close)
    except Exception:
        logger.exception("closing the tensor-parallel ranks failed")
