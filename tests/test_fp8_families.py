"""Every supported family on the fp8 paths, on the CPU, through chunked prefill, prefix-cache hits and
preemption in one run (test_model_families' waves): an fp8 (e4m3) KV cache against transformers with
the same KV round trip (helpers/fp8_kv_reference.py) and against an fp8 run without chunks, hits or
preemption; an FP8 block-scaled checkpoint against transformers on its dequantized weights, token and
logprob, as test_model_families holds the fp32 checkpoints."""

from __future__ import annotations

import shutil

import pytest
import torch
from checkpoints import FAMILIES, quantize_checkpoint_fp8
from helpers.families import DISTURBED, PROMPT_SEEDS, generate_disturbed
from helpers.fp8_kv_reference import assert_matches_fp8_kv_reference, load_reference
from helpers.hf_reference import MAX_NEW, assert_matches_hf
from safetensors.torch import load_file, save_file

from client.llm import LLM
from scheduler_service.sampling_params import SamplingParams

# Runs models at length: left out of `make test-fast`.
pytestmark = pytest.mark.slow

# The prompt seed per family on its FP8 checkpoint: every compared step has a clear top-1 margin on
# the dequantized weights (test_generate_vs_hf), which quantization moves.
FP8_PROMPT_SEEDS = {**PROMPT_SEEDS, "llama3_rope": 2, "mistral": 1}


def _generate_disturbed(path, seed: int, **options):
    """(prompts, outputs with logprobs) of both waves through chunks, hits and preemption."""
    return generate_disturbed(LLM(str(path), **DISTURBED, **options), seed)


def _generate_undisturbed(path, prompts, **options) -> list[list[int]]:
    llm = LLM(str(path), num_kv_blocks=128, block_size=16, max_model_len=128, enable_prefix_caching=False,
              **options)  # fmt: skip
    outputs = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW), use_tqdm=False)
    assert llm.engine.scheduler.stats.num_preemptions == 0
    return [o.token_ids for o in outputs]


def _dequantized_copy(src, fp8, dst):
    """The checkpoint `src` as an FP8 checkpoint at `fp8`, and its dequantized weights as a plain
    checkpoint at `dst` (what transformers loads as the reference)."""
    dequantized = quantize_checkpoint_fp8(src, fp8)
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors"))
    save_file({n: t.contiguous() for n, t in dequantized.items()}, dst / "model.safetensors")


@pytest.mark.parametrize("family", list(FAMILIES))
def test_fp8_kv_cache_matches_transformers_with_the_same_round_trip(family_checkpoint, family):
    path = family_checkpoint(family)
    prompts, outputs = _generate_disturbed(path, PROMPT_SEEDS[family], kv_cache_dtype="fp8")
    assert_matches_fp8_kv_reference(load_reference(path), prompts, outputs)
    # And exactly the tokens of an fp8 run in which every prompt is prefilled whole, once.
    assert [o.token_ids for o in outputs] == _generate_undisturbed(path, prompts, kv_cache_dtype="fp8")


@pytest.mark.parametrize("family", list(FAMILIES))
def test_fp8_checkpoint_matches_transformers_on_the_dequantized_weights(family_checkpoint, tmp_path, family):
    """Every projection (experts included) in e4m3 with 128 x 128 block scales, dequantized at load:
    the same tokens and logprobs as transformers on the dequantized weights."""
    _dequantized_copy(family_checkpoint(family), tmp_path / "fp8", tmp_path / "dequantized")
    prompts, outputs = _generate_disturbed(tmp_path / "fp8", FP8_PROMPT_SEEDS[family])
    assert_matches_hf(tmp_path / "dequantized", prompts, outputs)


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2", "mistral"])
def test_fp8_checkpoint_with_an_fp8_kv_cache_and_checkpoint_kv_scales(family_checkpoint, tmp_path, family):
    """Both fp8 paths at once, with per-layer k/v scales in the checkpoint (layer 0 scaled apart,
    layer 2 one kv_scale for both): against transformers on the dequantized weights with the same
    round trip at the same scales."""
    _dequantized_copy(family_checkpoint(family), tmp_path / "fp8", tmp_path / "dequantized")
    path = tmp_path / "fp8"
    weights = load_file(path / "model.safetensors")
    weights["model.layers.0.self_attn.k_scale"] = torch.tensor(0.05)
    weights["model.layers.0.self_attn.v_scale"] = torch.tensor(2.0)
    weights["model.layers.2.self_attn.kv_scale"] = torch.tensor(0.5)
    save_file(weights, path / "model.safetensors")
    prompts, outputs = _generate_disturbed(path, FP8_PROMPT_SEEDS[family], kv_cache_dtype="fp8")
    models = load_reference(tmp_path / "dequantized", {0: (0.05, 2.0), 2: (0.5, 0.5)})
    assert_matches_fp8_kv_reference(models, prompts, outputs)
