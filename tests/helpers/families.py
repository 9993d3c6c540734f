"""Shared by the tests: from test_model_families.py."""

from __future__ import annotations

from checkpoints import FAMILIES

from helpers.hf_reference import make_prompts

PROMPT_SEEDS = {family: 0 for family in FAMILIES}


def waves(seed: int) -> tuple[list[list[int]], list[list[int]]]:
    """Prompts of many lengths; the second wave shares a 32-token prefix with the first."""
    shared = make_prompts([32], seed=seed + 100)[0]
    first = make_prompts([1, 7, 17, 40, 100], seed=seed) + [shared + [5, 6, 7]]
    second = make_prompts([2, 9, 20], seed=seed + 1, prefix=shared)
    return first, second
