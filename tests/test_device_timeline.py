"""DeviceTimeline's arithmetic over CUDA events, with stand-in events on the CPU (the GPU test in
test_gpu_engine.py runs it on real ones)."""

from __future__ import annotations

import pytest

from executor_service import device_timeline
from executor_service.device_timeline import DeviceTimeline


class FakeEvent:
    """An event recorded at a given device time (ms), complete once `done` is set."""

    clock = 0.0

    def __init__(self) -> None:
        self.at: float | None = None
        self.done = False

    def record(self) -> None:
        self.at = FakeEvent.clock

    def query(self) -> bool:
        return self.done

    def elapsed_time(self, other: FakeEvent) -> float:
        return other.at - self.at


@pytest.fixture
def events(monkeypatch):
    monkeypatch.setattr(device_timeline.DeviceTimeline, "event", staticmethod(FakeEvent))
    FakeEvent.clock = 0.0


def _step(timeline: DeviceTimeline, start_ms: float, end_ms: float, done: FakeEvent | None = None):
    FakeEvent.clock = start_ms
    start = timeline.begin()
    FakeEvent.clock = end_ms
    if done is not None:
        done.record()
    timeline.end(start, done)
    return timeline._open[-1][1]


def test_steps_and_gaps_add_up_in_launch_order(events):
    timeline = DeviceTimeline()
    first = _step(timeline, 0.0, 4.0)
    second = _step(timeline, 5.0, 9.0, done=FakeEvent())
    third = _step(timeline, 9.0, 12.0)
    second.done = third.done = True
    timeline.settle()  # the first is not complete: nothing after it is settled either
    assert timeline.totals() == (0.0, 0.0, 0)
    first.done = True
    timeline.settle()
    busy, gaps, count = timeline.totals()
    assert busy == pytest.approx(0.011) and gaps == pytest.approx(0.001) and count == 2
    taken_busy, taken_gaps = timeline.take()
    assert taken_busy == pytest.approx(0.011) and taken_gaps == pytest.approx([0.001, 0.0])
    assert timeline.take() == (0.0, [])  # taken once; the totals stay
    assert timeline.num_steps == 3


def test_a_steps_done_event_is_its_end(events):
    timeline = DeviceTimeline()
    done = FakeEvent()
    end = _step(timeline, 1.0, 3.0, done=done)
    assert end is done


def test_events_that_refuse_stop_the_timeline_not_the_step(events, caplog):
    class Refusing(FakeEvent):
        def elapsed_time(self, other):
            raise RuntimeError("event not recorded")

    timeline = DeviceTimeline()
    start = Refusing()
    start.record()
    end = FakeEvent()
    end.record()
    end.done = True
    timeline.end(start, end)
    with caplog.at_level("WARNING"):
        timeline.settle()
    assert timeline.stopped and "the device timeline stops" in caplog.text
    timeline.end(FakeEvent(), FakeEvent())  # ignored from now on
    assert timeline.totals() == (0.0, 0.0, 0) and not timeline._open
