"""Nothing lost under faults and load: executor death and recovery, deadlines, backpressure,
graceful shutdown. The figures these tests print (-s) are recorded in bench/RESULTS.md.

Subprocess tests start the services as `python -m executor_service` / `python -m scheduler_service`
on free localhost ports, as tests/test_e2e_services.py does; in-process tests drive the
scheduler service over a LocalExecutor that can be made to vanish.
"""

from __future__ import annotations

import asyncio
import gc
import random
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2
from test_e2e_services import CHILD_ENV, ROOT, scrape
from test_scheduler_service import FlakyExecutor, collect, make_server, metrics, request, wait_serving

from client import AsyncTandemClient, Final, TandemClient, TandemError
from client.defaults import DEFAULT_MODEL, free_port
from client.up import Service
from executor_service.config import ExecutorConfig
from executor_service.executor import LocalExecutor
from protos.plan import StepPlan
from protos.tandem.v1 import executor_pb2 as epb
from protos.tandem.v1 import executor_pb2_grpc as epb_grpc
from protos.tandem.v1 import generation_pb2_grpc as pb_grpc
from scheduler_service.async_engine import EngineOptions
from scheduler_service.config import SchedulerConfig
from scheduler_service.executor_client import ExecutorError, RemoteExecutor
from scheduler_service.llm import LLM
from scheduler_service.sampling_params import SamplingParams
from scheduler_service.server import ServerThread

STARTUP_TIMEOUT = 60.0
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def token_prompts(n: int, seed: int, lo: int = 1, hi: int = 40, vocab: int = 400) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


# -- the services as processes -----------------------------------------------------------------


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

    def executor_reset(self) -> int:
        """Reset the executor behind the scheduler's back: how many sequences it still held."""
        with grpc.insecure_channel(self.executor_address) as channel:
            stub = epb_grpc.ExecutorServiceStub(channel)
            return stub.Reset(epb.ResetRequest(), timeout=10).num_dropped_seqs

    def logs(self) -> str:
        return "\n".join(f"--- {s.name} ---\n{s.tail(30)}" for s in (*self.executors, self.scheduler))

    def stop(self) -> None:
        for service in (self.scheduler, *self.executors):
            service.stop(10.0)


@pytest.fixture
def cluster_factory(tmp_path):
    clusters: list[Cluster] = []

    def make(model, **kwargs) -> Cluster:
        cluster = Cluster(model, tmp_path, **kwargs)
        clusters.append(cluster)
        return cluster

    yield make
    for cluster in clusters:
        cluster.stop()


async def _stream(client, prompt, progress: list[int], i: int, **sampling):
    ids, final = [], None
    async for item in client.generate(prompt, **sampling):
        if isinstance(item, Final):
            final = item
        else:
            ids += item.token_ids
            progress[i] = len(ids)
    return ids, final


def _kill_and_recover(
    cluster: Cluster, prompts, max_tokens: int, ready, restart_args=()
) -> tuple[list, list[int]]:
    """Start one greedy stream per prompt; once ready(progress) holds, SIGKILL the executor and
    start a new one on the same port. Returns the results and each stream's progress at the kill."""
    progress = [0] * len(prompts)

    async def run():
        async with AsyncTandemClient(cluster.address, timeout=180) as client:
            tasks = [
                asyncio.ensure_future(_stream(client, p, progress, i, max_tokens=max_tokens, ignore_eos=True))
                for i, p in enumerate(prompts)
            ]
            deadline = time.monotonic() + 60
            while not ready(progress):
                assert time.monotonic() < deadline, f"never ready to kill: {progress}"
                await asyncio.sleep(0.002)
            at_kill = list(progress)
            cluster.kill_executor()
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


@pytest.fixture(scope="module")
def reference(qwen3_tied):
    return LLM(str(qwen3_tied), num_kv_blocks=1024)


