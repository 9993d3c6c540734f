"""Every listening port of both services is its own: a second scheduler or executor on a port in
use (gRPC or /metrics) exits non-zero at start with one line naming the port and its holder, and
the first one keeps serving (issue 13, item 2: gRPC's default SO_REUSEPORT let two schedulers
share a port and split its traffic)."""

from __future__ import annotations

import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from helpers.processes import CHILD_ENV, ROOT, ServiceProcess
from helpers.services import scheduler_process

from client import TandemClient
from client.defaults import free_port

# Starts service processes or runs models at length: left out of `make test-fast`.
pytestmark = pytest.mark.slow

START_TIMEOUT = 60.0


def _scheduler(port: int, metrics_port: int, http_port: int, log: Path) -> ServiceProcess:
    executor = f"127.0.0.1:{free_port()}"
    return scheduler_process(
        log, executor, "--http-port", str(http_port), port=port, metrics_port=metrics_port
    )


def _run(argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", *argv],
        env=CHILD_ENV,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=START_TIMEOUT,
    )


@pytest.fixture(scope="module")
def first(tmp_path_factory):
    """A scheduler holding a gRPC port, a metrics port and an HTTP port (its executor never comes:
    it listens NOT_SERVING, which is all these tests need)."""
    port, metrics_port, http_port = free_port(), free_port(), free_port()
    scheduler = _scheduler(port, metrics_port, http_port, tmp_path_factory.mktemp("ports") / "first.log")
    scheduler.start()
    scheduler.wait_for(scheduler.health, what="a health answer")
    scheduler.http_port = http_port
    yield scheduler, port, metrics_port
    scheduler.stop(5.0)


def _assert_still_serving(first) -> None:
    scheduler, port, metrics_port = first
    assert scheduler.alive(), scheduler.tail()
    with TandemClient(f"127.0.0.1:{port}") as client:
        for _ in range(10):  # with a shared port, the kernel sent some of these to the second one
            assert client.health(timeout=2.0) == "NOT_SERVING"
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as response:
        assert b"tandem_scheduler_executor_up" in response.read()
    for _ in range(10):  # no executor: the HTTP API's health says so
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(f"http://127.0.0.1:{scheduler.http_port}/health", timeout=5)
        assert e.value.code == 503


def _assert_refused(done: subprocess.CompletedProcess, port: int, holder_pid: int) -> None:
    assert done.returncode != 0, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, done.stderr
    assert f"port {port} is already in use (pid {holder_pid}: " in errors[0], done.stderr


@pytest.mark.parametrize("which", ["grpc", "metrics", "http"])
def test_a_second_scheduler_on_a_port_in_use_exits_naming_it(first, which):
    scheduler, port, metrics_port = first
    taken = {"grpc": port, "metrics": metrics_port, "http": scheduler.http_port}[which]
    ports = {name: taken if name == which else free_port() for name in ("grpc", "metrics", "http")}
    argv = ["scheduler_service", "--executor", f"127.0.0.1:{free_port()}", "--port", str(ports["grpc"])]
    done = _run(argv + ["--metrics-port", str(ports["metrics"]), "--http-port", str(ports["http"])])
    _assert_refused(done, taken, scheduler.process.pid)
    _assert_still_serving(first)


@pytest.mark.parametrize("which", ["grpc", "metrics"])
def test_an_executor_on_a_port_in_use_exits_naming_it(first, which, qwen3_tied):
    scheduler, port, metrics_port = first
    taken = port if which == "grpc" else metrics_port
    ports = (taken, free_port()) if which == "grpc" else (free_port(), taken)
    argv = ["executor_service", "--model", str(qwen3_tied), "--num-kv-blocks", "16", "--max-model-len", "256"]
    done = _run(argv + ["--port", str(ports[0]), "--metrics-port", str(ports[1])])
    _assert_refused(done, taken, scheduler.process.pid)
    _assert_still_serving(first)


@pytest.mark.parametrize("host", ["localhost", "0.0.0.0"])
def test_a_name_or_wildcard_overlapping_a_bound_address_is_refused(host):
    """gRPC binds each address a name resolves to and starts if one succeeds; `localhost` (or the
    wildcard) beside a server on 127.0.0.1:P must not start on P."""
    from concurrent import futures

    import grpc

    from protos.ports import EXCLUSIVE_PORT_OPTION, PortInUseError, add_grpc_port

    first = grpc.server(futures.ThreadPoolExecutor(1), options=[EXCLUSIVE_PORT_OPTION])
    port = add_grpc_port(first, "127.0.0.1", 0)
    first.start()
    try:
        second = grpc.server(futures.ThreadPoolExecutor(1), options=[EXCLUSIVE_PORT_OPTION])
        with pytest.raises(PortInUseError, match=f"port {port} is already in use"):
            add_grpc_port(second, host, port)
    finally:
        first.stop(0)
