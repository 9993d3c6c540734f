"""Shared by the tests: from test_e2e_services.py."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from client import TandemClient, TandemError
from client.defaults import free_port
from client.up import Service
from helpers.metrics import scrape

ROOT = Path(__file__).resolve().parents[2]

NUM_KV_BLOCKS = 512

STARTUP_TIMEOUT = 60.0

# The HTTP API is off unless a test asks for it: its default port (8000) is one for all.
CHILD_ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TANDEM_LOG_LEVEL": "INFO", "TANDEM_HTTP_PORT": "0"}


class Services:
    def __init__(self, model: Path, log_dir: Path, scheduler_args: list[str] | None = None) -> None:
        host = "127.0.0.1"
        self.executor_port, self.executor_metrics_port = free_port(), free_port()
        self.scheduler_port, self.scheduler_metrics_port = free_port(), free_port()
        self.executor_address = f"{host}:{self.executor_port}"
        self.address = f"{host}:{self.scheduler_port}"
        common = ["--max-num-seqs", "64"]
        self.executor = Service(
            "executor",
            [
                sys.executable,
                "-m",
                "executor_service",
                "--model",
                str(model),
                "--port",
                str(self.executor_port),
            ]
            + ["--metrics-port", str(self.executor_metrics_port), "--num-kv-blocks", str(NUM_KV_BLOCKS)]
            + common,
            log_dir / "executor.log",
            env=CHILD_ENV,
            cwd=ROOT,
        )
        self.scheduler = Service(
            "scheduler",
            [sys.executable, "-m", "scheduler_service", "--executor", self.executor_address]
            + ["--port", str(self.scheduler_port), "--metrics-port", str(self.scheduler_metrics_port)]
            + ["--tokenizer", str(model)]
            + common
            + list(scheduler_args or []),
            log_dir / "scheduler.log",
            env=CHILD_ENV,
            cwd=ROOT,
        )
        self.health_before_executor: str | None = None
        self.health_after_executor: str | None = None

    def start(self) -> None:
        self.scheduler.start()
        with TandemClient(self.address) as client:
            self.health_before_executor = _first_health(client, self.scheduler)
            self.executor.start()
            try:
                client.wait_until_serving(STARTUP_TIMEOUT)
            except TandemError as e:
                raise RuntimeError(f"{e}\n{self.logs()}") from None
            self.health_after_executor = client.health()

    def logs(self) -> str:
        return "\n".join(f"--- {s.name} ---\n{s.tail(40)}" for s in (self.executor, self.scheduler))

    def stop(self) -> None:
        for service in (self.scheduler, self.executor):
            service.stop(10.0)

    def metrics(self, which: str) -> dict[str, float]:
        port = self.scheduler_metrics_port if which == "scheduler" else self.executor_metrics_port
        return scrape(f"http://127.0.0.1:{port}/metrics")


def _first_health(client: TandemClient, service: Service) -> str:
    """The scheduler's first health answer, once it listens."""
    deadline = time.monotonic() + STARTUP_TIMEOUT
    while time.monotonic() < deadline:
        assert service.alive(), service.tail()
        try:
            return client.health(timeout=1.0)
        except TandemError:
            time.sleep(0.05)
    raise AssertionError(f"the scheduler never answered health checks\n{service.tail()}")
