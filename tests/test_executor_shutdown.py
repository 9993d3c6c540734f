"""SIGTERM on the executor service (a real process on the embedded model): the step in flight
finishes, its result reaches the scheduler's stream, then the process exits 0 promptly; with
--tensor-parallel-size 2 no rank is left behind."""

from __future__ import annotations

import queue
import signal
import time
from pathlib import Path

import grpc
import pytest
from executor_fixtures import prompt_ids
from helpers.processes import ServiceProcess, alive, descendants
from helpers.services import executor_process

from client.defaults import free_port
from protos.plan import NewSequence, StepPlan, StepSamplingParams, plan_to_proto
from protos.tandem.v1 import executor_pb2 as pb
from protos.tandem.v1 import executor_pb2_grpc as pb_grpc

# Starts service processes or runs models at length: left out of `make test-fast`.
pytestmark = pytest.mark.slow

PROMPT_LEN = 2048  # the embedded model's whole context
# One step of this many such prefills (~0.1 s each on a CPU thread with SDPA's fused kernel).
NUM_PREFILLS = 8
SEQ_IDS = list(range(7, 7 + NUM_PREFILLS))
BLOCK_SIZE = 16
BLOCKS_PER_SEQ = PROMPT_LEN // BLOCK_SIZE
OPTIONS = dict(
    block_size=BLOCK_SIZE,
    num_kv_blocks=NUM_PREFILLS * BLOCKS_PER_SEQ + 32,
    max_model_len=PROMPT_LEN,
    max_num_batched_tokens=NUM_PREFILLS * PROMPT_LEN,
)
# SIGTERM goes out this long after the plan, well inside the prefill.
IN_FLIGHT_SECONDS = 0.3


def start(log: Path, *extra: str) -> ServiceProcess:
    """The executor on the embedded model (its default)."""
    return executor_process(log, "--grace", "30", *extra, **OPTIONS).start()


def long_prefill() -> StepPlan:
    """One step of NUM_PREFILLS whole-context prefills (SEQ_IDS)."""
    new = [
        NewSequence(
            seq_id,
            prompt_ids(PROMPT_LEN, seed=seq_id),
            list(range(i * BLOCKS_PER_SEQ, (i + 1) * BLOCKS_PER_SEQ)),
            0,
            StepSamplingParams(num_prompt_tokens=PROMPT_LEN),
        )
        for i, seq_id in enumerate(SEQ_IDS)
    ]
    return StepPlan(
        step_id=41,
        new_seqs=new,
        seq_ids=SEQ_IDS,
        num_scheduled_tokens=[PROMPT_LEN] * NUM_PREFILLS,
        num_computed_tokens=[0] * NUM_PREFILLS,
        num_new_blocks=[0] * NUM_PREFILLS,
    )


def sigterm_during_a_step(ep: ServiceProcess) -> float:
    """Open a Step stream as the scheduler does (it stays open), send a long prefill, SIGTERM while
    it runs; assert its result arrives after the signal and the process exits 0. Returns the
    seconds from the result to the exit."""
    plans: queue.SimpleQueue[pb.StepPlan | None] = queue.SimpleQueue()
    with grpc.insecure_channel(ep.address) as channel:
        responses = pb_grpc.ExecutorServiceStub(channel).Step(iter(plans.get, None), timeout=60)
        plans.put(plan_to_proto(long_prefill()))
        time.sleep(IN_FLIGHT_SECONDS)
        assert ep.process.poll() is None, ep.output()
        signalled = time.monotonic()
        ep.process.send_signal(signal.SIGTERM)
        result = next(responses)
        answered = time.monotonic()
        assert (result.step_id, list(result.seq_ids), len(result.token_ids)) == (41, SEQ_IDS, NUM_PREFILLS)
        assert all(0 <= t < 4096 for t in result.token_ids)
        # The step was still running when the signal came: its result is not one sent before.
        assert answered - signalled > 0.1, "the prefill finished before SIGTERM; make it longer"
        # Then the stream ends: the scheduler sees the executor go (and reconnects elsewhere).
        with pytest.raises(grpc.RpcError) as e:
            plans.put(plan_to_proto(StepPlan(step_id=42)))
            next(responses)
        assert e.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED), e.value
        plans.put(None)
    assert ep.process.wait(15) == 0, ep.output()
    exited = time.monotonic()
    assert "signal received" in ep.output() and "stopped" in ep.output()
    return exited - answered


def test_sigterm_finishes_the_running_step_then_exits_0(tmp_path):
    ep = start(tmp_path / "executor.log")
    try:
        ep.wait_serving()
        # A bound that only catches a hang (waiting out a stream, or the full grace period).
        assert sigterm_during_a_step(ep) < 20, ep.output()
    finally:
        ep.stop()


def test_sigterm_with_tensor_parallel_leaves_no_rank(tmp_path):
    ep = start(tmp_path / "executor.log", "--tensor-parallel-size", "2", "--tp-master-port", str(free_port()))
    try:
        ep.wait_serving()
        ranks = descendants(ep.process.pid)
        assert len(ranks) == 1, ep.output()
        assert sigterm_during_a_step(ep) < 20, ep.output()
        deadline = time.monotonic() + 5
        while any(alive(pid) for pid in ranks) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [pid for pid in ranks if alive(pid)], ep.output()
        assert "rank 1: closing" in ep.output()
    finally:
        ep.stop()


def test_sigterm_while_idle_exits_0_at_once(tmp_path):
    ep = start(tmp_path / "executor.log")
    try:
        ep.wait_serving()
        t0 = time.monotonic()
        # A burst of signals (a supervisor's SIGTERM, then a user's Ctrl-C...): one shutdown.
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGTERM, signal.SIGTERM, signal.SIGINT):
            ep.process.send_signal(sig)
        assert ep.process.wait(20) == 0, ep.output()
        # Well under the 30 s grace: an idle executor does not wait it out.
        assert time.monotonic() - t0 < 20
    finally:
        ep.stop()


def test_a_signal_after_the_shutdown_keeps_its_exit_code(tmp_path):
    """The rest of a burst may come once the shutdown is done, while the interpreter exits (where
    Python restores the signals' default action): the process still exits 0, not by the signal."""
    ep = start(tmp_path / "executor.log")
    try:
        ep.wait_serving()
        ep.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 20
        while "executor_service.server: stopped" not in ep.output() and time.monotonic() < deadline:
            time.sleep(0.01)
        while ep.process.poll() is None:
            ep.process.send_signal(signal.SIGINT)
            time.sleep(0.001)
        assert ep.process.returncode == 0, ep.output()
    finally:
        ep.stop()
