"""An API server process of the scheduler service (`--api-server-count N`): the client-facing work
(gRPC GenerationService, health, the HTTP API, validation, tokenization, detokenization, stop
strings, streaming) beside the engine core's process, which runs the scheduler and the executor
stream (engine_core.py). The N processes serve one client port; each talks to the core over
ZeroMQ (engine_ipc.py).

`RemoteEngine` is what the front ends see of the engine here: the same members they use of
AsyncEngine (submit, abort, check_admitting, tokenizer, engine.info / engine.limits, streams,
metrics), over IPC. It checks a request against the executor's limits where it stands (the core
sends them with every change of state), and the core admits it (its queue limits) or refuses it,
in one round trip. Tokens arrive once per engine step for all of this process's requests.

Metrics: the core serves the one /metrics. The front ends' own series (requests finished and
failed, e2e latency, request token histograms) are relayed to it as calls (MetricsRelay) every
0.1 s; TTFT and ITL are observed by the core as it hands each step's tokens out.

Run by the engine core, never by hand: `python -m scheduler_service.api_server` with its spec
(JSON: the scheduler's flags, this server's index, the core's IPC address) in
TANDEM_API_SERVER_SPEC.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import zmq
import zmq.asyncio

from protos.hub import resolve_model
from protos.plan import ExecutorInfo
from protos.service_main import freeze_startup_heap
from scheduler_service import engine_ipc as ipc
from scheduler_service.config import SchedulerLimits
from scheduler_service.engine import validate_request
from scheduler_service.errors import ErrorCode, TandemRequestError
from scheduler_service.request_stream import RequestStream, StreamTable
from scheduler_service.sampling_params import SamplingParams
from scheduler_service.tokenizer import Tokenizer, tokenizer_resolver

logger = logging.getLogger(__name__)

SPEC_ENV = "TANDEM_API_SERVER_SPEC"
_METRICS_FLUSH_S = 0.1


class _RelayedMetric:
    __slots__ = ("_labels", "_name", "_relay")

    def __init__(self, relay: MetricsRelay, name: str, labels: tuple = ()) -> None:
        self._relay, self._name, self._labels = relay, name, labels

    def labels(self, *values: str) -> _RelayedMetric:
        return _RelayedMetric(self._relay, self._name, values)

    def inc(self, amount: float = 1) -> None:
        self._relay.records.append([self._name, list(self._labels), "inc", amount])

    def observe(self, value: float) -> None:
        self._relay.records.append([self._name, list(self._labels), "observe", value])

    def dec(self, amount: float = 1) -> None:
        self._relay.records.append([self._name, list(self._labels), "dec", amount])

    def set(self, value: float) -> None:
        self._relay.records.append([self._name, list(self._labels), "set", value])


class _Ignored:
    def labels(self, *values: str) -> _Ignored:
        return self

    def inc(self, amount: float = 1) -> None:
        pass

    def observe(self, value: float) -> None:
        pass

    def observe_all(self, values: list[float]) -> None:
        pass


class MetricsRelay:
    """SchedulerMetrics' interface for counters and histograms, recorded as calls that the core
    replays on its own registry (`ignore`: series the core measures itself)."""

    def __init__(self, ignore: tuple[str, ...] = ("ttft", "itl")) -> None:
        self.records: list[list] = []
        self._ignore = frozenset(ignore)

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        return _Ignored() if name in self._ignore else _RelayedMetric(self, name)

    def take(self) -> list[list]:
        records, self.records = self.records, []
        return records


@dataclass(slots=True)
class EngineView:
    """The connected engine as an API server knows it (the front ends read these two)."""

    info: ExecutorInfo
    limits: SchedulerLimits


class RemoteEngine:
    """The engine core, seen from an API server (public methods run on its asyncio loop)."""

    def __init__(
        self,
        address: str,
        identity: str,
        metrics: MetricsRelay,
        tokenizer_for: Callable[[ExecutorInfo], Tokenizer | None] = lambda info: None,
        on_health: Callable[[bool], None] = lambda serving: None,
    ) -> None:
        self.address = address
        self.identity = identity
        self.metrics = metrics
        self.tokenizer_for = tokenizer_for
        self.on_health = on_health
        self.streams = StreamTable(metrics)
        self.engine: EngineView | None = None
        self.tokenizer: Tokenizer | None = None
        self._model: str | None = None
        self._message = "the engine core has not answered yet"
        self._core_admitting = True
        self._admitting = True
        self._serving = False
        # Requests sent to the core for admission: key -> (future, request id, prompt tokens, the
        # samples' params, arrival).
        self._pending: dict[int, tuple[asyncio.Future, str, int, list[SamplingParams], float]] = {}
        self._next_key = 0
        self._context = zmq.asyncio.Context()
        self._socket = self._context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.IDENTITY, identity.encode())
        self._socket.setsockopt(zmq.LINGER, 1000)
        self._tasks: list[asyncio.Task] = []

    # -- what the front ends call ---------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._socket.connect(self.address)
        self._send("hello")
        self._tasks = [loop.create_task(self._read()), loop.create_task(self._flush_metrics())]

    def not_connected_message(self) -> str:
        return self._message

    def stop_admitting(self) -> None:
        self._admitting = False

    @property
    def num_pending_admissions(self) -> int:
        """Requests sent to the core whose admission (or refusal) has not come back yet."""
        return len(self._pending)

    def check_admitting(self) -> EngineView:
        if not (self._admitting and self._core_admitting):
            raise TandemRequestError(
                "the scheduler is shutting down: send the request to another replica", ErrorCode.UNAVAILABLE
            )
        if self.engine is None:
            raise TandemRequestError(self._message, ErrorCode.UNAVAILABLE)
        return self.engine

    async def submit(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival: float,
        timeout: float | None = None,
        user: str | None = None,
    ) -> list[RequestStream]:
        """The request's params.n samples, checked here against the executor's limits, then
        admitted by the core (its queue limits) or refused: raises TandemRequestError as
        AsyncEngine.submit does."""
        samples = params.for_samples()
        validate_request(prompt_token_ids, samples[0], self.check_admitting().limits)
        self._next_key += 1
        key = self._next_key
        wire = ipc.params_to_wire(params)
        self._send("add", key, request_id, prompt_token_ids, wire, arrival, timeout, user)
        # Pending once sent (a message that cannot be sent is never answered); the answer is read
        # on this loop, after this awaits.
        future = asyncio.get_running_loop().create_future()
        self._pending[key] = (future, request_id, len(prompt_token_ids), samples, arrival)
        try:
            return await future
        except asyncio.CancelledError:
            # Cancelled once the core's answer had arrived but before this ran again: the streams
            # it admitted are nobody's (cancelled before the answer: _on_added aborts them).
            if future.done() and not future.cancelled() and future.exception() is None:
                for stream in future.result():
                    self.abort(stream)
            raise

    def abort(self, stream: RequestStream) -> None:
        self.streams.remove(stream)
        self._send("abort", stream.engine_id)

    def abort_all(self, failure: TandemRequestError) -> int:
        streams = self.streams.drain()
        for stream in streams:
            stream.fail(failure)
            self._send("abort", stream.engine_id)
        return len(streams)

    async def aclose(self) -> None:
        """Send what is left (aborts, metrics) and close (LINGER bounds the wait)."""
        for task in self._tasks:
            task.cancel()
        if records := self.metrics.take():
            self._send("metrics", records)
        self._socket.close()
        self._context.term()

    # -- IPC ------------------------------------------------------------------------------

    def _send(self, *message: object) -> None:
        # A DEALER queues while the core is away (up to its high-water mark): never blocks.
        self._socket.send(ipc.pack(*message), zmq.NOBLOCK)

    async def _flush_metrics(self) -> None:
        while True:
            await asyncio.sleep(_METRICS_FLUSH_S)
            if records := self.metrics.take():
                self._send("metrics", records)

    async def _read(self) -> None:
        handlers = {
            "state": self._on_state,
            "added": self._on_added,
            "refused": self._on_refused,
            "out": self._on_out,
        }
        while True:
            message = ipc.unpack(await self._socket.recv())
            try:
                handlers[message[0]](*message[1:])
            except Exception:
                logger.exception("engine core message %r failed", message[0])

    def _on_state(self, state: dict) -> None:
        self._core_admitting = state["admitting"]
        self._message = state["message"]
        if state["info"] is None:
            self.engine = None
        else:
            info = ipc.info_from_wire(state["info"])
            self.engine = EngineView(info, ipc.limits_from_wire(state["limits"]))
            if info.model != self._model:
                self._model = info.model
                self.tokenizer = self.tokenizer_for(info)
        serving = self.engine is not None and self._core_admitting
        if serving != self._serving:
            self._serving = serving
            self.on_health(serving)

    def _on_added(self, key: int, engine_ids: list[int]) -> None:
        future, request_id, num_prompt_tokens, samples, arrival = self._pending.pop(key)
        if future.cancelled():  # the caller went away while the core admitted it
            for engine_id in engine_ids:
                self._send("abort", engine_id)
            return
        streams = [
            RequestStream(request_id, engine_id, num_prompt_tokens, sample, arrival, j)
            for j, (engine_id, sample) in enumerate(zip(engine_ids, samples, strict=True))
        ]
        # Registered before any output for them can be read (outputs follow on the same socket).
        for stream in streams:
            self.streams.add(stream)
        future.set_result(streams)

    def _on_refused(self, key: int, code: str, message: str) -> None:
        future = self._pending.pop(key)[0]
        if not future.cancelled():
            future.set_exception(ipc.failure_from_wire(code, message))

    def _on_out(self, *columns: list) -> None:
        outputs, failures = ipc.outputs_from_wire(*columns)
        self.streams.dispatch(outputs, failures, time.perf_counter())


# -- the process ----------------------------------------------------------------------------


async def _serve(spec: dict) -> int:
    from scheduler_service.security import load_api_keys, server_credentials
    from scheduler_service.server import SchedulerServer

    args = spec["args"]
    index = spec["index"]
    tokenizer = Tokenizer(resolve_model(args["tokenizer"])) if args.get("tokenizer") else None
    api_keys = load_api_keys(args.get("api_key"), args.get("api_key_file"))
    tls = server_credentials(args["tls_cert"], args["tls_key"]) if args.get("tls_cert") else None
    http_socket = None
    if spec.get("http_fd") is not None:
        http_socket = socket.socket(fileno=spec["http_fd"])
        http_socket.setblocking(False)

    def remote(metrics, on_health):
        return RemoteEngine(spec["ipc"], f"api-{index}", metrics, tokenizer_resolver(tokenizer), on_health)

    server = SchedulerServer(
        engine_factory=remote,
        metrics=MetricsRelay(),
        host=args["host"],
        port=spec["port"],
        stream_interval=args["stream_interval"],
        api_keys=api_keys,
        tls_credentials=tls,
        http_socket=http_socket,
        http_tls=(args["tls_cert"], args["tls_key"]) if args.get("tls_cert") else None,
        reuse_port=True,
        allowed_origins=args.get("allowed_origins"),
        tool_call_parser=args.get("tool_call_parser", "auto"),
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await server.start()  # bound, then the engine's hello: the core counts it as this server's start
    freeze_startup_heap()
    await stop.wait()
    await server.stop(args["shutdown_timeout"])
    return 0


def _die_with_parent(parent_pid: int) -> None:
    """SIGKILL when the engine core dies (Linux): without it no request here can finish, and the
    port would stay served by a part of a service."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # it died before the line above
        os._exit(1)


def main() -> int:
    spec = json.loads(os.environ[SPEC_ENV])
    _die_with_parent(spec["parent_pid"])
    from protos.service_main import LOG_FORMAT, mark_service_process

    mark_service_process()
    level = (spec["args"].get("log_level") or "WARNING").upper()
    logging.basicConfig(level=level, format=LOG_FORMAT.replace("%(name)s", f"api-{spec['index']} %(name)s"))
    try:
        return asyncio.run(_serve(spec))
    except (OSError, RuntimeError) as e:  # the port: named by protos.ports
        print(f"error: API server {spec['index']}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
