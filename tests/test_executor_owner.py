"""One owner per executor (executor_service/ownership.py), its API key, and the executor's limits.

A second scheduler, or any other caller, against an executor that a scheduler drives must change
nothing: Reset and Step are refused with FAILED_PRECONDITION naming the owner, and the owner's
streams finish with exactly the tokens of an undisturbed run. Once the owner is gone (its stream
closed and its lease over, or it released the executor) another session takes over cleanly; plans
of an owner that lost the executor are refused. The services run as processes where the defect
needs them (two schedulers, a SIGKILL), else an ExecutorServer in this process.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Iterator

import grpc
import pytest
from executor_fixtures import MiniScheduler, make_executor
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helpers.processes import ServiceProcess
from helpers.services import Services, scheduler_process
from helpers.streams import MANY_STREAMS, check_identical, start_streams, token_prompts
from helpers.tls import CA

from client import AsyncTandemClient, TandemClient, TandemError
from client.defaults import free_port
from client.llm import LLM
from executor_service.plan_validation import PlanError, PlanLimits, validate_plan
from executor_service.security import server_credentials
from executor_service.server import ExecutorServer
from protos.plan import NewSequence, StepPlan, StepSamplingParams, plan_to_proto
from protos.session import session_metadata
from protos.tandem.v1 import executor_pb2 as pb
from protos.tandem.v1 import executor_pb2_grpc as pb_grpc
from scheduler_service.executor_client import (
    ExecutorError,
    ExecutorOwned,
    PlanRejected,
    RemoteExecutor,
)
from scheduler_service.sampling_params import SamplingParams

# Starts service processes or runs models at length: left out of `make test-fast`.
pytestmark = pytest.mark.slow

LEASE_S = 0.5
KEY = "executor-key-0123456789abcdef"


# -- an executor in this process --------------------------------------------------------------------


@pytest.fixture(scope="module")
def local_executor(qwen3_tied):
    return make_executor(qwen3_tied, max_num_seqs=2, max_num_batched_tokens=64)


@pytest.fixture
def server(local_executor) -> Iterator[ExecutorServer]:
    local_executor.reset()
    server = ExecutorServer("127.0.0.1", 0, owner_lease_s=LEASE_S)
    server.start()
    server.set_executor(local_executor)
    yield server
    server.stop(0)


def _new(seq_id: int, tokens: list[int], blocks: list[int]) -> NewSequence:
    return NewSequence(seq_id, tokens, blocks, 0, StepSamplingParams(num_prompt_tokens=len(tokens)))


def _prefill(step_id: int, seq_id: int, block: int) -> StepPlan:
    return StepPlan(
        step_id,
        new_seqs=[_new(seq_id, [5, 6, 7], [block])],
        seq_ids=[seq_id],
        num_scheduled_tokens=[3],
        num_computed_tokens=[0],
        num_new_blocks=[0],
    )


def _raw(address: str, call: str, *plans: StepPlan, metadata=None):
    """Reset, Describe or Step through a raw stub: a caller without a session unless `metadata`."""
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.ExecutorServiceStub(channel)
        if call == "Step":
            return list(stub.Step(iter([plan_to_proto(p) for p in plans]), timeout=10, metadata=metadata))
        request = pb.ResetRequest() if call == "Reset" else pb.DescribeRequest()
        return getattr(stub, call)(request, timeout=10, metadata=metadata)


def _refused(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value


def test_stray_callers_cannot_reset_or_step_while_the_owner_is_live(server):
    with RemoteExecutor(server.address, owner_name="scheduler A") as owner:
        owner.reset()
        mini = MiniScheduler(owner)
        mini.add(1, [5, 6, 7, 8])
        first = mini.plan({1: 4})
        mini.update(first, owner.step(first))
        for call in ("Reset", "Step"):
            error = _refused(lambda call=call: _raw(server.address, call, _prefill(10**6, 9, 50)))
            assert error.code() == grpc.StatusCode.FAILED_PRECONDITION, error.details()
            assert "owned by scheduler A" in error.details() and "without a session" in error.details()
        assert _raw(server.address, "Describe").num_kv_blocks == 128  # read-only: open to all
        # Another session is refused the same way, and names itself in the owner's terms.
        with RemoteExecutor(server.address, owner_name="scheduler B") as other:
            assert other.describe().num_kv_blocks == 128
            with pytest.raises(ExecutorOwned, match=r"owned by scheduler A .*Caller: scheduler B"):
                other.reset()
            with pytest.raises(ExecutorOwned, match="owned by scheduler A"):
                other.step(_prefill(10**6, 9, 50))
        # The owner never noticed: its sequence decodes where it was.
        plan = mini.plan(mini.decode_all())
        assert plan.num_computed_tokens == [4] and owner.step(plan).seq_ids == [1]


def _step_failures(server: ExecutorServer) -> dict[str, float]:
    return {
        s.labels["code"]: s.value
        for family in server.metrics.registry.collect()
        for s in family.samples
        if s.name == "tandem_executor_step_failures_total"
    }


def test_refused_step_streams_count_as_refused_steps(server):
    """tandem_executor_step_failures_total{code="FAILED_PRECONDITION"} counts the steps refused for
    not coming from the owner: most are refused as their Step stream opens (a stray caller, a
    scheduler that lost the executor), and those were not counted at all."""
    owner = session_metadata("o" * 32, "scheduler A")
    _raw(server.address, "Reset", metadata=owner)
    stream = queue.SimpleQueue()
    with grpc.insecure_channel(server.address) as channel:
        responses = pb_grpc.ExecutorServiceStub(channel).Step(
            iter(stream.get, None), timeout=10, metadata=owner
        )
        stream.put(plan_to_proto(_prefill(1, 1, 0)))
        assert next(responses).step_id == 1
        for metadata in (None, session_metadata("b" * 32, "scheduler B")):
            error = _refused(
                lambda metadata=metadata: _raw(server.address, "Step", _prefill(7, 2, 1), metadata=metadata)
            )
            assert error.code() == grpc.StatusCode.FAILED_PRECONDITION, error.details()
        stream.put(None)
        assert list(responses) == []
    assert _step_failures(server) == {"FAILED_PRECONDITION": 2}


def test_idle_step_streams_without_a_session_leave_the_executor_answering(server):
    """A caller without a session may open Step streams on an executor nobody owns yet, and each
    one open holds a server thread: 16 idle ones held every thread, and Describe, health and the
    scheduler's Reset waited forever. One such stream at a time is served; more are refused."""
    channel = grpc.insecure_channel(server.address)
    stub = pb_grpc.ExecutorServiceStub(channel)
    idle: list[queue.SimpleQueue] = []
    calls = []  # (a call that is garbage is cancelled)
    refused = []
    try:
        for _ in range(16):
            plans: queue.SimpleQueue = queue.SimpleQueue()
            idle.append(plans)
            responses = stub.Step(iter(plans.get, None), timeout=30)
            calls.append(responses)
            plans.put(plan_to_proto(StepPlan(len(idle))))  # an empty plan: the stream is served
            try:
                next(responses)
            except grpc.RpcError as e:
                refused.append(e)
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        assert stub.Describe(pb.DescribeRequest(), timeout=5).num_kv_blocks == 128
        with RemoteExecutor(server.address, owner_name="scheduler A", connect_timeout=5) as owner:
            owner.reset()
            assert owner.step(_prefill(1, 1, 0)).seq_ids == [1]
        assert len(refused) == 15
        assert {e.code() for e in refused} == {grpc.StatusCode.RESOURCE_EXHAUSTED}
        assert "one Step stream at a time" in refused[0].details()
    finally:
        for plans in idle:
            plans.put(None)
        channel.close()


