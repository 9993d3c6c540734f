"""The scheduler's Prometheus metrics without a model: bucket ranges, the info metric, what an
AsyncEngine over a fake executor records, and what the gRPC service over a fake engine core does."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from dataclasses import replace
from types import SimpleNamespace

import grpc
import pytest
from helpers.fake_executor import FakeExecutor, prompt
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from protos.tandem.v1 import generation_pb2 as pb
from protos.tandem.v1 import generation_pb2_grpc as pb_grpc
from scheduler_service.async_engine import AsyncEngine
from scheduler_service.config import EngineOptions, SchedulerConfig
from scheduler_service.executor_client import ExecutorUnavailable
from scheduler_service.metrics import _LATENCY_BUCKETS, SchedulerMetrics, StepHistogram
from scheduler_service.sampling_params import SamplingParams
from scheduler_service.server import SchedulerServer, ServerThread


def samples(m: SchedulerMetrics) -> dict[tuple, float]:
    text = generate_latest(m.registry).decode()
    return {
        (s.name, *sorted(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_a_long_answer_lands_in_a_finite_e2e_bucket():
    m = SchedulerMetrics()
    m.e2e.observe(300.0)  # a 5-minute answer: +Inf only before issue 16
    s = samples(m)
    assert s[("tandem_scheduler_e2e_request_latency_seconds_bucket", ("le", "240.0"))] == 0
    assert s[("tandem_scheduler_e2e_request_latency_seconds_bucket", ("le", "480.0"))] == 1
    # TTFT keeps its fine buckets.
    assert ("tandem_scheduler_time_to_first_token_seconds_bucket", ("le", "0.001")) in s


def test_request_token_histograms_and_model_name():
    m = SchedulerMetrics()
    m.request_prompt_tokens.observe(40000)
    m.request_generation_tokens.observe(3)
    info = replace(FakeExecutor().info, model="org/some-model")
    m.set_executor(info, max_model_len=2048)
    s = samples(m)
    assert s[("tandem_scheduler_request_prompt_tokens_bucket", ("le", "32768.0"))] == 0
    assert s[("tandem_scheduler_request_prompt_tokens_bucket", ("le", "65536.0"))] == 1
    assert s[("tandem_scheduler_request_generation_tokens_bucket", ("le", "4.0"))] == 1
    [labels] = [k[1:] for k in s if k[0] == "tandem_scheduler_info"]
    assert ("model_name", "org/some-model") in labels and ("max_model_len", "2048") in labels


def test_step_histogram_exposes_what_a_prometheus_histogram_would():
    plain, batched = CollectorRegistry(), CollectorRegistry()
    reference = Histogram("x_seconds", "doc", buckets=_LATENCY_BUCKETS, registry=plain)
    histogram = StepHistogram("x_seconds", "doc", buckets=_LATENCY_BUCKETS, registry=batched)
    rng = random.Random(0)
    values = [rng.expovariate(20) for _ in range(500)] + [*_LATENCY_BUCKETS, 0.0, 1000.0]
    for value in values:
        reference.observe(value)
    histogram.observe_all(values[:300])
    histogram.observe_all(values[300:-1])
    histogram.observe(values[-1])

    def exposed(registry: CollectorRegistry) -> list[str]:
        return [line for line in generate_latest(registry).decode().splitlines() if "_created " not in line]

    assert exposed(batched) == exposed(plain)


def test_step_histogram_batches_in_one_bucket_count_as_their_values_would():
    """observe_all counts a batch whose least and greatest values share a bucket at once (a
    step's gaps are mostly one value); its count and sum stay those of one observation each."""
    plain, batched = CollectorRegistry(), CollectorRegistry()
    reference = Histogram("x_seconds", "doc", buckets=_LATENCY_BUCKETS, registry=plain)
    histogram = StepHistogram("x_seconds", "doc", buckets=_LATENCY_BUCKETS, registry=batched)
    rng = random.Random(1)
    batches = [[0.0123456789] * 256, [rng.uniform(0.0101, 0.0199) for _ in range(100)], [0.02, 0.01], [5.0]]
    for batch in batches:
        for value in batch:
            reference.observe(value)
    for batch in batches:
        histogram.observe_all(batch)
    histogram.observe_all(iter([0.5, 0.3]))  # any iterable
    histogram.observe_all([])
    reference.observe(0.5)
    reference.observe(0.3)

    def exposed(registry: CollectorRegistry) -> list[str]:
        return [line for line in generate_latest(registry).decode().splitlines() if "_created " not in line]

    assert exposed(batched) == exposed(plain)


class SlowExecutor(FakeExecutor):
    """A FakeExecutor whose every step takes `seconds` (a long prefill, a slow device)."""

    def __init__(self, seconds: float, **kwargs) -> None:
        super().__init__(**kwargs)
        self.seconds = seconds

    def step(self, plan):
        time.sleep(self.seconds)
        return super().step(plan)


class LosingExecutor(FakeExecutor):
    """A FakeExecutor that is lost (ExecutorUnavailable) at the steps numbered in `lose_at` and
    back at once, as an executor restarted: the scheduler recomputes its requests on it."""

    def __init__(self, lose_at: set[int], **kwargs) -> None:
        super().__init__(**kwargs)
        self.lose_at = lose_at
        self.num_steps = 0

    def step(self, plan):
        self.num_steps += 1
        if self.num_steps in self.lose_at:
            raise ExecutorUnavailable("executor at fake:1 is unavailable (Step): connection reset")
        return super().step(plan)


async def started(executor, metrics: SchedulerMetrics) -> AsyncEngine:
    """An AsyncEngine over `executor`, started on the running loop and connected to it."""
    engine = AsyncEngine(executor, EngineOptions(SchedulerConfig()), metrics)
    engine.start(asyncio.get_running_loop())
    for _ in range(500):
        if engine.engine is not None:
            break
        await asyncio.sleep(0.01)
    return engine


async def complete(engine: AsyncEngine, requests: list[tuple[list[int], SamplingParams]], name="r") -> None:
    """The requests through the engine, to their ends."""
    streams = [
        engine.add_request(f"{name}{i}", p, s, time.perf_counter()) for i, (p, s) in enumerate(requests)
    ]
    for stream in streams:
        while not stream.finished:
            await asyncio.wait_for(stream.wait(10**9), 30)


def run_engine(executor, requests: list[tuple[list[int], SamplingParams]]) -> SchedulerMetrics:
    """The requests through an AsyncEngine over `executor`, to their ends; its metrics."""
    metrics = SchedulerMetrics()

    async def run() -> None:
        engine = await started(executor, metrics)
        try:
            await complete(engine, requests)
        finally:
            await engine.aclose()

    asyncio.run(run())
    return metrics


def test_queue_time_ends_when_the_request_is_scheduled_not_when_its_step_is_back():
    """tandem_scheduler_queue_time_seconds is arrival to first schedule: a request sent to an idle
    scheduler waits for nothing, however long its prefill step then takes."""
    m = run_engine(SlowExecutor(0.5), [(prompt(8), SamplingParams(max_tokens=1, ignore_eos=True))])
    s = samples(m)
    assert s[("tandem_scheduler_queue_time_seconds_count",)] == 1
    assert s[("tandem_scheduler_queue_time_seconds_sum",)] < 0.25


def test_preemption_counts_each_prompt_once_and_its_recompute_as_no_prefix_hit():
    """Requests preempted for want of blocks and recomputed: the prompt and generation token
    counters are what the clients got, and the prefix cache counters see each prompt once (a
    recompute reading back its own blocks is no prefix hit: vLLM's hit rate leaves it out too)."""
    executor = FakeExecutor(num_kv_blocks=16, block_size=4)  # 64 tokens for 4 x (8 + 20)
    requests = [(prompt(8, seed), SamplingParams(max_tokens=20, ignore_eos=True)) for seed in range(4)]
    s = samples(run_engine(executor, requests))
    assert s[("tandem_scheduler_preemptions_total",)] > 0
    assert s[("tandem_scheduler_prompt_tokens_total",)] == 4 * 8
    assert s[("tandem_scheduler_generation_tokens_total",)] == 4 * 20
    assert s[("tandem_scheduler_prefix_cache_queried_tokens_total",)] == 4 * 8
    assert s[("tandem_scheduler_prefix_cache_hit_tokens_total",)] == 0  # no two prompts share a block
    assert s[("tandem_scheduler_requests_running",)] == s[("tandem_scheduler_requests_waiting",)] == 0
    assert s[("tandem_scheduler_kv_cache_blocks_used",)] == s[("tandem_scheduler_kv_cache_usage_ratio",)] == 0


@pytest.mark.parametrize("lose_at", [{1}, {5}, {3, 9}])
def test_requests_recomputed_on_a_new_executor_count_their_tokens_once(lose_at):
    """The executor lost before any token (step 1), after some, or twice: the requests kept and
    recomputed on the next one count their prompts, tokens and prefix lookups once, as the
    clients got them, and each its first token and queue time once."""
    requests = [(prompt(8, seed), SamplingParams(max_tokens=20, ignore_eos=True)) for seed in range(4)]
    s = samples(run_engine(LosingExecutor(lose_at, num_kv_blocks=64, block_size=4), requests))
    assert s[("tandem_scheduler_prompt_tokens_total",)] == 4 * 8
    assert s[("tandem_scheduler_generation_tokens_total",)] == 4 * 20
    assert s[("tandem_scheduler_prefix_cache_queried_tokens_total",)] == 4 * 8
    assert s[("tandem_scheduler_time_to_first_token_seconds_count",)] == 4
    assert s[("tandem_scheduler_queue_time_seconds_count",)] == 4
    assert s[("tandem_scheduler_executor_up",)] == 1
    assert s[("tandem_scheduler_requests_running",)] == s[("tandem_scheduler_kv_cache_blocks_used",)] == 0


class SlowCore:
    """What an API server sees of an engine core that is slow to admit (busy, or far): submit()
    waits until the test lets it go (an API server's RemoteEngine awaits the core's answer)."""

    def __init__(self, metrics, on_health) -> None:
        self.metrics = metrics
        self.tokenizer = None
        self.engine = SimpleNamespace(limits=SimpleNamespace(max_model_len=128))
        self.streams: list = []
        self.num_pending_admissions = 0
        self.submitting = threading.Event()

    def start(self, loop) -> None:
        pass

    def check_admitting(self):
        return self.engine

    async def submit(self, *args, **kwargs):
        self.submitting.set()
        await asyncio.Event().wait()  # (never answered here: the client goes first)

    def stop_admitting(self) -> None:
        pass

    async def aclose(self) -> None:
        pass


@pytest.mark.parametrize("how", ["cancel", "deadline"])
def test_a_request_cancelled_while_it_is_admitted_counts_as_failed(how):
    """A client that cancels (or whose deadline passes) while its request is being admitted is
    in tandem_scheduler_requests_failed_total, as one that does so while the request runs."""
    server = SchedulerServer(engine_factory=SlowCore, port=0, metrics_port=0)
    with ServerThread(server), grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        message = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[2, 3, 4]))
        call = stub.Generate(message, timeout=0.5 if how == "deadline" else None)
        assert server.engine.submitting.wait(10)
        if how == "cancel":
            call.cancel()
        with pytest.raises(grpc.RpcError):
            list(call)
        code = "CANCELLED" if how == "cancel" else "DEADLINE_EXCEEDED"
        deadline = time.monotonic() + 5
        while samples(server.metrics).get(("tandem_scheduler_requests_failed_total", ("code", code))) != 1:
            assert time.monotonic() < deadline, samples(server.metrics)
            time.sleep(0.02)


class RefusingExecutor(FakeExecutor):
    """A FakeExecutor that refuses its first `refuse` plans (the requests in them fail), then runs."""

    def __init__(self, refuse: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.refuse = refuse

    def step(self, plan):
        if self.refuse > 0:
            self.refuse -= 1
            raise ValueError(f"step {plan.step_id} rejected")
        return super().step(plan)


def test_requests_failed_in_refused_plans_leave_no_arrival_behind():
    """A long-running scheduler keeps no memory of requests that failed in plans the executor
    refused (1,600 here): their arrival times (kept to time their queueing) were never dropped, so
    each such failure grew the engine thread's table for good."""

    async def run() -> int:
        engine = await started(RefusingExecutor(refuse=25, max_num_seqs=64), SchedulerMetrics())
        try:
            params = SamplingParams(max_tokens=1, ignore_eos=True)
            for batch in range(25):
                await complete(engine, [(prompt(4, i), params) for i in range(64)], f"r{batch}-")
            await complete(engine, [(prompt(4), params)], "last")
            return len(engine._tracker.arrivals)
        finally:
            await engine.aclose()

    assert asyncio.run(run()) == 0
