"""The one-pass Triton sampler (executor_service/sampling_kernel.py) on the GPU: greedy rows equal
torch.argmax, sampled rows follow softmax(logits / T) (a frequency test with fixed seeds, so it
gives the same verdict every run), and a row's draw depends only on its seed.

The `check_*` helpers also run on the CPU under TRITON_INTERPRET=1 (test_triton_interpret.py), at
sizes the interpreter can afford."""

from __future__ import annotations

import pytest
import torch
from helpers.sampling_checks import (
    check_distribution,
    check_greedy,
    check_logit_bias_and_min_tokens,
    check_sampler_routing,
    check_seed_isolation,
)

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
@pytest.mark.parametrize("fused", [True, False])
def test_logit_bias_and_min_tokens_on_both_sampler_paths(fused):
    check_logit_bias_and_min_tokens("cuda", fused)


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
