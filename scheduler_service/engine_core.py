"""The engine core of a scheduler service split over processes (`--api-server-count N`, N >= 1).

This process runs what must be one: the scheduler, the block manager and the executor stream with
its plans in flight (AsyncEngine's engine thread), the /metrics endpoint, and the executor's
ownership. N API server processes (api_server.py) do the client-facing work and share the client
port. Between them, ZeroMQ (engine_ipc.py): `CoreBridge` admits their requests into the engine
(its queue limits: --max-queue, --max-queued-tokens), and after each engine step sends every API
server one message with its requests' new tokens, so the step loop never waits on a client and
never writes to one. The engine thread builds those messages itself from the step's sequences
(`step_outputs`, one pass; a request with logprobs, or one that failed, takes the general path
of RequestOutputs through the core's StreamTable, a second message to that API server in the same
step) and sends them itself, on the loop's socket under a lock: the loop is woken (a
call_soon_threadsafe, a write to its self-pipe, and the GIL handed over) only for a step with
bookkeeping for it (first tokens, finished or failed requests) or messages to read.

Lifecycle: the core takes the client port's lock (protos.ports.port_lock: a second service on the
port is refused), binds the HTTP socket once for all API servers (they inherit it), starts them
and waits until each serves; it stops when one exits unexpectedly (exit code 1: the service is no
longer whole), and on SIGTERM / SIGINT stops admitting, lets each API server drain its streams
(--shutdown-timeout), then stops the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import zmq

from protos.ports import bind_address, bind_http_socket, check_free, port_lock
from protos.service_main import freeze_startup_heap
from scheduler_service import engine_ipc as ipc
from scheduler_service.api_server import SPEC_ENV
from scheduler_service.async_engine import AsyncEngine
from scheduler_service.engine import RequestOutput, to_output
from scheduler_service.errors import InvalidRequestError, TandemRequestError
from scheduler_service.metrics import SchedulerMetrics
from scheduler_service.request_stream import RequestStream
from scheduler_service.sequence import Sequence, SequenceStatus

_FINISHED = SequenceStatus.FINISHED

logger = logging.getLogger(__name__)

_START_TIMEOUT_S = 60.0
# Messages from the API servers handled in one pass of the loop before its other callbacks.
_READ_BATCH = 64
# pyzmq's flags and options as plain ints: as its enums, `NOBLOCK | SNDMORE` and `EVENTS & POLLIN`
# each went through enum.Flag's Python operators (about 2% of the engine thread in a W1 split).
_NOBLOCK = int(zmq.NOBLOCK)
_NOBLOCK_SNDMORE = int(zmq.NOBLOCK | zmq.SNDMORE)
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)


class CoreBridge:
    """The engine core's end of the IPC: its socket is read and written on the core's asyncio loop,
    and written by `step_outputs` on the engine thread, each use under `_lock` (a ZeroMQ socket may
    move between threads behind a full memory barrier)."""

    def __init__(self, engine: AsyncEngine, metrics: SchedulerMetrics, address: str) -> None:
        self.engine = engine
        self.metrics = metrics
        self.address = address
        # A plain (blocking-API) socket used only on the loop: sent to without blocking, read when
        # the loop sees its descriptor readable (_on_readable); zmq.asyncio would wrap every send
        # and receive in a Future (about 20 us a message against 6).
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        # A message for an API server whose queue is full, or that is gone, fails (and is reported
        # once per server) rather than vanishing silently.
        self._socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._socket.bind(address)
        self._lock = threading.Lock()
        self._unreachable: set[bytes] = set()
        self._last_state: bytes | None = None
        # The API servers that said hello: each does once it serves (SchedulerServer.start starts
        # its engine, and so the hello, after binding).
        self.peers: set[bytes] = set()
        # Requests admitted for an API server: engine id -> (its identity, the core's stream).
        self._remote: dict[int, tuple[bytes, RequestStream]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._read_scheduled = False
        engine.streams.listener = self._forward
        engine.step_outputs = self.step_outputs

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        loop.add_reader(self._socket.FD, self._on_readable)
        self._schedule_read()  # what arrived before

    def close(self) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._socket.FD)
        with self._lock:
            self._socket.close()
        self._context.term()
        ipc.remove_ipc_address(self.address)

    def broadcast_state(self) -> None:
        frame = self._state()
        self._last_state = frame
        for peer in self.peers:
            self._send(peer, frame)
        self._schedule_read()

    def refresh_state(self) -> None:
        """Broadcast the state again if it changed without a change of health: while the executor
        is away, why it is (a connect attempt's error, such as the scheduler that owns it), which
        the API servers answer new requests with."""
        if self._state() != self._last_state:
            self.broadcast_state()

    def _state(self) -> bytes:
        engine = self.engine.engine
        return ipc.pack(
            "state",
            ipc.state_to_wire(
                engine.info if engine is not None else None,
                engine.limits if engine is not None else None,
                self.engine.not_connected_message() if engine is None else "",
                self.engine.admitting,
            ),
        )

    def _send(self, peer: bytes, frame: bytes) -> None:
        with self._lock:
            self._send_locked(peer, frame)

    def _send_locked(self, peer: bytes, frame: bytes) -> None:
        if self._socket.closed:
            return
        try:
            # (send_multipart's type checks of its parts, without them: the frame fails at its
            # first part, the routing id, when its API server cannot take it)
            self._socket.send(peer, _NOBLOCK_SNDMORE)
            self._socket.send(frame, _NOBLOCK)
        except zmq.ZMQError as e:
            error = e
        else:
            if self._unreachable:
                self._unreachable.discard(peer)
            return
        if not isinstance(error, zmq.Again) and getattr(error, "errno", None) != zmq.EHOSTUNREACH:
            # Another failure (a socket closing at shutdown): logged, never raised into the step's
            # dispatch or the shutdown path.
            logger.warning("a message to API server %s failed: %s", peer.decode(), error)
            return
        if peer not in self._unreachable:  # its queue is full (it stopped reading) or it is gone
            self._unreachable.add(peer)
            why = "is not reading" if isinstance(error, zmq.Again) else "is gone"
            logger.warning(
                "API server %s %s; messages to it are dropped until it reads again", peer.decode(), why
            )

    def _readable_locked(self) -> bool:
        """Whether messages wait to be read (under `_lock`)."""
        return not self._socket.closed and bool(self._socket.get(_EVENTS) & _POLLIN)

    def _schedule_read(self) -> None:
        """A read pass on the loop, once, if messages wait. ZeroMQ's descriptor is edge-triggered:
        it signals a change, and any send or receive may consume the signal of a message that
        arrived meanwhile, so every pass of sends ends here (_deliver, _forward, broadcast_state)."""
        if self._read_scheduled or self._loop is None:
            return
        with self._lock:
            readable = self._readable_locked()
        if readable:
            self._read_scheduled = True
            self._loop.call_soon(self._on_readable)

    def _on_readable(self) -> None:
        """Handle the messages waiting (at most _READ_BATCH, then the loop's other work first)."""
        self._read_scheduled = False
        if self._socket.closed:  # a pass scheduled before close()
            return
        for _ in range(_READ_BATCH):
            try:
                with self._lock:
                    peer, frame = self._socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            message = ipc.unpack(frame)
            try:
                self._handle(peer, message)
            except Exception:
                logger.exception("API server %s: message %r failed", peer.decode(), message[0])
        self._schedule_read()

    def _handle(self, peer: bytes, message: list) -> None:
        kind = message[0]
        if kind == "add":
            key, request_id, prompt, params, arrival, timeout, user = message[1:]
            # Under the lock from queueing to the answer: the engine thread may step the streams
            # the moment they are queued, and the API server drops an "out" for an engine id that
            # its "added" has not named yet, so the answer must leave first (step_outputs sends
            # under the same lock).
            with self._lock:
                try:
                    streams = self.engine.add_requests(
                        request_id, prompt, ipc.params_from_wire(params), arrival, timeout, user, peer
                    )
                except (TandemRequestError, ValueError) as e:
                    error = e if isinstance(e, TandemRequestError) else InvalidRequestError(str(e))
                    self._send_locked(peer, ipc.pack("refused", key, error.code.name, error.message))
                    return
                for stream in streams:
                    self._remote[stream.engine_id] = (peer, stream)
                self._send_locked(peer, ipc.pack("added", key, [stream.engine_id for stream in streams]))
        elif kind == "abort":
            owned = self._remote.pop(message[1], None)
            if owned is not None:
                self.engine.abort(owned[1])
        elif kind == "metrics":
            for name, labels, method, value in message[1]:
                metric = getattr(self.metrics, name)
                getattr(metric.labels(*labels) if labels else metric, method)(value)
        elif kind == "hello":
            self.peers.add(peer)
            self._send(peer, self._state())

    def step_outputs(self, seqs: list[Sequence]) -> None:
        """AsyncEngine.step_outputs, on the engine thread: a step's "out" message for each API
        server, built from its sequences in one pass (no RequestOutput, no dispatch on the loop;
        TTFT and ITL observed here) and sent, then the step's bookkeeping handed to the loop
        (`_deliver`) if it has any. Sequences of requests with logprobs, or that failed, take the
        general path: their RequestOutputs go through StreamTable.dispatch and `_forward` on the
        loop (a stream takes one path or the other, so its messages keep their order)."""
        now = time.perf_counter()
        # Each API server's "out" columns: engine ids, numbers of new tokens, the new tokens (flat),
        # cached tokens, details (engine_ipc.py).
        columns: dict[bytes, tuple[list[int], list[int], list[int], list[int], list[list]]] = {}
        general: list[RequestOutput] = []
        first: list[RequestStream] = []
        finished: list[RequestStream] = []
        first_latencies: list[float] = []
        gaps: list[float] = []
        for seq in seqs:
            stream = seq.client  # set only for requests without logprobs (RequestTracker.drain_into)
            if stream is None or seq.error is not None:
                general.append(to_output(seq))
                continue
            if not stream.live:  # aborted while the step ran (dispatch skips those too)
                continue
            group = columns.get(stream.peer)
            if group is None:
                group = columns[stream.peer] = ([], [], [], [], [])
            k = seq.num_new_tokens
            if k:
                if stream.first_token_time is None:
                    stream.first_token_time = now
                    first_latencies.append(now - stream.arrival)
                    first.append(stream)
                else:
                    gaps.append(now - stream.last_token_time)
                stream.last_token_time = now
                if k == 1:
                    group[2].append(seq.token_ids[-1])
                else:
                    group[2].extend(seq.token_ids[-k:])
            group[0].append(seq.seq_id)
            group[1].append(k)
            group[3].append(seq.num_cached_tokens if seq.num_cached_tokens > 0 else 0)
            if seq.status is _FINISHED:
                group[4].append([len(group[0]) - 1, None, None, True, seq.finish_reason, None, None])
                finished.append(stream)
        metrics = self.metrics
        if first_latencies:
            metrics.ttft.observe_all(first_latencies)
        if gaps:
            metrics.itl.observe_all(gaps)
        # A finished request's abort from its API server finds nothing once its last message is out
        # (one dict operation: atomic beside the loop's).
        remote = self._remote
        for stream in finished:
            remote.pop(stream.engine_id, None)
        readable = False
        if columns:
            with self._lock:
                for peer, group in columns.items():
                    self._send_locked(peer, ipc.pack("out", *group))
                # A send may consume the edge of a message that arrived meanwhile (_schedule_read).
                readable = self._readable_locked()
        if first or finished or general or readable:
            self.engine.call_soon(self._deliver, first, finished, general, now)

    def _deliver(
        self,
        first: list[RequestStream],
        finished: list[RequestStream],
        general: list[RequestOutput],
        now: float,
    ) -> None:
        """On the loop: the bookkeeping of a step whose messages step_outputs sent."""
        streams = self.engine.streams
        for stream in first:
            streams.dequeue(stream)
        for stream in finished:
            streams.remove(stream)
        if general:
            streams.dispatch(general, None, now)
        self._schedule_read()

    def _forward(self, streams: list[RequestStream]) -> None:
        """StreamTable's listener: one message per API server with this step's news."""
        by_peer: dict[bytes, list[RequestStream]] = {}
        remote = self._remote
        for stream in streams:
            owned = remote.get(stream.engine_id)
            if owned is None:
                continue
            if stream.finished:
                del remote[stream.engine_id]
            group = by_peer.get(owned[0])
            if group is None:
                by_peer[owned[0]] = [stream]
            else:
                group.append(stream)
        for peer, group in by_peer.items():
            self._send(peer, ipc.pack("out", *ipc.outputs_to_wire(group)))
        self._schedule_read()


def _free_port(host: str) -> int:
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.bind((host.strip("[]"), 0))
        return probe.getsockname()[1]


def _spec_args(args) -> dict:
    return {k: v for k, v in vars(args).items() if isinstance(v, (str, int, float, bool, list, type(None)))}


async def serve(args, count: int, executor, options, tokenizer_for) -> int:
    """Run the engine core and `count` API servers until SIGTERM / SIGINT; returns the exit code."""
    metrics = SchedulerMetrics()
    port = args.port or _free_port(args.host)
    lock = port_lock(args.host, port)
    try:
        check_free(args.host, port)
    except OSError:
        lock.close()
        raise
    http_socket = bind_http_socket(args.host, args.http_port) if args.http_port else None
    if args.metrics_port:
        metrics.serve(args.metrics_port, args.host)
    loop = asyncio.get_running_loop()
    bridge: CoreBridge | None = None
    engine = AsyncEngine(
        executor,
        options,
        metrics,
        tokenizer_for,
        lambda serving: bridge.broadcast_state() if bridge else None,
    )
    bridge = CoreBridge(engine, metrics, ipc.ipc_address())
    bridge.start(loop)
    engine.start(loop)
    # The stop is armed before any API server is spawned: a SIGTERM from then on is a stop asked
    # for (exit 0), never the default action's death by signal that would leave them orphaned.
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    children = []
    code = 0
    try:
        for index in range(count):
            spec = {
                "args": _spec_args(args),
                "index": index,
                "port": port,
                "ipc": bridge.address,
                "parent_pid": os.getpid(),
            }
            pass_fds = ()
            if http_socket is not None:
                spec["http_fd"] = http_socket.fileno()
                pass_fds = (http_socket.fileno(),)
            children.append(
                subprocess.Popen(
                    [sys.executable, "-m", "scheduler_service.api_server"],
                    env={**os.environ, SPEC_ENV: json.dumps(spec)},
                    pass_fds=pass_fds,
                )
            )
        deadline = time.monotonic() + _START_TIMEOUT_S
        while len(bridge.peers) < count:
            if stop.is_set():  # SIGTERM / SIGINT while they start: a stop asked for, not a failure
                logger.info("stopping before the API servers served")
                return 0
            if any(c.poll() is not None for c in children) or time.monotonic() > deadline:
                print("error: an API server did not start (see its error above)", file=sys.stderr)
                return 2
            await asyncio.sleep(0.05)
        freeze_startup_heap()
        logger.info(
            "scheduler serving on %s: the engine core and %d API server processes (pids %s)",
            bind_address(args.host, port),
            count,
            ", ".join(str(c.pid) for c in children),
        )
        while not stop.is_set():
            if any(c.poll() is not None for c in children):
                logger.error("an API server exited unexpectedly: stopping the scheduler service")
                code = 1
                break
            bridge.refresh_state()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.5)
        logger.info(
            "stopping: new requests refused, API servers draining for up to %.1f s", args.shutdown_timeout
        )
    finally:
        engine.stop_admitting()
        bridge.broadcast_state()
        for child in children:
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + args.shutdown_timeout + 10
        while any(c.poll() is None for c in children) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for child in children:
            if child.poll() is None:
                child.kill()
        await engine.aclose()
        bridge.close()
        metrics.shutdown()
        if http_socket is not None:
            http_socket.close()
        lock.close()
    return code
