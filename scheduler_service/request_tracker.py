"""Request intake: new requests, aborts and deadlines on their way to the engine thread.

The asyncio side adds and aborts through a thread-safe inbox; the engine thread drains it into
the LLMEngine before each step and sleeps on it when idle. On the engine thread, each request's
arrival (for the queue-time metric) and gRPC deadline are kept here; failures go back to the
streams through `post`.
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
from collections.abc import Callable, Sequence

from scheduler_service.engine import LLMEngine, RequestOutput
from scheduler_service.errors import ErrorCode, TandemRequestError
from scheduler_service.metrics import SchedulerMetrics
from scheduler_service.request_stream import RequestStream, StreamTable
from scheduler_service.sampling_params import SamplingParams
from scheduler_service.sequence import Sequence as Seq

logger = logging.getLogger(__name__)

Failures = dict[int, TandemRequestError]
# Hands one batch of step outputs and failures to the streams, on the asyncio loop.
Post = Callable[[Sequence[RequestOutput], Failures | None], None]
# (engine id, prompt token ids, sampling params, arrival (perf_counter), deadline (monotonic) or
# None, its name in the engine's logs, its stream)
Add = tuple[int, list[int], SamplingParams, float, float | None, str, RequestStream]


class RequestTracker:
    """The inbox between the asyncio side and the engine thread, and the engine thread's
    arrivals and deadlines of the requests it took from it."""

    def __init__(self, streams: StreamTable, metrics: SchedulerMetrics, post: Post) -> None:
        self.streams = streams
        self.metrics = metrics
        self.post = post
        self._cond = threading.Condition()
        self._adds: list[Add] = []
        self._aborts: list[int] = []
        self._next_id = 0
        self.stopping = False
        # Engine thread only below.
        self.arrivals: dict[int, float] = {}
        self._deadlines: list[tuple[float, int]] = []  # a heap of (deadline, engine id)

    # -- asyncio side ---------------------------------------------------------------------

    @property
    def num_adds(self) -> int:
        """New requests the engine thread has not taken yet."""
        return len(self._adds)

    def add(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival: float,
        deadline: float | None,
        index: int = 0,
        name: str | None = None,
        peer: bytes | None = None,
    ) -> RequestStream:
        """A stream for sample `index` of the request; `name`: its id in the engine's logs
        (default request_id); `peer`: the API server it came from (RequestStream.peer)."""
        with self._cond:
            self._next_id += 1
            stream = RequestStream(
                request_id, self._next_id, len(prompt_token_ids), params, arrival, index, peer
            )
            self.streams.add(stream)
            self._adds.append(
                (stream.engine_id, prompt_token_ids, params, arrival, deadline, name or request_id, stream)
            )
            self._cond.notify()
        return stream

    def abort(self, stream: RequestStream) -> None:
        self.streams.remove(stream)
        with self._cond:
            self._aborts.append(stream.engine_id)
            self._cond.notify()

    def abort_all(self, failure: TandemRequestError) -> int:
        """End every live stream with `failure`; returns how many."""
        streams = self.streams.drain()
        for stream in streams:
            stream.fail(failure)
        with self._cond:
            self._aborts.extend(s.engine_id for s in streams)
            self._cond.notify()
        return len(streams)

    def stop(self) -> None:
        with self._cond:
            self.stopping = True
            self._cond.notify()

    # -- engine thread --------------------------------------------------------------------

    def wait_for_adds(self, timeout: float) -> bool:
        """Sleep until a new request or stop(); False after `timeout` without either."""
        with self._cond:
            return bool(self._cond.wait_for(lambda: self._adds or self.stopping, timeout))

    def wait_to_reconnect(self, delay: float) -> None:
        """Sleep the reconnect delay, cut short by an abort, stop() or the next deadline."""
        with self._cond:
            self._cond.wait_for(lambda: self.stopping or self._aborts, self._until_deadline(delay))

    def _until_deadline(self, delay: float) -> float:
        if self._deadlines:
            return max(0.0, min(delay, self._deadlines[0][0] - time.monotonic()))
        return delay

    def drain_into(self, engine: LLMEngine) -> None:
        """Hand the inbox's new requests and aborts to the engine."""
        with self._cond:
            adds, self._adds = self._adds, []
            aborts, self._aborts = self._aborts, []
        failures: Failures = {}
        for engine_id, prompt, params, arrival, deadline, name, stream in adds:
            try:
                # The engine core's fast path takes outputs of tokens alone (engine_core.py).
                fast = stream.peer is not None and params.logprobs is None and params.prompt_logprobs is None
                client = stream if fast else None
                engine.add_request(prompt, params, request_id=engine_id, name=name, client=client)
                self.arrivals[engine_id] = arrival
                if deadline is not None:
                    heapq.heappush(self._deadlines, (deadline, engine_id))
            except ValueError as e:  # the limits changed since the asyncio side validated
                logger.info("request %s refused by the engine: %s", name, e)
                failures[engine_id] = TandemRequestError(str(e), ErrorCode.INVALID_ARGUMENT)
        for engine_id in aborts:
            seq = engine.scheduler.seqs.get(engine_id)
            if engine.abort_request(engine_id):
                logger.info("request %s aborted after %d tokens", seq.name, seq.num_output_tokens)
            self.arrivals.pop(engine_id, None)
        if aborts:
            self.metrics.update_from_stats(engine.scheduler.stats)
        if failures:
            self.post([], failures)

    def expire(self, engine: LLMEngine) -> None:
        """Drop requests past their gRPC deadline (freeing their blocks): DEADLINE_EXCEEDED."""
        deadlines = self._deadlines
        if not deadlines:
            return
        now = time.monotonic()
        seqs = engine.scheduler.seqs
        failures: Failures = {}
        while deadlines and deadlines[0][0] <= now:
            _, engine_id = heapq.heappop(deadlines)
            seq = seqs.get(engine_id)
            if seq is not None and engine.abort_request(engine_id):
                self.arrivals.pop(engine_id, None)
                where = "while queued" if seq.num_output_tokens == 0 else "while generating"
                logger.info("request %s: its deadline passed %s", seq.name, where)
                failures[engine_id] = _expired(where)
        # Entries of requests that finished long before their deadline: drop them now and then.
        if len(deadlines) > 1024 and len(deadlines) > 4 * len(seqs):
            self._deadlines = [d for d in deadlines if d[1] in seqs]
            heapq.heapify(self._deadlines)
        if failures:
            self.metrics.update_from_stats(engine.scheduler.stats)
            self.post([], failures)

    # -- engine thread, without an executor ---------------------------------------------

    def drop_aborted(self, held: dict[int, Seq]) -> None:
        """Forget aborted requests, kept ones (`held`, by engine id) included."""
        with self._cond:
            aborts, self._aborts = self._aborts, []
        for engine_id in aborts:
            held.pop(engine_id, None)
            self.arrivals.pop(engine_id, None)

    def expire_held(self, held: dict[int, Seq], now: float) -> Failures:
        """Remove the kept (`held`) and queued requests past their deadline; returns their failures."""
        failures: Failures = {}
        while self._deadlines and self._deadlines[0][0] <= now:
            _, engine_id = heapq.heappop(self._deadlines)
            if held.pop(engine_id, None) is not None or self._remove_add(engine_id):
                failures[engine_id] = _expired("while the executor was unavailable")
        with self._cond:  # requests queued just before the loss have no heap entry yet
            expired = [a for a in self._adds if a[4] is not None and a[4] <= now]
            if expired:
                self._adds = [a for a in self._adds if a[4] is None or a[4] > now]
        for add in expired:
            failures[add[0]] = _expired("while the executor was unavailable")
        return failures

    def take_adds(self) -> list[int]:
        """Remove every new request from the inbox; returns their engine ids."""
        with self._cond:
            ids = [a[0] for a in self._adds]
            self._adds = []
        return ids

    def _remove_add(self, engine_id: int) -> bool:
        with self._cond:
            for i, add in enumerate(self._adds):
                if add[0] == engine_id:
                    del self._adds[i]
                    return True
        return False


def some(names: list[str], limit: int = 8) -> str:
    """Request ids for a log line: the first `limit`, and how many more."""
    head = ", ".join(names[:limit])
    return head + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _expired(where: str) -> TandemRequestError:
    return TandemRequestError(f"the request's deadline passed {where}", ErrorCode.DEADLINE_EXCEEDED)
