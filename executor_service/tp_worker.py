"""Tensor-parallel ranks 1..N-1: started by rank 0, each loads its shard of the weights and
loops reading plans from its stdin. A rank keeps its own per-sequence state (the same as rank
0's), runs the forward and joins the collectives; it never samples. It exits when rank 0 says
so, when its stdin reaches EOF or rank 0 is gone (parent-death watchdog, for a rank blocked in
a collective), or when a collective fails."""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import BinaryIO

import torch

from executor_service import parallel
from executor_service.config import ExecutorConfig
from executor_service.runner_startup import start_model_runner
from executor_service.steps_in_flight import Unfilled, apply_plan, drop_all, launch_batch
from protos.service_main import freeze_startup_heap, mark_service_process

logger = logging.getLogger(__name__)

JOIN_SECONDS = 10.0
WATCHDOG_SECONDS = 0.5


class WorkerProcesses:
    """Rank 0's handle on ranks 1..N-1: `python -m executor_service.tp_worker` subprocesses
    (not multiprocessing's spawn, which would re-run the user's main module). Each one's stdin
    carries its arguments, pickled, then the message of every step."""

    def __init__(self, config: ExecutorConfig) -> None:
        root = str(Path(__file__).resolve().parents[1])
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
        }
        self.procs: dict[int, subprocess.Popen] = {}
        for rank in range(1, config.tensor_parallel_size):
            proc = subprocess.Popen(
                [sys.executable, "-m", "executor_service.tp_worker"], stdin=subprocess.PIPE, env=env
            )
            args = (
                config,
                rank,
                os.getpid(),
                torch.get_num_threads(),
                logging.getLogger().getEffectiveLevel(),
            )
            self.procs[rank] = proc
            try:
                proc.stdin.write(pickle.dumps(args))
                proc.stdin.flush()
            except BrokenPipeError:
                self.kill()
                raise RuntimeError(
                    f"tensor-parallel rank {rank} died at start (exit code {proc.returncode})"
                ) from None
        logger.info(
            "tensor parallel size %d: started ranks %s (pids %s)",
            config.tensor_parallel_size,
            list(self.procs),
            self.pids,
        )

    def send(self, message: parallel.TPMessage) -> None:
        """The message to every rank (BrokenPipeError if one is gone)."""
        message.sent_ns = time.monotonic_ns()
        data = parallel.encode_message(message)
        for proc in self.procs.values():
            proc.stdin.write(data)
            proc.stdin.flush()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs.values()]

    def failed(self) -> list[tuple[int, int | None]]:
        """(rank, exit code) of the ranks that have exited."""
        return [(rank, p.returncode) for rank, p in self.procs.items() if p.poll() is not None]

    def join(self, timeout: float = JOIN_SECONDS) -> None:
        for proc in self.procs.values():
            with contextlib.suppress(OSError):
                proc.stdin.close()
        deadline = time.monotonic() + timeout
        for proc in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(0.0, deadline - time.monotonic()))
        self.kill()

    def kill(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs.values():
            proc.wait()
            with contextlib.suppress(OSError):
                proc.stdin.close()


class BroadcastLatency:
    """What the plan broadcast costs this rank, over every message received: from rank 0's send to
    the message unpickled here (queueing included when this rank was still busy), and the part of
    it this rank waited for (from the later of the send and this rank's read to the unpickled
    message): the broadcast's share of the step's critical path."""

    def __init__(self) -> None:
        self.count, self.latency_ns, self.waited_ns, self.max_waited_ns = 0, 0, 0, 0

    def add(self, sent_ns: int, asked_ns: int, received_ns: int) -> None:
        waited = received_ns - max(sent_ns, asked_ns)
        self.count += 1
        self.latency_ns += received_ns - sent_ns
        self.waited_ns += waited
        self.max_waited_ns = max(self.max_waited_ns, waited)

    def __str__(self) -> str:
        n = max(self.count, 1) * 1e3
        return (
            f"plan broadcast over {self.count} messages: waited for {self.waited_ns / n:.1f} us mean "
            f"(max {self.max_waited_ns / 1e3:.1f} us), {self.latency_ns / n:.1f} us mean from send to unpickled"
        )


def _exit_with_parent(parent_pid: int) -> None:
    """Exit as soon as rank 0 is gone (reparented), even while blocked in a collective."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(WATCHDOG_SECONDS)
        logger.error("rank 0 (pid %d) is gone: exiting", parent_pid)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()


def worker_main(
    config: ExecutorConfig, tp_rank: int, parent_pid: int, num_threads: int, log_level: int, plans: BinaryIO
) -> None:
    _exit_with_parent(parent_pid)
    logging.basicConfig(
        level=log_level, format=f"%(asctime)s %(levelname)s rank{tp_rank} %(name)s: %(message)s"
    )
    torch.set_num_threads(num_threads)
    try:
        _serve_plans(config, tp_rank, plans)
    except EOFError:
        logger.error("rank %d: rank 0 is gone, exiting", tp_rank)
        os._exit(1)
    except Exception:
        logger.exception("rank %d failed", tp_rank)
        sys.stderr.flush()
        os._exit(1)
    os._exit(0)


def _serve_plans(config: ExecutorConfig, tp_rank: int, plans: BinaryIO) -> None:
    device = parallel.rank_device(config.device, tp_rank)
    parallel.init_group(
        device, config.tp_master_addr, config.tp_master_port, tp_rank, config.tensor_parallel_size
    )
    runner = start_model_runner(config, tp_rank)
    freeze_startup_heap()
    seqs = {}
    unfilled = Unfilled()
    # The ids the last launched step received from rank 0 on the device.
    last_ids = None
    latency = BroadcastLatency()
    while True:
        asked = time.monotonic_ns()
        message = parallel.read_message(plans)
        latency.add(message.sent_ns, asked, time.monotonic_ns())
        unfilled.fill(message.sampled_token_ids)
        if message.kind == "close":
            break
        if message.kind == "reset":  # rank 0 collected its steps in flight first: none unfilled
            drop_all(runner, seqs)
            continue
        plan = message.plan
        batch = apply_plan(runner, seqs, plan)
        if not batch:
            continue
        launch, placeholders = launch_batch(
            runner, batch, plan, last_ids if message.pending else None, message.all_logits
        )
        unfilled.launched(placeholders)
        last_ids = launch.sampled.sampled_token_ids if launch.sampled is not None else None
    logger.info("rank %d: closing; %s", tp_rank, latency)
    runner.release_cuda_graphs()
    parallel.destroy_group()


if __name__ == "__main__":
    mark_service_process()
    worker_main(*pickle.load(sys.stdin.buffer), plans=sys.stdin.buffer)
