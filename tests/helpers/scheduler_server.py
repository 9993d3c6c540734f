"""Shared by the tests: from test_scheduler_service.py."""

from __future__ import annotations

import contextlib
import json
import threading
import time
import urllib.request

import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from executor_service.config import ExecutorConfig
from executor_service.executor import LocalExecutor
from protos.executor import StepOnlyExecutor
from protos.tandem.v1 import generation_pb2 as pb
from scheduler_service.async_engine import EngineOptions
from scheduler_service.config import SchedulerConfig
from scheduler_service.executor_client import ExecutorUnavailable, PlanRejected
from scheduler_service.server import SchedulerServer, ServerThread
from scheduler_service.tokenizer import Tokenizer

NUM_KV_BLOCKS = 256

MAX_NEW = 24

SERVING = health_pb2.HealthCheckResponse.SERVING


def make_server(path, executor=None, *, max_num_seqs=32, **kwargs) -> SchedulerServer:
    executor = executor or LocalExecutor(ExecutorConfig(model=str(path), num_kv_blocks=NUM_KV_BLOCKS))
    options = kwargs.pop("options", None) or EngineOptions(
        SchedulerConfig(max_num_seqs=max_num_seqs), max_queue=kwargs.pop("max_queue", None)
    )
    tokenizer = Tokenizer(path)
    return SchedulerServer(
        executor, options, tokenizer_for=lambda info: tokenizer, port=0, metrics_port=0, **kwargs
    )


def wait_http_health(url: str, want: int = 200, **httpx_kwargs) -> None:
    """Until the HTTP front end at `url` answers /health with `want` (20 s at most)."""
    deadline = time.monotonic() + 20
    while httpx.get(f"{url}/health", **httpx_kwargs).status_code != want:
        assert time.monotonic() < deadline
        time.sleep(0.05)


@contextlib.contextmanager
def serving_http(path, **kwargs):
    """make_server(path, **kwargs) with its HTTP front end on a free port, in a thread, answering
    /health; stopped after the block."""
    thread = ServerThread(make_server(path, http_port=0, **kwargs))
    server = thread.start()
    try:
        wait_http_health(f"http://127.0.0.1:{server.http_port}")
        yield server
    finally:
        thread.stop()


def wait_serving(channel, timeout=20.0, want=SERVING) -> None:
    stub = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + timeout
    while stub.Check(health_pb2.HealthCheckRequest(service="")).status != want:
        assert time.monotonic() < deadline, "health never reached the expected status"
        time.sleep(0.02)


def metrics(server) -> dict[tuple, float]:
    body = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=5).read()
    return {
        (s.name, *sorted(s.labels.items())): s.value
        for family in text_string_to_metric_families(body.decode())
        for s in family.samples
    }


def wait_idle(server, timeout=10.0) -> dict[tuple, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(server)
        idle = [m[(f"tandem_scheduler_{n}",)] for n in ("requests_running", "requests_waiting")]
        if idle == [0, 0] and m[("tandem_scheduler_kv_cache_usage_ratio",)] == 0:
            return m
        assert time.monotonic() < deadline, f"scheduler never became idle: {idle}"
        time.sleep(0.05)


def request(prompt, max_tokens=MAX_NEW, **sampling) -> pb.GenerateRequest:
    params = pb.SamplingParams(max_tokens=max_tokens, **sampling)
    if isinstance(prompt, str):
        return pb.GenerateRequest(text=prompt, sampling_params=params)
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling_params=params)


def collect(responses) -> tuple[list[int], list[str], pb.GenerateFinal, list[int]]:
    """(token ids, text deltas, final message, tokens per chunk)."""
    ids, texts, sizes, final = [], [], [], None
    for r in responses:
        if r.WhichOneof("payload") == "chunk":
            assert final is None
            ids += r.chunk.token_ids
            texts.append(r.chunk.text)
            sizes.append(len(r.chunk.token_ids))
        else:
            final = r.final
    assert final is not None
    return ids, texts, final, sizes


class FlakyExecutor(StepOnlyExecutor):
    """A LocalExecutor that is unreachable until `up` is set, and rejects plans for one prompt."""

    POISON = 397

    def __init__(self, path) -> None:
        self.inner = LocalExecutor(ExecutorConfig(model=str(path), num_kv_blocks=64))
        self.up = threading.Event()

    def _check(self) -> None:
        if not self.up.is_set():
            raise ExecutorUnavailable("executor at flaky:1 is unavailable (Describe): connection refused")

    def describe(self):
        self._check()
        return self.inner.describe()

    def reset(self) -> int:
        self._check()
        return self.inner.reset()

    def step(self, plan):
        self._check()
        if any(s.token_ids[0] == self.POISON for s in plan.new_seqs):
            raise PlanRejected("flaky:1", plan.step_id, "token id out of range")
        return self.inner.step(plan)


def post_ok(url: str, **body) -> dict:
    """The JSON answer of a POST of `body` to `url`, asserted a 200."""
    r = httpx.post(url, json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def stream_chunks(url: str, **body) -> list[dict]:
    """The chunks of a streamed POST of `body` to `url` (before `data: [DONE]`, which must end it)."""
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        events = [line[len("data: ") :] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]
