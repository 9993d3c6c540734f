"""Shared by the tests: from test_generate_vs_hf.py."""

from __future__ import annotations

import functools
import math
import random

import pytest
import torch
from transformers import AutoModelForCausalLM

MAX_NEW = 24

PROMPT_LENGTHS = [1, 3, 7, 15, 16, 17, 40, 100]

LOGPROB_ATOL = 1e-4

MIN_MARGIN = 10 * LOGPROB_ATOL

GREEDY_SEEDS = {16: 2, 256: 9}


def make_prompts(lengths=PROMPT_LENGTHS, seed=0, prefix: list[int] | None = None) -> list[list[int]]:
    rng = random.Random(seed)
    return [(prefix or []) + [rng.randrange(2, 400) for _ in range(n)] for n in lengths]


@functools.cache
def _hf_model(path: str):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_greedy(path, prompt: list[int], max_new: int = MAX_NEW) -> tuple[list[int], list[torch.Tensor]]:
    """Tokens from transformers' generate(do_sample=False) and the log-softmax at each step."""
    model = _hf_model(str(path))
    eos = model.generation_config.eos_token_id
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            do_sample=False,
            max_new_tokens=max_new,
            eos_token_id=eos,
            pad_token_id=eos if isinstance(eos, int) else eos[0],
            output_scores=True,
            return_dict_in_generate=True,
        )
    tokens = out.sequences[0, len(prompt) :].tolist()
    return tokens, [torch.log_softmax(s[0].float(), -1) for s in out.scores]


def assert_matches_hf(path, prompts, outputs):
    """Same tokens and finish reasons as transformers; where the outputs carry logprobs, the
    same logprobs at every step. Every step compared has a clear top-1 over top-2 margin."""
    eos = _hf_model(str(path)).generation_config.eos_token_id
    eos_ids = {eos} if isinstance(eos, int) else set(eos)
    margins = []
    for prompt, out in zip(prompts, outputs, strict=True):
        expected, scores = hf_greedy(path, prompt)
        assert out.token_ids == expected, f"prompt of {len(prompt)} tokens diverged"
        # An eos as the last allowed token is still a stop.
        assert out.finish_reason == ("stop" if expected[-1] in eos_ids else "length")
        for step, ref in enumerate(scores):
            top = ref.topk(2)
            margins.append(float(top.values[0] - top.values[1]))
            if out.logprobs is None:
                continue
            lp = out.logprobs[step]
            assert math.isclose(lp.logprob, float(ref[expected[step]]), abs_tol=LOGPROB_ATOL), f"step {step}"
            assert [t for t, _ in lp.top_logprobs] == top.indices.tolist()
            assert [v for _, v in lp.top_logprobs] == pytest.approx(top.values.tolist(), abs=LOGPROB_ATOL)
    smallest = min(margins)
    assert smallest >= MIN_MARGIN, f"a greedy near-tie: top-1 - top-2 = {smallest:.2e}"


def assert_prompt_logprobs_match_hf(path, prompt: list[int], prompt_logprobs, num_top: int) -> None:
    """prompt_logprobs (LLM's: None, then one TokenLogprob per prompt token) are transformers'
    log_softmax over the prompt: each token's logprob, rank, top `num_top` and text."""
    from scheduler_service.tokenizer import Tokenizer

    with torch.no_grad():
        logits = _hf_model(str(path))(torch.tensor([prompt])).logits[0].float()
    ref = logits.log_softmax(-1)  # row t - 1 scores token t
    text = Tokenizer(path).token_text
    assert len(prompt_logprobs) == len(prompt) and prompt_logprobs[0] is None
    for t in range(1, len(prompt)):
        lp, row = prompt_logprobs[t], ref[t - 1]
        assert lp.token_id == prompt[t] and lp.token == text(prompt[t])
        assert math.isclose(lp.logprob, float(row[prompt[t]]), abs_tol=LOGPROB_ATOL), t
        assert lp.rank == int((row > row[prompt[t]]).sum()) + 1
        top = row.topk(num_top)
        assert [i for i, _ in lp.top_logprobs] == top.indices.tolist()
        assert [v for _, v in lp.top_logprobs] == pytest.approx(top.values.tolist(), abs=LOGPROB_ATOL)
