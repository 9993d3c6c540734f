"""Every bad request fails with InvalidRequestError naming the limit it broke."""

from __future__ import annotations

import pytest

from scheduler_service.config import SchedulerConfig
from scheduler_service.sampling_params import InvalidRequestError, SamplingParams, verify_request


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -0.5}, "temperature must be >= 0, got -0.5"),
        ({"top_p": 0.0}, "top_p must be in (0, 1], got 0.0"),
        ({"top_p": 1.5}, "top_p must be in (0, 1], got 1.5"),
        ({"top_k": -2}, "top_k must be >= 0 (0 or -1 disables it), got -2"),
        ({"presence_penalty": 3.0}, "presence_penalty must be in [-2, 2], got 3.0"),
        ({"frequency_penalty": -2.5}, "frequency_penalty must be in [-2, 2], got -2.5"),
        ({"max_tokens": 0}, "max_tokens must be >= 1, got 0"),
        ({"min_p": -0.1}, "min_p must be in [0, 1], got -0.1"),
        ({"min_p": 1.1}, "min_p must be in [0, 1], got 1.1"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be > 0, got 0.0"),
        ({"logprobs": -1}, "logprobs must be >= 0, got -1"),
        ({"stop_token_ids": [3, -2]}, "stop_token_ids[1] must be >= 0, got -2"),
        ({"n": 129}, "n must be in [1, 128], got 129"),
        ({"min_tokens": -1}, "min_tokens must be >= 0, got -1"),
        ({"min_tokens": 17}, "min_tokens (17) must be <= max_tokens (16)"),
        ({"prompt_logprobs": -1}, "prompt_logprobs must be >= 0, got -1"),
        ({"logit_bias": {5: -100.5}}, "logit_bias[5] must be in [-100, 100], got -100.5"),
        ({"logit_bias": {5: float("nan")}}, "logit_bias[5] must be in [-100, 100], got nan"),
        ({"logit_bias": {5: "up"}}, "logit_bias[5] must be in [-100, 100], got up"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias keys must be token ids (integers >= 0), got '5'"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias keys must be token ids (integers >= 0), got -1"),
        ({"logit_bias": dict.fromkeys(range(301), 0.0)}, "logit_bias has 301 entries; at most 300"),
    ],
)
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(InvalidRequestError) as exc:
        SamplingParams(**kwargs)
    assert str(exc.value) == message
    assert isinstance(exc.value, ValueError)


def test_good_sampling_params_and_step_params():
    params = SamplingParams(
        max_tokens=None, temperature=0.7, top_k=5, top_p=0.9, min_p=0.05, seed=3, logprobs=2
    )
    step = params.to_step_params(num_prompt_tokens=11)
    assert (step.temperature, step.top_k, step.top_p, step.min_p, step.seed) == (0.7, 5, 0.9, 0.05, 3)
    assert (step.logprobs, step.num_prompt_tokens, step.repetition_penalty) == (2, 11, 1.0)
    assert SamplingParams().max_tokens == 16 and SamplingParams().temperature == 0.0


