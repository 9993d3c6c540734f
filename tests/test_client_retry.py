"""The clients retry a request refused UNAVAILABLE before its first response (a scheduler
restarting, its executor away), and never one that has streamed: no token is sent twice."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
from concurrent import futures

import grpc
import pytest

from client import AsyncTandemClient, TandemClient, TandemError
from protos.tandem.v1 import generation_pb2 as pb
from protos.tandem.v1 import generation_pb2_grpc as pb_grpc


class Refusing(pb_grpc.GenerationServiceServicer):
    """Refuses the first `refusals` Generate calls UNAVAILABLE; then streams two chunks and a
    final, or, with `fail_after_first`, one chunk and then UNAVAILABLE."""

    def __init__(self, refusals: int, fail_after_first: bool = False) -> None:
        self.refusals = refusals
        self.fail_after_first = fail_after_first
        self.attempts = 0
        self._lock = threading.Lock()

    def Generate(self, request, context):
        with self._lock:
            self.attempts += 1
            attempt = self.attempts
        if attempt <= self.refusals:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"executor is not connected (attempt {attempt})")
        yield pb.GenerateResponse(chunk=pb.GenerateChunk(token_ids=[7]))
        if self.fail_after_first:
            context.abort(grpc.StatusCode.UNAVAILABLE, "executor lost mid-stream")
        yield pb.GenerateResponse(chunk=pb.GenerateChunk(token_ids=[8]))
        final = pb.GenerateFinal(finish_reason=pb.FINISH_REASON_LENGTH, prompt_tokens=3, completion_tokens=2)
        yield pb.GenerateResponse(final=final)


@pytest.fixture
def serve():
    servers = []

    def start(servicer) -> str:
        server = grpc.server(futures.ThreadPoolExecutor(4))
        pb_grpc.add_GenerationServiceServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append(server)
        return f"127.0.0.1:{port}"

    yield start
    for server in servers:
        server.stop(0)


def test_a_refused_request_is_retried_until_it_streams(serve):
    servicer = Refusing(refusals=3)
    with TandemClient(serve(servicer), timeout=30) as client:
        done = client.complete([1, 2, 3], max_tokens=2)
    assert done.token_ids == [7, 8] and done.finish_reason == "length"
    assert servicer.attempts == 4


def test_the_async_client_retries_too(serve):
    servicer = Refusing(refusals=2)
    address = serve(servicer)

    async def run():
        async with AsyncTandemClient(address, timeout=30) as client:
            return await client.complete([1, 2, 3], max_tokens=2)

    assert asyncio.run(run()).token_ids == [7, 8]
    assert servicer.attempts == 3


def test_retries_zero_fails_at_once_and_too_many_refusals_fail_with_the_last_status(serve):
    servicer = Refusing(refusals=100)
    address = serve(servicer)
    with TandemClient(address, timeout=30, retries=0) as client, pytest.raises(TandemError) as err:
        client.complete([1, 2, 3], max_tokens=2)
    assert err.value.code == grpc.StatusCode.UNAVAILABLE and servicer.attempts == 1
    with TandemClient(address, timeout=30) as client, pytest.raises(TandemError) as err:
        client.complete([1, 2, 3], max_tokens=2)
    assert err.value.code == grpc.StatusCode.UNAVAILABLE and "attempt 6" in err.value.message
    assert servicer.attempts == 6  # one, then 4 retries
    with pytest.raises(ValueError, match="between 0 and 4"):
        TandemClient(address, retries=5)


def test_a_stream_that_has_sent_a_token_is_never_retried(serve):
    servicer = Refusing(refusals=0, fail_after_first=True)
    with TandemClient(serve(servicer), timeout=30) as client:
        stream = client.generate([1, 2, 3], max_tokens=2)
        first = next(stream)
        with pytest.raises(TandemError) as err:
            list(stream)
    assert first.token_ids == [7]
    assert err.value.code == grpc.StatusCode.UNAVAILABLE and servicer.attempts == 1


def test_the_cli_retries_by_default(serve):
    servicer = Refusing(refusals=2)
    address = serve(servicer)
    cli = [
        sys.executable,
        "-m",
        "client.cli",
        "generate",
        "--server",
        address,
        "--prompt-ids",
        "1,2",
        "--json",
    ]
    done = subprocess.run(cli, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert '"token_ids": [7, 8]' in done.stdout and servicer.attempts == 3
    servicer.refusals = 100
    refused = subprocess.run([*cli, "--retries", "0"], capture_output=True, text=True, timeout=60)
    assert refused.returncode != 0 and "UNAVAILABLE" in refused.stderr and servicer.attempts == 4


def test_a_request_sent_while_the_executor_is_away_is_served_once_it_is_back(qwen3_tied):
    """The scheduler refuses new requests UNAVAILABLE while its executor is away; the client's
    retries carry a request over a short absence (here 0.3 s; the first retry waits up to 0.5 s)."""
    from helpers.scheduler_server import FlakyExecutor, make_server

    from scheduler_service.async_engine import EngineOptions
    from scheduler_service.config import SchedulerConfig
    from scheduler_service.server import ServerThread

    executor = FlakyExecutor(qwen3_tied)
    options = EngineOptions(
        SchedulerConfig(), executor_address="flaky:1", heartbeat_s=0.1, backoff_min_s=0.02, backoff_max_s=0.05
    )
    server = make_server(qwen3_tied, executor, options=options)
    with ServerThread(server), TandemClient(f"127.0.0.1:{server.port}", timeout=60) as client:
        with (
            pytest.raises(TandemError) as refused,
            TandemClient(f"127.0.0.1:{server.port}", retries=0) as once,
        ):
            once.complete([5, 6], max_tokens=2)
        assert refused.value.code == grpc.StatusCode.UNAVAILABLE  # away: refused, as before
        threading.Timer(0.3, executor.up.set).start()
        done = client.complete([5, 6, 7], max_tokens=4, ignore_eos=True)
    assert len(done.token_ids) == 4
