"""The synchronous client of the scheduler service.

with TandemClient("127.0.0.1:50051") as client:
    for item in client.generate("The list type", max_tokens=32):
        if isinstance(item, Chunk):
            print(item.text, end="", flush=True)
    print(client.complete([1, 2, 3], max_tokens=8).token_ids)
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from client.defaults import CHANNEL_OPTIONS, DEFAULT_RETRIES, DEFAULT_SERVER, MAX_MESSAGE_BYTES
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
from protos.defaults import check_tls_ca, read_pem
from protos.tandem.v1 import generation_pb2 as pb
from protos.tandem.v1 import generation_pb2_grpc as pb_grpc


def call_timeout(timeout: float | None) -> float | None:
    """Every call's deadline in seconds (None: none); ValueError for one that is not a positive,
    finite number (0 or less would fail every call at once, DEADLINE_EXCEEDED)."""
    if timeout is not None and not 0 < timeout < math.inf:
        raise ValueError(f"timeout must be a positive, finite number of seconds (or none), got {timeout}")
    return timeout


def call_metadata(api_key: str | None) -> list[tuple[str, str]] | None:
    return [("authorization", f"Bearer {api_key}")] if api_key else None


def channel_credentials(tls: bool, tls_ca: str | Path | bytes | None) -> grpc.ChannelCredentials | None:
    """None for plaintext; TLS trusting `tls_ca` (PEM bytes or a file), else the system's CAs."""
    if tls_ca is None and not tls:
        return None
    if tls_ca is not None:
        tls_ca = read_pem(tls_ca, "the CA certificate")
        check_tls_ca(tls_ca, "tls_ca")
    return grpc.ssl_channel_credentials(root_certificates=tls_ca)


# Retries of a GenerationService call refused UNAVAILABLE (a scheduler restarting or draining, its
# executor away, a connection refused) before the first response: gRPC's own retry policy, whose
# backoff is jittered (each wait uniform in [0, backoff]). Once a response has arrived the call is
# never retried, so no token is sent twice. 4 retries (DEFAULT_RETRIES) wait 7.5 s at most (0.5,
# 1, 2, 4 s backoffs), 3.75 s on average: a restart of a small model's executor, not a large
# model's load (the scheduler keeps the requests it accepted through that).
_MAX_RETRIES = 4  # gRPC caps maxAttempts at 5


def retry_service_config(retries: int) -> str:
    """The channel's service config: `retries` retries of UNAVAILABLE, with jittered backoff."""
    if not 0 <= retries <= _MAX_RETRIES:
        raise ValueError(f"retries must be between 0 and {_MAX_RETRIES} (gRPC's limit), got {retries}")
    policy = {
        "maxAttempts": retries + 1,
        "initialBackoff": "0.5s",
        "maxBackoff": "4s",
        "backoffMultiplier": 2,
        "retryableStatusCodes": ["UNAVAILABLE"],
    }
    config = {"name": [{"service": pb.DESCRIPTOR.services_by_name["GenerationService"].full_name}]}
    if retries:
        config["retryPolicy"] = policy
    return json.dumps({"methodConfig": [config]})


def channel_options(tls_server_name: str | None, retries: int = DEFAULT_RETRIES) -> list[tuple[str, object]]:
    options = [
        *CHANNEL_OPTIONS,
        ("grpc.service_config", retry_service_config(retries)),
        # A request is kept for its retries only up to this size (gRPC's default: 256 KiB).
        ("grpc.per_rpc_retry_buffer_size", MAX_MESSAGE_BYTES),
    ]
    if tls_server_name:
        options.append(("grpc.ssl_target_name_override", tls_server_name))
    return options


def check_address(address: str) -> None:
    """ValueError for a HOST:PORT whose port is outside [1, 65535]: gRPC would take it modulo 2**16
    and report a failure to connect to another port. (Other gRPC targets are taken as given.)"""
    host, _, port = address.rpartition(":")
    if (
        host
        and re.fullmatch(r"-?[0-9]+", port)
        and not (len(port.lstrip("0")) <= 5 and 1 <= int(port) <= 65535)
    ):
        raise ValueError(f"the server address {address!r}: its port must be in [1, 65535], got {port}")


def open_channel(
    grpc_module, address: str, tls: bool, tls_ca, tls_server_name: str | None, retries: int = DEFAULT_RETRIES
):
    """A channel to `address` from `grpc` (sync) or `grpc.aio`: plaintext, or TLS as
    channel_credentials() says; GenerationService calls refused UNAVAILABLE before their first
    response are retried `retries` times."""
    check_address(address)
    credentials = channel_credentials(tls, tls_ca)
    options = channel_options(tls_server_name, retries)
    if credentials is None:
        return grpc_module.insecure_channel(address, options=options)
    return grpc_module.secure_channel(address, credentials, options=options)


