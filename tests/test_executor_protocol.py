"""protos/executor.py: every executor declares the interface the engine drives (no hasattr)."""

from __future__ import annotations

import pytest

from protos.executor import Executor, StepOnlyExecutor
from protos.plan import StepResult
from scheduler_service.executor_client import RemoteExecutor
from tests.helpers.fake_executor import CountingPipe, FakeExecutor


def test_executors_declare_the_protocol():
    fake = FakeExecutor()
    assert isinstance(fake, Executor) and fake.takes_plans_ahead is False
    assert isinstance(CountingPipe(fake), Executor) and CountingPipe.takes_plans_ahead is True
    assert RemoteExecutor.takes_plans_ahead is True
    # How many plans each takes sent and not received: a remote executor's service queues them.
    assert fake.max_plans_in_flight is None and RemoteExecutor.max_plans_in_flight is None


class _FailsStep2(StepOnlyExecutor):
    def step(self, plan):
        if plan.step_id == 2:
            raise ValueError("step 2 rejected")
        return StepResult(step_id=plan.step_id)


class _Plan:
    def __init__(self, step_id):
        self.step_id = step_id


def test_a_step_only_executor_runs_nothing_after_a_failure_until_discard():
    executor = _FailsStep2()
    plans = [_Plan(i) for i in (1, 2, 3)]
    for plan in plans:
        executor.send(plan)
    assert executor.receive(plans[0]).step_id == 1
    with pytest.raises(ValueError, match="step 2"):
        executor.receive(plans[1])
    with pytest.raises(RuntimeError, match="step 3 not run"):
        executor.receive(plans[2])
    executor.discard()
    executor.send(_Plan(4))
    assert executor.receive(_Plan(4)).step_id == 4