def test_an_owner_that_released_and_reset_again_keeps_its_open_stream_counted(server):
    """A released and reset again while a Step stream of its was open (a Release can overtake the
    stream's close); that stream's close then counted against A's next stream, which no longer
    held the executor: B took over after the lease while A streamed."""
    a = session_metadata("session-a", "scheduler A")
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.ExecutorServiceStub(channel)
        old: queue.SimpleQueue = queue.SimpleQueue()
        old_responses = stub.Step(iter(old.get, None), timeout=30, metadata=a)
        old.put(plan_to_proto(StepPlan(1)))
        next(old_responses)
        assert stub.Release(pb.ReleaseRequest(), timeout=5, metadata=a).released
        stub.Reset(pb.ResetRequest(), timeout=5, metadata=a)
        old.put(None)
        assert list(old_responses) == []  # the old stream is closed
        new: queue.SimpleQueue = queue.SimpleQueue()
        new_responses = stub.Step(iter(new.get, None), timeout=30, metadata=a)
        new.put(plan_to_proto(StepPlan(2)))
        next(new_responses)
        time.sleep(2 * LEASE_S)
        b = session_metadata("session-b", "scheduler B")
        error = _refused(lambda: stub.Reset(pb.ResetRequest(), timeout=5, metadata=b))
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "its Step stream is open" in error.details()
        new.put(None)
        assert list(new_responses) == []