class GenerationStream:
    """One Generate call: iterate for Chunks, then one Final. cancel() aborts it on the server.
    Leaving its `with` block before the stream has ended (with n > 1: every sample's Final) cancels it,
    and so does dropping it: a caller that breaks out of `for item in client.generate(...)` frees
    the request on the server at once. The stream holds no reference to itself (no generator over
    `self`), so CPython frees it as soon as the caller lets go, not at a later garbage collection."""

    def __init__(self, call, request_id: str = "") -> None:
        self._call = call
        self._request_id = request_id
        self._cancelled = False
        # The last Final (one per sample with n > 1); `done` once the stream has ended.
        self.final: Final | None = None
        self.done = False

    def __iter__(self) -> Iterator[Chunk | Final]:
        return self

    def __next__(self) -> Chunk | Final:
        while True:
            try:
                response = next(self._call)
            except StopIteration:
                self.done = True
                raise
            except grpc.RpcError as e:
                if self._cancelled and e.code() == grpc.StatusCode.CANCELLED:
                    raise StopIteration from None
                raise TandemError.from_rpc_error(e) from None
            item = item_from_response(response, self._request_id)
            if isinstance(item, Final):
                self.final = item
            if item is not None:
                return item

    def cancel(self) -> None:
        """Abort the request: the server stops generating for it and frees its KV blocks."""
        self._cancelled = True
        self._call.cancel()

    def __enter__(self) -> GenerationStream:
        return self

    def __exit__(self, *exc) -> None:
        # Not at the first Final: with n > 1 the other samples may still be running.
        if not self.done:
            self.cancel()

    def __del__(self) -> None:
        # (a stream built only in part has no call; at interpreter exit the channel may be gone)
        if not getattr(self, "done", True):
            with contextlib.suppress(Exception):
                self._call.cancel()


class TandemClient:
    """A connection to the scheduler service. `timeout` (seconds) is every call's deadline;
    `api_key` is sent as a bearer token; `tls_ca` (a PEM file or bytes) or `tls=True` (the
    system's CAs) connect over TLS; `tls_server_name` overrides the name the certificate must carry;
    `retries` (0-4) is how often a call refused UNAVAILABLE before its first response is retried,
    after a jittered backoff."""

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
        # Whether it connects over TLS (the CLI's errors tell a TLS mismatch from no server).
        self.tls = tls or tls_ca is not None
        self._metadata = call_metadata(api_key)
        self._channel = open_channel(grpc, address, tls, tls_ca, tls_server_name, retries)
        self._stub = pb_grpc.GenerationServiceStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    def generate(
        self, prompt: str | list[int], *, request_id: str = "", user: str = "", **sampling
    ) -> GenerationStream:
        """Stream a generation: Chunks, then one Final (one per sample with n > 1, each item
        carrying its sample's index). Sampling arguments: see SamplingParams; `user`: the end user
        it is for (logged by the server)."""
        request = generate_request(prompt, request_id, user=user, **sampling)
        call = self._stub.Generate(request, timeout=self.timeout, metadata=self._metadata)
        return GenerationStream(call, request_id)

    def chat(
        self,
        messages: list[dict],
        *,
        request_id: str = "",
        chat_template_kwargs: dict | None = None,
        tools: list[dict] | None = None,
        **sampling,
    ) -> GenerationStream:
        """Stream the assistant's reply to `messages` (OpenAI's message dicts: role, content as text
        or text parts, an assistant's tool_calls, a tool's tool_call_id, name), rendered by the
        server with the model's chat template (`chat_template_kwargs`: e.g. enable_thinking)."""
        request = chat_request(
            messages, request_id, chat_template_kwargs=chat_template_kwargs, tools=tools, **sampling
        )
        call = self._stub.Generate(request, timeout=self.timeout, metadata=self._metadata)
        return GenerationStream(call, request_id)

    def complete(self, prompt: str | list[int], *, request_id: str = "", **sampling) -> Completion:
        """The whole generation at once (one sample: for n > 1, complete_samples)."""
        if (sampling.get("n") or 1) != 1:
            raise ValueError("complete() returns one completion; for n > 1 use complete_samples()")
        builder = CompletionBuilder()
        with self.generate(prompt, request_id=request_id, **sampling) as stream:
            for item in stream:
                builder.add(item)
        return builder.build()

    def complete_samples(
        self, prompt: str | list[int], n: int, *, request_id: str = "", **sampling
    ) -> list[Completion]:
        """The request's n samples, whole, in index order."""
        builder = SamplesBuilder()
        with self.generate(prompt, request_id=request_id, n=n, **sampling) as stream:
            for item in stream:
                builder.add(item)
        return builder.build()

    def model_info(self) -> ModelInfo:
        try:
            info = self._stub.GetModelInfo(
                pb.GetModelInfoRequest(), timeout=self.timeout, metadata=self._metadata
            )
        except grpc.RpcError as e:
            raise TandemError.from_rpc_error(e) from None
        return model_info_from_proto(info)

    def reachable(self, timeout: float) -> bool:
        """Whether a connection to the server comes up within `timeout` seconds."""
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            return False
        return True

    def health(self, service: str = "", timeout: float | None = None) -> str:
        """The grpc.health.v1 status name: "SERVING", "NOT_SERVING", "SERVICE_UNKNOWN"..."""
        try:
            response = self._health.Check(
                health_pb2.HealthCheckRequest(service=service),
                timeout=timeout if timeout is not None else self.timeout,
                metadata=self._metadata,
            )
        except grpc.RpcError as e:
            raise TandemError.from_rpc_error(e) from None
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)

    def wait_until_serving(self, timeout: float = 60.0, service: str = "") -> None:
        """Poll health until SERVING; raise TandemError(DEADLINE_EXCEEDED) with the last status."""
        deadline = time.monotonic() + timeout
        last = "no answer"
        while True:
            try:
                last = self.health(service, timeout=1.0)
                if last == "SERVING":
                    return
            except TandemError as e:
                last = str(e)
            if time.monotonic() >= deadline:
                raise TandemError(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"{self.address} not SERVING after {timeout:.0f} s (last: {last})",
                )
            time.sleep(0.1)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> TandemClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
