"""Shared by the tests: from test_reliability.py."""

from __future__ import annotations

import asyncio
import random
import sys
import time
from pathlib import Path

from client import AsyncTandemClient, Final, TandemClient, TandemError
from client.defaults import free_port
from client.up import Service
from helpers.services import CHILD_ENV, ROOT, scrape

STARTUP_TIMEOUT = 60.0


def token_prompts(n: int, seed: int, lo: int = 1, hi: int = 40, vocab: int = 400) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


class Cluster:
    """An executor and a scheduler as subprocesses; the executor can be killed and started again
    on the same port."""

    def __init__(self, model: Path, log_dir: Path, *, num_kv_blocks: int = 1024, scheduler_args=()) -> None:
        self.model = model
        self.log_dir = log_dir
        self.num_kv_blocks = num_kv_blocks
        self.executor_port, self.executor_metrics_port = free_port(), free_port()
        self.port, self.metrics_port = free_port(), free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.executor_address = f"127.0.0.1:{self.executor_port}"
        self.executors: list[Service] = []
        self.scheduler = Service(
            "scheduler",
            [sys.executable, "-m", "scheduler_service", "--executor", self.executor_address]
            + ["--port", str(self.port), "--metrics-port", str(self.metrics_port)]
            + ["--tokenizer", str(model), "--max-num-seqs", "256", *scheduler_args],
            log_dir / "scheduler.log",
            env=CHILD_ENV,
            cwd=ROOT,
        )

    @property
    def executor(self) -> Service:
        return self.executors[-1]

    def start_executor(self, *extra: str, num_kv_blocks: int | None = None) -> Service:
        blocks = num_kv_blocks or self.num_kv_blocks
        service = Service(
            "executor",
            [sys.executable, "-m", "executor_service", "--model", str(self.model)]
            + ["--port", str(self.executor_port), "--metrics-port", str(self.executor_metrics_port)]
            + ["--num-kv-blocks", str(blocks), "--max-num-seqs", "256", *extra],
            self.log_dir / f"executor-{len(self.executors)}.log",
            env=CHILD_ENV,
            cwd=ROOT,
        )
        service.start()
        self.executors.append(service)
        return service

    def start(self, *executor_args: str) -> None:
        self.start_executor(*executor_args)
        self.scheduler.start()
        self.wait_serving()

    def wait_serving(self) -> None:
        with TandemClient(self.address) as client:
            try:
                client.wait_until_serving(STARTUP_TIMEOUT)
            except TandemError as e:
                raise AssertionError(f"{e}\n{self.logs()}") from None

    def kill_executor(self) -> None:
        self.executor.process.kill()  # SIGKILL
        self.executor.process.wait()

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

    def logs(self) -> str:
        return "\n".join(f"--- {s.name} ---\n{s.tail(30)}" for s in (*self.executors, self.scheduler))

    def stop(self) -> None:
        for service in (self.scheduler, *self.executors):
            service.stop(10.0)


async def _stream(client, prompt, progress: list[int], i: int, **sampling):
    ids, final = [], None
    async for item in client.generate(prompt, **sampling):
        if isinstance(item, Final):
            final = item
        else:
            ids += item.token_ids
            progress[i] = len(ids)
    return ids, final


def start_streams(client, prompts, progress: list[int], max_tokens: int) -> list[asyncio.Future]:
    """One greedy stream per prompt (ignore_eos), running on the loop; progress[i] counts the tokens
    stream i has received; each task ends with (token ids, Final)."""
    return [
        asyncio.ensure_future(_stream(client, p, progress, i, max_tokens=max_tokens, ignore_eos=True))
        for i, p in enumerate(prompts)
    ]


def _kill_and_recover(
    cluster: Cluster, prompts, max_tokens: int, ready, restart_args=(), kill=None
) -> tuple[list, list[int]]:
    """Start one greedy stream per prompt; once ready(progress) holds, SIGKILL the executor (or
    `kill()` it another way, returning once it is gone) and start a new one on the same port.
    Returns the results and each stream's progress at the kill."""
    progress = [0] * len(prompts)

    async def run():
        async with AsyncTandemClient(cluster.address, timeout=180) as client:
            tasks = start_streams(client, prompts, progress, max_tokens)
            deadline = time.monotonic() + 60
            # In a thread: `ready` may scrape metrics over HTTP, which would hold up the event loop
            # and with it the streams' requests, so that some would reach the scheduler late.
            while not await asyncio.to_thread(ready, progress):
                assert time.monotonic() < deadline, f"never ready to kill: {progress}"
                await asyncio.sleep(0.002)
            at_kill = list(progress)
            (kill or cluster.kill_executor)()
            cluster.start_executor(*restart_args)
            return await asyncio.gather(*tasks), at_kill

    return asyncio.run(run())


def _check_identical(results, expected) -> int:
    completed = 0
    for i, ((ids, final), want) in enumerate(zip(results, expected, strict=True)):
        assert ids == want.token_ids, f"stream {i} differs from the undisturbed run"
        assert final is not None and final.finish_reason == want.finish_reason
        assert final.completion_tokens == len(ids)  # nothing sent twice
        completed += 1
    return completed