def test_takeover_once_the_owner_stream_closed_and_its_lease_ran_out(server):
    a = RemoteExecutor(server.address, owner_name="scheduler A")
    a.reset()
    a.step(_prefill(1, 1, 0))  # a Step stream is open
    b = RemoteExecutor(server.address, owner_name="scheduler B")
    time.sleep(2 * LEASE_S)
    with pytest.raises(ExecutorOwned, match="its Step stream is open"):
        b.reset()  # an open stream holds the executor past the lease
    a.discard()  # the stream closes (as when a scheduler dies) ...
    with pytest.raises(ExecutorOwned, match="lease"):
        b.reset()  # ... and its lease still runs
    time.sleep(LEASE_S + 0.2)
    assert b.reset() == 1  # a clean takeover: A's sequence is dropped
    assert server.servicer.ownership.owner.name == "scheduler B"
    # A's plans are refused now: they would run on B's sequences.
    with pytest.raises(ExecutorOwned, match="owned by scheduler B"):
        a.step(
            StepPlan(2, seq_ids=[1], num_scheduled_tokens=[1], num_computed_tokens=[3], num_new_blocks=[0])
        )
    b.step(_prefill(3, 1, 0))
    b.discard()
    time.sleep(LEASE_S + 0.2)  # B gone too: A must Reset before it steps again
    with pytest.raises(ExecutorOwned, match=r"sequences of scheduler B .*call Reset first"):
        a.step(_prefill(4, 2, 1))
    # Nor may a caller without a session drive B's sequences: only after a Reset.
    error = _refused(lambda: _raw(server.address, "Step", _prefill(5, 3, 2)))
    assert (
        error.code() == grpc.StatusCode.FAILED_PRECONDITION and "sequences of scheduler B" in error.details()
    )
    _raw(server.address, "Reset")
    _raw(server.address, "Step", _prefill(6, 4, 3))
    a.close()
    b.close()


def test_release_hands_the_executor_over_at_once(server):
    a = RemoteExecutor(server.address, owner_name="scheduler A")
    a.reset()
    a.step(_prefill(1, 1, 0))
    a.close()  # releases: no lease to wait for
    with RemoteExecutor(server.address, owner_name="scheduler B") as b:
        assert b.reset() == 0  # Release dropped A's sequence
        assert server.servicer.ownership.owner.name == "scheduler B"
        with RemoteExecutor(server.address) as stranger:
            assert not stranger.release()  # from a non-owner: nothing happens
        assert server.servicer.ownership.owner.name == "scheduler B"


def test_a_release_behind_a_running_step_drops_nothing_of_the_next_owner(server):
    """A scheduler that stops closes its stream and calls Release while its last step may still
    run. Release gave the executor up at once and dropped the sequences only once the step was
    done: a successor's Reset in between took over, and the late drop took the successor's
    sequences (its plans then failed, 'reset after its Step stream opened'). The owner stays the
    owner until its Release has dropped its sequences; the successor is refused until then."""
    a, b = (session_metadata(c * 32, f"scheduler {c.upper()}") for c in "ab")
    _raw(server.address, "Reset", metadata=a)
    _raw(server.address, "Step", _prefill(1, 1, 0), metadata=a)
    released = []
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.ExecutorServiceStub(channel)
        with server.servicer._lock:  # A's last step still runs
            thread = threading.Thread(
                target=lambda: released.append(stub.Release(pb.ReleaseRequest(), timeout=10, metadata=a))
            )
            thread.start()
            time.sleep(0.3)
            error = _refused(lambda: _raw(server.address, "Reset", metadata=b))
        thread.join()
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION and "owned by scheduler A" in error.details()
    assert released[0].released
    assert _raw(server.address, "Reset", metadata=b).num_dropped_seqs == 0  # A's were dropped
    assert _raw(server.address, "Step", _prefill(2, 2, 1), metadata=b)[0].seq_ids == [2]
    assert len(server.servicer.executor.seqs) == 1


