"""Executor recovery by recompute for every family and precision, in-process: the executor goes away
mid-run, the scheduler keeps its requests (executor_recovery.py), resets the executor and recomputes
each from its prompt and the tokens it already generated; every request, greedy or seeded-sampled,
ends with the tokens of a run in which nothing went away. (test_reliability.py does this with real
processes on the qwen3 checkpoint, test_recompute.py measures where bf16 may differ.)"""

from __future__ import annotations

import pytest
from checkpoints import FAMILIES, quantize_checkpoint_fp8
from helpers.executor_loss import generate_losing_the_executor
from helpers.families import mixed_requests

from client.llm import LLM
from scheduler_service.config import SchedulerConfig

# Runs models at length: left out of `make test-fast`.
pytestmark = pytest.mark.slow

MAX_TOKENS = 20
# 10 blocks of 16 are too few for every request at once (preemption too), 32 tokens a step chunk the
# long prompts.
OPTIONS = dict(block_size=16, num_kv_blocks=10, max_model_len=128)
CONFIG = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32)


@pytest.mark.parametrize("precision", ["fp32", "fp8_kv", "fp8_checkpoint"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_requests_kept_over_a_lost_executor_end_with_the_undisturbed_tokens(
    family_checkpoint, tmp_path, family, precision
):
    path = family_checkpoint(family)
    options = dict(OPTIONS)
    if precision == "fp8_kv":
        options["kv_cache_dtype"] = "fp8"
    if precision == "fp8_checkpoint":
        quantize_checkpoint_fp8(path, tmp_path / "fp8")
        path = tmp_path / "fp8"
    work = mixed_requests(MAX_TOKENS)
    llm = LLM(str(path), max_num_seqs=8, max_num_batched_tokens=32, **options)
    expected = [o.token_ids for o in llm.generate([p for p, _ in work], [s for _, s in work], use_tqdm=False)]
    got, at_loss = generate_losing_the_executor(llm.executor, work, lose_at=12, config=CONFIG)
    assert 0 < at_loss < len(work) * MAX_TOKENS - 8, at_loss  # mid-run: generated tokens recomputed
    assert got == expected
