"""The executor's gRPC server: ExecutorService (Describe, the Step stream, Reset; servicer.py),
grpc.health.v1 and server reflection, in plaintext on loopback by default or behind (mutual) TLS
and an API key (security.py); Reset and Step are its owner's alone (ownership.py). It listens
before the model is loaded (health NOT_SERVING) so that probes and the scheduler can tell
"loading" from "down". It warns when anyone who reaches it could drive it: beyond loopback with
neither mutual TLS nor a key, or with TLS that accepts clients without a certificate."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from executor_service.metrics import ExecutorMetrics, start_metrics_server
from executor_service.ownership import DEFAULT_OWNER_LEASE_SECONDS, LogThrottle, Ownership
from executor_service.security import ApiKeyInterceptor, server_credentials
from executor_service.servicer import SERVICE_NAME, ExecutorServicer, executor_handler
from protos.defaults import DEFAULT_HOST, EXECUTOR_METRICS_PORT, EXECUTOR_PORT, MAX_MESSAGE_BYTES
from protos.ports import EXCLUSIVE_PORT_OPTION, add_grpc_port
from protos.service_main import freeze_startup_heap

if TYPE_CHECKING:
    from executor_service.config import ExecutorConfig
    from executor_service.executor import LocalExecutor
    from executor_service.tp_worker import WorkerProcesses

logger = logging.getLogger(__name__)

# Re-exported for the CLI and the tests: server_credentials (security.py), ExecutorServicer (servicer.py).
__all__ = [
    "DEFAULT_HOST",
    "DEFAULT_METRICS_PORT",
    "DEFAULT_PORT",
    "GRACE_SECONDS",
    "MAX_MESSAGE_BYTES",
    "SERVICE_NAME",
    "ExecutorServer",
    "ExecutorServicer",
    "serve",
    "server_credentials",
]

# A 256-sequence plan with new 8k-token prompts is ~8 MB; MAX_MESSAGE_BYTES (64 MiB) leaves room
# and fails loudly beyond.
DEFAULT_PORT = EXECUTOR_PORT
DEFAULT_METRICS_PORT = EXECUTOR_METRICS_PORT
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
    EXCLUSIVE_PORT_OPTION,
    # The scheduler pings an idle Step stream every 30 s (executor_client.py); allow it.
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
    # And we ping it: the stream of a scheduler whose host vanished closes within ~30 s, so that
    # its ownership (held while a stream is open) ends and another scheduler can take over.
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.max_pings_without_data", 0),
]


def _is_loopback(host: str) -> bool:
    return host in ("localhost", "::1", "[::1]") or host.startswith("127.")


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
        *,
        mutual_tls: bool = False,
        api_keys: list[str] | None = None,
        owner_lease_s: float = DEFAULT_OWNER_LEASE_SECONDS,
    ) -> None:
        """`credentials` (see `server_credentials`) serves TLS, `mutual_tls` says that they require
        a client certificate; without them the port is plaintext. `api_keys`: Describe, Step and
        Reset need one of them. `owner_lease_s`: how long the owner keeps the executor after its
        last call with no Step stream open (ownership.py)."""
        self.metrics = metrics if metrics is not None else ExecutorMetrics()
        self.servicer = ExecutorServicer(self.metrics, Ownership(owner_lease_s))
        # Health Watch streams must not hold the workers that Step streams need.
        self.health = health.HealthServicer(experimental_non_blocking=True)
        self._log_refusal = LogThrottle()
        interceptors = [ApiKeyInterceptor(api_keys, self._refused)] if api_keys else []
        self._server = grpc.server(
            ThreadPoolExecutor(max_workers, thread_name_prefix="executor-grpc"),
            options=SERVER_OPTIONS,
            interceptors=interceptors,
        )
        self._server.add_generic_rpc_handlers((executor_handler(self.servicer),))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        health_name = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_name, reflection.SERVICE_NAME), self._server
        )
        for name in ("", SERVICE_NAME):
            self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        self.port = add_grpc_port(self._server, host, port, credentials)
        self.address = f"{host}:{self.port}"
        self.tls = credentials is not None
        if not mutual_tls and not api_keys:
            if self.tls:
                logger.warning(
                    "TLS without --tls-ca on %s: clients without a certificate are accepted, and with no "
                    "--api-key anyone who reaches this address can drive the executor",
                    self.address,
                )
            elif not _is_loopback(host):
                logger.warning(
                    "listening on %s without TLS or an API key: anyone who reaches this address can "
                    "drive the executor (--api-key-file, or --tls-cert, --tls-key and --tls-ca for mutual TLS)",
                    self.address,
                )

    def _refused(self, method: str) -> None:
        if self._log_refusal(method):
            logger.warning("refused %s: missing or invalid API key (logged once a minute per method)", method)

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
        self.metrics.sequences.set_function(lambda: len(executor.seqs))
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
    *,
    mutual_tls: bool = False,
    api_keys: list[str] | None = None,
    owner_lease_s: float = DEFAULT_OWNER_LEASE_SECONDS,
) -> int:
    """Run the executor service until SIGTERM or SIGINT; returns the process exit code.
    `metrics_port` 0 serves no /metrics; the rest as ExecutorServer's."""
    from executor_service.executor import LocalExecutor

    stop = threading.Event()

    def on_signal(signum, frame) -> None:
        # The handler runs on the main thread, which may hold stop's lock inside stop.wait():
        # setting it from here could deadlock (seen with two signals in quick succession).
        threading.Thread(target=stop.set, name="signal").start()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)

    server = ExecutorServer(
        host,
        port,
        credentials=credentials,
        mutual_tls=mutual_tls,
        api_keys=api_keys,
        owner_lease_s=owner_lease_s,
    )
    metrics_http = start_metrics_server(server.metrics, host, metrics_port) if metrics_port else None
    server.start()
    exit_code = 0
    executor = None
    ranks: list[WorkerProcesses] = []
    # Whether the executor thread may be stuck in a rendezvous or a collective whose peer is gone:
    # then the process ends with os._exit (a normal exit could hang in its teardown).
    stuck = False
    try:
        if delay := float(os.environ.get(LOAD_DELAY_ENV, "0")):
            stop.wait(delay)
        if not stop.is_set():
            loading = server.servicer.submit_to_worker(LocalExecutor, config, ranks.append)
            # The group forms and loads only when every rank does: watch them, and the signals.
            while not loading.done() and not stop.wait(RANK_POLL_SECONDS):
                if ranks and (failed := ranks[0].failed()):
                    # A load that failed kills the ranks itself: its own error, if any, says why.
                    with contextlib.suppress(TimeoutError):
                        loading.result(timeout=2.0)
                    raise RuntimeError(
                        f"tensor-parallel rank(s) died while loading (rank, exit code): {failed}"
                    )
            if not loading.done():
                logger.info("signal received while loading, shutting down")
                stuck = True  # the load may wait for the other ranks (or anything else) for long
            else:
                executor = loading.result()
                freeze_startup_heap()
                server.set_executor(executor)
        while executor is not None and not stop.wait(RANK_POLL_SECONDS):
            if failed := executor.failed_ranks():
                # A rank is gone: the group cannot step any more. NOT_SERVING, then exit non-zero.
                logger.error("tensor-parallel rank(s) died (rank, exit code): %s; shutting down", failed)
                exit_code = 1
                break
        else:
            if executor is not None:
                logger.info("signal received, shutting down")
    except Exception:
        logger.exception("the executor failed to load %s", config.model)
        exit_code = 1
    finally:
        server.stop(grace)
        if metrics_http is not None:
            metrics_http.shutdown()
        if executor is not None:
            stuck = not _close(server, executor, exit_code)
        elif ranks:
            ranks[0].kill()
        stuck = stuck or (exit_code != 0 and bool(ranks))
    if stuck:
        logging.shutdown()
        os._exit(exit_code)
    return exit_code


def _close(server: ExecutorServer, executor: LocalExecutor, exit_code: int) -> bool:
    """Stop the other tensor-parallel ranks; False when the executor thread may be stuck (after a
    failure it may still wait in a collective: the ranks are killed rather than waited for)."""
    if exit_code:
        if executor.workers is not None:
            executor.workers.kill()
        return executor.workers is None
    try:
        return server.servicer.run_on_worker(executor.close)
    except Exception:
        logger.exception("closing the tensor-parallel ranks failed")
        return False
