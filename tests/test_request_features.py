"""Request features through the offline LLM, as a user sees them: logit_bias forces or removes
tokens, min_tokens holds an early end-of-sequence back, prompt_logprobs equal transformers'
log_softmax (with chunked prefill, and when the prompt is in the prefix cache), stop strings and
stop tokens kept with include_stop_str_in_output and left out without it, n samples of a prompt."""

from __future__ import annotations

import pytest
from helpers.hf_reference import assert_prompt_logprobs_match_hf, make_prompts

from client.llm import LLM
from scheduler_service.errors import InvalidRequestError
from scheduler_service.sampling_params import SamplingParams

EOS = 0  # the conftest checkpoints' end-of-sequence id
PROMPT = [5, 6, 7, 8, 9]


@pytest.fixture(scope="module")
def llm(qwen3_tied):
    # 16 tokens a step: a 40-token prompt is prefilled in three chunks.
    return LLM(str(qwen3_tied), block_size=4, num_kv_blocks=256, max_num_seqs=8, max_num_batched_tokens=16)


def _generate(llm, prompt, **params):
    return llm.generate(prompt, SamplingParams(**params), use_tqdm=False)[0]


def test_logit_bias_plus_100_forces_a_token_and_minus_100_removes_one(llm):
    for temperature in (0.0, 1.0):
        out = _generate(llm, PROMPT, max_tokens=6, temperature=temperature, logit_bias={42: 100})
        assert out.token_ids == [42] * 6
    greedy = _generate(llm, PROMPT, max_tokens=1).token_ids[0]
    out = _generate(llm, PROMPT, max_tokens=1, logit_bias={greedy: -100})
    assert out.token_ids[0] != greedy


def test_min_tokens_ignores_an_early_end_of_sequence(llm):
    greedy = _generate(llm, PROMPT, max_tokens=5, ignore_eos=True)
    assert EOS not in greedy.token_ids
    # A bias that makes end-of-sequence the greedy choice at every step: it ends at once...
    eager = _generate(llm, PROMPT, max_tokens=16, logit_bias={EOS: 100})
    assert (eager.token_ids, eager.finish_reason) == ([EOS], "stop")
    # ...unless min_tokens holds it back: the greedy tokens, then end-of-sequence.
    held = _generate(llm, PROMPT, max_tokens=16, logit_bias={EOS: 100}, min_tokens=5)
    assert held.token_ids == greedy.token_ids + [EOS]
    assert held.finish_reason == "stop"
    # a stop token id is held back the same way
    stop = greedy.token_ids[0]
    out = _generate(llm, PROMPT, max_tokens=16, stop_token_ids=[stop], min_tokens=3, ignore_eos=True)
    assert stop not in out.token_ids[:3] and out.token_ids[:3] != greedy.token_ids[:3]


def test_prompt_logprobs_equal_transformers_log_softmax_over_chunked_prefill(llm, qwen3_tied):
    prompts = make_prompts([40, 3, 1], seed=5)
    outs = llm.generate(prompts, SamplingParams(max_tokens=2, prompt_logprobs=3), use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        assert_prompt_logprobs_match_hf(qwen3_tied, prompt, out.prompt_logprobs, 3)
    # without prompt_logprobs there are none
    assert _generate(llm, prompts[0], max_tokens=1).prompt_logprobs is None


def test_prompt_logprobs_of_a_cached_prompt_are_recomputed(llm, qwen3_tied):
    """A prompt already in the prefix cache is computed again for its prompt logprobs (as vLLM
    does): a cache hit would leave its first positions unscored."""
    prompt = make_prompts([37], seed=6)[0]
    first = _generate(llm, prompt, max_tokens=2)
    again = _generate(llm, prompt, max_tokens=2)
    assert again.num_cached_tokens > 0  # the prompt is in the cache
    scored = _generate(llm, prompt, max_tokens=2, prompt_logprobs=0)
    assert scored.num_cached_tokens == 0
    assert scored.token_ids == first.token_ids
    assert_prompt_logprobs_match_hf(qwen3_tied, prompt, scored.prompt_logprobs, 0)
    # n = 2: the first sample scores the prompt, the second shares it through the cache
    both = _generate(llm, prompt, max_tokens=2, prompt_logprobs=1, n=2)
    assert [o.token_ids for o in both.outputs] == [first.token_ids] * 2
    assert_prompt_logprobs_match_hf(qwen3_tied, prompt, both.prompt_logprobs, 1)


def test_prompt_logprobs_over_max_logprobs_is_refused(llm):
    with pytest.raises(InvalidRequestError, match=r"prompt_logprobs \(21\) exceeds max_logprobs \(20"):
        _generate(llm, PROMPT, max_tokens=1, prompt_logprobs=21)


def test_include_stop_str_in_output_keeps_the_stop_text(llm):
    full = _generate(llm, "The list type", max_tokens=16, ignore_eos=True)
    stop = full.text[5:8]
    cut = _generate(llm, "The list type", max_tokens=16, ignore_eos=True, stop=[stop])
    kept = _generate(
        llm, "The list type", max_tokens=16, ignore_eos=True, stop=[stop], include_stop_str_in_output=True
    )
    assert cut.text == full.text[: full.text.find(stop)]
    assert kept.text == full.text[: full.text.find(stop) + len(stop)]
    assert kept.token_ids == cut.token_ids and kept.finish_reason == "stop"
    # A stop token's text is left out of the text (its id stays), unless asked for.
    token = full.token_ids[3]
    text = llm.tokenizer.decode([token])
    assert text
    dropped = _generate(llm, "The list type", max_tokens=16, ignore_eos=True, stop_token_ids=[token])
    with_it = _generate(
        llm,
        "The list type",
        max_tokens=16,
        ignore_eos=True,
        stop_token_ids=[token],
        include_stop_str_in_output=True,
    )
    assert dropped.token_ids == with_it.token_ids == full.token_ids[:4]
    assert with_it.text == dropped.text + text
    assert with_it.outputs[0].stop_reason == token


def test_a_stop_string_given_as_a_str_is_one_stop_string(llm):
    """vLLM's SamplingParams(stop="...") is one stop string, not a list of its characters."""
    full = _generate(llm, "The list type", max_tokens=16, ignore_eos=True)
    # A stop string whose characters also occur before it: split into characters, it ends early.
    stop = full.text[-4:]
    assert set(stop) & set(full.text[: full.text.find(stop)])
    as_str = _generate(llm, "The list type", max_tokens=16, ignore_eos=True, stop=stop)
    assert as_str.text == full.text[: full.text.find(stop)]
    assert as_str.outputs[0].stop_reason == stop
    assert SamplingParams(stop=stop).stop == [stop]
    assert SamplingParams(stop=None, stop_token_ids=None).stop == []


def test_n_samples_of_one_prompt(llm):
    out = _generate(llm, PROMPT, max_tokens=8, temperature=1.0, seed=7, n=3)
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in out.outputs}) == 3  # seeds 7, 8, 9
    again = _generate(llm, PROMPT, max_tokens=8, temperature=1.0, seed=7, n=3)
    assert [o.token_ids for o in again.outputs] == [o.token_ids for o in out.outputs]
    alone = _generate(llm, PROMPT, max_tokens=8, temperature=1.0, seed=8)
    assert alone.token_ids == out.outputs[1].token_ids