@pytest.mark.parametrize(
    ("temperature", "samples_at"), [(1e-6, 0.01), (0.005, 0.01), (0.01, 0.01), (0.0, 0.0)]
)
def test_a_temperature_below_0_01_samples_at_0_01_as_vllm(temperature, samples_at):
    """vLLM's SamplingParams raises a temperature in (0, 0.01) to 0.01 (_MAX_TEMP): 1e-6 samples
    at 0.01 there, not greedily, and 0.005 no more sharply than 0.01; 0 stays greedy."""
    import torch

    from executor_service.sampler import Sampler
    from executor_service.sampling_metadata import SamplingMetadata
    from executor_service.sequence import SequenceState

    params = SamplingParams(temperature=temperature)
    assert params.temperature == samples_at
    assert params.to_step_params(num_prompt_tokens=2).temperature == pytest.approx(samples_at)
    late = SamplingParams()
    late.temperature = temperature  # set after construction: the step still samples at samples_at
    assert late.to_step_params(num_prompt_tokens=2).temperature == pytest.approx(samples_at)
    # Two tokens 0.01 apart: at 0.01 the second is drawn 27% of the time; greedy never draws it.
    logits = torch.tensor([[2.0, 1.99, 0.0, 0.0]]).repeat(2000, 1)
    seqs = [SequenceState(i, [3, 3], [], 0, params.to_step_params(2), 2) for i in range(2000)]
    meta = SamplingMetadata.build(seqs, 4, torch.device("cpu"))
    share = (Sampler(0, torch.device("cpu"))(logits, meta).sampled_token_ids == 1).float().mean().item()
    expected = (logits[0] / samples_at).softmax(-1)[1].item() if samples_at else 0.0
    assert abs(share - expected) < 0.05


def test_seed_minus_1_is_no_seed_as_vllm():
    """vLLM's SamplingParams takes seed -1 for no seed: each request (and each of its n samples)
    draws anew, where a fixed seed 2**64 - 1 drew the same tokens every time."""
    params = SamplingParams(temperature=1.0, seed=-1, n=3)
    assert params.seed is None
    assert [p.seed for p in params.for_samples()] == [None] * 3
    assert params.to_step_params(num_prompt_tokens=2).seed is None
    assert SamplingParams(temperature=1.0, seed=-2).to_step_params(2).seed == 2**64 - 2


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ([], SamplingParams(), "prompt is empty: at least one token is required"),
        ([1, 2, 3, 600], SamplingParams(), "token id 600 at position 3 is outside the vocabulary (size 512)"),
        ([1, -1], SamplingParams(), "token id -1 at position 1 is outside the vocabulary (size 512)"),
        (
            [1] * 900,
            SamplingParams(max_tokens=200),
            "prompt (900 tokens) + max_tokens (200) exceeds max_model_len (1024)",
        ),
        (
            [1],
            SamplingParams(max_tokens=1024),
            "prompt (1 token) + max_tokens (1024) exceeds max_model_len (1024)",
        ),
        (
            [1] * 1024,
            SamplingParams(max_tokens=None),
            "prompt (1024 tokens) leaves no room to generate within max_model_len (1024)",
        ),
        (
            [1],
            SamplingParams(stop_token_ids=[512]),
            "stop_token_ids[0] = 512 is outside the vocabulary (size 512)",
        ),
    ],
)
def test_bad_requests(prompt, params, message):
    with pytest.raises(InvalidRequestError) as exc:
        verify_request(prompt, params, vocab_size=512, max_model_len=1024)
    assert str(exc.value) == message


def test_request_at_the_limit_is_accepted():
    verify_request([1] * 824, SamplingParams(max_tokens=200), vocab_size=512, max_model_len=1024)
    verify_request([511], SamplingParams(max_tokens=None), vocab_size=512, max_model_len=1024)


def test_a_prompt_too_long_is_refused_without_a_pass_over_its_ids():
    """Millions of prompt ids (a 14 MiB gRPC message holds 15M) are refused by their count: a pass
    over them would hold the event loop that serves health checks and every other stream."""

    class Unread:
        def __len__(self) -> int:
            return 15_000_000

        def __iter__(self):
            raise AssertionError("the ids were read")

    with pytest.raises(InvalidRequestError, match=r"prompt \(15000000 tokens\) \+ max_tokens \(16\) exceeds"):
        verify_request(Unread(), SamplingParams(max_tokens=16), vocab_size=512, max_model_len=1024)


