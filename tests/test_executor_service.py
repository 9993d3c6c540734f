"""The executor service as a real process on localhost, driven through RemoteExecutor and raw gRPC."""

from __future__ import annotations

import queue
import random
import re
import signal
import time
from pathlib import Path

import grpc
import pytest
from executor_fixtures import MiniScheduler, make_executor
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from helpers.engine_waves import finished_outputs
from helpers.metrics import scrape_samples
from helpers.processes import CHILD_ENV, ROOT, ServiceProcess
from helpers.services import EXECUTOR_OPTIONS, executor_process
from prometheus_client.parser import text_string_to_metric_families

from client.defaults import free_port
from executor_service import cli
from executor_service.metrics import step_kind
from executor_service.plan_validation import PlanError, StepOrderError
from executor_service.server import ExecutorServer
from protos.executor import StepOnlyExecutor
from protos.plan import ExecutorInfo, NewSequence, StepPlan, StepResult, StepSamplingParams, plan_to_proto
from protos.session import session_metadata
from protos.tandem.v1 import executor_pb2 as pb
from protos.tandem.v1 import executor_pb2_grpc as pb_grpc
from scheduler_service.config import SchedulerConfig
from scheduler_service.engine import LLMEngine
from scheduler_service.executor_client import (
    SERVICE_NAME,
    ExecutorError,
    ExecutorUnavailable,
    PlanRejected,
    RemoteExecutor,
)
from scheduler_service.sampling_params import SamplingParams

# Starts service processes or runs models at length: left out of `make test-fast`.
pytestmark = pytest.mark.slow


NUM_KV_BLOCKS = EXECUTOR_OPTIONS["num_kv_blocks"]


def start_executor(model: Path, log: Path, **env: str) -> ServiceProcess:
    return executor_process(
        log, model=model, metrics_port=free_port(), env={**CHILD_ENV, **env}, **EXECUTOR_OPTIONS
    ).start()


@pytest.fixture(scope="module")
def executor_proc(qwen3_tied, tmp_path_factory):
    with start_executor(qwen3_tied, tmp_path_factory.mktemp("executor") / "executor.log") as ep:
        ep.wait_serving()
        yield ep


@pytest.fixture
def remote(executor_proc):
    with RemoteExecutor(executor_proc.address) as r:
        r.reset()
        yield r


SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture(scope="module")
def local(qwen3_tied):
    return make_executor(qwen3_tied, **EXECUTOR_OPTIONS)


class CountingExecutor(StepOnlyExecutor):
    """Wraps an executor and counts the steps and tokens it was asked to run."""

    def __init__(self, executor) -> None:
        self.executor = executor
        self.forward_steps = 0
        self.forward_tokens = 0

    def describe(self) -> ExecutorInfo:
        return self.executor.describe()

    def reset(self) -> int:
        return self.executor.reset()

    def step(self, plan: StepPlan) -> StepResult:
        if plan.seq_ids:
            self.forward_steps += 1
            self.forward_tokens += sum(plan.num_scheduled_tokens)
        return self.executor.step(plan)


def waves() -> list[list[tuple[list[int], SamplingParams]]]:
    """8 prompts of different lengths in two waves; the second shares prefixes with the first
    (prefix-cache hits), the 61-token prompt needs two chunks of the 32-token budget."""
    rng = random.Random(7)
    first = [[rng.randrange(2, 400) for _ in range(n)] for n in (3, 9, 30, 61)]
    second = [
        first[2][:20] + [rng.randrange(2, 400) for _ in range(5)],
        first[3] + [rng.randrange(2, 400) for _ in range(7)],
        first[1][:8],
        [rng.randrange(2, 400)],
    ]
    prompts = first + second

    def params(i: int) -> SamplingParams:
        if i % 2 == 0:
            return SamplingParams(max_tokens=12, ignore_eos=True, logprobs=2 if i == 2 else 0)
        return SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.9, top_p=0.95, seed=100 + i)

    items = [(p, params(i)) for i, p in enumerate(prompts)]
    return [items[:4], items[4:]]