def test_executor_killed_mid_decode_all_32_streams_finish_identically(qwen3_tied, reference, cluster_factory):
    cluster = cluster_factory(qwen3_tied)
    cluster.start()
    prompts = token_prompts(32, seed=11)
    max_tokens = 64
    expected = reference.generate(
        prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True), use_tqdm=False
    )
    t0 = time.monotonic()
    results, at_kill = _kill_and_recover(cluster, prompts, max_tokens, lambda p: min(p) >= 4)
    recovered_s = time.monotonic() - t0
    assert max(at_kill) < max_tokens, "every stream had finished before the kill"
    completed = _check_identical(results, expected)
    print(
        f"\nkill mid-decode: {completed}/{len(prompts)} streams completed identically "
        f"(tokens at the kill: {min(at_kill)}..{max(at_kill)}; {recovered_s:.1f} s with the restart)"
    )
    m = cluster.wait_idle()
    assert m["tandem_scheduler_executor_up"] == 1
    assert cluster.executor_reset() == 0  # the new executor holds nothing of them


def test_executor_killed_during_prefill_restarted_smaller(qwen3_tied, reference, cluster_factory):
    # Long prompts in chunks of 64 tokens: the prefill of the 32 takes over 100 steps.
    cluster = cluster_factory(qwen3_tied, scheduler_args=["--max-num-batched-tokens", "64"])
    cluster.start()
    prompts = token_prompts(32, seed=12, lo=200, hi=300)
    max_tokens = 24
    expected = reference.generate(
        prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True), use_tqdm=False
    )

    def prefill_started(progress) -> bool:
        return cluster.metrics("executor").get("tandem_executor_forward_tokens_total", 0) >= 128

    # The new executor is smaller: the scheduler rebuilds its block accounting from Describe.
    results, at_kill = _kill_and_recover(
        cluster, prompts, max_tokens, prefill_started, restart_args=["--num-kv-blocks", "700"]
    )
    waiting = sum(1 for n in at_kill if n == 0)
    assert waiting >= 16, f"the kill came after most prefills: {at_kill}"
    completed = _check_identical(results, expected)
    print(
        f"\nkill during prefill: {completed}/{len(prompts)} streams completed identically "
        f"({waiting} had no token yet at the kill)"
    )
    m = cluster.wait_idle()
    assert m["tandem_scheduler_kv_cache_blocks_total"] == 700
    assert cluster.executor_reset() == 0


def test_sigterm_drains_in_flight_requests_and_refuses_new_ones(qwen3_tied, reference, cluster_factory):
    cluster = cluster_factory(qwen3_tied, scheduler_args=["--shutdown-timeout", "60"])
    cluster.start()
    prompts = token_prompts(8, seed=13)
    max_tokens = 400
    expected = reference.generate(
        prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True), use_tqdm=False
    )
    progress = [0] * len(prompts)

    async def run():
        async with AsyncTandemClient(cluster.address, timeout=120) as client:
            tasks = [
                asyncio.ensure_future(_stream(client, p, progress, i, max_tokens=max_tokens, ignore_eos=True))
                for i, p in enumerate(prompts)
            ]
            while min(progress) < 1:
                await asyncio.sleep(0.005)
            cluster.scheduler.process.send_signal(signal.SIGTERM)
            while await client.health() != "NOT_SERVING":
                await asyncio.sleep(0.01)
            with pytest.raises(TandemError) as refused:
                await client.complete([5, 6], max_tokens=2)
            in_flight = sum(1 for n in progress if n < max_tokens)
            return await asyncio.gather(*tasks), refused.value, in_flight

    results, refused, in_flight = asyncio.run(run())
    assert refused.code == grpc.StatusCode.UNAVAILABLE and "shutting down" in refused.message
    assert in_flight == len(prompts)  # all were still generating when the new one was refused
    completed = _check_identical(results, expected)
    assert cluster.scheduler.process.wait(30) == 0, cluster.scheduler.tail()
    print(
        f"\nSIGTERM drain: {completed}/{len(prompts)} in-flight streams finished, new request "
        f"refused ({refused.code.name}), exit code 0"
    )


def test_sigterm_past_the_shutdown_timeout_fails_what_is_left(qwen3_tied, cluster_factory):
    cluster = cluster_factory(qwen3_tied, scheduler_args=["--shutdown-timeout", "0.5"])
    cluster.start()
    with TandemClient(cluster.address, timeout=60) as client:
        streams = [client.generate(p, max_tokens=900, ignore_eos=True) for p in token_prompts(4, seed=14)]
        for s in streams:
            next(s)
        t0 = time.monotonic()
        cluster.scheduler.process.send_signal(signal.SIGTERM)
        for s in streams:
            with pytest.raises(TandemError) as err:
                list(s)
            assert err.value.code == grpc.StatusCode.UNAVAILABLE and "shut down before" in err.value.message
    assert cluster.scheduler.process.wait(30) == 0
    assert time.monotonic() - t0 < 10


