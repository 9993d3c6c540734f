"""Shared by the tests: from test_executor_service.py and helpers/tp_generate.py (requests added in
waves to an LLMEngine, each wave stepped to its end)."""

from __future__ import annotations

from scheduler_service.engine import LLMEngine
from scheduler_service.sampling_params import SamplingParams


def finished_outputs(engine: LLMEngine, waves: list[list[tuple[list[int], SamplingParams]]]) -> dict:
    """Each wave's (prompt ids, params) added, then the engine stepped until none is unfinished;
    the finished outputs by request id. An output with an error fails the test."""
    finished = {}
    for wave in waves:
        for prompt, params in wave:
            engine.add_request(prompt, params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                assert out.error is None, out.error
                if out.finished:
                    finished[out.request_id] = out
    return finished
