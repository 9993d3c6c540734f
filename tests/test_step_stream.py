"""The scheduler's Step stream (scheduler_service/executor_client.py _StepStream: one segregated gRPC
call polled by the thread that steps) against a real executor service over a stub model
(bench/stub_executor.py): plans queued behind the send in flight, streams opened and closed over
and over, streams the executor ends with an error, the watchdog's cancel, an executor killed
mid-stream, and close()."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import pytest
from helpers.processes import ROOT, ServiceProcess

from client.defaults import free_port
from executor_service.ownership import NotOwner
from executor_service.plan_validation import PlanError
from executor_service.server import ExecutorServer
from protos.plan import NewSequence, StepPlan, StepResult, StepSamplingParams
from scheduler_service.executor_client import (
    ExecutorError,
    ExecutorOwned,
    ExecutorUnavailable,
    PlanRejected,
    RemoteExecutor,
)

_spec = importlib.util.spec_from_file_location("stub_executor", ROOT / "bench" / "stub_executor.py")
stub_executor = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(stub_executor)

VOCAB = 1000


class _Stub(stub_executor.StubExecutor):
    """The stub model, answering each sequence's id (mod VOCAB) as its token, so that a result
    shows which plan it belongs to; it records the steps it ran and fails those in `failures`
    (step id -> exception) as a model's executor would."""

    def __init__(self) -> None:
        super().__init__(VOCAB, 1024, 1 << 20)
        self.ran: list[int] = []
        self.failures: dict[int, Exception] = {}

    def step(self, plan: StepPlan) -> StepResult:
        if (error := self.failures.pop(plan.step_id, None)) is not None:
            raise error
        self.ran.append(plan.step_id)
        result = super().step(plan)
        result.token_ids = [sid % VOCAB for sid in result.seq_ids]
        return result


def _prefill(step_id: int, seq_id: int, num_tokens: int = 3) -> StepPlan:
    """A new sequence's whole prompt: the stub answers it with one token."""
    prompt = [5] * num_tokens
    return StepPlan(
        step_id,
        new_seqs=[NewSequence(seq_id, prompt, [0], 0, StepSamplingParams(num_prompt_tokens=num_tokens))],
        seq_ids=[seq_id],
        num_scheduled_tokens=[num_tokens],
        num_computed_tokens=[0],
        num_new_blocks=[0],
    )


def _check(result: StepResult, plan: StepPlan) -> None:
    assert (result.step_id, result.seq_ids, result.token_ids) == (
        plan.step_id,
        plan.seq_ids,
        [sid % VOCAB for sid in plan.seq_ids],
    )


@pytest.fixture
def served() -> Iterator[tuple[ExecutorServer, _Stub]]:
    server = ExecutorServer("127.0.0.1", 0)
    server.start()
    executor = _Stub()
    server.set_executor(executor)
    yield server, executor
    server.stop(0)


@pytest.fixture
def remote(served) -> Iterator[RemoteExecutor]:
    with RemoteExecutor(served[0].address) as r:
        r.reset()
        yield r