def test_step_ids_must_increase_on_a_stream(server):
    owner = session_metadata("s" * 32, "scheduler A")
    _raw(server.address, "Reset", metadata=owner)
    empty = lambda step_id: StepPlan(step_id)  # noqa: E731
    for second in (5, 3):
        error = _refused(
            lambda second=second: _raw(server.address, "Step", empty(5), empty(second), metadata=owner)
        )
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"step {second} is out of order" in error.details() and "must be 6 or above" in error.details()
    # Step ids continue across reconnects: a new stream may start anywhere, lower included.
    assert [r.step_id for r in _raw(server.address, "Step", empty(1), empty(2), metadata=owner)] == [1, 2]


def test_the_executor_holds_at_most_twice_max_num_seqs(server):
    """max_num_seqs 2: new sequences that are never scheduled stop at 4, naming the limit; the
    executor keeps serving, and finishing sequences makes room."""
    with RemoteExecutor(server.address) as remote:
        remote.reset()
        step = iter(range(1, 100))
        remote.step(StepPlan(next(step), new_seqs=[_new(i, [5, 6], [i]) for i in range(4)]))
        with pytest.raises(PlanRejected, match=r"hold 5 sequences, more than 2 x max_num_seqs \(4\)"):
            remote.step(StepPlan(next(step), new_seqs=[_new(4, [5, 6], [4])]))
        remote.step(StepPlan(next(step), finished_seq_ids=[0], new_seqs=[_new(4, [5, 6], [4])]))
        assert remote.reset() == 4


def test_a_plan_of_more_new_seqs_than_the_executor_holds_is_refused_before_it_is_read(server):
    """300,000 new sequences in one 6 MiB plan (max_num_seqs 2: at most 4 held) are refused at
    once, naming the limit. Each was turned into Python objects and checked first: 3.5 s and
    250 MB here; 3M in a 64 MiB plan took 30 s and 2.5 GB of the executor's memory."""
    owner = session_metadata("o" * 32, "scheduler A")
    _raw(server.address, "Reset", metadata=owner)
    new = pb.NewSequence(
        seq_id=1,
        token_ids=[5],
        block_table=[0],
        sampling_params=pb.StepSamplingParams(top_p=1, repetition_penalty=1),
    ).SerializeToString()
    new_seqs = 300_000
    plan = pb.StepPlan(step_id=1).SerializeToString() + (b"\x12" + bytes([len(new)]) + new) * new_seqs
    with grpc.insecure_channel(server.address) as channel:
        step = channel.stream_stream("/tandem.v1.ExecutorService/Step")  # the bytes as they are
        started = time.monotonic()
        error = _refused(lambda: list(step(iter([plan]), timeout=30, metadata=owner)))
        elapsed = time.monotonic() - started
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
    assert error.details() == (
        f"step 1: {new_seqs} new seqs exceed 2 x max_num_seqs (4), the most sequences the executor holds"
    )
    assert elapsed < 2.0
    assert _raw(server.address, "Step", _prefill(2, 1, 0), metadata=owner)[0].seq_ids == [1]


def test_sequence_cap_in_validate_plan():
    limits = PlanLimits(
        block_size=16,
        num_kv_blocks=64,
        vocab_size=512,
        max_num_seqs=3,
        max_num_batched_tokens=64,
        max_model_len=64,
    )
    held = {i: object() for i in range(5)}
    validate_plan(StepPlan(1, new_seqs=[_new(9, [5], [0])]), held, limits)  # 6 = 2 x 3
    with pytest.raises(PlanError, match=r"7 sequences, more than 2 x max_num_seqs \(6\)"):
        validate_plan(StepPlan(1, new_seqs=[_new(9, [5], [0]), _new(10, [5], [1])]), held, limits)
    validate_plan(
        StepPlan(1, finished_seq_ids=[0], new_seqs=[_new(9, [5], [0]), _new(10, [5], [1])]), held, limits
    )


