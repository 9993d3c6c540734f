"""The tests' one process wrapper: `ServiceProcess` runs a service (`python -m executor_service`,
`python -m scheduler_service`, `tandem up`) as a child process with its output in a log file,
waits until it answers, and stops it with SIGTERM, then SIGKILL. `descendants` and `alive` look
at what a process left behind (Linux /proc)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos.service_main import PARENT_PID_ENV

ROOT = Path(__file__).resolve().parents[2]

STARTUP_TIMEOUT = 60.0

# One intra-op thread: the same float reductions as an in-process reference. The HTTP API is off
# unless a test asks for it: its default port (8000) is one for all.
CHILD_ENV = {
    **os.environ,
    "PYTHONPATH": str(ROOT),
    "OMP_NUM_THREADS": "1",
    "TANDEM_LOG_LEVEL": "INFO",
    "TANDEM_HTTP_PORT": "0",
}

T = TypeVar("T")


class ServiceProcess:
    """`argv` as a child process in the repository's root, with `env` (default CHILD_ENV) and its
    stdout and stderr in `log`. `address` is where its gRPC server listens, `health_service` the
    service whose grpc.health.v1 status says it is ready. Like `tandem up`'s services, it gets
    SIGTERM when the test process dies. A context manager: started on entry, stopped on exit."""

    def __init__(
        self,
        name: str,
        argv: list[str],
        log: Path,
        *,
        env: dict[str, str] | None = None,
        address: str | None = None,
        metrics_port: int | None = None,
        health_service: str = "",
    ) -> None:
        self.name = name
        self.argv = argv
        self.log = log
        self.env = env if env is not None else CHILD_ENV
        self.address = address
        self.metrics_port = metrics_port
        self.health_service = health_service
        self.process: subprocess.Popen | None = None

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def start(self) -> ServiceProcess:
        with self.log.open("w") as out:
            self.process = subprocess.Popen(
                self.argv,
                cwd=ROOT,
                env={**self.env, PARENT_PID_ENV: str(os.getpid())},
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        return self

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def output(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""

    def tail(self, n: int = 30) -> str:
        return "".join(self.output().splitlines(keepends=True)[-n:])

    def wait_for(
        self,
        answer: Callable[[], T | None],
        timeout: float = STARTUP_TIMEOUT,
        what: str = "an answer",
        logs: Callable[[], str] | None = None,
    ) -> T:
        """answer()'s first result that is not None, asked while the process runs; fails with the
        end of its log (or `logs()`) if it exits first or `timeout` passes."""
        logs = logs or self.tail
        deadline = time.monotonic() + timeout
        while True:
            assert self.alive(), f"{self.name} exited with {self.process.returncode} before {what}\n{logs()}"
            result = answer()
            if result is not None:
                return result
            assert time.monotonic() < deadline, f"{self.name}: no {what} after {timeout:.0f} s\n{logs()}"
            time.sleep(0.05)

    def health(self) -> str | None:
        """Its grpc.health.v1 status name ("SERVING", "NOT_SERVING"...), None while it does not answer."""
        with grpc.insecure_channel(self.address) as channel:
            request = health_pb2.HealthCheckRequest(service=self.health_service)
            try:
                response = health_pb2_grpc.HealthStub(channel).Check(request, timeout=1.0)
            except grpc.RpcError:
                return None
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)

    def wait_serving(self, timeout: float = STARTUP_TIMEOUT, logs: Callable[[], str] | None = None) -> None:
        self.wait_for(lambda: self.health() == "SERVING" or None, timeout, "SERVING", logs)

    def wait_listening(self, timeout: float = STARTUP_TIMEOUT) -> None:
        """Until its port accepts connections (a gRPC channel would back off between attempts)."""
        host, port = self.address.rsplit(":", 1)

        def connected() -> bool | None:
            try:
                socket.create_connection((host, int(port)), timeout=1).close()
                return True
            except OSError:
                return None

        self.wait_for(connected, timeout, "a listening port")

    def stop(self, grace: float = 10.0) -> int | None:
        """SIGTERM, then SIGKILL after `grace` seconds; its exit code (None if it never started)."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(grace)
            except subprocess.TimeoutExpired:
                print(f"{self.name} did not stop within {grace:.0f} s: killing it", file=sys.stderr)
                self.kill()
        return self.process.returncode

    def kill(self) -> None:
        """SIGKILL, and reap it."""
        self.process.kill()
        self.process.wait()

    def __enter__(self) -> ServiceProcess:
        return self.start() if self.process is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def descendants(pid: int) -> list[int]:
    """Every live process below `pid` (Linux /proc)."""
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                children = [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
            found += children
            todo += children
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"
