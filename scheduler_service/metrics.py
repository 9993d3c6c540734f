"""The scheduler's Prometheus metrics, in their own registry, served on `--metrics-port`.

Counters and gauges are updated once per step from SchedulerStats deltas (engine thread);
latencies are observed when a request streams or finishes (asyncio thread).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from bisect import bisect_left
from collections.abc import Iterable
from functools import reduce
from operator import add
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info
from prometheus_client.metrics_core import Metric
from prometheus_client.utils import floatToGoString

from protos.plan import ExecutorInfo
from protos.ports import start_metrics_server
from scheduler_service.stats import SchedulerStats

logger = logging.getLogger(__name__)

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80)
# End to end: long answers take minutes (vLLM's e2e buckets reach 7680 s).
_E2E_BUCKETS = (*_LATENCY_BUCKETS, 120, 240, 480, 960, 1920, 3840, 7680)
_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# Tokens of one request: up to the longest max_model_len served (Qwen3's 40960 fits below 65536).
_REQUEST_TOKEN_BUCKETS = (*_TOKEN_BUCKETS, 32768, 65536, 131072)
_STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)
# Counters taken from SchedulerStats, as (metric attribute, stats attribute).
_STAT_COUNTERS = (
    ("preemptions", "num_preemptions"),
    ("prompt_tokens", "num_prompt_tokens"),
    ("generation_tokens", "num_generation_tokens"),
    ("prefix_queried_tokens", "num_prefix_queried_tokens"),
    ("prefix_hit_tokens", "num_prefix_hit_tokens"),
)


class StepHistogram:
    """A histogram that takes an engine step's observations in one call (`observe_all`: every
    stream's TTFT or ITL of the step): prometheus_client's Histogram.observe costs about 1 us a
    call, a tenth of the engine core's CPU per output token at 256 streams. Exposed as
    prometheus_client exposes a Histogram: cumulative buckets, count, sum and created."""

    def __init__(
        self, name: str, documentation: str, buckets: Iterable[float], registry: CollectorRegistry
    ) -> None:
        self._name = name
        self._documentation = documentation
        self._bounds = [*(float(b) for b in buckets), math.inf]
        self._counts = [0] * len(self._bounds)
        self._sum = 0.0
        self._created = time.time()
        self._lock = threading.Lock()  # observed on the asyncio thread, collected on the HTTP one
        registry.register(self)

    def observe(self, value: float) -> None:
        bucket = bisect_left(self._bounds, value)
        with self._lock:
            self._counts[bucket] += 1
            self._sum += value

    def observe_all(self, values: Iterable[float]) -> None:
        values = values if isinstance(values, (list, tuple)) else list(values)
        if not values:
            return
        bounds, counts = self._bounds, self._counts
        # The first bucket with value <= its bound. A step's values are mostly one (its streams'
        # gaps since the step before): when the least and the greatest share a bucket, all do.
        first = bisect_left(bounds, min(values))
        one_bucket = first == bisect_left(bounds, max(values))
        with self._lock:
            if one_bucket:
                counts[first] += len(values)
            else:
                for value in values:
                    counts[bisect_left(bounds, value)] += 1
            # (each added in turn, as a loop would: the same sum to the last bit)
            self._sum = reduce(add, values, self._sum)

    def collect(self) -> list[Metric]:
        with self._lock:
            counts, total = list(self._counts), self._sum
        metric = Metric(self._name, self._documentation, "histogram")
        cumulative = 0.0
        for bound, count in zip(self._bounds, counts, strict=True):
            cumulative += count
            metric.add_sample(self._name + "_bucket", {"le": floatToGoString(bound)}, cumulative)
        metric.add_sample(self._name + "_count", {}, cumulative)
        metric.add_sample(self._name + "_sum", {}, total)
        metric.add_sample(self._name + "_created", {}, self._created)
        return [metric]


class SchedulerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = r = registry if registry is not None else CollectorRegistry()
        p = "tandem_scheduler_"
        self.requests_running = Gauge(p + "requests_running", "Requests in the running batch", registry=r)
        self.requests_waiting = Gauge(p + "requests_waiting", "Requests queued for admission", registry=r)
        self.kv_usage = Gauge(p + "kv_cache_usage_ratio", "Fraction of KV cache blocks in use", registry=r)
        self.kv_blocks_used = Gauge(p + "kv_cache_blocks_used", "KV cache blocks in use", registry=r)
        self.kv_blocks_total = Gauge(p + "kv_cache_blocks_total", "KV cache blocks in all", registry=r)
        self.executor_up = Gauge(p + "executor_up", "1 while the executor is connected", registry=r)
        self.prefix_queried_tokens = Counter(
            p + "prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix cache", registry=r
        )
        self.prefix_hit_tokens = Counter(
            p + "prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache", registry=r
        )
        self.preemptions = Counter(p + "preemptions", "Sequences preempted (recomputed later)", registry=r)
        self.prompt_tokens = Counter(
            p + "prompt_tokens", "Prompt tokens of admitted requests (prefix-cache hits included)", registry=r
        )
        self.generation_tokens = Counter(p + "generation_tokens", "Tokens generated", registry=r)
        self.requests_finished = Counter(
            p + "requests_finished", "Requests finished, by finish reason", ["reason"], registry=r
        )
        self.requests_failed = Counter(
            p + "requests_failed",
            "Requests that ended with a gRPC error, by status code",
            ["code"],
            registry=r,
        )
        self.ttft = StepHistogram(
            p + "time_to_first_token_seconds", "Arrival to first token", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.itl = StepHistogram(
            p + "inter_token_latency_seconds",
            "Time between steps that gave a request tokens",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            p + "e2e_request_latency_seconds",
            "Arrival to final message",
            buckets=_E2E_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            p + "queue_time_seconds", "Arrival to first schedule", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.request_prompt_tokens = Histogram(
            p + "request_prompt_tokens",
            "Prompt tokens of each finished request",
            buckets=_REQUEST_TOKEN_BUCKETS,
            registry=r,
        )
        self.request_generation_tokens = Histogram(
            p + "request_generation_tokens",
            "Tokens generated for each finished request",
            buckets=_REQUEST_TOKEN_BUCKETS,
            registry=r,
        )
        self.info = Info(p[:-1], "The served model, as the executor describes it", registry=r)
        # Observed every step on the engine thread: StepHistograms (a third of prometheus_client's
        # Histogram.observe).
        self.tokens_per_step = StepHistogram(
            p + "tokens_per_step", "Tokens scheduled per step", buckets=_TOKEN_BUCKETS, registry=r
        )
        self.executor_round_trip = StepHistogram(
            p + "executor_round_trip_seconds",
            "From sending a step plan to reading its result (behind the plan before it, if any)",
            buckets=_STEP_BUCKETS,
            registry=r,
        )
        self._last = SchedulerStats()
        # The gauges SchedulerStats sets, in update_from_stats's order, and the values last set.
        self._stat_gauges = (
            self.requests_running,
            self.requests_waiting,
            self.kv_blocks_used,
            self.kv_blocks_total,
        )
        self._gauges: tuple[int, int, int, int] | None = None
        self._http: WSGIServer | None = None

    def update_from_stats(self, stats: SchedulerStats) -> None:
        """Gauges and counter deltas after a step; called from the engine thread. A gauge is set
        only when its value changed since the last call (a decode step changes one or two of
        them; each set takes the gauge's lock)."""
        last = self._last
        for metric, attr in _STAT_COUNTERS:
            value = getattr(stats, attr)
            delta = value - getattr(last, attr)
            if delta:
                if delta > 0:
                    getattr(self, metric).inc(delta)
                setattr(last, attr, value)
        gauges = (stats.num_running, stats.num_waiting, stats.num_used_blocks, stats.num_total_blocks)
        if gauges != self._gauges:
            previous = self._gauges or (None,) * 4
            for gauge, value, before in zip(self._stat_gauges, gauges, previous, strict=True):
                if value != before:
                    gauge.set(value)
            self.kv_usage.set(stats.kv_usage)
            self._gauges = gauges

    def executor_lost(self, num_held: int) -> None:
        """The gauges while no executor is connected: nothing runs, `num_held` requests wait."""
        self.requests_running.set(0)
        self.requests_waiting.set(num_held)
        self.kv_blocks_used.set(0)
        self.kv_usage.set(0)
        self._gauges = None  # the next update_from_stats sets every gauge

    def set_executor(self, info: ExecutorInfo, max_model_len: int) -> None:
        """The `tandem_scheduler_info` labels, at each connection to an executor."""
        self.info.info(
            {
                "model_name": info.model,
                "max_model_len": str(max_model_len),
                "block_size": str(info.block_size),
                "tensor_parallel_size": str(info.tensor_parallel_size),
            }
        )

    def reset_stats_baseline(self) -> None:
        """A new engine (after a reconnect) counts its stats from zero again."""
        self._last = SchedulerStats()
        self._gauges = None

    def serve(self, port: int, host: str = "127.0.0.1") -> int:
        """Serve /metrics over HTTP in a daemon thread; returns the bound port (port 0 picks one)."""
        self._http = start_metrics_server(self.registry, host, port)
        bound = self._http.server_port
        logger.info("metrics on http://%s:%d/metrics", host, bound)
        return bound

    def shutdown(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