# -- the API key ----------------------------------------------------------------------------------


def test_api_key_is_required_on_every_executor_call_but_health(local_executor):
    local_executor.reset()
    server = ExecutorServer("127.0.0.1", 0, api_keys=["old-key", KEY])
    server.start()
    server.set_executor(local_executor)
    try:
        for key in (None, "wrong-key", KEY[:-1]):
            with RemoteExecutor(server.address, api_key=key) as remote:
                for call in (remote.describe, remote.reset, lambda r=remote: r.step(StepPlan(1))):
                    with pytest.raises(
                        ExecutorError, match=r"UNAUTHENTICATED.*missing or invalid executor API key"
                    ):
                        call()
        with RemoteExecutor(server.address, api_key=KEY) as remote:
            assert remote.describe().num_kv_blocks == 128 and remote.reset() == 0
            assert remote.step(_prefill(1, 1, 0)).seq_ids == [1]
        with grpc.insecure_channel(server.address) as channel:
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        server.stop(0)


def test_an_executor_anyone_could_drive_is_logged(caplog, tmp_path):
    cert, key = CA("owner test CA").issue("localhost", server=True)
    tls = server_credentials(cert, key)
    cases = [
        (dict(host="127.0.0.1"), None),
        (dict(host="0.0.0.0"), "without TLS or an API key"),
        (dict(host="0.0.0.0", api_keys=[KEY]), None),
        (dict(host="0.0.0.0", credentials=tls, mutual_tls=True), None),
        (dict(host="127.0.0.1", credentials=tls), "clients without a certificate are accepted"),
        (dict(host="0.0.0.0", credentials=tls, api_keys=[KEY]), None),
    ]
    for kwargs, warning in cases:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="executor_service.server"):
            ExecutorServer(port=0, **kwargs).stop(0)
        text = caplog.text
        if warning is None:
            assert "drive the executor" not in text and "without a certificate" not in text, kwargs
        else:
            assert warning in text, kwargs


# -- two schedulers as processes -------------------------------------------------------------------


def _second_scheduler(cluster: Services, log_dir, *extra: str) -> tuple[ServiceProcess, str]:
    service = scheduler_process(
        log_dir / "scheduler-b.log",
        cluster.executor_address,
        *("--tokenizer", str(cluster.model), *extra),
        name="scheduler-b",
    )
    service.start()
    return service, service.address


def _health(address: str) -> str:
    try:
        with TandemClient(address) as client:
            return client.health(timeout=1.0)
    except TandemError as e:
        return f"{e.code.name}"


def _wait_for(condition, timeout: float, what: str, logs) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what}\n{logs()}"
        time.sleep(0.1)


