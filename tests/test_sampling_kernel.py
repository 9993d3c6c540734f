"""The one-pass Triton sampler (executor_service/sampling_kernel.py) on the GPU: greedy rows equal
torch.argmax, sampled rows follow softmax(logits / T) (a frequency test with fixed seeds, so it
gives the same verdict every run), and a row's draw depends only on its seed.

The `check_*` helpers also run on the CPU under TRITON_INTERPRET=1 (test_triton_interpret.py), at
sizes the interpreter can afford."""

from __future__ import annotations

import pytest
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


pytestmark = pytest.mark.gpu
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_rows, vocab_size", [(1, 151936), (256, 151936), (7, 1000), (512, 4096)])
def test_greedy_matches_argmax(num_rows, vocab_size, dtype):
    check_greedy(num_rows, vocab_size, dtype, "cuda")


@cuda
@pytest.mark.parametrize("temperature", [0.6, 1.0, 1.7])
def test_sampled_frequencies_follow_softmax(temperature):
    # 40,000 draws: the standard error of a frequency is at most 0.0025; 0.012 is ~5 of them.
    check_distribution(40_000, 50, temperature, "cuda", block=2048, tol=0.012)


@cuda
def test_sampler_routes_seeded_batches_to_the_unfused_path():
    check_sampler_routing("cuda")


@cuda
def test_draw_depends_only_on_the_row_and_its_seed():
    check_seed_isolation(151936, "cuda")


@cuda
def test_engine_sampler_fused_and_unfused_agree_in_distribution():
    """The Sampler's fused path (fused ops on) and its unfused path draw from the same distribution."""
    from executor_service.sampler import Sampler
    from executor_service.sampling_metadata import SamplingMetadata
    from executor_service.sequence import SequenceState
    from protos.plan import StepSamplingParams

    device = torch.device("cuda")
    vocab_size, num_rows = 30, 20_000
    row = torch.randn(vocab_size, generator=torch.Generator().manual_seed(3))
    logits = row.repeat(num_rows, 1).to(device, torch.bfloat16)
    seqs = [SequenceState(i, [1], [], 0, StepSamplingParams(temperature=0.8), 1) for i in range(num_rows)]
    meta = SamplingMetadata.build(seqs, vocab_size, device)
    assert meta.temperature_only
    frequencies = []
    for fused in (True, False):
        ids = Sampler(0, device, fused=fused)(logits, meta).sampled_token_ids.cpu()
        frequencies.append(torch.bincount(ids, minlength=vocab_size).float() / num_rows)
    assert (frequencies[0] - frequencies[1]).abs().max().item() < 0.02