# -- load: 500 streams on the embedded model ------------------------------------------------------


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc for the scheduler's RSS")
def test_500_streams_with_cancels_and_deadlines(cluster_factory):
    n, max_tokens = 500, 8
    cluster = cluster_factory(DEFAULT_MODEL, num_kv_blocks=2048)
    cluster.start("--dtype", "float32")
    prompts = token_prompts(n, seed=15, lo=4, hi=24, vocab=4000)
    llm = LLM(str(DEFAULT_MODEL), num_kv_blocks=2048, dtype="float32")
    expected = llm.generate(prompts, SamplingParams(max_tokens=max_tokens), use_tqdm=False)
    del llm
    gc.collect()
    rng = random.Random(16)
    kind = ["cancel" if i % 10 == 0 else "deadline" if i % 10 == 1 else "normal" for i in range(n)]
    rng.shuffle(kind)
    pid = cluster.scheduler.process.pid

    async def wave(outcomes: list | None, health_latency: list[float], rss: list[int]):
        progress = [0] * n
        async with AsyncTandemClient(cluster.address, timeout=120) as client:
            short = [AsyncTandemClient(cluster.address, timeout=rng.uniform(0.05, 1.0)) for _ in range(10)]

            async def one(i: int):
                if outcomes is None:  # warm-up
                    return await _stream(client, prompts[i], progress, i, max_tokens=max_tokens)
                try:
                    if kind[i] == "cancel":
                        stop_after = rng.randint(0, max_tokens - 1)
                        stream = client.generate(prompts[i], max_tokens=max_tokens)
                        if stop_after == 0:
                            await asyncio.sleep(rng.uniform(0, 0.5))
                            stream.cancel()
                        async for item in stream:
                            if not isinstance(item, Final):
                                progress[i] += len(item.token_ids)
                                if progress[i] >= stop_after:
                                    stream.cancel()
                        return ("completed" if stream.final is not None else "cancelled"), stream.final
                    c = short[i % 10] if kind[i] == "deadline" else client
                    ids, final = await _stream(c, prompts[i], progress, i, max_tokens=max_tokens)
                    return ("completed", (ids, final))
                except TandemError as e:
                    return ("expired" if e.code == grpc.StatusCode.DEADLINE_EXCEEDED else f"error {e}", None)

            async def watch(done: asyncio.Event):
                while not done.is_set():
                    t = time.perf_counter()
                    assert await client.health(timeout=5) == "SERVING"
                    health_latency.append(time.perf_counter() - t)
                    rss.append(_rss_bytes(pid))
                    await asyncio.sleep(0.02)

            done = asyncio.Event()
            watcher = asyncio.ensure_future(watch(done))
            results = await asyncio.gather(*(one(i) for i in range(n)))
            done.set()
            await watcher
            for c in short:
                await c.close()
            if outcomes is not None:
                outcomes.extend(results)

    asyncio.run(wave(None, [], []))  # warm-up: the allocator's pools, the detokenizers' caches
    cluster.wait_idle()
    gc.collect()
    time.sleep(0.5)
    baseline = _rss_bytes(pid)
    outcomes, latencies, rss = [], [], []
    t0 = time.monotonic()
    asyncio.run(wave(outcomes, latencies, rss))
    seconds = time.monotonic() - t0
    counts = {"completed": 0, "cancelled": 0, "expired": 0, "errors": 0}
    for i, (outcome, payload) in enumerate(outcomes):
        if outcome.startswith("error"):
            counts["errors"] += 1
            continue
        counts[outcome] += 1
        if outcome == "completed" and kind[i] != "cancel":
            ids, final = payload
            assert ids == expected[i].token_ids, f"stream {i} ({kind[i]}) differs"
            assert final.finish_reason == expected[i].finish_reason
        if outcome == "expired":
            assert kind[i] == "deadline"
    assert counts["errors"] == 0, [o for o in outcomes if o[0].startswith("error")][:3]
    assert counts["completed"] >= sum(k == "normal" for k in kind)
    m = cluster.wait_idle()
    assert m["tandem_scheduler_kv_cache_usage_ratio"] == 0 and m["tandem_scheduler_requests_running"] == 0
    assert cluster.executor_reset() == 0  # the executor holds no sequence either
    time.sleep(0.5)
    after = _rss_bytes(pid)
    peak = max(rss + [after])
    MiB = 2**20
    print(
        f"\nload: {n} requests in {seconds:.1f} s: {counts}; health check latency max "
        f"{1000 * max(latencies):.0f} ms over {len(latencies)} checks; scheduler RSS baseline "
        f"{baseline / MiB:.0f} MiB, peak {peak / MiB:.0f} MiB, after {after / MiB:.0f} MiB"
    )
    assert max(latencies) < 1.0
    assert after - baseline < 24 * MiB, (baseline, peak, after)