def test_logprobs_name_their_tokens(llm):
    out = _generate(llm, "The list type", max_tokens=4, logprobs=2)
    for lp in out.logprobs:
        assert lp.token == llm.tokenizer.token_text(lp.token_id)
        assert lp.top_tokens == [llm.tokenizer.token_text(t) for t, _ in lp.top_logprobs]


@pytest.mark.parametrize(
    "params, message",
    [
        ({"logit_bias": {1: 101}}, "logit_bias[1] must be in [-100, 100], got 101"),
        ({"logit_bias": dict.fromkeys(range(301), 1.0)}, "logit_bias has 301 entries; at most 300"),
        ({"logit_bias": {512: 1.0}}, "logit_bias token id 512 is outside the vocabulary (size 512)"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens (5) must be <= max_tokens (4)"),
        ({"n": 0}, "n must be in [1, 128], got 0"),
    ],
)
def test_bad_features_name_the_limit(llm, params, message):
    with pytest.raises(InvalidRequestError) as e:
        _generate(llm, PROMPT, **params)
    assert message in str(e.value)
    assert _generate(llm, PROMPT, max_tokens=1).token_ids  # it keeps serving


# generate()'s TypeErrors: for its argument, and for one prompt of a list.
NOT_PROMPTS = "prompts must be a string, a list of token ids, a dict ({'prompt': text} or {'prompt_token_ids': ids}), or a list of those, got "
NOT_A_PROMPT = (
    " must be a string, a list of token ids (ints), or a dict with 'prompt' or 'prompt_token_ids', got "
)


@pytest.mark.parametrize(
    "prompts, message",
    [
        (None, NOT_PROMPTS + "None"),
        ({"text": "x"}, "prompts[0] has keys this model does not take: 'text'"),
        (b"abc", NOT_PROMPTS + "b'abc'"),
        ([5, 6.0], "prompts[0]" + NOT_A_PROMPT + "[5, 6.0]"),
        ([[5, 6], [1.5, 2]], "prompts[1]" + NOT_A_PROMPT + "[1.5, 2]"),
        ([[True, 5]], "prompts[0]" + NOT_A_PROMPT + "[True, 5]"),
        (["a", None], "prompts[1]" + NOT_A_PROMPT + "None"),
    ],
)
def test_prompts_of_another_type_are_refused_and_the_llm_keeps_serving(llm, prompts, message):
    """A float token id passed validation and failed inside the engine's step (struct.error), with
    the request still admitted: every later generate() failed the same way. A dict was a KeyError,
    bytes ran as the token ids of its bytes. (vLLM's prompt dicts are taken: test_llm_api.py.)"""
    with pytest.raises(TypeError) as e:
        llm.generate(prompts, use_tqdm=False)
    assert message in str(e.value)
    assert _generate(llm, PROMPT, max_tokens=1).token_ids


def test_sampling_params_of_another_type_are_refused(llm):
    for params in ({"max_tokens": 3}, [{"max_tokens": 3}]):
        with pytest.raises(TypeError, match="sampling_params must be a SamplingParams or a list of them"):
            llm.generate([PROMPT], params, use_tqdm=False)


def test_a_tokenizer_that_is_not_there_is_refused_not_dropped(qwen3_tied, tmp_path):
    """LLM(model, tokenizer=PATH) with nothing at PATH ran without a tokenizer at all, the model's
    own included: text prompts then failed with "this model has no tokenizer.json"."""
    with pytest.raises(FileNotFoundError, match=f"no tokenizer.json in {tmp_path / 'typo'}"):
        LLM(str(qwen3_tied), tokenizer=str(tmp_path / "typo"), num_kv_blocks=64)
