"""The sampler on fixed logits: greedy, seeds, top-k / top-p / min-p frequencies, penalties, logprobs."""

from __future__ import annotations

import pytest
import torch
from helpers.sampling_checks import check_logit_bias_and_min_tokens

from executor_service.sampler import Sampler, apply_penalties
from executor_service.sampling_metadata import SamplingMetadata
from executor_service.sequence import SequenceState
from protos.plan import StepSamplingParams

CPU = torch.device("cpu")
V = 64


def _seq(params: StepSamplingParams, token_ids: list[int] | None = None, num_prompt: int | None = None):
    token_ids = token_ids if token_ids is not None else [1, 2, 3]
    num_prompt = len(token_ids) if num_prompt is None else num_prompt
    return SequenceState(0, token_ids, [0], len(token_ids), params, num_prompt)


def _sample(logits: torch.Tensor, seqs: list[SequenceState], seed: int = 0):
    meta = SamplingMetadata.build(seqs, logits.shape[-1], CPU)
    return Sampler(seed, CPU)(logits, meta)


def _random_logits(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, V, generator=torch.Generator().manual_seed(seed)) * 3


def test_temperature_zero_is_argmax_even_next_to_random_rows():
    logits = _random_logits(6)
    params = [StepSamplingParams(temperature=0.0 if i % 2 == 0 else 1.0, top_p=0.9) for i in range(6)]
    out = _sample(logits, [_seq(p) for p in params])
    greedy = logits.argmax(-1)
    assert out.sampled_token_ids[::2].tolist() == greedy[::2].tolist()


def test_top_k_one_equals_greedy():
    logits = _random_logits(32, seed=1)
    out = _sample(logits, [_seq(StepSamplingParams(temperature=1.5, top_k=1)) for _ in range(32)])
    assert out.sampled_token_ids.tolist() == logits.argmax(-1).tolist()


def test_seeded_row_same_alone_and_in_any_batch():
    logits = _random_logits(5, seed=2) / 3  # flat enough that draws vary
    seeded = StepSamplingParams(temperature=1.0, seed=1234)
    for num_tokens in (3, 4, 10):
        tokens = list(range(num_tokens))
        alone = _sample(logits[2:3], [_seq(seeded, tokens)], seed=7).sampled_token_ids.item()
        batch = [
            _seq(StepSamplingParams(temperature=1.0)),
            _seq(StepSamplingParams(temperature=0.7, seed=99), [5, 6]),
            _seq(seeded, tokens),
            _seq(StepSamplingParams(temperature=0.0)),
            _seq(StepSamplingParams(temperature=1.0, top_k=5)),
        ]
        in_batch = _sample(logits, batch, seed=123).sampled_token_ids[2].item()
        assert alone == in_batch
    # The draw changes with the sequence's length: not one token forever.
    draws = {
        _sample(logits[2:3], [_seq(seeded, list(range(n)))]).sampled_token_ids.item() for n in range(1, 30)
    }
    assert len(draws) > 5


def _draw_frequencies(logits: torch.Tensor, params: StepSamplingParams, draws: int = 20_000) -> torch.Tensor:
    out = _sample(logits.expand(draws, -1).clone(), [_seq(params) for _ in range(draws)], seed=0)
    return torch.bincount(out.sampled_token_ids, minlength=logits.shape[-1]).float() / draws


def _total_variation(p: torch.Tensor, q: torch.Tensor) -> float:
    return 0.5 * (p - q).abs().sum().item()


FIXED = torch.tensor([3.0, 2.5, 2.0, 1.5, 1.0, 0.0, -1.0, -2.0])
PROBS = FIXED.softmax(-1)  # [0.415, 0.252, 0.153, 0.093, 0.056, 0.021, 0.008, 0.003]


def _renormalised(keep: list[int]) -> torch.Tensor:
    p = torch.zeros_like(PROBS)
    p[keep] = PROBS[keep]
    return p / p.sum()


