"""The executor's Prometheus metrics, in a registry of their own, served at /metrics."""

from __future__ import annotations

import logging
import os
import resource
from collections.abc import Callable
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

from protos import ports
from protos.plan import ExecutorInfo, StepPlan

logger = logging.getLogger(__name__)

# Gaps between steps: from 50 us (a plan already queued) to seconds (no work).
IDLE_BUCKETS = (0.00005, 0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.05, 0.25, 1.0, 5.0)
# From a 1 ms decode step on a GPU to a long CPU prefill.
STEP_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.0075,
    0.01,
    0.015,
    0.02,
    0.03,
    0.05,
    0.075,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)


def step_kind(plan: StepPlan) -> str:
    """ "decode" when every scheduled entry is one token of a sequence the executor already held,
    "prefill" when none is, "mixed" otherwise. (The rare one-token last chunk of a prefill counts
    as a decode: the plan alone cannot tell them apart.)"""
    if plan.new_seqs:
        new_ids = {s.seq_id for s in plan.new_seqs}
        decodes = sum(
            1
            for seq_id, n in zip(plan.seq_ids, plan.num_scheduled_tokens)
            if n == 1 and seq_id not in new_ids
        )
    else:  # a 256-entry decode plan in ~1 us rather than ~13
        decodes = plan.num_scheduled_tokens.count(1)
    if decodes == len(plan.seq_ids):
        return "decode"
    return "prefill" if decodes == 0 else "mixed"


def memory_reader(device: str) -> Callable[[], float]:
    """What tandem_executor_device_memory_used_bytes reports for this device."""
    if device.startswith("cuda"):
        import torch

        return lambda: torch.cuda.memory_allocated(device)
    return process_rss_bytes


def process_rss_bytes() -> int:
    """Resident set size of this process (peak RSS where /proc is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class ExecutorMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.step_duration = Histogram(
            "tandem_executor_step_duration_seconds",
            "Wall time of one step in the executor (validation, prepare, forward, sample)",
            ["kind"],
            buckets=STEP_BUCKETS,
            registry=r,
        )
        self.idle = Histogram(
            "tandem_executor_idle_seconds",
            "With two steps in flight (CUDA): time a Step stream had no step in flight, from a step's "
            "answer to the next plan's send (the device waiting on the scheduler, or for work)",
            buckets=IDLE_BUCKETS,
            registry=r,
        )
        self.device_busy = Counter(
            "tandem_executor_device_busy_seconds",
            "On CUDA, from events around each step: the device's time in steps, from a step's forward "
            "(its inputs copied) to its last op",
            registry=r,
        )
        self.device_gap = Histogram(
            "tandem_executor_device_gap_seconds",
            "On CUDA, from events around each step: the device's gaps between one step's last op and "
            "the next step's first (nothing of a step queued: the host, the scheduler or no work)",
            buckets=IDLE_BUCKETS,
            registry=r,
        )
        self.forward_tokens = Counter(
            "tandem_executor_forward_tokens",
            "Tokens run through the model (prefill chunks and decodes)",
            registry=r,
        )
        self.steps = Counter(
            "tandem_executor_steps", "Steps that ran a forward, by execution mode", ["mode"], registry=r
        )
        self.step_failures = Counter(
            "tandem_executor_step_failures",
            "Steps that failed, by gRPC status code",
            ["code"],
            registry=r,
        )
        self.kv_cache_blocks = Gauge(
            "tandem_executor_kv_cache_blocks", "Blocks in the paged KV cache", registry=r
        )
        self.kv_cache_bytes = Gauge(
            "tandem_executor_kv_cache_bytes", "Bytes of the paged KV cache (all layers, K and V)", registry=r
        )
        self.device_memory_used = Gauge(
            "tandem_executor_device_memory_used_bytes",
            "Device memory allocated by torch on CUDA; the process's resident set size on CPU",
            registry=r,
        )
        self.sequences = Gauge(
            "tandem_executor_sequences",
            "Sequences the executor holds (at most 2 x max_num_seqs)",
            registry=r,
        )
        self.info = Info("tandem_executor", "The served model and how it runs", registry=r)
        # Pre-create label values so dashboards see zeros before the first step.
        for kind in ("prefill", "decode", "mixed"):
            self.step_duration.labels(kind)
        for mode in ("cuda_graph", "eager"):
            self.steps.labels(mode)

    def set_executor(self, info: ExecutorInfo) -> None:
        """Called once the model is loaded; device memory is read at every scrape."""
        self.info.info(
            {
                "model": info.model,
                "architecture": info.architecture,
                "dtype": info.dtype,
                "kv_cache_dtype": info.kv_cache_dtype,
                "tensor_parallel_size": str(info.tensor_parallel_size),
                "attention_backend": info.attention_backend,
                "device": info.device,
            }
        )
        self.kv_cache_blocks.set(info.num_kv_blocks)
        self.kv_cache_bytes.set(info.num_kv_blocks * info.block_bytes)
        self.device_memory_used.set_function(memory_reader(info.device))

    def observe_step(self, plan: StepPlan, seconds: float, cuda_graph: bool) -> None:
        """A step that ran; plans that only drop sequences (no scheduled entry) are not counted."""
        if not plan.seq_ids:
            return
        self.step_duration.labels(step_kind(plan)).observe(seconds)
        self.forward_tokens.inc(sum(plan.num_scheduled_tokens))
        self.steps.labels("cuda_graph" if cuda_graph else "eager").inc()

    def observe_device(self, busy_seconds: float, gaps: list[float]) -> None:
        """The device timeline's steps settled since the last call (device_timeline.py)."""
        if busy_seconds:
            self.device_busy.inc(busy_seconds)
        for gap in gaps:
            self.device_gap.observe(gap)

    def step_failed(self, code: str) -> None:
        self.step_failures.labels(code).inc()


def start_metrics_server(metrics: ExecutorMetrics, host: str, port: int) -> WSGIServer:
    """Serve /metrics in a daemon thread; returns the HTTP server (call shutdown() to stop)."""
    server = ports.start_metrics_server(metrics.registry, host, port)
    logger.info("metrics at http://%s:%d/metrics", host, server.server_port)
    return server