def test_a_second_scheduler_serves_nothing_and_the_first_streams_finish_exactly(qwen3_tied, tmp_path):
    """8 greedy streams on scheduler A; meanwhile a second RemoteExecutor and a caller without a
    session try Reset and Step, and a second scheduler process starts against the same executor:
    all are refused naming A, B stays NOT_SERVING, A's streams end OK with exactly the reference's
    tokens. When A is SIGKILLed, B takes over once A's lease ran out and serves."""
    reference = LLM(str(qwen3_tied), num_kv_blocks=1024)
    prompts = token_prompts(8, seed=13)
    # Long enough for a second scheduler process to start while they stream: at 300 they were at ~100
    # when it tried on an idle 2-core machine, and done under a loaded one (2026-12-04).
    max_tokens = 800
    expected = reference.generate(
        prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True), use_tqdm=False
    )
    cluster = Services(qwen3_tied, tmp_path, **MANY_STREAMS)
    owner_a = f"scheduler 127.0.0.1:{cluster.port}"
    scheduler_b = None
    try:
        cluster.start("--owner-lease-seconds", "2")
        progress = [0] * len(prompts)
        refusals: list[str] = []

        def intrude() -> None:
            with RemoteExecutor(cluster.executor_address, owner_name="second scheduler") as second:
                second.describe()
                for call in (second.reset, lambda: second.step(_prefill(1, 0, 0))):
                    try:
                        call()
                        refusals.append("accepted")
                    except ExecutorOwned as e:
                        refusals.append(str(e))
            for call in ("Reset", "Step"):
                try:
                    _raw(cluster.executor_address, call, _prefill(1, 0, 0))
                    refusals.append("accepted")
                except grpc.RpcError as e:
                    refusals.append(f"{e.code().name}: {e.details()}")

        async def run():
            async with AsyncTandemClient(cluster.address, timeout=120) as client:
                tasks = start_streams(client, prompts, progress, max_tokens)
                while min(progress) < 2:
                    await asyncio.sleep(0.005)
                at_intrusion = list(progress)
                await asyncio.to_thread(intrude)
                # A second scheduler process against the busy executor: refused, naming A.
                nonlocal scheduler_b
                scheduler_b, address = _second_scheduler(cluster, tmp_path)
                deadline = time.monotonic() + 60
                while f"owned by {owner_a}" not in scheduler_b.tail(200):
                    assert time.monotonic() < deadline, f"B never tried:\n{scheduler_b.tail(30)}"
                    await asyncio.sleep(0.05)
                at_second = list(progress)
                return await asyncio.gather(*tasks), at_intrusion, at_second, address

        results, at_intrusion, at_second, address_b = asyncio.run(run())
        assert max(at_intrusion) < max_tokens, "the streams had finished before the intrusion"
        assert min(at_second) < max_tokens, "the streams had finished before the second scheduler tried"
        assert len(refusals) == 4 and all(f"owned by {owner_a}" in r for r in refusals), refusals
        assert check_identical(results, expected) == len(prompts)

        logs = lambda: f"{cluster.logs()}\n--- scheduler-b ---\n{scheduler_b.tail(30)}"  # noqa: E731
        time.sleep(3)  # past A's lease: A still owns the executor, by its open stream and heartbeats
        assert _health(address_b) == "NOT_SERVING", logs()
        with TandemClient(address_b, timeout=10, retries=0) as client, pytest.raises(TandemError) as refused:
            client.complete(prompts[0], max_tokens=4)
        assert refused.value.code == grpc.StatusCode.UNAVAILABLE and f"owned by {owner_a}" in str(
            refused.value
        )
        with TandemClient(cluster.address, timeout=60) as client:
            out = client.complete(prompts[0], max_tokens=max_tokens, ignore_eos=True)
        assert out.token_ids == expected[0].token_ids

        # A dies without releasing: B takes over after A's stream closed and its lease ran out.
        cluster.scheduler.process.kill()
        cluster.scheduler.process.wait()
        _wait_for(lambda: _health(address_b) == "SERVING", 30, "B never took over", logs)
        with TandemClient(address_b, timeout=60) as client:
            out = client.complete(prompts[1], max_tokens=max_tokens, ignore_eos=True)
        assert out.token_ids == expected[1].token_ids
        assert "took over the executor from scheduler 127.0.0.1" in "".join(
            s.tail(400) for s in cluster.executors
        ), logs()
    finally:
        if scheduler_b is not None:
            scheduler_b.stop(10)
        cluster.stop()


def test_a_stopped_scheduler_releases_its_executor(qwen3_tied, tmp_path):
    """SIGTERM on the owner: it releases the executor, so that its replacement serves at once
    rather than after the lease (a minute here)."""
    cluster = Services(qwen3_tied, tmp_path, **MANY_STREAMS)
    scheduler_b = None
    try:
        cluster.start("--owner-lease-seconds", "60")
        cluster.scheduler.stop(10)
        assert cluster.scheduler.process.returncode == 0
        t0 = time.monotonic()
        scheduler_b, address_b = _second_scheduler(cluster, tmp_path)
        logs = lambda: f"{cluster.logs()}\n--- scheduler-b ---\n{scheduler_b.tail(30)}"  # noqa: E731
        _wait_for(lambda: _health(address_b) == "SERVING", 30, "B never connected", logs)
        assert time.monotonic() - t0 < 30
    finally:
        if scheduler_b is not None:
            scheduler_b.stop(10)
        cluster.stop()


