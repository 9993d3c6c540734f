"""The reference attention backend (attention/torch_ref.py, the CPU path) against transformers' sdpa
attention, to the bit in bf16."""

from __future__ import annotations

import types

import pytest
import torch
from helpers.attention_checks import make_batch


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_paged_attention_is_transformers_sdpa_to_the_bit(dtype):
    """A prefill (the whole sequence: transformers' is_causal call) and decodes (one query over a
    cached context: its call without a mask) through the paged cache give transformers' sdpa output
    to the bit. SDPA takes its math kernel for 3-D inputs (on CPU in fp32 throughout) and, for 4-D
    ones as transformers passes them, its fused flash kernel, which rounds the probabilities to bf16
    before P @ V: with 3-D calls about a third of the bf16 outputs were a rounding step off (and
    fp32 ones differed in the last bits)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from executor_service.attention.torch_ref import TorchRefBackend

    num_heads, num_kv_heads, head_dim, block_size = 4, 2, 16, 16
    query_lens, context_lens = [40, 1, 1, 130], [40, 37, 300, 130]
    batch = make_batch(query_lens, context_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, "cpu")
    k_cache, v_cache, ctx = batch["k_cache"], batch["v_cache"], batch["context"]
    out = TorchRefBackend().forward(batch["q"], batch["k"], batch["v"], k_cache, v_cache, ctx, batch["scale"])
    module = types.SimpleNamespace(num_key_value_groups=num_heads // num_kv_heads, is_causal=True)
    start = 0
    for i, (n, c) in enumerate(zip(query_lens, context_lens, strict=True)):
        blocks = ctx.block_tables[i, : -(-c // block_size)]
        # [1, kv_heads, c, head_dim]: the sequence's keys and values, this step's among them
        k = k_cache[blocks].flatten(0, 1)[:c].transpose(0, 1)[None]
        v = v_cache[blocks].flatten(0, 1)[:c].transpose(0, 1)[None]
        q = batch["q"][start : start + n].transpose(0, 1)[None]
        want, _ = sdpa_attention_forward(module, q, k, v, None, scaling=batch["scale"])
        got = out[start : start + n]
        assert torch.equal(got, want[0]), (
            f"sequence {i} ({n} of {c}): {(got != want[0]).float().mean():.1%} of the outputs differ"
        )
        start += n
