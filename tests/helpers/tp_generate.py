"""Shared by the tests: from test_tensor_parallel.py (greedy generation through a tensor-parallel
executor service, and at TP=1, on the same requests)."""

from __future__ import annotations

from pathlib import Path

from executor_fixtures import prompt_ids

from client.defaults import free_port
from client.llm import LLM
from helpers.engine_waves import finished_outputs
from helpers.processes import ServiceProcess
from helpers.services import executor_process
from scheduler_service.config import SchedulerConfig
from scheduler_service.engine import LLMEngine
from scheduler_service.sampling_params import SamplingParams

# A small token budget: the 61-token prompts are prefilled in chunks.
OPTIONS = dict(block_size=4, num_kv_blocks=96, max_model_len=256, max_num_seqs=8, max_num_batched_tokens=24)


def start_tp_executor(model: Path, log: Path, tp: int = 2, **options) -> ServiceProcess:
    """The executor service at tensor_parallel_size `tp` with OPTIONS and `options` (as flags)."""
    tp_flags = ("--tensor-parallel-size", str(tp), "--tp-master-port", str(free_port()))
    return executor_process(log, *tp_flags, model=model, **{**OPTIONS, **options}).start()


def requests() -> list[list[tuple[list[int], SamplingParams]]]:
    """Two waves of greedy requests; the second shares prefixes with the first (cache hits)."""
    first = [prompt_ids(n, seed=n) for n in (3, 9, 30, 61)]
    second = [first[2][:20] + prompt_ids(5, 1), first[3] + prompt_ids(7, 2), first[1][:8], [7]]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    return [[(p, params) for p in first], [(p, params) for p in second]]


def generate(executor) -> tuple[list[list[int]], LLMEngine]:
    engine = LLMEngine(executor, SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=24))
    outputs = finished_outputs(engine, requests())
    return [outputs[k].token_ids for k in sorted(outputs)], engine


def tp1_tokens(model: Path, **options) -> list[list[int]]:
    """generate's tokens at TP=1 (OPTIONS, with `options` over them)."""
    llm = LLM(str(model), **{**OPTIONS, **options})
    try:
        return generate(llm.executor)[0]
    finally:
        llm.executor.close()
