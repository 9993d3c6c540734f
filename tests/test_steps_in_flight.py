"""The records of two plans in flight that the transports use (steps_in_flight.py on each side),
without gRPC: a Step stream's steps on the executor's side, a result's deadline on the scheduler's."""

from __future__ import annotations

import queue
import threading
import time

import pytest

from executor_service.steps_in_flight import END, StreamSteps
from protos.plan import StepPlan
from scheduler_service.steps_in_flight import ResultDeadline


def _stream(lock: threading.Lock | None = None) -> tuple[queue.SimpleQueue, StreamSteps]:
    requests: queue.SimpleQueue = queue.SimpleQueue()
    return requests, StreamSteps(iter(requests.get, None), lock or threading.Lock())


def test_a_stream_waits_for_a_plan_then_for_the_plan_or_the_step_then_answers():
    requests, steps = _stream()
    requests.put("plan 1")
    assert steps.next_request(lambda: False) == "plan 1"  # nothing in flight: the next plan
    steps.sending(StepPlan(1), num_graph_steps=0)
    # One in flight, not done: the plan that comes first.
    requests.put("plan 2")
    assert steps.next_request(lambda: False) == "plan 2"
    # One in flight and done, no plan read: answer it.
    assert steps.next_request(lambda: True) is None
    steps.sending(StepPlan(2), num_graph_steps=0)
    # Two in flight: answer the oldest, even with a plan read.
    requests.put("plan 3")
    assert steps.next_request(lambda: False) is None
    assert steps.answered()[0].plan.step_id == 1
    assert steps.next_request(lambda: False) == "plan 3"
    assert steps.next_request(lambda: True) is None
    steps.answered()
    requests.put(None)  # the requests end
    assert steps.next_request(lambda: True) is END


def test_a_stream_holds_the_lock_while_it_has_steps_in_flight():
    lock = threading.Lock()
    _, steps = _stream(lock)
    steps.sending(StepPlan(1), num_graph_steps=3)
    steps.sending(StepPlan(2), num_graph_steps=3)
    assert lock.locked()
    step, seconds = steps.answered()
    assert (step.plan.step_id, step.num_graph_steps) == (1, 3) and seconds >= 0
    assert lock.locked()
    steps.answered()
    assert not lock.locked()
    steps.sending(StepPlan(3), num_graph_steps=0)
    steps.clear()
    assert not lock.locked() and not steps


def test_overlapped_steps_are_not_counted_twice():
    _, steps = _stream()
    steps.sending(StepPlan(1), num_graph_steps=0)
    steps.sending(StepPlan(2), num_graph_steps=0)
    time.sleep(0.1)
    _, first = steps.answered()
    _, second = steps.answered()
    # Step 2's time runs from step 1's answer, not from its own send (before that answer).
    assert first >= 0.1 and second < 0.05


def test_the_deadline_grows_with_what_large_steps_took_and_doubles_after_an_overdue_one():
    deadline = ResultDeadline(2.0)
    assert deadline.awaited(1, now=0.0) == 2.0
    deadline.answered(now=0.5)  # a small step teaches nothing
    assert deadline.awaited(300, now=1.0) == 2.0
    deadline.answered(now=4.0)  # 300 tokens in 3 s: 10 ms a token
    assert deadline.awaited(600, now=5.0) == pytest.approx(2.0 + 10 * 0.01 * 600)
    deadline.overdue()
    assert deadline.awaited(1, now=100.0) == pytest.approx(4.0 + 10 * 0.01)
    for _ in range(10):
        deadline.overdue()
    assert deadline.awaited(0, now=200.0) == 2.0 * 64
    deadline.answered(now=201.0)
    assert deadline.awaited(0, now=300.0) == 2.0