# -- in-process: an executor that can vanish ------------------------------------------------------


class DyingExecutor(FlakyExecutor):
    """Goes away at a given step (`die_at_step`), until `up` is set again; `replace()` swaps in
    another executor, as a restart with other settings would."""

    def __init__(self, path) -> None:
        super().__init__(path)
        self.up.set()
        self.steps = 0
        self.die_at_step: int | None = None

    def step(self, plan: StepPlan):
        self.steps += 1
        if self.die_at_step is not None and self.steps >= self.die_at_step:
            self.die_at_step = None
            self.up.clear()
        return super().step(plan)

    def replace(self, path, num_kv_blocks: int) -> None:
        self.inner = LocalExecutor(ExecutorConfig(model=str(path), num_kv_blocks=num_kv_blocks))


def _dying_server(path, **options):
    executor = DyingExecutor(path)
    options = EngineOptions(
        SchedulerConfig(max_num_seqs=options.pop("max_num_seqs", 32)),
        executor_address="dying:1",
        heartbeat_s=0.1,
        backoff_min_s=0.02,
        backoff_max_s=0.05,
        **options,
    )
    return make_server(path, executor, options=options), executor


def _channel(server) -> grpc.Channel:
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    wait_serving(channel)
    return channel


def test_a_restart_with_other_capacity_is_recomputed_identically(qwen3_tied, reference):
    server, executor = _dying_server(qwen3_tied)
    prompts = token_prompts(8, seed=21)
    expected = reference.generate(prompts, SamplingParams(max_tokens=40, ignore_eos=True), use_tqdm=False)
    with ServerThread(server):
        channel = _channel(server)
        stub = pb_grpc.GenerationServiceStub(channel)
        executor.die_at_step = executor.steps + 12
        with ThreadPoolExecutor(len(prompts)) as pool:
            futures = [
                pool.submit(lambda p=p: collect(stub.Generate(request(p, 40, ignore_eos=True))))
                for p in prompts
            ]
            wait_serving(channel, want=NOT_SERVING)
            executor.replace(qwen3_tied, num_kv_blocks=96)
            executor.up.set()
            results = [f.result(60) for f in futures]
        for (ids, _, final, _), want in zip(results, expected, strict=True):
            assert ids == want.token_ids and final.completion_tokens == 40
        m = metrics(server)
        assert m[("tandem_scheduler_kv_cache_blocks_total",)] == 96
        assert m[("tandem_scheduler_executor_up",)] == 1
        channel.close()


def test_deadline_while_the_executor_is_away_never_hangs(qwen3_tied):
    server, executor = _dying_server(qwen3_tied)
    with ServerThread(server):
        channel = _channel(server)
        stub = pb_grpc.GenerationServiceStub(channel)
        call = stub.Generate(request([5, 6, 7], 500, ignore_eos=True), timeout=1.5)
        next(call)
        executor.up.clear()
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as e:
            list(call)
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert time.monotonic() - t0 < 3
        deadline = time.monotonic() + 5
        while server.engine._held or len(server.engine.streams):
            assert time.monotonic() < deadline, "the expired request is still held"
            time.sleep(0.02)
        executor.up.set()
        wait_serving(channel)
        assert len(collect(stub.Generate(request([5], 3)))[0]) == 3
        channel.close()


