"""The asyncio client of the scheduler service (grpc.aio).

async with AsyncTandemClient("127.0.0.1:50051") as client:
    async for item in client.generate("The list type", max_tokens=32):
        if isinstance(item, Chunk):
            print(item.text, end="", flush=True)
    completion = await client.complete([1, 2, 3], max_tokens=8)
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from client.client import call_metadata, call_timeout, open_channel
from client.defaults import DEFAULT_RETRIES, DEFAULT_SERVER
from client.messages import (
    Chunk,
    Completion,
    CompletionBuilder,
    Final,
    ModelInfo,
    SamplesBuilder,
    TandemError,
    chat_request,
    generate_request,
    item_from_response,
    model_info_from_proto,
)
from protos.tandem.v1 import generation_pb2 as pb
from protos.tandem.v1 import generation_pb2_grpc as pb_grpc


class AsyncGenerationStream:
    """One Generate call: `async for` Chunks, then one Final. cancel() aborts it on the server.
    Leaving its `with` block before the stream has ended (with n > 1: every sample's Final) cancels it,
    and so does dropping it: a caller that breaks out of `async for item in client.generate(...)`
    frees the request on the server at once (grpc.aio would keep the call running). The stream reads
    with `call.read()` and holds no async generator over `self`, so CPython frees it as soon as the
    caller lets go. A task cancelled while it awaits the next item cancels the call (grpc.aio's own).
    Closing the client cancels its open streams too, which grpc.aio reports as asyncio.CancelledError:
    a reader whose task was not cancelled gets TandemError(CANCELLED) instead, as the sync client's
    does, not a CancelledError that would pass for its task's own cancellation."""

    def __init__(
        self, call: grpc.aio.UnaryStreamCall, request_id: str = "", client_closed=lambda: False
    ) -> None:
        self._call = call
        self._request_id = request_id
        self._client_closed = client_closed
        self._cancelled = False
        # The last Final (one per sample with n > 1); `done` once the stream has ended.
        self.final: Final | None = None
        self.done = False

    def __aiter__(self) -> AsyncIterator[Chunk | Final]:
        return self

    async def __anext__(self) -> Chunk | Final:
        while True:
            try:
                response = await self._call.read()
            except asyncio.CancelledError:
                if self._cancelled:
                    raise StopAsyncIteration from None
                task = asyncio.current_task()
                cancelling = getattr(task, "cancelling", None)  # Python 3.11+
                if self._client_closed() and not (cancelling and cancelling()):
                    raise TandemError(grpc.StatusCode.CANCELLED, "the client was closed") from None
                raise
            except grpc.RpcError as e:
                if self._cancelled and e.code() == grpc.StatusCode.CANCELLED:
                    raise StopAsyncIteration from None
                raise TandemError.from_rpc_error(e) from None
            if response is grpc.aio.EOF:
                self.done = True
                raise StopAsyncIteration
            item = item_from_response(response, self._request_id)
            if isinstance(item, Final):
                self.final = item
            if item is not None:
                return item

    def cancel(self) -> None:
        """Abort the request: the server stops generating for it and frees its KV blocks."""
        self._cancelled = True
        self._call.cancel()

    async def __aenter__(self) -> AsyncGenerationStream:
        return self

    async def __aexit__(self, *exc) -> None:
        # Not at the first Final: with n > 1 the other samples may still be running.
        if not self.done:
            self.cancel()

    def __del__(self) -> None:
        # (a stream built only in part has no call; at interpreter exit the channel may be gone)
        if not getattr(self, "done", True):
            with contextlib.suppress(Exception):
                self._call.cancel()


class AsyncTandemClient:
    """A grpc.aio connection to the scheduler service; create it inside the running event loop.
    The arguments are TandemClient's."""

    def __init__(
        self,
        address: str = DEFAULT_SERVER,
        *,
        timeout: float | None = None,
        api_key: str | None = None,
        tls: bool = False,
        tls_ca: str | Path | bytes | None = None,
        tls_server_name: str | None = None,
        retries: int = DEFAULT_RETRIES,
    ):
        self.address = address
        self.timeout = call_timeout(timeout)
        self._metadata = call_metadata(api_key)
        self._channel = open_channel(grpc.aio, address, tls, tls_ca, tls_server_name, retries)
        self._closed = False
        self._stub = pb_grpc.GenerationServiceStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    def generate(
        self, prompt: str | list[int], *, request_id: str = "", user: str = "", **sampling
    ) -> AsyncGenerationStream:
        """Stream a generation: Chunks, then one Final (one per sample with n > 1, each item
        carrying its sample's index). Sampling arguments: see SamplingParams; `user`: the end user
        it is for (logged by the server)."""
        request = generate_request(prompt, request_id, user=user, **sampling)
        call = self._stub.Generate(request, timeout=self.timeout, metadata=self._metadata)
        return AsyncGenerationStream(call, request_id, lambda: self._closed)

    def chat(
        self,
        messages: list[dict],
        *,
        request_id: str = "",
        chat_template_kwargs: dict | None = None,
        tools: list[dict] | None = None,
        **sampling,
    ) -> AsyncGenerationStream:
        """Stream the assistant's reply to `messages` (OpenAI's message dicts: role, content as text
        or text parts, an assistant's tool_calls, a tool's tool_call_id, name), rendered by the
        server with the model's chat template (`chat_template_kwargs`: e.g. enable_thinking)."""
        request = chat_request(
            messages, request_id, chat_template_kwargs=chat_template_kwargs, tools=tools, **sampling
        )
        call = self._stub.Generate(request, timeout=self.timeout, metadata=self._metadata)
        return AsyncGenerationStream(call, request_id, lambda: self._closed)

    async def complete(self, prompt: str | list[int], *, request_id: str = "", **sampling) -> Completion:
        """The whole generation at once (one sample: for n > 1, complete_samples)."""
        if (sampling.get("n") or 1) != 1:
            raise ValueError("complete() returns one completion; for n > 1 use complete_samples()")
        builder = CompletionBuilder()
        async with self.generate(prompt, request_id=request_id, **sampling) as stream:
            async for item in stream:
                builder.add(item)
        return builder.build()

    async def complete_samples(
        self, prompt: str | list[int], n: int, *, request_id: str = "", **sampling
    ) -> list[Completion]:
        """The request's n samples, whole, in index order."""
        builder = SamplesBuilder()
        async with self.generate(prompt, request_id=request_id, n=n, **sampling) as stream:
            async for item in stream:
                builder.add(item)
        return builder.build()

    async def model_info(self) -> ModelInfo:
        try:
            info = await self._stub.GetModelInfo(
                pb.GetModelInfoRequest(), timeout=self.timeout, metadata=self._metadata
            )
        except grpc.RpcError as e:
            raise TandemError.from_rpc_error(e) from None
        return model_info_from_proto(info)

    async def health(self, service: str = "", timeout: float | None = None) -> str:
        """The grpc.health.v1 status name: "SERVING", "NOT_SERVING", "SERVICE_UNKNOWN"..."""
        try:
            response = await self._health.Check(
                health_pb2.HealthCheckRequest(service=service),
                timeout=timeout if timeout is not None else self.timeout,
                metadata=self._metadata,
            )
        except grpc.RpcError as e:
            raise TandemError.from_rpc_error(e) from None
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)

    async def wait_until_serving(self, timeout: float = 60.0, service: str = "") -> None:
        """Poll health until SERVING; raise TandemError(DEADLINE_EXCEEDED) with the last status."""
        deadline = time.monotonic() + timeout
        last = "no answer"
        while True:
            try:
                last = await self.health(service, timeout=1.0)
                if last == "SERVING":
                    return
            except TandemError as e:
                last = str(e)
            if time.monotonic() >= deadline:
                raise TandemError(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"{self.address} not SERVING after {timeout:.0f} s (last: {last})",
                )
            await asyncio.sleep(0.1)

    async def close(self) -> None:
        self._closed = True
        await self._channel.close()

    async def __aenter__(self) -> AsyncTandemClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