@pytest.mark.parametrize(
    ("params", "keep"),
    [
        (StepSamplingParams(temperature=1.0), list(range(8))),
        (StepSamplingParams(temperature=1.0, top_k=3), [0, 1, 2]),
        # Cumulative 0.415, 0.667, 0.820, 0.913: top-p 0.85 keeps four tokens, 0.8 three.
        (StepSamplingParams(temperature=1.0, top_p=0.85), [0, 1, 2, 3]),
        (StepSamplingParams(temperature=1.0, top_p=0.8), [0, 1, 2]),
        # Top-p applies to the top-k renormalised: [0.506, 0.307, 0.186] reaches 0.7 after two.
        (StepSamplingParams(temperature=1.0, top_k=3, top_p=0.7), [0, 1]),
        # min-p 0.2: tokens with probability below 0.2 * 0.415 = 0.083 are dropped.
        (StepSamplingParams(temperature=1.0, min_p=0.2), [0, 1, 2, 3]),
    ],
)
def test_empirical_frequencies_match_renormalised_distribution(params, keep):
    freqs = _draw_frequencies(FIXED.unsqueeze(0), params)
    assert set(freqs.nonzero().flatten().tolist()) <= set(keep)
    assert _total_variation(freqs, _renormalised(keep)) < 0.02


@pytest.mark.parametrize("top_p", [1.0, 0.99])
def test_top_k_keeps_the_tokens_tied_with_the_k_th_as_vllm(top_p):
    """vLLM's top-k masks the logits below the k-th largest (apply_top_k_only / apply_top_k_top_p):
    tokens tied with the k-th all stay (bf16 logits tie often), where a cut by rank kept k of them."""
    tied = torch.tensor([3.0, 2.0, 2.0, 2.0, 0.0, -1.0, -1.0, -2.0])
    freqs = _draw_frequencies(tied.unsqueeze(0), StepSamplingParams(temperature=1.0, top_k=2, top_p=top_p))
    keep = [0, 1, 2, 3]
    expected = torch.zeros_like(tied)
    expected[keep] = tied[keep].softmax(-1)
    assert _total_variation(freqs, expected) < 0.02
    top_tie = torch.tensor([1.0, 5.0, 5.0, 0.0])  # top_k 1 with two maxima: either, half the time
    freqs = _draw_frequencies(top_tie.unsqueeze(0), StepSamplingParams(temperature=1.0, top_k=1, top_p=top_p))
    assert abs(freqs[1].item() - 0.5) < 0.02 and abs(freqs[2].item() - 0.5) < 0.02


def test_temperature_sharpens_the_distribution():
    freqs = _draw_frequencies(FIXED.unsqueeze(0), StepSamplingParams(temperature=0.5))
    assert _total_variation(freqs, (FIXED / 0.5).softmax(-1)) < 0.02


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    logits = torch.tensor([[2.0, -1.0, 1.5, 0.5]])
    # Prompt [0], generated [1]: both penalised by repetition; tokens 2 and 3 untouched.
    seq = _seq(StepSamplingParams(repetition_penalty=2.0), [0, 1], num_prompt=1)
    meta = SamplingMetadata.build([seq], 4, CPU)
    assert apply_penalties(logits, meta).tolist() == [[1.0, -2.0, 1.5, 0.5]]
    # Greedy sees the penalised logits: token 2 now wins over token 0.
    assert _sample(logits, [seq]).sampled_token_ids.item() == 2


def test_a_tiny_repetition_penalty_picks_among_the_favoured_seen_tokens_not_nan():
    # 1e-40 is a float32 subnormal: a positive logit divided by it overflows to +inf, and a row
    # with two +inf logits has no softmax (inf - inf): it sampled whatever NaN argmaxes to.
    logits = torch.tensor([[2.0, -1.0, 1.5, 0.5], [2.0, -1.0, 1.5, 0.5]])
    params = [
        StepSamplingParams(repetition_penalty=1e-40),
        StepSamplingParams(temperature=1.0, repetition_penalty=1e-40),
    ]
    seqs = [_seq(p, [0, 3], num_prompt=1) for p in params]  # tokens 0 and 3 seen, both positive
    meta = SamplingMetadata.build(seqs, 4, CPU)
    penalised = apply_penalties(logits, meta)
    assert torch.isfinite(penalised).all()
    for seed in range(20):
        assert _sample(logits, seqs, seed=seed).sampled_token_ids.tolist()[1] in (0, 3)
    assert _sample(logits, seqs).sampled_token_ids.tolist()[0] in (0, 3)


