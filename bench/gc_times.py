"""Python's garbage collections over a stretch of a benchmark (gc.callbacks): how many of each
generation and how long they took. A full (generation 2) collection walks every tracked object,
which is what the services' start-up freeze (protos/service_main.freeze_startup_heap) spares."""

from __future__ import annotations

import gc
import time


class GCTimes:
    """Python's garbage collections while it runs: count and seconds per generation."""

    def __init__(self) -> None:
        self.counts, self.seconds, self._start = [0, 0, 0], [0.0, 0.0, 0.0], 0.0
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.counts[info["generation"]] += 1
            self.seconds[info["generation"]] += time.perf_counter() - self._start

    def stop(self) -> None:
        gc.callbacks.remove(self._on_gc)

    def __str__(self) -> str:
        return ", ".join(
            f"gen{g} {n} in {s * 1e3:.1f} ms" for g, (n, s) in enumerate(zip(self.counts, self.seconds))
        )