def test_a_rogue_reset_is_refused_while_the_owner_streams(server):
    """A caller without a session keeps trying Reset while the owner decodes: nothing it does
    reaches the owner's sequences."""
    stop = threading.Event()
    codes: set[str] = set()

    def rogue() -> None:
        while not stop.is_set():
            codes.add(_refused(lambda: _raw(server.address, "Reset")).code().name)

    with RemoteExecutor(server.address, owner_name="scheduler A") as owner:
        owner.reset()
        mini = MiniScheduler(owner)
        mini.add(1, [5, 6, 7, 8])
        thread = threading.Thread(target=rogue)
        thread.start()
        try:
            plan = mini.plan({1: 4})
            for _ in range(20):
                result = owner.step(plan)
                mini.update(plan, result)
                plan = mini.plan(mini.decode_all())
        finally:
            stop.set()
            thread.join()
    assert codes == {"FAILED_PRECONDITION"}
    assert mini.seqs[1].num_computed_tokens == 4 + 19


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--owner-lease-seconds", "-1"],
            "--owner-lease-seconds must be a finite number of seconds >= 0, got -1.0",
        ),
        (["--api-key-file", "/no/such/keys"], "cannot read the API key file /no/such/keys"),
    ],
)
def test_executor_cli_refuses_bad_owner_and_key_flags(capsys, flags, message):
    from client.cli import main

    assert main(["executor", "--metrics-port", "0", "--port", str(free_port()), *flags]) == 2
    assert message in capsys.readouterr().err


def test_scheduler_sends_the_first_key_of_its_file(tmp_path, monkeypatch):
    """--executor-api-key-file (TANDEM_EXECUTOR_API_KEY_FILE, the executor's variable too): a file
    of keys being rotated serves both sides; the scheduler sends its first key."""
    keys = tmp_path / "executor-keys"
    keys.write_text(f"# new key first\n{KEY}\nold-key\n")
    monkeypatch.setenv("TANDEM_EXECUTOR_API_KEY_FILE", str(keys))
    sent: dict = {}

    class Recorded(RemoteExecutor):
        def __init__(self, address, **kwargs):
            sent.update(kwargs)
            raise ValueError("recorded")

    monkeypatch.setattr("scheduler_service.executor_client.RemoteExecutor", Recorded)
    from client.cli import main

    assert main(["scheduler", "--executor", "127.0.0.1:1", "--metrics-port", "0"]) == 2
    assert sent["api_key"] == KEY and sent["owner_name"].startswith("scheduler 127.0.0.1:")


def test_the_overlapped_step_loop_refuses_the_same(server, local_executor, monkeypatch):
    """The Step loop of CUDA executors (two plans in flight), forced on the CPU: a stray Step is
    refused while the owner streams, and a repeated step id ends the owner's stream after the
    steps before it were answered."""
    monkeypatch.setattr(local_executor, "overlaps_steps", True)
    owner = session_metadata("o" * 32, "scheduler A")
    _raw(server.address, "Reset", metadata=owner)
    results: list[int] = []

    def plans():
        yield plan_to_proto(_prefill(1, 1, 0))
        error = _refused(lambda: _raw(server.address, "Step", _prefill(7, 2, 1)))
        assert (
            error.code() == grpc.StatusCode.FAILED_PRECONDITION and "owned by scheduler A" in error.details()
        )
        yield plan_to_proto(
            StepPlan(2, seq_ids=[1], num_scheduled_tokens=[1], num_computed_tokens=[3], num_new_blocks=[0])
        )
        yield plan_to_proto(StepPlan(2))

    with grpc.insecure_channel(server.address) as channel:
        stream = pb_grpc.ExecutorServiceStub(channel).Step(plans(), timeout=30, metadata=owner)
        with pytest.raises(grpc.RpcError) as e:
            for result in stream:
                results.append(result.step_id)
    assert results == [1, 2]
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "must be 3 or above" in e.value.details()


def test_repeated_refusals_are_logged_once_a_minute_per_caller():
    from executor_service.ownership import LogThrottle

    throttle = LogThrottle(interval_s=60.0)
    assert [throttle("scheduler B") for _ in range(5)] == [True, False, False, False, False]
    assert throttle("scheduler C")  # another caller is logged
    assert not throttle("scheduler B")
