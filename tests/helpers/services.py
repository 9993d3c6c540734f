"""Tandem's two services as the tests start them (ServiceProcess, processes.py): one executor or one
scheduler on free localhost ports, or `Services`, a pair whose executor can be killed and started
again on the same port."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from client.defaults import free_port
from helpers.metrics import scrape
from helpers.processes import STARTUP_TIMEOUT, ServiceProcess
from protos.tandem.v1 import executor_pb2

EXECUTOR_SERVICE = executor_pb2.DESCRIPTOR.services_by_name["ExecutorService"].full_name

# The executor of test_executor_service.py and test_executor_security.py, and its in-process twin.
EXECUTOR_OPTIONS = dict(
    block_size=4, num_kv_blocks=96, max_model_len=256, max_num_seqs=16, max_num_batched_tokens=64
)

NUM_KV_BLOCKS = 512


def _flags(options: dict[str, object]) -> list[str]:
    """block_size=4 -> ["--block-size", "4"]"""
    return [arg for name, value in options.items() for arg in (f"--{name.replace('_', '-')}", str(value))]


def executor_process(
    log: Path,
    *flags: str,
    model: Path | None = None,
    port: int | None = None,
    metrics_port: int = 0,
    env: dict[str, str] | None = None,
    **options: object,
) -> ServiceProcess:
    """`python -m executor_service` (not started) on `port` (default: a free one) with `model` (default:
    the embedded one), its metrics on `metrics_port` (0: none), `options` as flags, then `flags`."""
    port = port or free_port()
    argv = [sys.executable, "-m", "executor_service"]
    if model is not None:
        argv += ["--model", str(model)]
    argv += ["--port", str(port), "--metrics-port", str(metrics_port), *_flags(options), *flags]
    return ServiceProcess(
        "executor",
        argv,
        log,
        env=env,
        address=f"127.0.0.1:{port}",
        metrics_port=metrics_port,
        health_service=EXECUTOR_SERVICE,
    )


def scheduler_process(
    log: Path,
    executor_address: str,
    *flags: str,
    name: str = "scheduler",
    port: int | None = None,
    metrics_port: int = 0,
    env: dict[str, str] | None = None,
) -> ServiceProcess:
    """`python -m scheduler_service` (not started) against `executor_address`, on `port` (default: a
    free one), its metrics on `metrics_port` (0: none), then `flags`."""
    port = port or free_port()
    argv = [sys.executable, "-m", "scheduler_service", "--executor", executor_address]
    argv += ["--port", str(port), "--metrics-port", str(metrics_port), *flags]
    return ServiceProcess(name, argv, log, env=env, address=f"127.0.0.1:{port}", metrics_port=metrics_port)


class Services:
    """An executor and a scheduler (`--max-num-seqs` for both) as processes on free localhost ports;
    the executor can be killed and another started on the same port."""

    def __init__(
        self,
        model: Path,
        log_dir: Path,
        scheduler_args=(),
        *,
        num_kv_blocks: int = NUM_KV_BLOCKS,
        max_num_seqs: int = 64,
    ) -> None:
        self.model = model
        self.log_dir = log_dir
        self.num_kv_blocks = num_kv_blocks
        self.max_num_seqs = max_num_seqs
        self.executor_port, self.executor_metrics_port = free_port(), free_port()
        self.port, self.metrics_port = free_port(), free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.executor_address = f"127.0.0.1:{self.executor_port}"
        self.executors: list[ServiceProcess] = []
        self.scheduler = scheduler_process(
            log_dir / "scheduler.log",
            self.executor_address,
            *("--tokenizer", str(model), "--max-num-seqs", str(max_num_seqs), *scheduler_args),
            port=self.port,
            metrics_port=self.metrics_port,
        )
        # The scheduler's health before and after its executor came (start_scheduler_first).
        self.health_before_executor: str | None = None
        self.health_after_executor: str | None = None

    @property
    def executor(self) -> ServiceProcess:
        return self.executors[-1]

    def start_executor(self, *extra: str, num_kv_blocks: int | None = None) -> ServiceProcess:
        service = executor_process(
            self.log_dir / f"executor-{len(self.executors)}.log",
            *extra,
            model=self.model,
            port=self.executor_port,
            metrics_port=self.executor_metrics_port,
            num_kv_blocks=num_kv_blocks or self.num_kv_blocks,
            max_num_seqs=self.max_num_seqs,
        )
        self.executors.append(service.start())
        return service

    def start(self, *executor_args: str) -> None:
        """The executor, then the scheduler, until it serves."""
        self.start_executor(*executor_args)
        self.scheduler.start()
        self.wait_serving()

    def start_scheduler_first(self) -> None:
        """The scheduler, then the executor, until the scheduler serves; records its health before
        and after the executor came."""
        self.scheduler.start()
        self.health_before_executor = self.scheduler.wait_for(self.scheduler.health, what="a health answer")
        self.start_executor()
        self.wait_serving()
        self.health_after_executor = self.scheduler.health()

    def wait_serving(self) -> None:
        self.scheduler.wait_serving(STARTUP_TIMEOUT, logs=self.logs)

    def kill_executor(self) -> None:
        self.executor.kill()

    def metrics(self, which: str = "scheduler") -> dict[str, float]:
        port = self.metrics_port if which == "scheduler" else self.executor_metrics_port
        return scrape(f"http://127.0.0.1:{port}/metrics")

    def wait_idle(self, timeout: float = 20.0) -> dict[str, float]:
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            busy = [
                m[f"tandem_scheduler_{n}"]
                for n in ("requests_running", "requests_waiting", "kv_cache_blocks_used")
            ]
            if busy == [0, 0, 0] and m["tandem_scheduler_kv_cache_usage_ratio"] == 0:
                return m
            assert time.monotonic() < deadline, f"never idle: {busy}"
            time.sleep(0.05)

    def executor_held(self) -> int:
        """How many sequences the executor holds (a Reset behind the scheduler's back would be
        refused: the scheduler owns the executor)."""
        return int(self.metrics("executor")["tandem_executor_sequences"])

    def executor_held_after_drops(self, timeout: float = 10.0) -> int:
        """executor_held() once it is 0, or after `timeout`. A sequence that stopped on a token is
        in the plans scheduled ahead of its result: the executor drops it with the plan behind
        them, up to two steps after the scheduler is idle (three plans in flight). A sequence
        leaked is held for good."""
        deadline = time.monotonic() + timeout
        while (held := self.executor_held()) and time.monotonic() < deadline:
            time.sleep(0.05)
        return held

    def logs(self) -> str:
        return "\n".join(f"--- {s.name} ---\n{s.tail(30)}" for s in (*self.executors, self.scheduler))

    def stop(self) -> None:
        for service in (self.scheduler, *self.executors):
            service.stop(10.0)