def _wait_until(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"no {what} after {timeout:.0f} s"
        time.sleep(0.01)


def test_plans_queued_behind_the_send_in_flight_come_back_in_order(served, remote):
    """One send at a time is in flight on the call; the plans sent behind it (some larger than the
    HTTP/2 window, so that their sends complete only as the executor reads them) go out in order
    and every result comes back to its plan, as the engine sends ahead (max_plans_in_flight 3)."""
    _, executor = served
    plans = [_prefill(i, 100 + i, 200_000 if i % 3 == 1 else 3) for i in range(10)]
    for plan in plans[:8]:  # all sent before the first result is asked for
        remote.send(plan)
    for plan in plans[:3]:
        _check(remote.receive(plan), plan)
    remote.send(plans[8])
    remote.send(plans[9])
    for plan in plans[3:]:
        _check(remote.receive(plan), plan)
    assert executor.ran == list(range(10))


def _count_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_300_stream_reopenings_leave_no_calls_threads_or_fds_behind(served, remote):
    """reset() and discard() close the Step stream (with a plan unsent, a send in flight or a result
    unread) and the next send opens another: a call left open would hold an executor thread and its
    stream (after 16, steps hang), a completion queue or socket would show as a descriptor."""
    server, _ = served
    step = iter(range(1, 10**6))

    def cycle(i: int) -> None:
        first, second = _prefill(next(step), i), _prefill(next(step), 10**5 + i)
        remote.send(first)
        remote.send(second)  # queued behind `first`'s send
        _check(remote.receive(first), first)
        if i % 10 == 0:
            remote.reset()
        else:
            remote.discard()

    for i in range(20):
        cycle(i)
    threads, fds = threading.active_count(), _count_fds()
    for i in range(20, 320):
        cycle(i)
    last = _prefill(next(step), 424242)
    _check(remote.step(last), last)
    remote.discard()
    _wait_until(lambda: not server.servicer.ownership._open_streams, 5, "closed streams on the executor")
    # A closed call's threads end on their own schedule (under load, after this line): a leak is
    # a count that stays up, not one still coming down.
    _wait_until(lambda: threading.active_count() <= threads + 2, 10, f"threads back to {threads} + 2")
    _wait_until(lambda: _count_fds() <= fds + 2, 10, f"descriptors back to {fds} + 2")


def _dead_rank(executor: _Stub) -> Exception:
    """A tensor-parallel executor whose rank 1 died: the servicer answers UNAVAILABLE."""
    executor.tp_size = 2
    executor.failed_ranks = lambda: [(1, -9)]
    return RuntimeError("NCCL error: remote process exited")


@pytest.mark.parametrize(
    ("fail", "error", "message"),
    [
        (
            lambda executor: PlanError("unknown seq id 77"),
            PlanRejected,
            r"rejected step 3: unknown seq id 77$",
        ),
        (
            lambda executor: RuntimeError("device fault"),
            ExecutorError,
            r"failed Step 3: INTERNAL: step 3 failed: RuntimeError: device fault$",
        ),
        (_dead_rank, ExecutorUnavailable, r"step 3 failed: tensor-parallel rank\(s\) \[1\] died"),
    ],
    ids=["INVALID_ARGUMENT", "INTERNAL", "UNAVAILABLE"],
)
def test_a_stream_the_executor_fails_keeps_the_results_before_and_maps_its_status(
    served, remote, fail, error, message
):
    """Plans 1..5 out at once, the executor fails step 3: steps 1 and 2 are answered, step 3 raises
    the error its status maps to with the executor's message, step 4 finds the stream closed,
    and the next plan runs on a new stream."""
    executor = served[1]
    executor.failures[3] = fail(executor)
    plans = [_prefill(i, 200 + i) for i in range(1, 6)]
    for plan in plans:
        remote.send(plan)
    for plan in plans[:2]:
        _check(remote.receive(plan), plan)
    with pytest.raises(error, match=message) as e:
        remote.receive(plans[2])
    assert type(e.value) is error
    if error is PlanRejected:
        assert (e.value.step_id, e.value.message) == (3, "unknown seq id 77")
    with pytest.raises(ExecutorUnavailable, match="closed before the result of step 4"):
        remote.receive(plans[3])
    executor.tp_size = 1
    again = _prefill(10, 300)
    _check(remote.step(again), again)


def test_a_stream_refused_for_another_owner_maps_to_executor_owned(served, remote, monkeypatch):
    """FAILED_PRECONDITION mid-stream (the executor went to another scheduler between two plans):
    the steps answered before it stay answered, and the next raises ExecutorOwned naming the
    owner, so that the engine keeps its requests."""
    server, _ = served
    ownership = server.servicer.ownership
    check_plan = ownership.check_plan

    def taken_at_step_3(session, step_id):
        if step_id >= 3:
            raise NotOwner("executor owned by scheduler B since step 3")
        check_plan(session, step_id)

    monkeypatch.setattr(ownership, "check_plan", taken_at_step_3)
    plans = [_prefill(i, 400 + i) for i in range(1, 5)]
    for plan in plans:
        remote.send(plan)
    for plan in plans[:2]:
        _check(remote.receive(plan), plan)
    with pytest.raises(ExecutorOwned, match="refused Step 3: executor owned by scheduler B since step 3"):
        remote.receive(plans[2])


def test_an_overdue_step_is_cancelled_by_the_watchdog_and_the_next_stream_works(served):
    """A step 5x past --executor-step-timeout (a hung device): its receive fails within the
    timeout, not after the step, the plan queued behind it is dropped with the stream, and once
    the executor answers again the next send opens a stream that works."""
    server, _ = served
    paced = stub_executor.PacedStubExecutor(VOCAB, 64, 4096, 1.0)
    server.set_executor(paced)
    with RemoteExecutor(server.address, step_timeout=0.2) as remote:
        remote.reset()
        slow, behind = _prefill(1, 1), _prefill(2, 2)
        t0 = time.monotonic()
        remote.send(slow)
        remote.send(behind)
        with pytest.raises(ExecutorUnavailable, match=r"did not answer step 1 within 0\.2 s"):
            remote.receive(slow)
        assert time.monotonic() - t0 < 0.7
        with pytest.raises(ExecutorUnavailable, match="closed before the result of step 2"):
            remote.receive(behind)
        paced.step_s = 0.01
        # The cancelled step still holds the emulated device for its 1 s; its stream's end frees it.
        _wait_until(lambda: not server.servicer.ownership._open_streams, 5, "closed stream on the executor")
        for step_id in (3, 4, 5):
            plan = _prefill(step_id, step_id)
            result = remote.step(plan)
            assert (result.step_id, result.seq_ids) == (step_id, [step_id])


@pytest.mark.parametrize("state", ["never stepped", "stream idle", "stream ended by the executor"])
def test_close_of_an_idle_executor_is_prompt_and_releases_it(served, state):
    """close() with no result awaited: nothing to wait for (a stream's call is cancelled and its
    events taken, an ended one has none left), and the executor is free for another scheduler."""
    server, executor = served
    remote = RemoteExecutor(server.address, owner_name="scheduler A")
    remote.reset()
    if state != "never stepped":
        plan = _prefill(1, 1)
        _check(remote.step(plan), plan)
    if state == "stream ended by the executor":
        executor.failures[2] = RuntimeError("boom")
        with pytest.raises(ExecutorError, match="boom"):
            remote.step(_prefill(2, 2))
    t0 = time.monotonic()
    remote.close()
    assert time.monotonic() - t0 < 0.5
    assert server.servicer.ownership.owner is None
    _wait_until(lambda: not server.servicer.ownership._open_streams, 5, "closed stream on the executor")
    with RemoteExecutor(server.address, owner_name="scheduler B") as other:
        other.reset()  # not ExecutorOwned: A let go
        plan = _prefill(3, 3)
        _check(other.step(plan), plan)


def _stub_process(tmp_path: Path, port: int) -> ServiceProcess:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps({"vocab_size": VOCAB}))
    argv = [sys.executable, str(ROOT / "bench" / "stub_executor.py"), "--model", str(model)]
    argv += ["--port", str(port), "--step-ms", "300"]
    return ServiceProcess(
        "stub executor",
        argv,
        tmp_path / f"stub-{time.monotonic_ns()}.log",
        address=f"127.0.0.1:{port}",
        health_service="tandem.v1.ExecutorService",
    )


