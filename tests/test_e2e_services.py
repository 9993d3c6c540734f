"""End to end: the executor and the scheduler as real processes on localhost ports, driven through
the real client. One pair of services is shared by the module (started scheduler first, so the
fixture also records how health follows the executor)."""

from __future__ import annotations

import asyncio
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time

import grpc
import pytest
from helpers.processes import CHILD_ENV, ROOT, ServiceProcess
from helpers.services import NUM_KV_BLOCKS, Services, scheduler_process

from client import AsyncTandemClient, Chunk, Final, TandemClient, TandemError
from client.defaults import free_port
from client.llm import LLM
from scheduler_service.sampling_params import SamplingParams

# Starts service processes or runs models at length: left out of `make test-fast`.
pytestmark = pytest.mark.slow

MAX_TOKENS = 24
CANCEL_MAX_TOKENS = 120
# The services share two cores with the test process (and another xdist worker).
TEXT_PROMPTS = ["The list type", "Exceptions are", "A class definition", "The for statement"]


@pytest.fixture(scope="module")
def services(qwen3_tied, tmp_path_factory):
    services = Services(qwen3_tied, tmp_path_factory.mktemp("e2e_logs"))
    try:
        services.start_scheduler_first()
        yield services
    finally:
        services.stop()


@pytest.fixture(scope="module")
def reference(qwen3_tied):
    """The in-process LLM on the same checkpoint (greedy is deterministic)."""
    return LLM(str(qwen3_tied), num_kv_blocks=NUM_KV_BLOCKS)


def token_prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, 400) for _ in range(rng.randint(1, 40))] for _ in range(n)]


async def stream_one(client: AsyncTandemClient, prompt, **sampling) -> tuple[list[Chunk], Final | None]:
    chunks, final = [], None
    async for item in client.generate(prompt, **sampling):
        if isinstance(item, Final):
            final = item
        else:
            chunks.append(item)
    return chunks, final


def wait_idle(services: Services, timeout: float = 10.0) -> dict[str, float]:
    """Scheduler metrics once nothing runs or waits and no KV block is used."""
    deadline = time.monotonic() + timeout
    while True:
        m = services.metrics("scheduler")
        idle = (
            m["tandem_scheduler_requests_running"] == 0
            and m["tandem_scheduler_requests_waiting"] == 0
            and m["tandem_scheduler_kv_cache_usage_ratio"] == 0
        )
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.1)


def test_scheduler_health_follows_the_executor(services):
    assert services.health_before_executor == "NOT_SERVING"
    assert services.health_after_executor == "SERVING"
    with TandemClient(services.address) as client:
        info = client.model_info()
    assert info.vocab_size == 512 and info.num_kv_blocks == NUM_KV_BLOCKS and info.device == "cpu"


def test_32_concurrent_streams_match_in_process(services, reference):
    prompts = TEXT_PROMPTS + token_prompts(28, seed=1)
    expected = reference.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS), use_tqdm=False)
    before = services.metrics("scheduler")

    async def run():
        async with AsyncTandemClient(services.address) as client:
            return await asyncio.gather(*(stream_one(client, p, max_tokens=MAX_TOKENS) for p in prompts))

    results = asyncio.run(run())
    received = 0
    for i, ((chunks, final), want) in enumerate(zip(results, expected)):
        ids = [t for c in chunks for t in c.token_ids]
        assert ids == want.token_ids, f"prompt {i} diverged"
        assert "".join(c.text for c in chunks) == want.text, f"prompt {i}: text differs"
        assert final is not None and final.finish_reason == want.finish_reason
        assert final.completion_tokens == len(ids) and final.prompt_tokens == len(want.prompt_token_ids)
        received += len(ids)
    # Streaming: the longer generations arrive in several chunks.
    assert max(len(chunks) for chunks, _ in results) > 1
    after = wait_idle(services)
    generated = (
        after["tandem_scheduler_generation_tokens_total"] - before["tandem_scheduler_generation_tokens_total"]
    )
    assert generated == received


