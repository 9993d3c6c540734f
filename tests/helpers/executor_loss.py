"""Shared by the tests: from test_executor_recovery.py and test_tensor_parallel.py (the scheduler's
executor recovery, in-process: an executor that goes away mid-run, and the kept requests recomputed
on the same executor after its reset, through scheduler_service/executor_recovery.py as the engine
thread drives it).

The services' tests (test_reliability.py) kill a real executor process; these run the same recovery
code in-process on any executor (an fp8 cache, an FP8 checkpoint, a tensor-parallel group), cheaply
enough to do so for each."""

from __future__ import annotations

from types import SimpleNamespace

from scheduler_service.config import EngineOptions, SchedulerConfig
from scheduler_service.executor_client import ExecutorUnavailable
from scheduler_service.executor_recovery import ExecutorRecovery
from scheduler_service.metrics import SchedulerMetrics
from scheduler_service.sampling_params import SamplingParams


class LosingExecutor:
    """An executor that is unavailable once, at its `lose_at`-th result (the plans in flight are
    lost with it); then, reset, it serves again. Everything else is the inner executor's."""

    def __init__(self, inner, lose_at: int) -> None:
        self.inner = inner
        self.lose_at = lose_at
        self.received = 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def receive(self, plan):
        self.received += 1
        if self.received == self.lose_at:
            raise ExecutorUnavailable(f"test: executor lost at step {plan.step_id}")
        return self.inner.receive(plan)


def generate_losing_the_executor(
    executor, requests: list[tuple[list[int], SamplingParams]], lose_at: int, config: SchedulerConfig
) -> tuple[list[list[int]], int]:
    """Each request's generated tokens, through an ExecutorRecovery whose executor (a LosingExecutor
    around `executor`) goes away at its `lose_at`-th result: the engine thread's handling
    (async_engine.AsyncEngine._step: lose on ExecutorUnavailable), then a reconnect (Describe, Reset,
    the kept requests adopted for recompute). Also returns how many tokens had been generated when
    the executor went away (to check the loss came mid-run)."""
    losing = LosingExecutor(executor, lose_at)
    tracker = SimpleNamespace(post=lambda outputs, failures: None)
    recovery = ExecutorRecovery(losing, EngineOptions(config), SchedulerMetrics(), tracker, lambda up: None)
    assert recovery.connect(lambda info: None)
    engine = recovery.engine
    ids = [engine.add_request(prompt, params) for prompt, params in requests]
    finished, at_loss = {}, None
    while engine.has_unfinished_requests():
        try:
            outputs = engine.step()
        except ExecutorUnavailable as e:
            at_loss = sum(len(seq.output_token_ids) for seq in engine.scheduler.unfinished())
            recovery.lose(engine, str(e))
            assert recovery.connect(lambda info: None)
            engine = recovery.engine
            continue
        for out in outputs:
            assert out.error is None, out.error
            if out.finished:
                finished[out.request_id] = out.token_ids
    assert at_loss is not None, "the executor was never lost"
    return [finished[i] for i in ids], at_loss
