"""Shared by the tests: from test_sampling_kernel.py."""

from __future__ import annotations

import torch


def check_greedy(num_rows: int, vocab_size: int, dtype: torch.dtype, device: str, block: int = 2048) -> None:
    from executor_service.sampling_kernel import sample_from_logits

    gen = torch.Generator().manual_seed(num_rows)
    logits = (3 * torch.randn(num_rows, vocab_size, generator=gen)).to(dtype)
    # Ties: row 0's maximum appears twice, in different tiles; the first one wins, as in torch.
    logits[0, :] = -1.0
    logits[0, vocab_size // 3] = logits[0, vocab_size - 1] = 5.0
    logits = logits.to(device)
    temperatures = torch.zeros(num_rows, device=device)
    seeds = torch.arange(num_rows, dtype=torch.int64, device=device)
    got = sample_from_logits(logits, temperatures, seeds, block=block)
    assert got.tolist() == logits.float().argmax(-1).tolist()
    assert got[0].item() == vocab_size // 3


def check_distribution(
    num_rows: int, vocab_size: int, temperature: float, device: str, block: int, tol: float
):
    """num_rows independent draws of one logits row: each token's frequency within `tol` of its
    probability under softmax(logits / temperature)."""
    from executor_service.sampling_kernel import sample_from_logits

    gen = torch.Generator().manual_seed(vocab_size)
    row = 1.5 * torch.randn(vocab_size, generator=gen)
    logits = row.repeat(num_rows, 1).to(device)
    temperatures = torch.full((num_rows,), temperature, device=device)
    seeds = (torch.arange(num_rows, dtype=torch.int64) * 0x9E3779B9 + 17).to(device)
    got = sample_from_logits(logits, temperatures, seeds, block=block).cpu()
    assert ((got >= 0) & (got < vocab_size)).all()
    frequencies = torch.bincount(got, minlength=vocab_size).float() / num_rows
    expected = (row / temperature).softmax(-1)
    worst = (frequencies - expected).abs().max().item()
    assert worst <= tol, f"a token's frequency is {worst:.3f} off its probability (allowed {tol})"


def check_seed_isolation(vocab_size: int, device: str, block: int = 2048) -> None:
    """A row's token depends on its logits, temperature and seed only: moved to another position
    in a batch of other rows (which changes how many programs split its vocabulary), or split
    differently, it draws the same token; another seed moves some draws."""
    from executor_service.sampling_kernel import sample_from_logits

    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(6, vocab_size, generator=gen).to(device)
    temperatures = torch.tensor([1.0, 0.0, 0.8, 1.3, 1.0, 0.5], device=device)
    seeds = torch.tensor([11, 12, 13, 14, 15, 16], dtype=torch.int64, device=device)
    batch = sample_from_logits(logits, temperatures, seeds, block=block).tolist()
    order = [4, 2, 0, 5, 1, 3]
    shuffled = sample_from_logits(logits[order], temperatures[order], seeds[order], block=block).tolist()
    assert [batch[i] for i in order] == shuffled
    alone = [sample_from_logits(logits[i : i + 1], temperatures[i : i + 1], seeds[i : i + 1], block=block).item()
             for i in range(6)]  # fmt: skip
    assert alone == batch
    for splits in (1, 2, 4):  # however a row's vocabulary is split over programs
        got = sample_from_logits(logits, temperatures, seeds, block=block, num_splits=splits).tolist()
        assert got == batch, f"{splits} splits"
    flat = torch.zeros(64, vocab_size, device=device)  # uniform: the seed alone decides
    draws = sample_from_logits(
        flat, torch.ones(64, device=device), torch.arange(64, device=device), block=block
    )
    assert len(set(draws.tolist())) > 1, "different seeds drew the same token every time"


def check_sampler_routing(device: str) -> None:
    """The engine's Sampler with fused=True: greedy rows give argmax through the kernel, and a batch
    with a seeded row takes the unfused path whole (the seeded row's noise must not depend on
    which path its batch takes), so it equals Sampler(fused=False) token for token."""
    from executor_service.sampler import Sampler
    from executor_service.sampling_metadata import SamplingMetadata
    from executor_service.sequence import SequenceState
    from protos.plan import StepSamplingParams

    dev = torch.device(device)
    vocab_size = 40
    logits = torch.randn(4, vocab_size, generator=torch.Generator().manual_seed(7)).to(dev)

    def meta(*params: StepSamplingParams) -> SamplingMetadata:
        seqs = [SequenceState(i, [1, 2], [], 0, p, 2) for i, p in enumerate(params)]
        return SamplingMetadata.build(seqs, vocab_size, dev)

    greedy = meta(*[StepSamplingParams(temperature=0.0)] * 4)
    assert greedy.temperature_only
    fused = Sampler(0, dev, fused=True)
    assert fused(logits, greedy).sampled_token_ids.tolist() == logits.argmax(-1).tolist()
    seeded = meta(
        *[StepSamplingParams(temperature=0.9, seed=s) for s in (1, 2, 3)], StepSamplingParams(temperature=0.7)
    )
    assert seeded.seeded_rows
    got = fused(logits, seeded).sampled_token_ids.tolist()
    want = Sampler(0, dev, fused=False)(logits, seeded).sampled_token_ids.tolist()
    assert got[:3] == want[:3], "a seeded row drew other noise on the fused sampler"


def check_logit_bias_and_min_tokens(device: str, fused: bool) -> None:
    """The Sampler (`fused`: its one-pass path, which samples the biased logits) with OpenAI's
    logit_bias and vLLM's min_tokens: +100 forces a token, greedy or sampled; -100 removes one;
    a row short of min_tokens never draws its stop tokens, a row that reached it may; rows
    without either keep their tokens; logprobs stay the model's own."""
    from executor_service.sampler import Sampler
    from executor_service.sampling_metadata import SamplingMetadata
    from executor_service.sequence import SequenceState
    from protos.plan import StepSamplingParams

    dev = torch.device(device)
    vocab_size, n = 40, 8
    logits = torch.randn(n, vocab_size, generator=torch.Generator().manual_seed(5)).to(dev)
    top = logits.argmax(-1).tolist()
    stops = [top[4], top[5]]  # the stop tokens are the most likely ones

    def params(i: int) -> StepSamplingParams:
        if i in (0, 1):  # forced: greedy, then sampled
            return StepSamplingParams(
                temperature=float(i), logit_bias_token_ids=[7], logit_bias_values=[100.0]
            )
        if i == 2:  # the greedy choice removed
            return StepSamplingParams(logit_bias_token_ids=[top[2]], logit_bias_values=[-100.0])
        if i in (4, 5):  # 2 tokens generated (below): short of min_tokens 3, then at min_tokens 2
            return StepSamplingParams(min_tokens=3 if i == 4 else 2, stop_token_ids=stops)
        return StepSamplingParams()

    # prompt [1, 2], then 2 generated tokens
    seqs = [SequenceState(i, [1, 2, 3, 3], [], 0, params(i), 2) for i in range(n)]
    meta = SamplingMetadata.build(seqs, vocab_size, dev)
    assert meta.temperature_only  # with fused=True: the one-pass path
    sampler = Sampler(0, dev, fused=fused)
    best_allowed = logits[4].index_fill(0, torch.tensor(stops, device=dev), float("-inf")).argmax().item()
    for _ in range(20):
        got = sampler(logits, meta).sampled_token_ids.tolist()
        assert got[0] == got[1] == 7
        assert got[2] != top[2]
        assert got[4] == best_allowed
        assert got[5] == top[5]
        assert got[3] == top[3] and got[6:] == top[6:]
    lp = SamplingMetadata.build(
        [SequenceState(0, [1], [], 0, StepSamplingParams(logprobs=1, **_bias(7)), 1)], vocab_size, dev
    )
    out = Sampler(0, dev, fused=fused)(logits[:1], lp)
    assert out.sampled_token_ids.item() == 7
    assert abs(out.sampled_logprobs.item() - logits[0].float().log_softmax(-1)[7].item()) < 1e-5


def _bias(token_id: int) -> dict:
    return {"logit_bias_token_ids": [token_id], "logit_bias_values": [100.0]}
