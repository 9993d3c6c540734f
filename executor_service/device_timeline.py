"""The device's side of the step pipeline, from a pair of CUDA events around each launched step.

The host-side view (tandem_executor_idle_seconds) counts the time a Step stream had no step in
flight; it cannot see the device drain while a step is still "in flight" on the host, its work
done and the next plan not yet prepared and launched (the host or the scheduler's round trip
behind the device). The events can: a step's start event is recorded once its inputs are copied,
before its forward, and its end event after its last op, both on the step's stream, so that

- its time on the device is start -> end (including any wait for kernels still being launched,
  as in an eager step whose launches are slower than the device), and
- the device's gap before it is the previous step's end -> its start: nothing of a step was
  queued in between (the host was preparing this one, or had no plan for it yet).

The model runner records the pair (rank 0 only) and settles the steps whose end event has
completed when it collects one; the executor service exports the sums (tandem_executor_device_*),
and bench/throughput.py prints them for both modes.
"""

from __future__ import annotations

import logging
import threading
from collections import deque

import torch

logger = logging.getLogger(__name__)


class DeviceTimeline:
    """Sums of the device's time in steps and in the gaps between them, in seconds."""

    def __init__(self) -> None:
        self._open: deque[tuple[torch.cuda.Event, torch.cuda.Event]] = deque()
        self._last_end: torch.cuda.Event | None = None
        self.busy_seconds = 0.0  # in steps, start to end
        self.gap_seconds = 0.0  # between one step's end and the next one's start
        self.num_steps = 0
        self.num_gaps = 0
        # Since the last take(): the busy seconds and each gap (the service's metrics, read on
        # another thread than the one that settles).
        self._new_busy = 0.0
        self._new_gaps: list[float] = []
        self._lock = threading.Lock()
        self.stopped = False  # the events refused once: nothing more is recorded

    @staticmethod
    def begin() -> torch.cuda.Event:
        """Record a step's start on the current stream, after its inputs' copies."""
        start = DeviceTimeline.event()
        start.record()
        return start

    @staticmethod
    def event() -> torch.cuda.Event:
        """An event these timings can use (Launch.done is one)."""
        return torch.cuda.Event(enable_timing=True)

    def end(self, start: torch.cuda.Event, end: torch.cuda.Event | None = None) -> None:
        """The step's end: `end` if recorded after its last op already (its done event), else an
        event recorded now. It is settled once the device gets there."""
        if self.stopped:
            return
        if end is None:
            end = self.event()
            end.record()
        self._open.append((start, end))

    def settle(self) -> None:
        """Add up the steps whose end event has completed, in launch order (never waits). A
        diagnostic must not fail a step: should the events refuse (a RuntimeError), the timeline
        stops, with a warning."""
        while self._open and self._open[0][1].query():
            start, end = self._open.popleft()
            try:
                busy = start.elapsed_time(end) / 1e3
                gap = None
                if self._last_end is not None:
                    gap = max(0.0, self._last_end.elapsed_time(start) / 1e3)
            except RuntimeError as e:
                logger.warning("the device timeline stops: %s", e)
                self._open.clear()
                self.stopped = True
                return
            self._last_end = end
            with self._lock:
                self.busy_seconds += busy
                self._new_busy += busy
                self.num_steps += 1
                if gap is not None:
                    self.gap_seconds += gap
                    self.num_gaps += 1
                    self._new_gaps.append(gap)

    def take(self) -> tuple[float, list[float]]:
        """The busy seconds and the gaps settled since the last take()."""
        with self._lock:
            busy, gaps = self._new_busy, self._new_gaps
            self._new_busy, self._new_gaps = 0.0, []
        return busy, gaps

    def totals(self) -> tuple[float, float, int]:
        """(busy seconds, gap seconds, gaps) since the start."""
        with self._lock:
            return self.busy_seconds, self.gap_seconds, self.num_gaps
