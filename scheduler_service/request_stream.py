"""The asyncio side of each request: tokens accumulate here between a stream's writes."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

from scheduler_service.engine import RequestOutput
from scheduler_service.errors import ErrorCode, TandemRequestError
from scheduler_service.metrics import SchedulerMetrics
from scheduler_service.sampling_params import SamplingParams
from scheduler_service.sequence import TokenLogprob


class RequestStream:
    """Written by StreamTable.dispatch (one batch per engine step), read by the RPC handler. In the
    engine core, a stream of a request of tokens alone only keeps its timings and bookkeeping (its
    outputs go straight to its API server: CoreBridge.step_outputs)."""

    def __init__(
        self,
        request_id: str,
        engine_id: int,
        num_prompt_tokens: int,
        params: SamplingParams,
        arrival: float,
        index: int = 0,
        peer: bytes | None = None,
    ) -> None:
        self.request_id = request_id
        # The engine core's: the API server the request came from (engine_core.py), whose
        # outputs the engine thread builds itself; None in one process.
        self.peer = peer
        # Which of the request's n samples this is.
        self.index = index
        self.engine_id = engine_id
        self.num_prompt_tokens = num_prompt_tokens
        self.params = params
        self.arrival = arrival
        # Tokens (and logprobs) not yet written to the client.
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprob] = []
        # The prompt's, when the request asked for them (with its first tokens).
        self.prompt_logprobs: list[TokenLogprob] | None = None
        self.last_token_id: int | None = None
        self.num_cached_tokens = 0
        self.finished = False
        self.finish_reason: str | None = None
        self.failure: TandemRequestError | None = None
        # Prompt tokens counted in StreamTable.num_queued_tokens until its first token (or its end).
        self.queued_tokens = num_prompt_tokens
        self.first_token_time: float | None = None
        self.last_token_time = 0.0
        self.event = asyncio.Event()
        # False once it left its StreamTable (finished, failed or aborted): the engine core's
        # engine thread reads it to drop the outputs of a stream no longer served.
        self.live = True

    def take(self) -> tuple[list[int], list[TokenLogprob]]:
        ids, lps = self.token_ids, self.logprobs
        self.token_ids, self.logprobs = [], []
        return ids, lps

    def fail(self, failure: TandemRequestError) -> None:
        self.finished = True
        self.finish_reason = "abort"
        self.failure = failure
        self.event.set()

    async def wait(self, min_tokens: int) -> None:
        """Until min_tokens have accumulated, or the request finished or failed."""
        while len(self.token_ids) < min_tokens and not self.finished:
            self.event.clear()
            await self.event.wait()


class StreamTable:
    """The live streams by engine request id; dispatch() runs on the asyncio loop."""

    def __init__(self, metrics: SchedulerMetrics) -> None:
        self.metrics = metrics
        self._streams: dict[int, RequestStream] = {}
        # Called after each dispatch with the streams it wrote to (the engine core forwards those of
        # the general path to their API servers, engine_core.py); None in one process.
        self.listener: Callable[[list[RequestStream]], None] | None = None
        # Prompt tokens of live requests that have had no output yet (--max-queued-tokens).
        self.num_queued_tokens = 0

    def __len__(self) -> int:
        return len(self._streams)

    def add(self, stream: RequestStream) -> None:
        self._streams[stream.engine_id] = stream
        self.num_queued_tokens += stream.queued_tokens

    def remove(self, stream: RequestStream) -> None:
        if self._streams.pop(stream.engine_id, None) is not None:
            stream.live = False
            self.dequeue(stream)

    def drain(self) -> list[RequestStream]:
        """Remove and return every live stream."""
        streams = list(self._streams.values())
        self._streams.clear()
        self.num_queued_tokens = 0
        for stream in streams:
            stream.live = False
            stream.queued_tokens = 0
        return streams

    def dequeue(self, stream: RequestStream) -> None:
        """Its prompt tokens no longer count as queued (its first output came)."""
        self.num_queued_tokens -= stream.queued_tokens
        stream.queued_tokens = 0

    def dispatch(
        self, outputs: Sequence[RequestOutput], failures: dict[int, TandemRequestError] | None, now: float
    ) -> None:
        """One engine step's outputs, handed over in one batch."""
        streams = self._streams
        # The step's time to first token and inter-token latency of each stream, observed at once.
        first_token_latencies: list[float] = []
        token_gaps: list[float] = []
        touched: list[RequestStream] | None = [] if self.listener is not None else None
        for out in outputs:
            stream = streams.get(out.request_id)
            if stream is None:
                continue  # aborted while the step ran
            if touched is not None:
                touched.append(stream)
            if stream.queued_tokens:
                self.dequeue(stream)
            new = out.new_token_ids
            if new:
                if stream.first_token_time is None:
                    stream.first_token_time = now
                    first_token_latencies.append(now - stream.arrival)
                else:
                    token_gaps.append(now - stream.last_token_time)
                stream.last_token_time = now
                stream.token_ids.extend(new)
                stream.last_token_id = new[-1]
                if out.new_logprobs:
                    stream.logprobs.extend(out.new_logprobs)
                if out.prompt_logprobs is not None:
                    stream.prompt_logprobs = out.prompt_logprobs
            stream.num_cached_tokens = out.num_cached_tokens
            if out.finished:
                stream.finished = True
                stream.finish_reason = out.finish_reason
                if out.error is not None:
                    stream.failure = TandemRequestError(out.error, ErrorCode.RESOURCE_EXHAUSTED)
                del streams[out.request_id]
                stream.live = False
            stream.event.set()
        if first_token_latencies:
            self.metrics.ttft.observe_all(first_token_latencies)
        if token_gaps:
            self.metrics.itl.observe_all(token_gaps)
        for engine_id, failure in (failures or {}).items():
            stream = streams.pop(engine_id, None)
            if stream is not None:
                stream.live = False
                self.dequeue(stream)
                stream.fail(failure)
                if touched is not None:
                    touched.append(stream)
        if touched:
            self.listener(touched)
