"""The scheduler's step watchdog (scheduler_service/executor_client.py): a result awaited far
longer than its step's kind takes is taken for a hung executor; a step that is merely long, as a
large prefill on CPU, is not."""

from __future__ import annotations

import time

from scheduler_service.executor_client import _StepWatchdog


class Stream:
    def __init__(self) -> None:
        self.expired_after: float | None = None

    def expire(self, allowed: float) -> None:
        self.expired_after = allowed


def _await(watchdog: _StepWatchdog, stream: Stream, num_tokens: int, seconds: float) -> bool:
    """One step whose result takes `seconds`: whether it was answered before the watchdog fired."""
    watchdog.arm(stream, num_tokens)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and stream.expired_after is None:
        time.sleep(0.01)
    answered = stream.expired_after is None
    watchdog.disarm(answered)
    return answered


def test_an_overdue_result_is_cancelled_and_a_timely_one_is_not():
    watchdog = _StepWatchdog(0.3)
    try:
        assert _await(watchdog, fast := Stream(), 1, 0.05) and fast.expired_after is None
        t0 = time.monotonic()
        assert not _await(watchdog, Stream(), 1, 5.0)
        assert 0.3 <= time.monotonic() - t0 < 0.3 + 0.5
    finally:
        watchdog.close()


def test_a_step_of_many_tokens_gets_time_in_proportion_to_what_tokens_took():
    watchdog = _StepWatchdog(0.3)
    try:
        # 300 tokens in 0.2 s: 0.67 ms a token; a 600-token step may take 0.3 + 10 x 0.4 s.
        assert _await(watchdog, Stream(), 300, 0.2)
        assert _await(watchdog, Stream(), 600, 1.0)
        # Small steps teach it nothing: a 1-token step still gets about 0.3 s.
        assert not _await(watchdog, small := Stream(), 1, 5.0)
        assert small.expired_after < 0.35
    finally:
        watchdog.close()


def test_after_a_cancel_the_next_step_gets_twice_the_time_until_one_is_answered():
    watchdog = _StepWatchdog(0.2)
    try:
        assert not _await(watchdog, Stream(), 1, 5.0)  # 0.2 s allowed
        t0 = time.monotonic()
        assert not _await(watchdog, second := Stream(), 1, 5.0)  # 0.4 s
        assert second.expired_after >= 0.4 and time.monotonic() - t0 >= 0.4
        assert _await(watchdog, Stream(), 1, 0.5)  # 0.8 s allowed: answered, back to 0.2 s
        assert not _await(watchdog, last := Stream(), 1, 5.0)
        assert last.expired_after < 0.3
    finally:
        watchdog.close()