def test_engine_add_request_validates():
    from helpers.fake_executor import make_engine

    engine, _ = make_engine(max_model_len=64)
    with pytest.raises(InvalidRequestError, match=r"outside the vocabulary \(size 512\)"):
        engine.add_request([5, 512])
    with pytest.raises(InvalidRequestError, match=r"exceeds max_model_len \(64\)"):
        engine.add_request([5] * 60, SamplingParams(max_tokens=5))
    params = SamplingParams()
    params.temperature = -1.0  # mutated after construction: checked again on admission
    with pytest.raises(InvalidRequestError, match="temperature must be >= 0"):
        engine.add_request([5], params)
    engine.validate_request([5] * 59, SamplingParams(max_tokens=5))
    with pytest.raises(InvalidRequestError, match="prompt is empty"):
        engine.validate_request([], SamplingParams())
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_num_seqs": 0}, "max_num_seqs must be >= 1, got 0"),
        ({"max_num_batched_tokens": 0}, "max_num_batched_tokens must be >= 1, got 0"),
        ({"max_model_len": 1}, "max_model_len must be >= 2 (or None for the executor's), got 1"),
    ],
)
def test_bad_scheduler_config(kwargs, message):
    with pytest.raises(ValueError) as exc:
        SchedulerConfig(**kwargs)
    assert str(exc.value) == message


def test_top_k_minus_one_is_off_and_penalties_at_the_limit_are_accepted():
    params = SamplingParams(top_k=-1, presence_penalty=2.0, frequency_penalty=-2.0)
    assert params.top_k == 0
    assert params.to_step_params(1).top_k == 0


def test_top_k_set_to_minus_one_after_construction_is_off():
    """`params.top_k = -1` on a made SamplingParams was refused when the request was checked, by a
    message that says -1 disables it ("top_k must be >= 0 (0 or -1 disables it), got -1")."""
    params = SamplingParams(temperature=1.0, top_k=5)
    params.top_k = -1
    params.verify()
    assert params.to_step_params(1).top_k == 0  # (the executor takes 0 for off)
    params.top_k = -2
    with pytest.raises(InvalidRequestError, match="top_k must be >= 0 \\(0 or -1 disables it\\), got -2"):
        params.verify()


def test_samples_and_the_plan_fields_of_the_features():
    params = SamplingParams(n=3, seed=2**64 - 1, prompt_logprobs=1, logit_bias={7: 100}, min_tokens=2)
    samples = params.for_samples()
    assert [s.seed for s in samples] == [2**64 - 1, 0, 1] and {s.n for s in samples} == {1}
    assert [s.prompt_logprobs for s in samples] == [1, None, None]  # the first scores the prompt
    step = samples[0].to_step_params(5)
    assert (step.min_tokens, step.logit_bias_token_ids, step.logit_bias_values) == (2, [7], [100.0])
    assert SamplingParams().to_step_params(5).logit_bias_token_ids == []  # nothing in the plan
    assert SamplingParams(max_tokens=4, logit_bias={1: 2.0}).summary() == "max_tokens=4, logit_bias=1 entries"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"n": 2.0}, "n must be an integer, got 2.0"),
        ({"seed": 1.5}, "seed must be an integer, got 1.5"),
        ({"max_tokens": 8.5}, "max_tokens must be an integer, got 8.5"),
        ({"top_k": True}, "top_k must be an integer, got True"),
        ({"stop_token_ids": [7, 2.0]}, "stop_token_ids[1] must be an integer, got 2.0"),
    ],
)
def test_integer_fields_refuse_other_numbers(kwargs, message):
    """Offline, SamplingParams(n=2.0) passed validation and failed later (range() of a float), and a
    fractional seed or max_tokens reached the step plan; each is refused naming the field."""
    with pytest.raises(InvalidRequestError) as exc:
        SamplingParams(**kwargs)
    assert str(exc.value) == message


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": "0.5"}, "temperature must be a number, got '0.5'"),
        ({"top_p": None}, "top_p must be a number, got None"),
        ({"n": None}, "n must be an integer, got None"),
        ({"top_k": None}, "top_k must be an integer, got None"),
        ({"min_tokens": None}, "min_tokens must be an integer, got None"),
        ({"stop": 5}, "stop must be a string or a list of strings, got 5"),
        ({"stop": ["a", None]}, "stop[1] must be a string, got None"),
        ({"stop": [b"x"]}, "stop[0] must be a string, got b'x'"),
        ({"stop_token_ids": 5}, "stop_token_ids must be a list of token ids, got 5"),
        ({"logit_bias": [1]}, "logit_bias must be a dict of token id -> bias, got [1]"),
    ],
)
def test_fields_of_another_type_are_refused_naming_the_field(kwargs, message):
    """Offline, a field of another type failed in Python's words: struct.error ("required argument
    is not a float"), "'<=' not supported between instances of 'int' and 'NoneType'", "object of
    type 'int' has no len()", an AttributeError for a list as logit_bias; bytes passed as a stop."""
    with pytest.raises(InvalidRequestError) as exc:
        SamplingParams(**kwargs)
    assert str(exc.value) == message


