"""The scheduler's Prometheus metrics without a service: bucket ranges, the info metric, and what
an AsyncEngine over a fake executor records."""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import replace

from helpers.fake_executor import FakeExecutor, prompt
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from scheduler_service.async_engine import AsyncEngine
from scheduler_service.config import EngineOptions, SchedulerConfig
from scheduler_service.metrics import _LATENCY_BUCKETS, SchedulerMetrics, StepHistogram
from scheduler_service.sampling_params import SamplingParams


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


def run_engine(executor, requests: list[tuple[list[int], SamplingParams]]) -> SchedulerMetrics:
    """The requests through an AsyncEngine over `executor`, to their ends; its metrics."""
    metrics = SchedulerMetrics()

    async def run() -> None:
        engine = AsyncEngine(executor, EngineOptions(SchedulerConfig()), metrics)
        engine.start(asyncio.get_running_loop())
        try:
            for _ in range(500):
                if engine.engine is not None:
                    break
                await asyncio.sleep(0.01)
            streams = [
                engine.add_request(f"r{i}", p, s, time.perf_counter()) for i, (p, s) in enumerate(requests)
            ]
            for stream in streams:
                while not stream.finished:
                    await asyncio.wait_for(stream.wait(10**9), 30)
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