def generate(
    executor, max_plans_in_flight: int | None = None
) -> tuple[dict[int, list[int]], dict[int, list], LLMEngine]:
    config = SchedulerConfig(
        max_num_seqs=16, max_num_batched_tokens=32, max_plans_in_flight=max_plans_in_flight
    )
    engine = LLMEngine(executor, config)
    outputs = finished_outputs(engine, waves())
    tokens = {k: out.token_ids for k, out in outputs.items()}
    return tokens, {k: out.logprobs for k, out in outputs.items()}, engine


# -- health, describe, reflection ---------------------------------------------------------


def test_describe_matches_local_executor(remote, local):
    assert remote.describe() == local.describe()


def test_health_serving_for_server_and_service(executor_proc):
    with grpc.insecure_channel(executor_proc.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", SERVICE_NAME):
            response = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert response.status == SERVING


def test_reflection_lists_the_services(executor_proc):
    with grpc.insecure_channel(executor_proc.address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        (response,) = list(stub.ServerReflectionInfo(iter([request]), timeout=5))
    names = {s.name for s in response.list_services_response.service}
    assert {"tandem.v1.ExecutorService", "grpc.health.v1.Health"} <= names


# -- generation over the wire -------------------------------------------------------------


def test_remote_generation_identical_to_local(remote, local):
    local.reset()
    expected, expected_lp, local_engine = generate(local)
    got, got_lp, remote_engine = generate(remote)
    assert len(got) == 8
    assert got == expected
    assert got_lp == expected_lp
    assert got_lp[2] is not None and len(got_lp[2]) == 12
    stats = remote_engine.scheduler.stats
    assert stats.num_chunked_prefills > 0
    assert stats.num_prefix_hit_tokens > 0
    assert stats.num_prefix_hit_tokens == local_engine.scheduler.stats.num_prefix_hit_tokens


def test_metrics_count_steps_and_tokens(executor_proc, remote):
    before = scrape_samples(executor_proc.metrics_url)
    counting = CountingExecutor(remote)
    generate(counting)
    after = scrape_samples(executor_proc.metrics_url)

    def delta(name: str) -> float:
        return sum(after.get(name, {}).values()) - sum(before.get(name, {}).values())

    assert counting.forward_steps > 0
    assert delta("tandem_executor_step_duration_seconds_count") == counting.forward_steps
    assert delta("tandem_executor_steps_total") == counting.forward_steps
    assert delta("tandem_executor_forward_tokens_total") == counting.forward_tokens
    counts = after["tandem_executor_step_duration_seconds_count"]
    assert all(counts[(("kind", kind),)] > 0 for kind in ("prefill", "decode", "mixed"))
    assert after["tandem_executor_steps_total"][(("mode", "cuda_graph"),)] == 0
    assert after["tandem_executor_kv_cache_blocks"][()] == NUM_KV_BLOCKS
    info = remote.describe()
    assert after["tandem_executor_kv_cache_bytes"][()] == NUM_KV_BLOCKS * info.block_bytes
    assert after["tandem_executor_device_memory_used_bytes"][()] > 0
    ((labels, value),) = after["tandem_executor_info"].items()
    assert value == 1
    assert dict(labels) == {
        "model": info.model,
        "architecture": "Qwen3ForCausalLM",
        "dtype": "float32",
        "tensor_parallel_size": "1",
        "attention_backend": "torch",
        "device": "cpu",
        "kv_cache_dtype": "float32",
    }


# -- bad plans, reset ---------------------------------------------------------------------


def _good_step(remote: RemoteExecutor, mini: MiniScheduler, seq_id: int) -> StepResult:
    mini.add(seq_id, [5, 6, 7, 8, 9])
    plan = mini.plan({seq_id: 5})
    result = remote.step(plan)
    mini.update(plan, result)
    assert result.step_id == plan.step_id and result.seq_ids == [seq_id]
    return result


@pytest.mark.parametrize(
    ("bad", "problem"),
    [
        (
            StepPlan(
                1000, seq_ids=[424242], num_scheduled_tokens=[1], num_computed_tokens=[0], num_new_blocks=[0]
            ),
            "unknown seq id 424242",
        ),
        (
            StepPlan(
                1000,
                new_seqs=[NewSequence(77, [5, 6], [NUM_KV_BLOCKS], 0, StepSamplingParams())],
                seq_ids=[77],
                num_scheduled_tokens=[2],
                num_computed_tokens=[0],
                num_new_blocks=[0],
            ),
            f"block id {NUM_KV_BLOCKS} in the block_table of new seq 77 is outside [0, {NUM_KV_BLOCKS})",
        ),
        (
            StepPlan(
                1000,
                new_seqs=[NewSequence(78, [5, 512], [0], 0, StepSamplingParams())],
                seq_ids=[78],
                num_scheduled_tokens=[2],
                num_computed_tokens=[0],
                num_new_blocks=[0],
            ),
            "token id 512 is outside the vocabulary [0, 512)",
        ),
    ],
    ids=["unknown-seq", "block-out-of-range", "token-outside-vocab"],
)
def test_bad_plan_rejected_then_new_stream_works(remote, executor_proc, bad, problem):
    mini = MiniScheduler(remote)
    _good_step(remote, mini, seq_id=1)
    with pytest.raises(PlanRejected, match=re.escape(problem)) as excinfo:
        remote.step(bad)
    assert excinfo.value.step_id == 1000
    assert executor_proc.address in str(excinfo.value)
    # The rejected plan changed nothing: seq 1 decodes where it was, on a new stream.
    plan = mini.plan(mini.decode_all())
    assert plan.seq_ids == [1] and plan.num_computed_tokens == [5]
    assert remote.step(plan).seq_ids == [1]

    # The same plan from a raw stub of the owner's session (a stray caller would be refused).
    owner = session_metadata(remote.session_id, remote.owner_name)
    with grpc.insecure_channel(executor_proc.address) as channel:
        responses = pb_grpc.ExecutorServiceStub(channel).Step(
            iter([plan_to_proto(bad)]), timeout=10, metadata=owner
        )
        with pytest.raises(grpc.RpcError) as raw:
            list(responses)
    assert raw.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert problem in raw.value.details()


def test_reset_drops_every_sequence(remote):
    mini = MiniScheduler(remote)
    _good_step(remote, mini, seq_id=1)
    _good_step(remote, mini, seq_id=2)
    assert remote.reset() == 2
    with pytest.raises(PlanRejected, match="unknown seq id 1"):
        remote.step(mini.plan(mini.decode_all()))
    assert remote.reset() == 0


def test_a_step_stream_opened_before_a_reset_runs_no_more_plans(remote, executor_proc):
    """A scheduler that lost its executor closes its Step stream, then resets on reconnecting; a
    plan of the old stream read before its cancellation was seen must not run on the reset state
    (its new sequences would be held for good). The executor refuses it: FAILED_PRECONDITION."""

    def new_seq_plan(step_id: int, seq_id: int):
        new = NewSequence(seq_id, [5, 6], [seq_id], 0, StepSamplingParams())
        plan = StepPlan(
            step_id, new_seqs=[new], seq_ids=[seq_id], num_scheduled_tokens=[2], num_computed_tokens=[0]
        )
        plan.num_new_blocks = [0]
        return plan_to_proto(plan)

    owner = session_metadata(remote.session_id, remote.owner_name)
    plans: queue.SimpleQueue = queue.SimpleQueue()
    with grpc.insecure_channel(executor_proc.address) as channel:
        responses = pb_grpc.ExecutorServiceStub(channel).Step(
            iter(plans.get, None), timeout=30, metadata=owner
        )
        plans.put(new_seq_plan(5000, 3))
        assert list(next(responses).seq_ids) == [3]
        assert remote.reset() == 1
        plans.put(new_seq_plan(5001, 4))
        with pytest.raises(grpc.RpcError) as stale:
            next(responses)
        plans.put(None)
    assert stale.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "reset after its Step stream opened" in stale.value.details()
    assert remote.reset() == 0  # sequence 4 was never added
    # A stream opened after the Reset runs plans.
    mini = MiniScheduler(remote)
    _good_step(remote, mini, seq_id=5)


# -- errors and lifecycle -----------------------------------------------------------------


def test_dead_address_raises_executor_unavailable():
    address = f"127.0.0.1:{free_port()}"
    with RemoteExecutor(address, connect_timeout=2) as remote:
        with pytest.raises(ExecutorUnavailable, match=address):
            remote.describe()
        with pytest.raises(ExecutorUnavailable, match=address):
            remote.step(StepPlan(0))
        with pytest.raises(ExecutorUnavailable, match=f"{address} not ready"):
            remote.wait_ready(0.3)


def test_not_serving_while_loading_then_serving_then_sigterm(qwen3_tied, tmp_path):
    ep = start_executor(qwen3_tied, tmp_path / "executor.log", TANDEM_TEST_LOAD_DELAY="2")
    try:
        ep.wait_listening()
        statuses = []
        with grpc.insecure_channel(ep.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            deadline = time.monotonic() + 60
            while SERVING not in statuses and time.monotonic() < deadline:
                assert ep.process.poll() is None, ep.output()
                try:
                    # The server's overall status first: if the service still loads after it, the
                    # overall status read before must not have been SERVING (no race with the load).
                    overall = stub.Check(health_pb2.HealthCheckRequest(), timeout=5).status
                    response = stub.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=5)
                    statuses.append(response.status)
                    if response.status == NOT_SERVING:
                        assert overall == NOT_SERVING
                except grpc.RpcError as e:  # not listening yet
                    assert e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED), e
                time.sleep(0.05)
        assert statuses[0] == NOT_SERVING, ep.output()
        assert statuses[-1] == SERVING, ep.output()

        with RemoteExecutor(ep.address) as remote:
            _good_step(remote, MiniScheduler(remote), seq_id=3)  # leaves a Step stream open
            t0 = time.monotonic()
            ep.process.send_signal(signal.SIGTERM)
            assert ep.process.wait(10) == 0, ep.output()
            assert time.monotonic() - t0 < 5
            with pytest.raises(ExecutorUnavailable, match=ep.address):
                remote.describe()
        assert "stopped" in ep.output()
    finally:
        ep.stop()


def test_loading_executor_answers_unavailable(qwen3_tied, tmp_path):
    ep = start_executor(qwen3_tied, tmp_path / "executor.log", TANDEM_TEST_LOAD_DELAY="30")
    try:
        with RemoteExecutor(ep.address, connect_timeout=5) as remote:
            deadline = time.monotonic() + 60
            while True:
                try:
                    remote.describe()
                    raise AssertionError("Describe answered while loading")
                except ExecutorUnavailable as e:
                    if "still loading" in str(e):
                        break
                    assert time.monotonic() < deadline, ep.output()
                    time.sleep(0.05)
        # SIGTERM during the load: exits at once.
        assert ep.stop() == 0
    finally:
        ep.stop()


# -- in-process server with a fake executor ------------------------------------------------


class FakeExecutor(StepOnlyExecutor):
    """Echoes each scheduled seq id as its token; step 1 fails, step 2 answers the wrong step id."""

    overlaps_steps = False  # the servicer's ServedExecutor
    tp_size = 1
    num_graph_steps = 0
    device_timeline = None

    def __init__(self) -> None:
        self.seqs: dict = {}  # the sequences held, as LocalExecutor's (the server's gauge counts them)

    def describe(self) -> ExecutorInfo:
        return ExecutorInfo("fake", "Fake", 4, 8, 64, 512, [0], 1, "float32", "cpu", 8, 64, "none", 1, 16)

    def reset(self) -> int:
        return 0

    def step(self, plan: StepPlan) -> StepResult:
        if plan.step_id == 1:
            raise RuntimeError("boom")
        if plan.step_id == 3:
            raise PlanError("step 3: nope")
        step_id = plan.step_id + 1 if plan.step_id == 2 else plan.step_id
        return StepResult(step_id, list(plan.seq_ids), list(plan.seq_ids), [1] * len(plan.seq_ids))


def test_internal_error_keeps_service_up():
    server = ExecutorServer("127.0.0.1", 0)
    server.start()
    server.set_executor(FakeExecutor())
    plan = lambda step_id: StepPlan(step_id, seq_ids=[9], num_scheduled_tokens=[1], num_computed_tokens=[0])  # noqa: E731
    try:
        with RemoteExecutor(server.address) as remote:
            assert remote.step(plan(0)).token_ids == [9]
            with pytest.raises(ExecutorError, match="INTERNAL: step 1 failed: RuntimeError: boom") as e:
                remote.step(plan(1))
            assert not isinstance(e.value, ExecutorUnavailable | PlanRejected)
            with pytest.raises(ExecutorError, match="answered step 2 with the result of step 3"):
                remote.step(plan(2))
            with pytest.raises(PlanRejected, match="nope"):
                remote.step(plan(3))
            assert remote.step(plan(4)).token_ids == [9]
        failures = {
            s.labels["code"]: s.value
            for f in text_string_to_metric_families(_registry_text(server))
            for s in f.samples
            if s.name == "tandem_executor_step_failures_total"
        }
        assert failures == {"INTERNAL": 1, "INVALID_ARGUMENT": 1}
    finally:
        server.stop(1)


class UnfinishedExecutor(FakeExecutor):
    """Overlaps steps, as on CUDA, and no step it is sent finishes until it is received."""

    overlaps_steps = True

    def __init__(self) -> None:
        super().__init__()
        self.sent: list[StepPlan] = []

    def ready(self) -> bool:
        return False

    def send(self, plan: StepPlan) -> None:
        self.sent.append(plan)

    def receive(self, plan: StepPlan) -> StepResult:
        assert self.sent.pop(0) is plan
        return StepResult(plan.step_id, list(plan.seq_ids), list(plan.seq_ids), [1] * len(plan.seq_ids))

    def discard(self) -> None:
        self.sent.clear()


def test_shutdown_answers_the_step_in_flight_before_refusing_the_next():
    """SIGTERM's close while a step is in flight on the device: the plan behind it is refused
    UNAVAILABLE, but only after the step in flight is answered (its tokens are not lost)."""
    executor = UnfinishedExecutor()
    server = ExecutorServer("127.0.0.1", 0)
    server.start()
    server.set_executor(executor)
    plan = lambda step_id: StepPlan(step_id, seq_ids=[9], num_scheduled_tokens=[1], num_computed_tokens=[0])  # noqa: E731
    plans: queue.SimpleQueue = queue.SimpleQueue()
    try:
        with grpc.insecure_channel(server.address) as channel:
            responses = pb_grpc.ExecutorServiceStub(channel).Step(iter(plans.get, None), timeout=30)
            plans.put(plan_to_proto(plan(0)))
            deadline = time.monotonic() + 10
            while not executor.sent and time.monotonic() < deadline:
                time.sleep(0.01)
            assert [p.step_id for p in executor.sent] == [0]
            server.servicer.close(timeout=1)  # what SIGTERM does first
            plans.put(plan_to_proto(plan(1)))
            first = next(responses)
            assert (first.step_id, list(first.token_ids)) == (0, [9])
            with pytest.raises(grpc.RpcError) as e:
                next(responses)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in e.value.details()
            plans.put(None)
    finally:
        server.stop(1)


class ResettableExecutor(UnfinishedExecutor):
    """As LocalExecutor: a reset forgets the steps in flight (ready() then holds), and a receive of
    a step no longer in flight is a StepOrderError."""

    def ready(self) -> bool:
        return not self.sent

    def reset(self) -> int:
        self.sent.clear()
        return 0

    def receive(self, plan: StepPlan) -> StepResult:
        if not self.sent or self.sent[0] is not plan:
            raise StepOrderError(f"receive of step {plan.step_id}, which is not the oldest in flight")
        return super().receive(plan)


def test_a_reset_while_a_step_is_in_flight_refuses_it_as_stale():
    """The owner's Reset (or Release) while its stream has a step in flight on the device (the
    scheduler closes the stream first, but the executor may not have seen that yet): the step is
    gone, and the stream ends FAILED_PRECONDITION as for a plan read after the Reset. It ended
    INTERNAL, with a traceback logged and tandem_executor_step_failures_total{code="INTERNAL"}."""
    executor = ResettableExecutor()
    server = ExecutorServer("127.0.0.1", 0)
    server.start()
    server.set_executor(executor)
    owner = session_metadata("o" * 32, "scheduler A")
    plan = StepPlan(0, seq_ids=[9], num_scheduled_tokens=[1], num_computed_tokens=[0])
    plans: queue.SimpleQueue = queue.SimpleQueue()
    try:
        with grpc.insecure_channel(server.address) as channel:
            stub = pb_grpc.ExecutorServiceStub(channel)
            stub.Reset(pb.ResetRequest(), timeout=10, metadata=owner)
            responses = stub.Step(iter(plans.get, None), timeout=30, metadata=owner)
            plans.put(plan_to_proto(plan))
            deadline = time.monotonic() + 10
            while not executor.sent and time.monotonic() < deadline:
                time.sleep(0.01)
            stub.Reset(pb.ResetRequest(), timeout=10, metadata=owner)
            with pytest.raises(grpc.RpcError) as e:
                next(responses)
            plans.put(None)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION, e.value.details()
        assert "reset after its Step stream opened" in e.value.details()
        failures = {
            s.labels["code"]: s.value
            for f in text_string_to_metric_families(_registry_text(server))
            for s in f.samples
            if s.name == "tandem_executor_step_failures_total"
        }
        assert failures == {"FAILED_PRECONDITION": 1}
    finally:
        server.stop(1)


class FinishedExecutor(UnfinishedExecutor):
    """Overlaps steps, and each step it is sent is done at once."""

    def ready(self) -> bool:
        return bool(self.sent)


def test_idle_waits_are_logged_when_asked(monkeypatch, caplog):
    """TANDEM_LOG_IDLE_MS: each wait of the device for a plan that long is logged with the step it
    came before (what tandem_executor_idle_seconds counts, placed in the run)."""
    monkeypatch.setenv("TANDEM_LOG_IDLE_MS", "30")
    server = ExecutorServer("127.0.0.1", 0)
    server.start()
    server.set_executor(FinishedExecutor())
    plan = lambda step_id: StepPlan(step_id, seq_ids=[9], num_scheduled_tokens=[1], num_computed_tokens=[0])  # noqa: E731
    plans: queue.SimpleQueue = queue.SimpleQueue()
    try:
        with (
            caplog.at_level("INFO", logger="executor_service.servicer"),
            grpc.insecure_channel(server.address) as channel,
        ):
            responses = pb_grpc.ExecutorServiceStub(channel).Step(iter(plans.get, None), timeout=30)
            plans.put(plan_to_proto(plan(0)))
            assert next(responses).step_id == 0
            plans.put(plan_to_proto(plan(1)))  # at once: no wait logged
            assert next(responses).step_id == 1
            time.sleep(0.1)
            plans.put(plan_to_proto(plan(2)))
            assert next(responses).step_id == 2
            plans.put(None)
        waits = [r.getMessage() for r in caplog.records if "device idle" in r.getMessage()]
        assert len(waits) == 1 and "before step 2: 1 sequences (0 new, 0 finished), 1 tokens" in waits[0], (
            waits
        )
        assert float(waits[0].split()[2]) >= 100
    finally:
        server.stop(1)


class TimedExecutor(FinishedExecutor):
    """With a device timeline, as LocalExecutor on CUDA: each answered step settled 2 ms busy after
    a 1 ms gap."""

    class Timeline:
        def take(self) -> tuple[float, list[float]]:
            return 0.002, [0.001]

    device_timeline = Timeline()


def test_device_timeline_is_exported():
    """tandem_executor_device_busy_seconds and tandem_executor_device_gap_seconds add up what the
    executor's device timeline settles with each answered step."""
    server = ExecutorServer("127.0.0.1", 0)
    server.start()
    server.set_executor(TimedExecutor())
    plan = lambda step_id: StepPlan(step_id, seq_ids=[9], num_scheduled_tokens=[1], num_computed_tokens=[0])  # noqa: E731
    try:
        with grpc.insecure_channel(server.address) as channel:
            requests = iter([plan_to_proto(plan(i)) for i in range(3)])
            results = list(pb_grpc.ExecutorServiceStub(channel).Step(requests, timeout=30))
        assert [r.step_id for r in results] == [0, 1, 2]
        text = _registry_text(server)
        assert "tandem_executor_device_busy_seconds_total 0.006" in text
        assert "tandem_executor_device_gap_seconds_count 3.0" in text
        assert "tandem_executor_device_gap_seconds_sum 0.003" in text
    finally:
        server.stop(1)


def test_port_in_use_fails_loudly():
    first = ExecutorServer("127.0.0.1", 0)
    first.start()
    try:
        with pytest.raises(OSError, match=f"port {first.port} is already in use"):
            ExecutorServer("127.0.0.1", first.port)
    finally:
        first.stop(0)


def _registry_text(server: ExecutorServer) -> str:
    from prometheus_client import generate_latest

    return generate_latest(server.metrics.registry).decode()


def test_step_kind():
    new = NewSequence(1, [5, 6, 7], [0], 0, StepSamplingParams())
    prefill = StepPlan(0, new_seqs=[new], seq_ids=[1], num_scheduled_tokens=[3])
    decode = StepPlan(0, seq_ids=[2, 3], num_scheduled_tokens=[1, 1])
    mixed = StepPlan(0, new_seqs=[new], seq_ids=[2, 1], num_scheduled_tokens=[1, 3])
    chunk = StepPlan(0, seq_ids=[4], num_scheduled_tokens=[16])
    assert [step_kind(p) for p in (prefill, decode, mixed, chunk)] == [
        "prefill",
        "decode",
        "mixed",
        "prefill",
    ]


# -- CLI ----------------------------------------------------------------------------------


def test_cli_flags_have_env_twins(monkeypatch):
    import argparse

    monkeypatch.setenv("TANDEM_EXECUTOR_PORT", "50123")
    monkeypatch.setenv("TANDEM_GPU_MEMORY_UTILIZATION", "0.5")
    monkeypatch.setenv("TANDEM_ENFORCE_EAGER", "1")
    parser = argparse.ArgumentParser()
    cli.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["executor"])
    assert (args.port, args.gpu_memory_utilization, args.enforce_eager) == (50123, 0.5, True)
    assert args.host == "127.0.0.1" and args.metrics_port == 9102
    assert Path(args.model) == ROOT / "models" / "tandem-tiny-pydoc"
    assert args.port == parser.parse_args(["executor", "--port", "50123"]).port
    assert parser.parse_args(["executor", "--port", "7"]).port == 7
    for action in parser._subparsers._group_actions[0].choices["executor"]._actions:
        assert action.help, action.dest


