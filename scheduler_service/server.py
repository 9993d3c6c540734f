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

from protos.plan import ExecutorInfo
from protos.tandem.v1 import generation_pb2_grpc as pb_grpc
from scheduler_service.async_engine import AsyncEngine, EngineOptions
from scheduler_service.engine import Executor
from scheduler_service.generation_service import SERVICE_NAME, GenerationServicer
from scheduler_service.metrics import SchedulerMetrics
from scheduler_service.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# A prompt of max_model_len token ids is a few hundred KiB; this leaves room for long contexts.
MAX_MESSAGE_BYTES = 16 * 2**20
SERVER_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
]
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def _bind_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


class SchedulerServer:
    def __init__(
        self,
        executor: Executor,
        options: EngineOptions,
        *,
        tokenizer_for: Callable[[ExecutorInfo], Tokenizer | None] = lambda info: None,
        host: str = "127.0.0.1",
        port: int = 50051,
        metrics_port: int | None = None,
        stream_interval: int = 1,
    ) -> None:
        self.host = host
        self.port = port
        # None: no /metrics endpoint; 0: any free port (see self.metrics_port after start()).
        self.metrics_port = metrics_port
        self.metrics = SchedulerMetrics()
        self.engine = AsyncEngine(executor, options, self.metrics, tokenizer_for, self._on_health)
        self.servicer = GenerationServicer(self.engine, stream_interval)
        self.health = health.aio.HealthServicer()
        self._server: grpc.aio.Server | None = None
        self._health_tasks: set[asyncio.Task] = set()

    async def start(self) -> None:
        """Bind and serve; the executor is connected in the background (health says when)."""
        server = grpc.aio.server(options=SERVER_OPTIONS)
        pb_grpc.add_GenerationServiceServicer_to_server(self.servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        for name in ("", SERVICE_NAME):
            await self.health.set(name, _NOT_SERVING)
        names = (
            SERVICE_NAME,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        )
        reflection.enable_server_reflection(names, server)
        self.port = server.add_insecure_port(_bind_address(self.host, self.port))
        await server.start()
        self._server = server
        if self.metrics_port is not None:
            self.metrics_port = self.metrics.serve(self.metrics_port, self.host)
        self.engine.start(asyncio.get_running_loop())
        logger.info("scheduler serving on %s", _bind_address(self.host, self.port))

    def _on_health(self, serving: bool) -> None:
        status = _SERVING if serving else _NOT_SERVING
        logger.info("health: %s", health_pb2.HealthCheckResponse.ServingStatus.Name(status))
        for name in ("", SERVICE_NAME):
            task = asyncio.ensure_future(self.health.set(name, status))
            self._health_tasks.add(task)
            task.add_done_callback(self._health_tasks.discard)

    async def stop(self, grace: float = 5.0) -> None:
        """NOT_SERVING, refuse new requests, let streams finish for up to `grace` seconds."""
        await self.health.enter_graceful_shutdown()
        self.engine.stop_admitting()
        if self._server is not None:
            await self._server.stop(grace)
        await asyncio.to_thread(self.engine.shutdown)
        self.metrics.shutdown()


async def serve_until_signal(server: SchedulerServer, grace: float = 5.0) -> None:
    """Run until SIGTERM or SIGINT, then stop gracefully."""
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    logger.info("stopping: draining streams for up to %.1f s", grace)
    await server.stop(grace)


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