def test_cancelling_half_leaves_the_others_correct_and_frees_everything(services, reference):
    prompts = token_prompts(32, seed=2)
    params = SamplingParams(max_tokens=CANCEL_MAX_TOKENS, ignore_eos=True)
    expected = reference.generate(prompts, params, use_tqdm=False)
    before = services.metrics("scheduler")
    received = [0] * len(prompts)

    async def run_one(client, i: int):
        stream = client.generate(prompts[i], max_tokens=CANCEL_MAX_TOKENS, ignore_eos=True)
        ids, final = [], None
        async for item in stream:
            if isinstance(item, Final):
                final = item
                continue
            ids += item.token_ids
            received[i] = len(ids)
            if i % 2 and len(ids) >= 3:
                stream.cancel()
        return ids, final

    async def run():
        async with AsyncTandemClient(services.address) as client:
            return await asyncio.gather(*(run_one(client, i) for i in range(len(prompts))))

    results = asyncio.run(run())
    for i, ((ids, final), want) in enumerate(zip(results, expected)):
        if i % 2:
            assert final is None and 3 <= len(ids) < CANCEL_MAX_TOKENS
            assert ids == want.token_ids[: len(ids)], f"cancelled prompt {i} diverged before its cancel"
        else:
            assert ids == want.token_ids, f"prompt {i} diverged"
            assert final.finish_reason == "length" and final.completion_tokens == CANCEL_MAX_TOKENS

    after = wait_idle(services)
    assert after["tandem_scheduler_requests_running"] == 0
    assert after["tandem_scheduler_requests_waiting"] == 0
    assert after["tandem_scheduler_kv_cache_usage_ratio"] == 0
    assert after["tandem_scheduler_kv_cache_blocks_used"] == 0
    generated = (
        after["tandem_scheduler_generation_tokens_total"] - before["tandem_scheduler_generation_tokens_total"]
    )
    # Cancelled requests may have generated a token or two that was never sent.
    assert sum(received) <= generated <= sum(received) + 16 * CANCEL_MAX_TOKENS
    assert generated < len(prompts) * CANCEL_MAX_TOKENS


def test_executor_counted_every_step(services):
    # Traffic of its own: under xdist this test may get a fresh `services` with none before it.
    with TandemClient(services.address) as client:
        assert len(client.complete([5, 6, 7], max_tokens=6, ignore_eos=True).token_ids) == 6
    scheduler, executor = services.metrics("scheduler"), services.metrics("executor")
    steps = executor["tandem_executor_step_duration_seconds_count"]
    assert steps > 0 and executor["tandem_executor_step_duration_seconds_sum"] > 0
    # Every plan with scheduled tokens is one executor step; plans that only drop finished
    # sequences reach the executor but run no forward.
    assert steps <= scheduler["tandem_scheduler_executor_round_trip_seconds_count"]
    assert (
        executor["tandem_executor_forward_tokens_total"] == scheduler["tandem_scheduler_tokens_per_step_sum"]
    )


def test_bad_request_is_invalid_argument_and_the_service_stays_up(services):
    with TandemClient(services.address) as client:
        with pytest.raises(TandemError) as err:
            client.complete([1, 2, 600], max_tokens=4)
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and "vocabulary" in err.value.message
        assert client.complete([5, 6, 7], max_tokens=4, ignore_eos=True).token_ids


