"""Shared by the tests: from test_executor_service.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from client.defaults import free_port
from scheduler_service.executor_client import (
    ExecutorUnavailable,
    RemoteExecutor,
)

ROOT = Path(__file__).resolve().parents[2]

NUM_KV_BLOCKS = 96

EXECUTOR_OPTIONS = dict(
    block_size=4, num_kv_blocks=NUM_KV_BLOCKS, max_model_len=256, max_num_seqs=16, max_num_batched_tokens=64
)


@dataclass
class ExecutorProcess:
    proc: subprocess.Popen
    address: str
    metrics_url: str
    log: Path

    def output(self) -> str:
        return self.log.read_text()


def start_executor(model: Path, log: Path, **env: str) -> ExecutorProcess:
    port, metrics_port = free_port(), free_port()
    args = [sys.executable, "-m", "executor_service", "--model", str(model)]
    args += ["--port", str(port), "--metrics-port", str(metrics_port)]
    for name, value in EXECUTOR_OPTIONS.items():
        args += [f"--{name.replace('_', '-')}", str(value)]
    # One intra-op thread: the same float reductions as the in-process reference.
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **env}
    with log.open("w") as f:
        proc = subprocess.Popen(args, cwd=ROOT, env=full_env, stdout=f, stderr=subprocess.STDOUT)
    return ExecutorProcess(proc, f"127.0.0.1:{port}", f"http://127.0.0.1:{metrics_port}/metrics", log)


def wait_ready(ep: ExecutorProcess, timeout: float = 60) -> None:
    with RemoteExecutor(ep.address) as remote:
        deadline = time.monotonic() + timeout
        while True:
            assert ep.proc.poll() is None, f"executor exited early:\n{ep.output()}"
            try:
                return remote.wait_ready(0.5)
            except ExecutorUnavailable:
                if time.monotonic() > deadline:
                    raise


def stop(ep: ExecutorProcess, timeout: float = 10) -> int | None:
    if ep.proc.poll() is None:
        ep.proc.send_signal(signal.SIGTERM)
        try:
            return ep.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            ep.proc.kill()
            ep.proc.wait()
            return None
    return ep.proc.returncode
