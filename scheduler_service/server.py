"""The scheduler service: gRPC server (generation, health, reflection), /metrics, engine thread.

In-process (tests, notebooks):

    server = SchedulerServer(LocalExecutor(...), EngineOptions(SchedulerConfig()), port=0,
                             tokenizer_for=lambda info: Tokenizer(path), metrics_port=0)
    with ServerThread(server):
        channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
from collections.abc import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from protos.defaults import GENERATION_MAX_MESSAGE_BYTES, SCHEDULER_PORT
from protos.parsing import deserializer
from protos.plan import ExecutorInfo
from protos.ports import (
    EXCLUSIVE_PORT_OPTION,
    SHARED_PORT_OPTION,
    add_grpc_port,
    bind_address,
    bind_http_socket,
)
from protos.service_main import freeze_startup_heap
from protos.tandem.v1 import generation_pb2 as pb
from scheduler_service.async_engine import AsyncEngine, EngineOptions
from scheduler_service.engine import Executor
from scheduler_service.errors import ErrorCode, TandemRequestError
from scheduler_service.generation_service import SERVICE_NAME, GenerationServicer
from scheduler_service.metrics import SchedulerMetrics
from scheduler_service.security import ApiKeyInterceptor
from scheduler_service.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

SERVER_OPTIONS = [
    ("grpc.max_receive_message_length", GENERATION_MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", GENERATION_MAX_MESSAGE_BYTES),
    EXCLUSIVE_PORT_OPTION,
]
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def _is_loopback(host: str) -> bool:
    return host in ("localhost", "::1", "[::1]") or host.startswith("127.")


def _generation_handler(servicer: GenerationServicer) -> grpc.GenericRpcHandler:
    """GenerationService's methods, with deserializers that turn undecodable bytes into
    INVALID_ARGUMENT."""
    return grpc.method_handlers_generic_handler(
        SERVICE_NAME,
        {
            # A stream-request handler: see GenerationServicer.Generate.
            "Generate": grpc.stream_stream_rpc_method_handler(
                servicer.Generate,
                request_deserializer=deserializer(pb.GenerateRequest),
                response_serializer=pb.GenerateResponse.SerializeToString,
            ),
            "GetModelInfo": grpc.unary_unary_rpc_method_handler(
                servicer.GetModelInfo,
                request_deserializer=deserializer(pb.GetModelInfoRequest),
                response_serializer=pb.GetModelInfoResponse.SerializeToString,
            ),
        },
    )


class SchedulerServer:
    def __init__(
        self,
        executor: Executor | None = None,
        options: EngineOptions | None = None,
        *,
        engine_factory: Callable | None = None,
        metrics: SchedulerMetrics | None = None,
        tokenizer_for: Callable[[ExecutorInfo], Tokenizer | None] = lambda info: None,
        host: str = "127.0.0.1",
        port: int = SCHEDULER_PORT,
        metrics_port: int | None = None,
        stream_interval: int = 1,
        api_keys: list[str] | None = None,
        tls_credentials: grpc.ServerCredentials | None = None,
        http_port: int | None = None,
        http_tls: tuple[str, str] | None = None,
        http_socket=None,
        reuse_port: bool = False,
        allowed_origins: list[str] | None = None,
        tool_call_parser: str = "auto",
    ) -> None:
        """`api_keys`: callers must send one as a bearer token (health checks excepted);
        `tls_credentials`: serve TLS (scheduler_service.security.server_credentials);
        `http_port`: also serve the OpenAI-compatible HTTP API there (None: not; 0: any free port),
        with TLS when `http_tls` (certificate chain file, key file), or on `http_socket`, bound;
        `allowed_origins`: the browser origins it answers cross-origin (CORS; none: no CORS headers);
        `tool_call_parser`: the format chat answers' tool calls are read in (tool_call_formats.py).

        The engine is an AsyncEngine over `executor`, or in an API server process
        `engine_factory(metrics, on_health)` (api_server.RemoteEngine), with `metrics` its relay
        and `reuse_port` to share the client port with the other API servers."""
        self.host = host
        self.port = port
        # None: no /metrics endpoint; 0: any free port (see self.metrics_port after start()).
        self.metrics_port = metrics_port
        self.metrics = metrics if metrics is not None else SchedulerMetrics()
        if engine_factory is not None:
            self.engine = engine_factory(self.metrics, self._on_health)
        else:
            self.engine = AsyncEngine(executor, options, self.metrics, tokenizer_for, self._on_health)
        self.servicer = GenerationServicer(self.engine, stream_interval, tool_call_parser=tool_call_parser)
        self.stream_interval = stream_interval
        self.health = health.aio.HealthServicer()
        self.api_keys = list(api_keys or [])
        self.tls_credentials = tls_credentials
        self._server: grpc.aio.Server | None = None
        self.http_port = http_port
        self.http_tls = http_tls
        self._http_socket = http_socket
        self.reuse_port = reuse_port
        self.allowed_origins = list(allowed_origins or [])
        self.tool_call_parser = tool_call_parser
        self._http = None
        self._health_tasks: set[asyncio.Task] = set()

    async def start(self) -> None:
        """Bind and serve; the executor is connected in the background (health says when)."""
        interceptors = []
        if self.api_keys:
            refused = self.metrics.requests_failed.labels(grpc.StatusCode.UNAUTHENTICATED.name)
            interceptors.append(ApiKeyInterceptor(self.api_keys, refused.inc))
        options = SERVER_OPTIONS
        if self.reuse_port:
            options = [SHARED_PORT_OPTION if o is EXCLUSIVE_PORT_OPTION else o for o in SERVER_OPTIONS]
        server = grpc.aio.server(options=options, interceptors=interceptors)
        server.add_generic_rpc_handlers((_generation_handler(self.servicer),))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        for name in ("", SERVICE_NAME):
            await self.health.set(name, _NOT_SERVING)
        names = (
            SERVICE_NAME,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        )
        reflection.enable_server_reflection(names, server)
        self.port = add_grpc_port(server, self.host, self.port, self.tls_credentials, shared=self.reuse_port)
        if self.metrics_port is not None:  # bound before serving: a port in use fails the start
            self.metrics_port = self.metrics.serve(self.metrics_port, self.host)
        if not _is_loopback(self.host) and (self.tls_credentials is None or not self.api_keys):
            logger.warning(
                "listening on %s without %s: anyone who reaches this address can use it",
                self.host,
                " and ".join(
                    what
                    for what, on in (("TLS", self.tls_credentials), ("an API key", self.api_keys))
                    if not on
                ),
            )
        if self.http_port is not None or self._http_socket is not None:
            try:
                from scheduler_service.http_api import HttpServer, OpenAIServer
            except ImportError as e:
                raise SystemExit(
                    f"the HTTP API (--http-port {self.http_port}) needs fastapi and uvicorn ({e}); "
                    "install them, or pass --http-port 0 to serve gRPC only"
                ) from None

            sock = self._http_socket or bind_http_socket(self.host, self.http_port)
            self.http_port = sock.getsockname()[1]
            cert, key = self.http_tls or (None, None)
            self._http = HttpServer(
                OpenAIServer(
                    self.engine,
                    self.api_keys,
                    self.stream_interval,
                    self.allowed_origins,
                    self.tool_call_parser,
                ).app,
                sock,
                cert,
                key,
            )
        await server.start()
        self._server = server
        if self._http is not None:
            await self._http.start()
            logger.info("OpenAI-compatible HTTP API on %s", bind_address(self.host, self.http_port))
        self.engine.start(asyncio.get_running_loop())
        logger.info(
            "scheduler serving on %s (%s%s)",
            bind_address(self.host, self.port),
            "TLS" if self.tls_credentials is not None else "plaintext",
            ", API key required" if self.api_keys else "",
        )

    def _on_health(self, serving: bool) -> None:
        status = _SERVING if serving else _NOT_SERVING
        logger.info("health: %s", health_pb2.HealthCheckResponse.ServingStatus.Name(status))
        for name in ("", SERVICE_NAME):
            task = asyncio.ensure_future(self.health.set(name, status))
            self._health_tasks.add(task)
            task.add_done_callback(self._health_tasks.discard)

    async def stop(self, grace: float = 5.0) -> None:
        """Health NOT_SERVING, refuse new requests (UNAVAILABLE), let the streams in flight
        finish for up to `grace` seconds, fail what is left (UNAVAILABLE), then stop."""
        await self.health.enter_graceful_shutdown()
        self.engine.stop_admitting()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        # (with API server processes, a request the core admitted just before the signal has its
        # streams here only once the core's answer is back: wait for those too)
        while (len(self.engine.streams) or self.engine.num_pending_admissions) and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if left := len(self.engine.streams):
            message = f"the scheduler shut down before this request finished (shutdown timeout {grace:g} s)"
            self.engine.abort_all(TandemRequestError(message, ErrorCode.UNAVAILABLE))
            logger.warning("shutdown timeout: %d requests still running were failed", left)
        if self._http is not None:
            await self._http.stop()
        if self._server is not None:
            # Long enough for the last messages of finished streams to be written.
            await self._server.stop(1.0)
        await self.engine.aclose()
        if isinstance(self.metrics, SchedulerMetrics):
            self.metrics.shutdown()


async def serve_until_signal(server: SchedulerServer, grace: float = 30.0) -> None:
    """Run until SIGTERM or SIGINT, then stop gracefully (drain for up to `grace` seconds)."""
    await server.start()
    freeze_startup_heap()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    logger.info("stopping: health NOT_SERVING, new requests refused, draining for up to %.1f s", grace)
    await server.stop(grace)
    logger.info("stopped")


class ServerThread:
    """A SchedulerServer on its own event loop in a daemon thread (tests, notebooks)."""

    def __init__(self, server: SchedulerServer) -> None:
        self.server = server
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="scheduler-loop", daemon=True)

    def start(self, timeout: float = 30.0) -> SchedulerServer:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self.server.start(), self.loop).result(timeout)
        return self.server

    def call(self, fn: Callable[[], object]) -> object:
        """Run fn on the server's loop and return its result (to read asyncio-side state)."""

        async def run() -> object:
            return fn()

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(10)

    def stop(self, grace: float = 1.0) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(grace), self.loop).result(grace + 30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()

    def __enter__(self) -> SchedulerServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