def test_logprobs_none_is_none():
    """vLLM's default logprobs=None: no logprobs (it raised a TypeError); its logit_bias=None: no bias
    (a TypeError too)."""
    assert SamplingParams(logprobs=None).to_step_params(1).logprobs == 0
    assert SamplingParams(logit_bias=None).logit_bias == {}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"truncate_prompt_tokens": 0},
            "truncate_prompt_tokens must be >= 1 (keep the prompt's last N tokens) or -1 (max_model_len), got 0",
        ),
        (
            {"truncate_prompt_tokens": -2},
            "truncate_prompt_tokens must be >= 1 (keep the prompt's last N tokens) or -1 (max_model_len), got -2",
        ),
        ({"truncate_prompt_tokens": 2.0}, "truncate_prompt_tokens must be an integer, got 2.0"),
        ({"truncate_prompt_tokens": True}, "truncate_prompt_tokens must be an integer, got True"),
        ({"skip_special_tokens": "false"}, "skip_special_tokens must be a boolean, got 'false'"),
        ({"spaces_between_special_tokens": 0}, "spaces_between_special_tokens must be a boolean, got 0"),
    ],
)
def test_bad_special_token_and_truncation_options_are_refused_naming_the_field(kwargs, message):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kwargs)
    assert str(e.value) == message


def test_truncate_prompt_keeps_the_last_tokens():
    """vLLM's left truncation: the prompt's last k tokens, -1 for max_model_len, None for all."""
    from scheduler_service.sampling_params import truncate_prompt

    ids = list(range(10))
    assert truncate_prompt(ids, SamplingParams(truncate_prompt_tokens=3), 8) == [7, 8, 9]
    assert truncate_prompt(ids, SamplingParams(truncate_prompt_tokens=-1), 8) == list(range(2, 10))
    assert truncate_prompt(ids, SamplingParams(truncate_prompt_tokens=20), 8) == ids
    assert truncate_prompt(ids, SamplingParams(), 8) == ids
    # Both of vLLM's values of spaces_between_special_tokens are taken (the text is the same).
    assert not SamplingParams(spaces_between_special_tokens=False).spaces_between_special_tokens


def test_a_text_too_long_to_fit_is_not_refused_from_its_size_when_it_is_truncated(tmp_path):
    """The size check before tokenizing counts what truncate_prompt_tokens keeps of a text."""
    from checkpoints import train_tokenizer

    from scheduler_service.request_handling import check_text_prompt
    from scheduler_service.tokenizer import Tokenizer

    tok = Tokenizer(train_tokenizer(tmp_path))
    text = "word " * 5000
    assert tok.min_num_tokens(text) > 100
    with pytest.raises(InvalidRequestError, match="from its size"):
        check_text_prompt(tok, text, SamplingParams(max_tokens=4), 100)
    assert check_text_prompt(tok, text, SamplingParams(max_tokens=4, truncate_prompt_tokens=50), 100) is tok