def test_executor_away_past_the_recovery_timeout_is_unavailable(qwen3_tied):
    server, executor = _dying_server(qwen3_tied, recovery_timeout_s=0.5)
    with ServerThread(server):
        channel = _channel(server)
        stub = pb_grpc.GenerationServiceStub(channel)
        call = stub.Generate(request([5, 6, 7], 500, ignore_eos=True))
        next(call)
        executor.up.clear()
        with pytest.raises(grpc.RpcError) as e:
            list(call)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "--executor-recovery-timeout 0.5" in e.value.details() and "dying:1" in e.value.details()
        executor.up.set()
        wait_serving(channel)
        channel.close()


def test_queued_request_past_its_deadline_is_dropped_and_frees_its_place(qwen3_tied):
    server, _ = _dying_server(qwen3_tied, max_num_seqs=1)
    with ServerThread(server):
        channel = _channel(server)
        stub = pb_grpc.GenerationServiceStub(channel)
        running = stub.Generate(request([5, 6], 900, ignore_eos=True))
        next(running)
        queued = stub.Generate(request(list(range(3, 100)), 4), timeout=0.5)
        with pytest.raises(grpc.RpcError) as e:
            list(queued)
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        deadline = time.monotonic() + 3
        while metrics(server)[("tandem_scheduler_requests_waiting",)] != 0:
            assert time.monotonic() < deadline, "the expired request is still queued"
            time.sleep(0.02)
        assert server.engine.streams.num_queued_tokens == 0
        running.cancel()
        channel.close()


def test_max_queued_tokens_refuses_with_resource_exhausted(qwen3_tied):
    server, _ = _dying_server(qwen3_tied, max_num_seqs=1, max_queued_tokens=100)
    with ServerThread(server):
        channel = _channel(server)
        stub = pb_grpc.GenerationServiceStub(channel)
        running = stub.Generate(request([5, 6], 900, ignore_eos=True))
        next(running)  # it has output: its prompt no longer counts
        first = stub.Generate(request([7] * 60, 2))
        deadline = time.monotonic() + 5
        while server.engine.streams.num_queued_tokens != 60:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(request([8] * 50, 2)))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert (
            "--max-queued-tokens 100" in e.value.details() and "60 prompt tokens waiting" in e.value.details()
        )
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(request([8] * 150, 2)))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        second = stub.Generate(request([9] * 30, 2))  # 90 tokens: still under the limit
        running.cancel()
        assert len(collect(first)[0]) == 2 and len(collect(second)[0]) == 2
        channel.close()


class StaleStepServicer(epb_grpc.ExecutorServiceServicer):
    """Answers every plan with the result of an older step first, then with its own."""

    def Step(self, request_iterator, context):
        for plan in request_iterator:
            yield epb.StepResult(step_id=plan.step_id - 1)
            if plan.step_id == 99:
                yield epb.StepResult(step_id=plan.step_id + 5)
            else:
                yield epb.StepResult(step_id=plan.step_id)


def test_results_of_old_steps_are_discarded():
    server = grpc.server(ThreadPoolExecutor(4))
    epb_grpc.add_ExecutorServiceServicer_to_server(StaleStepServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with RemoteExecutor(f"127.0.0.1:{port}") as executor:
            assert executor.step(StepPlan(step_id=7)).step_id == 7
            assert executor.step(StepPlan(step_id=8)).step_id == 8
            with pytest.raises(ExecutorError, match="result of step 104"):
                executor.step(StepPlan(step_id=99))
    finally:
        server.stop(0)


def test_health_is_answered_while_generation_saturates_the_loop(qwen3_tied):
    """A health check does not wait behind streaming work (the load test measures it at 500)."""
    server = make_server(qwen3_tied, max_num_seqs=64)
    with ServerThread(server):
        channel = _channel(server)
        stub = pb_grpc.GenerationServiceStub(channel)
        calls = [stub.Generate(request(p, 200, ignore_eos=True)) for p in token_prompts(64, seed=22)]
        for call in calls:
            next(call)
        with TandemClient(f"127.0.0.1:{server.port}") as client:
            worst = 0.0
            for _ in range(20):
                t = time.perf_counter()
                assert client.health(timeout=2) == "SERVING"
                worst = max(worst, time.perf_counter() - t)
        for call in calls:
            call.cancel()
        assert worst < 0.5, worst
        channel.close()