class _CountingRemote(RemoteExecutor):
    """How many plans were out at once."""

    out = most_out = 0

    def send(self, plan) -> None:
        super().send(plan)
        self.out += 1
        self.most_out = max(self.most_out, self.out)

    def receive(self, plan):
        result = super().receive(plan)
        self.out -= 1
        return result


def _overlapping_server(path) -> ExecutorServer:
    """An executor service whose Step handler runs its overlapped loop (on CUDA: each plan
    launched as it arrives, the oldest step answered when done), forced on the CPU."""
    executor = make_executor(path, **EXECUTOR_OPTIONS)
    executor.overlaps_steps = True
    server = ExecutorServer("127.0.0.1", 0)
    server.start()
    server.set_executor(executor)
    return server


def test_three_plans_in_flight_through_the_service_match_local(qwen3_tied, local):
    """--max-plans-in-flight 3: the Step handler's overlapped loop runs two steps and keeps the
    third plan queued until the oldest is answered; the same tokens and logprobs as in-process."""
    server = _overlapping_server(qwen3_tied)
    try:
        local.reset()
        expected, expected_lp, _ = generate(local)
        with _CountingRemote(server.address) as remote:
            got, got_lp, engine = generate(remote, max_plans_in_flight=3)
            assert engine.max_plans_in_flight == 3 and remote.most_out == 3
            assert (got, got_lp) == (expected, expected_lp)
    finally:
        server.stop(1)