@pytest.mark.slow
def test_an_executor_killed_mid_stream_fails_the_steps_at_once_and_a_restarted_one_serves(tmp_path):
    """SIGKILL while a step runs and plans wait behind it: every receive raises ExecutorUnavailable
    at once (not after keepalive's ~40 s, nor the step timeout), close-and-reopen works, and the
    same RemoteExecutor drives the executor restarted on its port."""
    port = free_port()
    first = _stub_process(tmp_path, port).start()
    try:
        first.wait_serving()
        with RemoteExecutor(first.address, step_timeout=30) as remote:
            remote.reset()
            plans = [_prefill(i, i) for i in range(1, 5)]
            assert remote.step(plans[0]).token_ids == [stub_executor.TOKEN]
            for plan in plans[1:]:
                remote.send(plan)
            threading.Timer(0.1, first.kill).start()
            t0 = time.monotonic()
            for plan in plans[1:]:
                with pytest.raises(ExecutorUnavailable):
                    remote.receive(plan)
            assert time.monotonic() - t0 < 2.0
            with pytest.raises(ExecutorUnavailable):
                remote.step(_prefill(5, 5))
            with _stub_process(tmp_path, port) as second:
                second.wait_serving()
                _wait_until(lambda: _reset_ok(remote), 10, "reconnect")
                plan = _prefill(6, 6)
                result = remote.step(plan)
                assert (result.step_id, result.seq_ids, result.token_ids) == (6, [6], [stub_executor.TOKEN])
    finally:
        if first.alive():
            first.kill()


def _reset_ok(remote: RemoteExecutor) -> bool:
    try:
        remote.reset()
    except ExecutorUnavailable:
        return False
    return True


def test_a_result_that_does_not_parse_is_an_executor_error_naming_it():
    """An executor (or a proxy before it) answering bytes that are no StepResult: the step fails as
    an ExecutorError saying so, as grpc's own call reported it (INTERNAL), not protobuf's
    DecodeError from inside the engine's step."""
    import grpc

    def step(requests, context):
        for _ in requests:
            yield b"\xff\xff\xff"  # (no serializer: the bytes go out as they are)

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "tandem.v1.ExecutorService", {"Step": grpc.stream_stream_rpc_method_handler(step)}
            ),
        )
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        remote = RemoteExecutor(f"127.0.0.1:{port}", step_timeout=5.0)
        try:
            plan = _prefill(1, 1)
            remote.send(plan)
            with pytest.raises(
                ExecutorError, match=r"INTERNAL: the executor's result for step 1 does not parse"
            ):
                remote.receive(plan)
        finally:
            remote.close()
    finally:
        server.stop(0)
