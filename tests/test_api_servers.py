"""The scheduler service split over processes (`--api-server-count 2`): the engine core and two API
server processes on one client port, as real processes on localhost, driven through the client.
The rest of the process-level suite runs against this layout too with TANDEM_API_SERVER_COUNT=2
(`make test-api-servers`)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from helpers.processes import CHILD_ENV, ROOT, alive, descendants
from helpers.services import NUM_KV_BLOCKS, Services

from client import AsyncTandemClient, Final, TandemClient, TandemError
from client.llm import LLM
from scheduler_service.cli import default_api_server_count
from scheduler_service.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = ["The list type", "Exceptions are", "A class definition", "The for statement"]


@pytest.fixture(scope="module")
def split(qwen3_tied, tmp_path_factory):
    services = Services(
        qwen3_tied,
        tmp_path_factory.mktemp("split_logs"),
        ["--api-server-count", "2", "--max-queued-tokens", "600"],
    )
    try:
        services.start()
        yield services
    finally:
        services.stop()


def _api_servers(services: Services) -> list[int]:
    pids = []
    for pid in descendants(services.scheduler.process.pid):
        with contextlib.suppress(OSError):  # it exited since it was listed
            if b"scheduler_service.api_server" in Path(f"/proc/{pid}/cmdline").read_bytes():
                pids.append(pid)
    return pids


def test_default_api_server_count_follows_the_cores():
    assert [default_api_server_count(n) for n in (1, 2, 4, 7, 8, 12, 16, 64)] == [0, 0, 0, 0, 2, 3, 4, 4]


def test_two_api_servers_stream_what_one_process_computes(split, qwen3_tied):
    assert len(_api_servers(split)) == 2
    rng_prompts = [[(7 * i + 3 * j) % 397 + 2 for j in range(5 + i)] for i in range(20)]
    prompts = PROMPTS + rng_prompts
    reference = LLM(str(qwen3_tied), num_kv_blocks=NUM_KV_BLOCKS)
    expected = reference.generate(prompts, SamplingParams(max_tokens=16), use_tqdm=False)
    before = split.metrics("scheduler")

    async def one(client, prompt):
        ids, final = [], None
        async for item in client.generate(prompt, max_tokens=16):
            if isinstance(item, Final):
                final = item
            else:
                ids += item.token_ids
        return ids, final

    async def run():
        # A channel per stream: the kernel spreads connections over the two API servers.
        clients = [AsyncTandemClient(split.address) for _ in prompts]
        try:
            return await asyncio.gather(*(one(c, p) for c, p in zip(clients, prompts)))
        finally:
            for c in clients:
                await c.close()

    results = asyncio.run(run())
    for i, ((ids, final), want) in enumerate(zip(results, expected)):
        assert ids == want.token_ids, f"prompt {i} diverged"
        assert final.finish_reason == want.finish_reason
    # One /metrics, the engine core's, with the API servers' series relayed into it.
    deadline = time.monotonic() + 5
    while True:
        after = split.metrics("scheduler")
        finished = after.get("tandem_scheduler_requests_finished_total", 0) - before.get(
            "tandem_scheduler_requests_finished_total", 0
        )
        if finished == len(prompts) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert finished == len(prompts)
    e2e = "tandem_scheduler_e2e_request_latency_seconds_count"
    assert after[e2e] - before.get(e2e, 0) == len(prompts)
    ttft = "tandem_scheduler_time_to_first_token_seconds_count"
    assert after[ttft] - before.get(ttft, 0) == len(prompts)
    assert after["tandem_scheduler_generation_tokens_total"] - before[
        "tandem_scheduler_generation_tokens_total"
    ] == sum(len(ids) for ids, _ in results)


def test_the_engine_cores_limits_and_the_executors_reach_the_client(split):
    with TandemClient(split.address) as client:
        # --max-queued-tokens: checked by the engine core, refused over IPC.
        with pytest.raises(TandemError) as err:
            list(client.generate([i % 500 + 2 for i in range(700)], max_tokens=4))
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "--max-queued-tokens (600)" in err.value.message
        # --max-logprobs: checked in the API server against the limits the core sent it.
        with pytest.raises(TandemError) as err:
            list(client.generate("The list type", max_tokens=4, logprobs=300))
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "--max-logprobs" in err.value.message
        # A deadline is the engine core's to enforce, then the API server's to report.
        with TandemClient(split.address, timeout=0.5) as hurried, pytest.raises(TandemError) as err:
            list(hurried.generate("The list type", max_tokens=1000, ignore_eos=True))
        assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        # Still serving.
        assert [
            t for c in client.generate("The list type", max_tokens=4) for t in getattr(c, "token_ids", [])
        ]


def test_a_cancelled_stream_frees_its_blocks_in_the_core(split):
    with TandemClient(split.address) as client:
        stream = client.generate("The list type", max_tokens=1000, ignore_eos=True)
        next(iter(stream))
        stream.cancel()
    deadline = time.monotonic() + 10
    while (
        split.metrics("scheduler")["tandem_scheduler_kv_cache_usage_ratio"] > 0
        and time.monotonic() < deadline
    ):
        time.sleep(0.1)
    m = split.metrics("scheduler")
    assert m["tandem_scheduler_requests_running"] == 0 and m["tandem_scheduler_kv_cache_usage_ratio"] == 0


def test_a_second_split_service_on_the_port_is_refused(split):
    second = subprocess.run(
        [sys.executable, "-m", "scheduler_service", "--executor", split.executor_address, "--port",
         str(split.port), "--metrics-port", "0", "--api-server-count", "2"],
        env=CHILD_ENV, cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert second.returncode == 2, second.stderr
    assert f"port {split.port} is already in use (pid {split.scheduler.process.pid}: " in second.stderr


def test_api_servers_end_with_their_engine_core(qwen3_tied, tmp_path):
    services = Services(qwen3_tied, tmp_path, ["--api-server-count", "2"])
    try:
        services.start()
        children = _api_servers(services)
        assert len(children) == 2
        os.kill(services.scheduler.process.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while any(alive(pid) for pid in children) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(alive(pid) for pid in children)
    finally:
        services.stop()


def test_samples_and_prompt_logprobs_cross_the_ipc(split, qwen3_tied):
    """n seeded samples and prompt logprobs through an API server: what one process computes."""
    prompt = [5, 9, 13, 2, 77, 31]
    params = SamplingParams(max_tokens=8, n=3, seed=11, temperature=1.0, prompt_logprobs=2, logprobs=1)
    want = LLM(str(qwen3_tied), num_kv_blocks=NUM_KV_BLOCKS).generate([prompt], params, use_tqdm=False)[0]
    with TandemClient(split.address) as client:
        got = client.complete_samples(
            prompt, 3, max_tokens=8, seed=11, temperature=1.0, prompt_logprobs=2, logprobs=1
        )
    assert [c.index for c in got] == [0, 1, 2]
    assert [c.token_ids for c in got] == [o.token_ids for o in want.outputs]
    assert len({tuple(c.token_ids) for c in got}) > 1  # seeds seed, seed + 1, seed + 2 differ
    assert [lp.logprob for lp in got[0].logprobs] == pytest.approx(
        [lp.logprob for lp in want.outputs[0].logprobs]
    )
    scored = [lp for lp in want.prompt_logprobs if lp is not None]
    assert [lp.token_id for lp in got[0].prompt_logprobs] == [lp.token_id for lp in scored]
    assert [lp.rank for lp in got[0].prompt_logprobs] == [lp.rank for lp in scored]
    assert [lp.logprob for lp in got[0].prompt_logprobs] == pytest.approx(
        [lp.logprob for lp in scored], abs=1e-5
    )


def test_a_refusal_while_another_scheduler_owns_the_executor_names_the_owner(qwen3_tied, tmp_path):
    """Split as in one process: while the executor is owned by another session, new requests are
    UNAVAILABLE naming the owner (the API servers had kept the message of the moment it was lost)."""
    from protos.session import session_metadata
    from protos.tandem.v1 import executor_pb2 as epb
    from protos.tandem.v1 import executor_pb2_grpc as epb_grpc

    services = Services(qwen3_tied, tmp_path, ["--api-server-count", "2"])
    try:
        services.start()
        services.kill_executor()
        services.scheduler.wait_for(
            lambda: services.scheduler.health() == "NOT_SERVING" or None, what="NOT_SERVING"
        )
        time.sleep(3)  # its reconnect backoff at its 2 s maximum
        # The engine core held stopped while the new executor comes up, so that the rogue takes it
        # first (the core's reconnect could otherwise win the race).
        core = services.scheduler.process.pid
        os.kill(core, signal.SIGSTOP)
        try:
            services.start_executor()
            rogue = session_metadata("rogue-session", "rogue owner")
            deadline = time.monotonic() + 60
            while True:  # the rogue resets the new executor as soon as it answers
                try:
                    with grpc.insecure_channel(services.executor_address) as channel:
                        epb_grpc.ExecutorServiceStub(channel).Reset(
                            epb.ResetRequest(), timeout=5, metadata=rogue
                        )
                    break
                except grpc.RpcError as e:
                    assert time.monotonic() < deadline, e
                    time.sleep(0.01)
        finally:
            os.kill(core, signal.SIGCONT)
        deadline = time.monotonic() + 6  # within the rogue's 10 s lease: a few reconnect attempts
        with TandemClient(services.address) as client:
            while True:
                with pytest.raises(TandemError) as refused:
                    list(client.generate([5, 9, 13], max_tokens=2))
                assert refused.value.code == grpc.StatusCode.UNAVAILABLE
                if "rogue owner" in refused.value.message or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
        assert "rogue owner" in refused.value.message, refused.value.message
    finally:
        services.stop()


def _assert_all_exit(pids: list[int]) -> None:
    """The processes are all gone within 30 s (no orphaned API server)."""
    deadline = time.monotonic() + 30
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in pids if alive(pid)]


def test_sigterm_as_the_first_api_server_is_spawned_exits_0_without_orphans(qwen3_tied, tmp_path):
    """A SIGTERM that reaches the core while it is still spawning its API servers (the first one is
    there, the second not yet) is a stop asked for too: exit 0 and no API server left behind. The
    core armed its handler only after spawning them all, so such a signal killed it (-15) and
    orphaned the ones already started."""
    services = Services(qwen3_tied, tmp_path, ["--api-server-count", "4"])
    try:
        services.scheduler.start()
        core = services.scheduler.process
        deadline = time.monotonic() + 60
        while not (children := _api_servers(services)):
            assert time.monotonic() < deadline and core.poll() is None, services.logs()
            time.sleep(0.001)
        core.send_signal(signal.SIGTERM)
        spawned = set(children)
        while core.poll() is None and time.monotonic() < deadline:  # any it spawns after the signal
            spawned.update(_api_servers(services))
            time.sleep(0.001)
        assert core.wait(60) == 0, services.logs()
        _assert_all_exit(sorted(spawned))
    finally:
        services.stop()


def test_sigterm_while_the_api_servers_start_exits_0_without_orphans(qwen3_tied, tmp_path):
    """SIGTERM during start-up is a stop asked for (exit 0, as at any other time), not "an API server
    did not start" (exit 2). An API server held stopped keeps the core waiting for its hello."""
    services = Services(qwen3_tied, tmp_path, ["--api-server-count", "2"])
    try:
        services.scheduler.start()  # (no executor: the core starts its API servers all the same)
        core = services.scheduler.process
        deadline = time.monotonic() + 60
        while len(_api_servers(services)) < 2:
            assert time.monotonic() < deadline and core.poll() is None, services.logs()
            time.sleep(0.05)
        children = _api_servers(services)
        os.kill(children[0], signal.SIGSTOP)
        core.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        # The core passes the SIGTERM on at once. A server that has not set its handler yet can die of
        # it before the stop has reached all its threads (seen under load): gone, not orphaned.
        with contextlib.suppress(ProcessLookupError):
            os.kill(children[0], signal.SIGCONT)
        assert core.wait(60) == 0, services.logs()
        _assert_all_exit(children)
    finally:
        services.stop()