def test_presence_and_frequency_penalties_count_only_generated_tokens():
    logits = torch.zeros(1, 4)
    # Prompt [3, 3], generated [2, 2, 1].
    params = StepSamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    meta = SamplingMetadata.build([_seq(params, [3, 3, 2, 2, 1], num_prompt=2)], 4, CPU)
    assert apply_penalties(logits, meta).tolist() == [[0.0, -0.75, -1.0, 0.0]]


def test_logprobs_are_log_softmax_of_raw_logits():
    logits = _random_logits(3, seed=3)
    seqs = [
        _seq(StepSamplingParams(logprobs=5)),
        _seq(StepSamplingParams(temperature=1.0, logprobs=2, repetition_penalty=1.3)),
        _seq(StepSamplingParams()),
    ]
    out = _sample(logits, seqs)
    expected = logits.log_softmax(-1)
    sampled = out.sampled_token_ids
    torch.testing.assert_close(out.sampled_logprobs, expected.gather(-1, sampled[:, None]).squeeze(-1))
    top_lp, top_ids = expected.topk(5, dim=-1)
    assert out.top_token_ids.tolist() == top_ids.tolist()
    torch.testing.assert_close(out.top_logprobs, top_lp)
    assert torch.all(out.top_logprobs[:, :-1] >= out.top_logprobs[:, 1:])


def test_no_logprobs_computed_when_no_row_asks():
    out = _sample(_random_logits(2), [_seq(StepSamplingParams()) for _ in range(2)])
    assert out.sampled_logprobs is None and out.top_token_ids is None


def test_logit_bias_forces_and_removes_tokens_and_min_tokens_bans_stop_tokens():
    check_logit_bias_and_min_tokens("cpu", fused=False)


def test_plans_without_bias_or_min_tokens_build_neither():
    meta = SamplingMetadata.build([_seq(StepSamplingParams(temperature=1.0)) for _ in range(3)], V, CPU)
    assert meta.logit_bias is None and meta.banned_tokens is None
    # min_tokens reached: nothing banned
    done = StepSamplingParams(min_tokens=1, stop_token_ids=[0])
    meta = SamplingMetadata.build([_seq(done, [1, 2, 3], num_prompt=2)], V, CPU)
    assert meta.banned_tokens is None


def test_metadata_reused_only_while_it_depends_on_the_rows_parameters_alone():
    """A decode step whose rows have the same parameters as the step before gets the same metadata
    (no rebuild); other rows, a seeded row (its seed moves with the token count) or a penalty (it
    reads the tokens) build anew, and the reused metadata samples what a fresh one does."""
    plain = [_seq(StepSamplingParams(temperature=t, top_k=k)) for t, k in ((0.0, 0), (0.7, 5), (1.2, 0))]
    first = SamplingMetadata.build(plain, V, CPU)
    again = SamplingMetadata.build(plain, V, CPU, previous=first)
    assert again is first
    assert SamplingMetadata.build(plain[:2], V, CPU, previous=first) is not first
    assert SamplingMetadata.build(plain[::-1], V, CPU, previous=first) is not first
    logits = _random_logits(3, seed=4)
    torch.testing.assert_close(
        Sampler(1, CPU)(logits, again).sampled_token_ids,
        Sampler(1, CPU)(logits, SamplingMetadata.build(plain, V, CPU)).sampled_token_ids,
    )
    for params in (StepSamplingParams(temperature=0.8, seed=3), StepSamplingParams(repetition_penalty=1.3)):
        seqs = [_seq(params, [1, 2, 3], num_prompt=2)]
        built = SamplingMetadata.build(seqs, V, CPU)
        assert SamplingMetadata.build(seqs, V, CPU, previous=built) is not built
