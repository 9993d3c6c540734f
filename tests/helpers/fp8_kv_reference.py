"""Shared by the tests: from test_fp8_families.py and test_tensor_parallel.py (transformers with the
KV round trip of an e4m3 cache, as a reference for tandem's fp8 KV cache).

tandem stores each token's K (after q/k norm and rotary) and V as e4m3(x / scale) and attends over
what it reads back (fp8.quantize_kv / dequantize_kv), the step's own tokens included. The reference
is transformers' SDPA attention over keys and values put through the same round trip, teacher-forced
on the tokens tandem generated: one forward over prompt + output, so that no divergence cascades.

Not to the bit: tandem's K differs from transformers' in the last float32 bits, and where an element
sits at an e4m3 rounding boundary that flips it by one e4m3 step (a few in 10^5 elements). Such a flip
moves a logprob by up to about 2e-3 on the family checkpoints, while the e4m3 round trip itself moves
them by 0.4 to 0.8 on average (the checks assert that it does, so a cache that kept full precision, or
read its scales wrongly, fails). So: logprobs within FP8_KV_LOGPROB_ATOL, and each token the
reference's top-1 wherever its top-1 - top-2 margin exceeds twice that."""

from __future__ import annotations

import functools
import math

import torch

from executor_service.fp8 import dequantize_kv, quantize_kv

FP8_KV_LOGPROB_ATOL = 1e-2

# How far the e4m3 round trip must move the reference's logprobs from full precision, on average:
# far beyond FP8_KV_LOGPROB_ATOL, so that these checks tell an e4m3 cache from one that is not.
FP8_KV_MIN_EFFECT = 0.1

IMPLEMENTATION = "tandem_fp8_kv"


def _fp8_kv_attention(module, query, key, value, attention_mask, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    k_scale, v_scale = getattr(module, "tandem_kv_scales", (1.0, 1.0))
    key = dequantize_kv(quantize_kv(key, k_scale), k_scale, key.dtype)
    value = dequantize_kv(quantize_kv(value, v_scale), v_scale, value.dtype)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


@functools.cache
def _register() -> None:
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(IMPLEMENTATION, _fp8_kv_attention)
    AttentionMaskInterface.register(IMPLEMENTATION, sdpa_mask)


def load_reference(path, kv_scales: dict[int, tuple[float, float]] | None = None):
    """(transformers with the e4m3 KV round trip, transformers in full precision) on the checkpoint
    at `path`, fp32; kv_scales: layer -> (k_scale, v_scale), 1 where not given."""
    from transformers import AutoModelForCausalLM

    _register()
    models = [
        AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=name).eval()
        for name in (IMPLEMENTATION, "sdpa")
    ]
    for layer, scales in (kv_scales or {}).items():
        models[0].model.layers[layer].self_attn.tandem_kv_scales = scales
    return models


def assert_matches_fp8_kv_reference(models, prompts, outputs) -> None:
    """Each output's tokens and logprobs (the outputs carry them) against the e4m3-KV reference,
    teacher-forced (see the module's docstring)."""
    fp8, full = models
    checked = effect = steps = 0
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
        ids = torch.tensor([prompt + out.token_ids])
        with torch.no_grad():
            ref = fp8(ids).logits[0, len(prompt) - 1 : -1].float().log_softmax(-1)
            plain = full(ids).logits[0, len(prompt) - 1 : -1].float().log_softmax(-1)
        for step, (token, lp) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
            top = ref[step].topk(2)
            assert math.isclose(lp.logprob, float(ref[step, token]), abs_tol=FP8_KV_LOGPROB_ATOL), (
                f"prompt of {len(prompt)} tokens, step {step}: {lp.logprob} vs {float(ref[step, token])}"
            )
            if float(top.values[0] - top.values[1]) > 2 * FP8_KV_LOGPROB_ATOL:
                assert token == int(top.indices[0]), f"prompt of {len(prompt)} tokens, step {step}"
                checked += 1
            effect += float((ref[step] - plain[step]).abs().max())
            steps += 1
    # Near-ties are rare: nearly every step's token is checked.
    assert checked >= 0.9 * steps, f"only {checked} of {steps} steps have a clear top-1"
    assert effect / steps > FP8_KV_MIN_EFFECT, f"the e4m3 round trip moved logprobs by {effect / steps:.2e}"