def test_a_stop_string_stops_the_same_through_the_services_as_in_process(services, reference):
    params = {"max_tokens": MAX_TOKENS, "ignore_eos": True}
    full = reference.generate("The list type", SamplingParams(**params), use_tqdm=False)[0]
    stop = full.text[len(full.text) // 2 :][:3]
    offline = reference.generate("The list type", SamplingParams(**params, stop=[stop]), use_tqdm=False)[0]
    assert offline.finish_reason == "stop" and len(offline.token_ids) < MAX_TOKENS
    with TandemClient(services.address) as client:
        remote = client.complete("The list type", **params, stop=[stop])
    assert (remote.token_ids, remote.text) == (offline.token_ids, offline.text)
    assert (remote.finish_reason, remote.stop_reason) == ("stop", stop)


def test_unreachable_executor_is_unavailable_naming_it(tmp_path):
    dead = f"127.0.0.1:{free_port()}"
    scheduler = scheduler_process(tmp_path / "scheduler.log", dead)
    scheduler.start()
    try:
        with TandemClient(scheduler.address) as client:
            assert scheduler.wait_for(scheduler.health, what="a health answer") == "NOT_SERVING"
            with pytest.raises(TandemError) as err:
                client.complete([1, 2, 3], max_tokens=4)
    finally:
        scheduler.stop(5.0)
    assert err.value.code == grpc.StatusCode.UNAVAILABLE
    assert dead in err.value.message


def _pids_alive(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        alive.append(pid)
    return alive


def test_tandem_up_generate_and_ctrl_c(tmp_path):
    up, address, pids = _start_up(tmp_path, "--prompt", "The list type", "--max-tokens", "24")
    try:
        lines = _lines(up)
        output = "".join(lines)
        assert address in output and f"tandem generate --server {address}" in output
        port = address.rsplit(":", 1)[1]
        assert len(pids) == 2
        # --prompt: one generation streamed by `tandem up` itself, continuing the prompt.
        # The demo's line comes after the ready banner's last line.
        ready_at = next(i for i, line in enumerate(lines) if line.startswith("Ctrl-C stops both"))
        deadline = time.monotonic() + 60
        while not (demo := [line for line in _lines(up)[ready_at + 1 :] if line.startswith("The list type")]):
            assert time.monotonic() < deadline, up.output()
            time.sleep(0.05)
        streamed = demo[0]
        assert re.search(r"The list type\S* [a-z]+ [a-z]+", streamed), streamed

        gen = subprocess.run(
            [sys.executable, "-m", "client.cli", "generate", "--server", f"127.0.0.1:{port}", "The list type"]
            + ["--max-tokens", "32"],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
        )
        assert gen.returncode == 0, gen.stderr
        # The embedded model writes Python documentation.
        assert re.search(r"[a-z]+ [a-z]+ [a-z]+", gen.stdout), gen.stdout
        assert "list" in gen.stdout or "mutable" in gen.stdout

        up.process.send_signal(signal.SIGINT)
        assert up.process.wait(30) == 0, up.output()
        assert _pids_alive(pids) == [], "tandem up left child processes behind"
    finally:
        up.stop()


def _lines(up: ServiceProcess) -> list[str]:
    """`tandem up`'s complete output lines so far."""
    return [line for line in up.output().splitlines(keepends=True) if line.endswith("\n")]


def _start_up(tmp_path, *args: str) -> tuple[ServiceProcess, str, list[int]]:
    """`tandem up` on free ports, once both services serve: (its process, the scheduler's address,
    the pids its banner names)."""
    port, executor_port = free_port(), free_port()
    up = ServiceProcess(
        "tandem up",
        [sys.executable, "-m", "client.cli", "up", "--port", str(port), "--executor-port", str(executor_port)]
        + ["--metrics-port", "0", "--executor-metrics-port", "0", "--log-dir", str(tmp_path), *args],
        tmp_path / "up.log",
    ).start()

    def banner() -> list[str] | None:
        lines = _lines(up)
        ready_at = next((i for i, line in enumerate(lines) if line.startswith("Ctrl-C stops both")), None)
        return None if ready_at is None else lines[: ready_at + 1]

    banner_lines = up.wait_for(banner, what="its ready banner", logs=up.output)
    return up, f"127.0.0.1:{port}", [int(p) for p in re.findall(r"pid (\d+)", "".join(banner_lines))]


@pytest.mark.parametrize("ctrl_c", ["once", "twice"])
def test_tandem_up_ctrl_c_with_a_request_in_flight_stops_promptly(tmp_path, ctrl_c):
    # Once: the scheduler drains for `tandem up`'s shutdown timeout (5 s), not 30 s. Twice: at once,
    # even with a long drain asked for.
    args = ["--shutdown-timeout", "60"] if ctrl_c == "twice" else []
    up, address, pids = _start_up(tmp_path, *args)
    try:
        with TandemClient(address, timeout=120, retries=0) as client:
            stream = client.generate([5, 6, 7], max_tokens=2000, ignore_eos=True)
            next(stream)  # generating
            t0 = time.monotonic()
            up.process.send_signal(signal.SIGINT)
            if ctrl_c == "twice":
                time.sleep(0.5)
                up.process.send_signal(signal.SIGINT)
            with pytest.raises(TandemError) as err:
                list(stream)
            up.process.wait(60)
            stopped_s = time.monotonic() - t0
        assert err.value.code == grpc.StatusCode.UNAVAILABLE
        assert stopped_s < (4.0 if ctrl_c == "twice" else 5.0 + 5.0), f"stopped after {stopped_s:.1f} s"
        assert _pids_alive(pids) == [], "tandem up left child processes behind"
    finally:
        up.stop()


def test_tandem_up_reports_a_service_that_dies(tmp_path):
    """The executor cannot bind its port: `tandem up` exits non-zero with the executor's last log lines."""
    with socket.socket() as busy:
        busy.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 0)
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        executor_port = busy.getsockname()[1]
        proc = subprocess.run(
            [sys.executable, "-m", "client.cli", "up", "--port", str(free_port())]
            + ["--executor-port", str(executor_port), "--metrics-port", "0", "--executor-metrics-port", "0"]
            + ["--log-dir", str(tmp_path), "--startup-timeout", "60"],
            capture_output=True,
            text=True,
            timeout=90,
            cwd=ROOT,
            env=CHILD_ENV,
        )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "executor exited with code" in proc.stderr
    assert (
        f"port {executor_port} is already in use" in proc.stderr
    )  # the executor's own message, from its log
    assert not (tmp_path / "scheduler.log").exists()  # the scheduler was never started