def test_cli_rejects_bad_configuration(capsys):
    from client.cli import main

    assert main(["executor", "--model", str(ROOT / "no-such-model")]) == 2
    assert main(["executor", "--gpu-memory-utilization", "1.5"]) == 2
    err = capsys.readouterr().err
    assert "no-such-model" in err and "gpu_memory_utilization (1.5) must be in (0, 1]" in err


def test_two_steps_in_flight_through_the_service_match_local(qwen3_tied, local):
    """The Step handler's overlapped loop (on CUDA: each plan launched as it arrives, the oldest
    step answered when done), forced on the CPU: the same tokens as in-process, then a refused
    plan fails alone and the stream that follows works."""
    server = _overlapping_server(qwen3_tied)
    try:
        local.reset()
        expected, expected_lp, _ = generate(local)
        registry = server.metrics.registry
        with RemoteExecutor(server.address) as remote:
            t0 = time.perf_counter()
            got, got_lp, engine = generate(remote)
            wall = time.perf_counter() - t0
            assert engine.max_plans_in_flight == 2
            assert (got, got_lp) == (expected, expected_lp)
            # The device's time split into steps and the gaps between them (waiting on the
            # scheduler): at most the wall time, each gap counted once, never for the first plan.
            kinds = [{"kind": kind} for kind in ("prefill", "decode", "mixed")]
            count, total = (
                "tandem_executor_step_duration_seconds_count",
                "tandem_executor_step_duration_seconds_sum",
            )
            steps = sum(registry.get_sample_value(count, labels) for labels in kinds)
            busy = sum(registry.get_sample_value(total, labels) for labels in kinds)
            gaps = registry.get_sample_value("tandem_executor_idle_seconds_count")
            idle = registry.get_sample_value("tandem_executor_idle_seconds_sum")
            assert steps > 0 and 0 <= gaps < steps and idle >= 0
            assert busy + idle <= wall
            bad = StepPlan(engine.scheduler.next_step_id + 5, seq_ids=[424242], num_scheduled_tokens=[1],
                           num_computed_tokens=[0], num_new_blocks=[0])  # fmt: skip
            with pytest.raises(PlanRejected, match="unknown seq id 424242"):
                remote.step(bad)
            remote.reset()
            again, _, _ = generate(remote)
            assert again == expected
    finally:
        server.stop(1)
