"""Live scheduler counters and gauges, read by the metrics exporter and progress bars."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SchedulerStats:
    # Counters (monotonic).
    num_preemptions: int = 0
    # Prompt tokens of requests that produced their first token.
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    # Prompt tokens looked up in the prefix cache, and found there, at each request's first
    # admission (a recompute is not counted).
    num_prefix_queried_tokens: int = 0
    num_prefix_hit_tokens: int = 0
    num_steps: int = 0
    # Scheduled prefill chunks that did not reach the end of their prompt.
    num_chunked_prefills: int = 0
    finished_by_reason: dict[str, int] = field(default_factory=dict)
    # Gauges, refreshed after every schedule() and update().
    num_running: int = 0
    num_waiting: int = 0
    num_used_blocks: int = 0
    num_total_blocks: int = 0

    @property
    def kv_usage(self) -> float:
        return self.num_used_blocks / self.num_total_blocks if self.num_total_blocks else 0.0

    @property
    def prefix_hit_rate(self) -> float:
        q = self.num_prefix_queried_tokens
        return self.num_prefix_hit_tokens / q if q else 0.0
