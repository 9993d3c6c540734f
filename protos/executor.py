"""The executor interface the scheduler drives, declared once for both sides: LocalExecutor
(executor_service, in-process) and RemoteExecutor (scheduler_service, the gRPC stream) implement
it, and so does every test fake; nothing is detected with hasattr.

Two plans may be in flight: `send(plan)` hands a plan over, `receive(plan)` returns its result,
in plan order, and `discard()` forgets plans sent and not received. `takes_plans_ahead` says
whether the executor works on one plan while the next is sent (the engine then keeps two in
flight by default); `max_plans_in_flight`, how many it takes sent and not received (None: no
limit, as a remote executor, whose service queues the plans behind the two steps it runs). An
executor that can only `step` derives from `StepOnlyExecutor`, which runs each plan when it is
sent."""

from __future__ import annotations

from collections import deque
from typing import ClassVar, Protocol, runtime_checkable

from protos.plan import ExecutorInfo, StepPlan, StepResult


@runtime_checkable
class Executor(Protocol):
    takes_plans_ahead: bool
    max_plans_in_flight: int | None

    def describe(self) -> ExecutorInfo: ...

    def reset(self) -> int: ...

    def step(self, plan: StepPlan) -> StepResult: ...

    def send(self, plan: StepPlan) -> None: ...

    def receive(self, plan: StepPlan) -> StepResult: ...

    def discard(self) -> None: ...


class StepOnlyExecutor:
    """send / receive / discard over `step()`, for executors that run one plan at a time: each
    plan runs when it is sent. Once one fails, later plans (built on it) are not run: receive
    raises for them until the caller discards."""

    takes_plans_ahead: ClassVar[bool] = False
    max_plans_in_flight: ClassVar[int | None] = None  # each plan runs when it is sent

    def describe(self) -> ExecutorInfo:
        raise NotImplementedError

    def reset(self) -> int:
        raise NotImplementedError

    def step(self, plan: StepPlan) -> StepResult:
        raise NotImplementedError

    @property
    def _sent_results(self) -> deque[StepResult | BaseException]:
        try:
            return self.__dict__["_step_only_results"]
        except KeyError:  # no __init__ to call: subclasses keep their own
            return self.__dict__.setdefault("_step_only_results", deque())

    def send(self, plan: StepPlan) -> None:
        results = self._sent_results
        if results and isinstance(results[-1], BaseException):
            results.append(RuntimeError(f"step {plan.step_id} not run: an earlier step failed"))
            return
        try:
            results.append(self.step(plan))
        except Exception as e:
            results.append(e)

    def receive(self, plan: StepPlan) -> StepResult:
        out = self._sent_results.popleft()
        if isinstance(out, BaseException):
            raise out
        return out

    def discard(self) -> None:
        self._sent_results.clear()
