"""Shared by the tests: from test_model_families.py, test_fp8_families.py, test_executor_recovery.py
and test_tensor_parallel.py."""

from __future__ import annotations

from checkpoints import FAMILIES

from helpers.hf_reference import MAX_NEW, make_prompts
from scheduler_service.sampling_params import SamplingParams

PROMPT_SEEDS = {family: 0 for family in FAMILIES}

# The LLM options of a run through every path at once: a 32-token budget chunks the long prompts,
# 10 blocks of 16 are too few for waves()' first wave (preemption), and the second wave finds the
# shared prefix in the cache.
DISTURBED = dict(
    block_size=16, num_kv_blocks=10, max_num_batched_tokens=32, max_num_seqs=8, max_model_len=128
)


def waves(seed: int) -> tuple[list[list[int]], list[list[int]]]:
    """Prompts of many lengths; the second wave shares a 32-token prefix with the first."""
    shared = make_prompts([32], seed=seed + 100)[0]
    first = make_prompts([1, 7, 17, 40, 100], seed=seed) + [shared + [5, 6, 7]]
    second = make_prompts([2, 9, 20], seed=seed + 1, prefix=shared)
    return first, second


def generate_disturbed(llm, seed: int) -> tuple[list[list[int]], list]:
    """(prompts, greedy outputs with logprobs) of both waves on an LLM made with DISTURBED: through
    chunks, prefix hits and preemption, which it asserts."""
    first, second = waves(seed)
    params = SamplingParams(max_tokens=MAX_NEW, logprobs=2)
    outputs = llm.generate(first, params, use_tqdm=False)
    outputs += llm.generate(second, params, use_tqdm=False)
    stats = llm.engine.scheduler.stats
    assert stats.num_chunked_prefills > 0 and stats.num_preemptions > 0
    assert [o.num_cached_tokens for o in outputs[-3:]] == [32] * 3
    return first + second, outputs


def mixed_requests(max_tokens: int) -> list[tuple[list[int], SamplingParams]]:
    """Greedy and seeded-sampled requests (temperature, top-k, top-p, min-p) for one batch; the
    last two share a 32-token prefix with the fourth."""
    prompts = make_prompts([5, 40, 13, 70], seed=3)
    prompts += [prompts[3][:32] + [7, 8], prompts[3][:32] + [9]]
    greedy = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    sampled = [
        SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.9, seed=11),
        SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=1.2, top_k=40, top_p=0.9, seed=12),
        SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.7, min_p=0.05, seed=13),
    ]
    return list(zip(prompts, [greedy, sampled[0], greedy, sampled[1], greedy, sampled[2]], strict=True))
