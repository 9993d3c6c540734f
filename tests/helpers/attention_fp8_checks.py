"""Shared by the tests: from test_triton_kernels.py."""

from __future__ import annotations

import contextlib

import torch

from executor_service.context import Context
from helpers.attention_checks import (
    NAN,
    assert_matches,
    longest_first,
)


def to_fp8(batch: dict, k_scale: float, v_scale: float) -> dict:
    """The batch with e4m3 caches (the cached prefix quantized as a store would have; NaN stays NaN),
    the V cache kept transposed per block, with zeros past each sequence's context in its last
    block, as the store leaves them (the unused blocks keep their NaN)."""
    from executor_service.fp8 import fp8_v_cache, quantize_kv, v_cache_slots

    fp8 = dict(batch, kv_scales=(k_scale, v_scale))
    fp8["k_cache"] = quantize_kv(batch["k_cache"], k_scale)
    fp8["v_cache"] = fp8_v_cache(quantize_kv(batch["v_cache"], v_scale))
    ctx = batch["context"]
    block_size = fp8["k_cache"].shape[1]
    v_slots = v_cache_slots(fp8["v_cache"])
    for table, context_len in zip(ctx.block_tables.tolist(), ctx.context_lens_host, strict=True):
        if context_len % block_size:
            v_slots[table[(context_len - 1) // block_size], context_len % block_size :] = 0
    return fp8


def nan_past_runs(batch: dict, run: int = 16) -> dict:
    """The batch (from to_fp8) with NaN in the V slots of each last block past the context's last
    run of `run` slots: the kernels read an e4m3 V cache in such runs (16-byte vectors), never
    further, so these slots cannot reach the output. Not so with the decode config's TMA_KV, whose
    boxes read whole tiles: it needs the stores' zeros in every slot of a block past the context
    (every store path zeroes a block's V^T past a token written at its first slot). Prefill rows read
    their chunk's later keys too: use decode-only batches."""
    from executor_service.fp8 import v_cache_slots

    ctx = batch["context"]
    v_slots = v_cache_slots(batch["v_cache"])
    block_size = v_slots.shape[1]
    for table, context_len in zip(ctx.block_tables.tolist(), ctx.context_lens_host, strict=True):
        end = -(-(context_len % block_size) // run) * run
        if context_len % block_size and end < block_size:
            v_slots[table[(context_len - 1) // block_size], end:] = NAN
    return batch


def check_store_fp8(batch: dict) -> None:
    """The store kernel writes exactly fp8.quantize_kv's bytes (round to nearest even, saturated),
    and zeroes the V slots after a block's first slot that the launch does not write (over NaN:
    both the lone token's whole rows and the masked path of a run ending inside its block)."""
    from executor_service.attention import triton_kernels
    from executor_service.fp8 import quantize_kv, v_cache_slots

    ctx, (k_scale, v_scale) = batch["context"], batch["kv_scales"]
    k_cache, v_cache = batch["k_cache"], batch["v_cache"]
    keep = ctx.slot_mapping >= 0
    slots = ctx.slot_mapping[keep]
    block_size = k_cache.shape[1]
    v_cache.view(torch.uint8).fill_(0x7F)  # NaN everywhere, as a block's earlier owner may leave it
    before = v_cache_slots(v_cache).clone()
    triton_kernels.store_kv(batch["k"], batch["v"], k_cache, v_cache, ctx.slot_mapping, k_scale, v_scale)
    for cache, x, scale in ((k_cache, batch["k"], k_scale), (v_cache_slots(v_cache), batch["v"], v_scale)):
        got = cache[slots // block_size, slots % block_size].view(torch.uint8)
        assert torch.equal(got, quantize_kv(x[keep], scale).view(torch.uint8))
    # A block whose first slot was written has zeros in the V slots after it that were not; every
    # other slot is untouched.
    v_slots = v_cache_slots(v_cache).view(torch.uint8)
    zeroed = torch.zeros(v_slots.shape[:2], dtype=torch.bool, device=v_slots.device)
    for slot in slots[slots % block_size == 0].tolist():
        zeroed[slot // block_size, slot % block_size + 1 :] = True
    zeroed[slots // block_size, slots % block_size] = False
    written = torch.zeros_like(zeroed)
    written[slots // block_size, slots % block_size] = True
    assert (v_slots[zeroed] == 0).all()
    untouched = ~zeroed & ~written
    assert torch.equal(v_slots[untouched], before.view(torch.uint8)[untouched])


def check_attention_fp8(
    batch: dict, num_splits: int = 1, config: dict | None = None, decode_config: dict | None = None
) -> None:
    """Store, decode rows and prefill rows over e4m3 caches against torch_ref in fp32 over the same
    caches (its store quantizes the same way; it dequantizes before SDPA, the kernels fold the scales
    into the scores and the output: not the same order, so within the 16-bit tolerance)."""
    from executor_service.attention import torch_ref
    from executor_service.attention import triton_kernels as tk

    ctx, pad, kv_scales = batch["context"], batch["num_padding"], batch["kv_scales"]
    k_ref, v_ref = batch["k_cache"].clone(), batch["v_cache"].clone()
    torch_ref.store_kv(batch["k"], batch["v"], k_ref, v_ref, ctx.slot_mapping, *kv_scales)
    n = len(ctx.query_lens_host) - pad
    real = Context(
        block_tables=ctx.block_tables[:n],
        query_lens_host=ctx.query_lens_host[:n],
        context_lens_host=ctx.context_lens_host[:n],
    )
    num_tokens = sum(real.query_lens_host)
    q = batch["q"]
    ref = torch_ref.paged_attention(q[:num_tokens].float(), k_ref, v_ref, real, batch["scale"], *kv_scales)
    tk.store_kv(batch["k"], batch["v"], batch["k_cache"], batch["v_cache"], ctx.slot_mapping, *kv_scales)
    assert torch.equal(batch["k_cache"].view(torch.uint8), k_ref.view(torch.uint8))
    assert torch.equal(batch["v_cache"].view(torch.uint8), v_ref.view(torch.uint8))
    out = torch.full_like(q, NAN)
    meta = (ctx.block_tables, ctx.context_lens, ctx.cu_seqlens_q)
    caches = (batch["k_cache"], batch["v_cache"])
    has_decode, has_prefill = 1 in ctx.query_lens_host, any(n > 1 for n in ctx.query_lens_host)
    if has_decode:
        rows = 1 if has_prefill else 0
        tk.paged_decode(
            q, *caches, out, *meta, batch["scale"], num_splits, rows=rows, config=decode_config, kv_scales=kv_scales,
            seq_order=longest_first(ctx.context_lens),
        )  # fmt: skip
    if has_prefill:
        tk.paged_prefill(
            q, *caches, out, *meta, ctx.max_seqlen_q, batch["scale"], rows=2 if has_decode else 0,
            config=config, kv_scales=kv_scales,
        )  # fmt: skip
    assert_matches(out, batch, ref)


@contextlib.contextmanager
def decode_flags(stores_kv: bool, fuses_rope: bool = False):
    """DECODE_STORES_KV and DECODE_FUSES_ROPE as given inside the block, as they were after it."""
    from executor_service.attention import triton_kernels as tk

    was = tk.DECODE_STORES_KV, tk.DECODE_FUSES_ROPE
    tk.DECODE_STORES_KV, tk.DECODE_FUSES_ROPE = stores_kv, fuses_rope
    try:
        yield
    finally:
        tk.DECODE_STORES_KV, tk.DECODE_FUSES_ROPE = was


def _store_then_decode(batch: dict, q, k, v, num_splits: int, decode_config: dict | None):
    """Today's decode step over copies of the batch's caches: the store kernel's K/V, then the decode
    kernel. Returns (k_cache, v_cache, out)."""
    from executor_service.attention import triton_kernels as tk

    ctx, kv_scales = batch["context"], batch["kv_scales"]
    k_cache, v_cache = batch["k_cache"].clone(), batch["v_cache"].clone()
    out = torch.full_like(q, NAN)
    tk.store_kv(k, v, k_cache, v_cache, ctx.slot_mapping, *kv_scales)
    tk.paged_decode(
        q, k_cache, v_cache, out, ctx.block_tables, ctx.context_lens, ctx.cu_seqlens_q, batch["scale"], num_splits,
        config=decode_config, kv_scales=kv_scales, seq_order=longest_first(ctx.context_lens),
    )  # fmt: skip
    return k_cache, v_cache, out


def _decode_storing(batch: dict, q, k, v, num_splits: int, decode_config: dict | None, rope=None):
    """The same step with the decode kernel storing K/V itself (DECODE_STORES_KV), and with rope
    normalising and rotating q and k too (DECODE_FUSES_ROPE), over copies of the batch's caches.
    Returns (k_cache, v_cache, out)."""
    from executor_service.attention import triton_kernels as tk
    from helpers.fp8_mma_checks import decode_kernel_launches

    ctx, kv_scales = batch["context"], batch["kv_scales"]
    k_cache, v_cache = batch["k_cache"].clone(), batch["v_cache"].clone()
    out = torch.full_like(q, NAN)
    with decode_flags(True, rope is not None), decode_kernel_launches() as launches:
        if rope is None:
            assert tk.decode_stores_kv(k_cache)
        else:
            assert tk.decode_fuses_rope(k_cache, q.shape[2])
        tk.paged_decode(
            q, k_cache, v_cache, out, ctx.block_tables, ctx.context_lens, ctx.cu_seqlens_q, batch["scale"],
            num_splits, config=decode_config, kv_scales=kv_scales, seq_order=longest_first(ctx.context_lens),
            new_kv=(k, v, ctx.slot_mapping), rope=rope,
        )  # fmt: skip
    # A config asking for TMA_KV takes it wherever its tiles fit the blocks (the fenced path).
    (launch,) = launches
    asked = {**tk.decode_config(k_cache.dtype), **(decode_config or {})}.get("TMA_KV", False)
    want_tma = bool(asked) and tk.tma_kv_applies(k_cache, v_cache, q.shape[2], launch["BLOCK_N"])
    assert launch.get("TMA_KV", False) == want_tma, launch
    return k_cache, v_cache, out


def check_decode_stores_kv(batch: dict, num_splits: int = 1, decode_config: dict | None = None) -> None:
    """A decode step whose K and V the decode kernel stores (paged_decode's new_kv,
    DECODE_STORES_KV) against the store kernel then the decode kernel: the same cache bytes (K and
    V written over stale NaN, a block's first slot zeroing the rest of its V^T rows, every other
    byte untouched, padding rows skipped) and the same output, bit for bit. Under the interpreter
    the programs run one after another, so only the GPU tests can show a race (a split reading the
    token's slots before the split that stores them, or a missing barrier)."""
    from executor_service.fp8 import v_cache_slots

    ctx = batch["context"]
    block_size = batch["k_cache"].shape[1]
    # Stale bytes (NaN) in each decode token's slot, and after it in a block the token starts (a
    # block's earlier owner may leave them; past a mid-block token the cache already holds zeros).
    k_slots = batch["k_cache"].view(torch.uint8)
    v_slots = v_cache_slots(batch["v_cache"]).view(torch.uint8)
    for slot in ctx.slot_mapping[ctx.slot_mapping >= 0].tolist():
        block, offset = divmod(slot, block_size)
        k_slots[block, offset] = 0x7F
        v_slots[block, offset : None if offset == 0 else offset + 1] = 0x7F
    step = (batch, batch["q"], batch["k"], batch["v"], num_splits, decode_config)
    k_a, v_a, out_a = _store_then_decode(*step)
    k_b, v_b, out_b = _decode_storing(*step)
    assert torch.equal(k_b.view(torch.uint8), k_a.view(torch.uint8)), "K cache"
    assert torch.equal(v_b.view(torch.uint8), v_a.view(torch.uint8)), "V cache"
    assert torch.equal(out_b, out_a), "output"
    assert not out_b[: int(ctx.cu_seqlens_q[-1 - batch["num_padding"]])].isnan().any()


def check_decode_new_key_regs(batch: dict, num_splits: int = 1, decode_config: dict | None = None) -> None:
    """DECODE_NEW_KEY_REGS: the decode kernel storing the step's K and V and attending to that key
    from registers, its loop leaving the key out and no barrier before it. Against the store kernel
    then the decode kernel: the same cache bytes; the output within the fp32 reference over those
    bytes and within a rounding step or two of the read-back's (the key's score is taken from q as
    it is, not through the loop's MMA). The stale bytes are a serving cache's: a block the token
    starts holds its earlier owner's (NaN here, K and V), and past a mid-block token a block holds
    zeros (every store zeroes a block's V^T past a token at its first slot) and, in the token's K
    slot, NaN (the loop's K loads stop before it; under the interpreter the store lands first, so
    only the GPU test can show a load that raced it). Contexts of 2 tokens on give the new key up to half
    the weight: left out, or counted twice, it moves the output past either tolerance."""
    from executor_service.attention import torch_ref
    from executor_service.fp8 import v_cache_slots

    ctx = batch["context"]
    block_size = batch["k_cache"].shape[1]
    k_slots = batch["k_cache"].view(torch.uint8)
    v_slots = v_cache_slots(batch["v_cache"]).view(torch.uint8)
    for slot in ctx.slot_mapping[ctx.slot_mapping >= 0].tolist():
        block, offset = divmod(slot, block_size)
        if offset == 0:
            k_slots[block] = 0x7F
            v_slots[block] = 0x7F
        else:
            k_slots[block, offset] = 0x7F
            v_slots[block, offset:] = 0
    step = (batch, batch["q"], batch["k"], batch["v"], num_splits)
    k_a, v_a, out_a = _store_then_decode(*step, decode_config)
    k_b, v_b, out_b = _decode_storing(*step, {**(decode_config or {}), "NEW_KEY_REGS": True})
    assert torch.equal(k_b.view(torch.uint8), k_a.view(torch.uint8)), "K cache"
    assert torch.equal(v_b.view(torch.uint8), v_a.view(torch.uint8)), "V cache"
    n = len(ctx.query_lens_host) - batch["num_padding"]
    real = Context(
        block_tables=ctx.block_tables[:n],
        query_lens_host=ctx.query_lens_host[:n],
        context_lens_host=ctx.context_lens_host[:n],
    )
    rows = sum(real.query_lens_host)
    assert not out_b[:rows].isnan().any(), "NaN in the output: a stale byte reached it"
    ref = torch_ref.paged_attention(
        batch["q"][:rows].float(), k_a, v_a, real, batch["scale"], *batch["kv_scales"]
    )
    tol = 2e-2 if out_b.dtype == torch.bfloat16 else 1e-2
    torch.testing.assert_close(out_b[:rows].float(), ref, atol=tol, rtol=tol)
    torch.testing.assert_close(out_b[:rows].float(), out_a[:rows].float(), atol=tol / 2, rtol=tol / 2)


def check_decode_fuses_rope(
    batch: dict,
    num_splits: int = 1,
    decode_config: dict | None = None,
    with_norm: bool = True,
    exact: bool = True,
    new_key_regs: bool = False,
) -> None:
    """A decode step whose decode kernel also normalises and rotates q and the new K itself
    (DECODE_FUSES_ROPE: paged_decode's rope) against the fused rotary kernel (qk_norm_rope), the
    store kernel and the decode kernel: the same cache bytes and output (exact: bit for bit, as
    under the interpreter, whose sums run in one order; else within a rounding step of the norm's
    sum: on the GPU each kernel sums the squares in its own order). new_key_regs: the rotating
    kernel with DECODE_NEW_KEY_REGS (the step's key from registers), whose output is the read-back's
    within a rounding step or two (exact is then about the K codes alone)."""
    from executor_service.attention import triton_kernels as tk
    from executor_service.layers.rotary import RotaryEmbedding
    from executor_service.layers.triton_ops import qk_norm_rope

    ctx = batch["context"]
    q_raw, k_raw, v = batch["q"], batch["k"], batch["v"]
    num_tokens, num_heads, head_dim = q_raw.shape
    num_kv_heads = k_raw.shape[1]
    device, dtype = q_raw.device, q_raw.dtype
    gen = torch.Generator().manual_seed(3)
    qkv = torch.cat([q_raw.flatten(1), k_raw.flatten(1), v.flatten(1)], dim=1)
    q_raw = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    k_raw = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim].view(
        num_tokens, num_kv_heads, head_dim
    )
    v = qkv[:, (num_heads + num_kv_heads) * head_dim :].view(num_tokens, num_kv_heads, head_dim)
    weights = [(1 + 0.2 * torch.randn(head_dim, generator=gen)).to(dtype).to(device) for _ in range(2)]
    if not with_norm:
        weights = [None, None]
    rotary = RotaryEmbedding(head_dim, 4096, 1_000_000.0).to(device)
    positions = (ctx.context_lens.long() - 1).clamp(min=0)  # a decode token sits at context_len - 1
    eps = 1e-6
    q, k = qk_norm_rope(
        qkv, positions, *weights, rotary.cos_sin_cache, eps, num_heads, num_kv_heads, head_dim
    )
    k_a, v_a, out_a = _store_then_decode(batch, q, k, v, num_splits, decode_config)
    rope = tk.DecodeRope(rotary.cos_sin_cache, *weights, eps)
    config_b = {**(decode_config or {}), "NEW_KEY_REGS": True} if new_key_regs else decode_config
    k_b, v_b, out_b = _decode_storing(batch, q_raw, k_raw, v, num_splits, config_b, rope)
    real = int(ctx.cu_seqlens_q[-1 - batch["num_padding"]])
    assert not out_b[:real].isnan().any()
    assert torch.equal(v_b.view(torch.uint8), v_a.view(torch.uint8)), "V cache"
    if new_key_regs:
        if exact:
            assert torch.equal(k_b.view(torch.uint8), k_a.view(torch.uint8)), "K cache"
        tol = 1e-2 if out_b.dtype == torch.bfloat16 else 5e-3
        torch.testing.assert_close(out_b[:real].float(), out_a[:real].float(), atol=tol, rtol=tol)
    elif exact:
        assert torch.equal(k_b.view(torch.uint8), k_a.view(torch.uint8)), "K cache"
        assert torch.equal(out_b[:real], out_a[:real]), "output"
    else:
        # The written K rows: few codes differ, each by one e4m3 step (the same sign); the rest of
        # the cache is untouched either way.
        keep = ctx.slot_mapping >= 0
        block_size = k_a.shape[1]
        slots = ctx.slot_mapping[keep]
        got = k_b[slots // block_size, slots % block_size].view(torch.uint8).int()
        want = k_a[slots // block_size, slots % block_size].view(torch.uint8).int()
        differ = got != want
        assert ((got - want).abs() <= 1).all(), "K cache: a code more than one e4m3 step away"
        assert differ.float().mean().item() < 0.01, (
            f"K cache: {differ.float().mean().item():.2%} of the new codes differ"
        )
        k_a[slots // block_size, slots % block_size] = k_b[slots // block_size, slots % block_size]
        assert torch.equal(k_b.view(torch.uint8), k_a.view(torch.uint8)), "K cache outside the new slots"
        torch.testing.assert_close(out_b[:real].float(), out_a[:real].float(), atol=2e-2, rtol=2e-2)


def check_layer_fuses_rope(
    qk_norm: bool,
    rope_parameters: dict,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    context_lens: list[int],
    dtype: torch.dtype,
) -> None:
    """SelfAttention.forward on a decode step over an e4m3 cache (Triton backend, fused ops), with
    DECODE_STORES_KV: the fused rotary kernel normalising and rotating q and k, against
    DECODE_FUSES_ROPE, where the layer runs no rotary kernel and the decode kernel does it. The same
    output and cache bytes (under the interpreter, whose sums run in one order), for a family with
    or without q/k norms and any rope_parameters."""
    from executor_service.attention import triton_paged
    from executor_service.attention.triton_paged import TritonPagedBackend
    from executor_service.context import reset_context, set_context
    from executor_service.layers import triton_ops
    from executor_service.layers.rotary import RotaryEmbedding
    from executor_service.layers.self_attention import AttentionOptions, SelfAttention
    from executor_service.model_config import ModelConfig
    from helpers.attention_checks import make_batch

    hidden_size = 64
    config = ModelConfig(
        "Qwen3ForCausalLM", 100, hidden_size, 128, 1, num_heads, num_kv_heads, head_dim, 1e-6, 1e6, 8192,
        False, False, None, rope_parameters=rope_parameters,
    )  # fmt: skip
    torch.manual_seed(0)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        rotary = RotaryEmbedding(head_dim, 8192, rope_parameters or 1e6)
        layer = SelfAttention(config, AttentionOptions(qk_norm=qk_norm), rotary, 0, 1)
    finally:
        torch.set_default_dtype(default_dtype)
    with torch.no_grad():
        for p in layer.parameters():  # weights of 0.2, norm weights around 1
            p.copy_(torch.randn_like(p) * (0.2 if p.dim() > 1 else 0.3) + (0.0 if p.dim() > 1 else 1.0))
    layer.fused = True
    layer.attn.backend = TritonPagedBackend()
    batch = to_fp8(
        make_batch([1] * len(context_lens), context_lens, num_heads, num_kv_heads, head_dim, 16, dtype, "cpu", seed=3,
                   num_padding=2),
        0.05, 2.5,
    )  # fmt: skip
    ctx = batch["context"]
    positions = (ctx.context_lens.long() - 1).clamp(min=0)
    hidden = torch.randn(len(positions), hidden_size, dtype=dtype)
    rotary_calls = []
    qk_norm_rope, num_sms = triton_ops.qk_norm_rope, triton_paged._num_sms
    triton_ops.qk_norm_rope = lambda *a, **k: rotary_calls.append(True) or qk_norm_rope(*a, **k)
    triton_paged._num_sms = lambda device: 132  # (an H200's: the CPU has no device properties)
    results = []
    try:
        for fuse in (False, True):
            layer.attn.k_cache, layer.attn.v_cache = batch["k_cache"].clone(), batch["v_cache"].clone()
            layer.attn.k_scale, layer.attn.v_scale = 0.05, 2.5
            rotary_calls.clear()
            set_context(ctx)
            try:
                with torch.no_grad(), decode_flags(True, fuse):
                    out = layer(positions, hidden)
            finally:
                reset_context()
            results.append((out, layer.attn.k_cache, layer.attn.v_cache, bool(rotary_calls)))
    finally:
        triton_ops.qk_norm_rope, triton_paged._num_sms = qk_norm_rope, num_sms
    (out_a, k_a, v_a, rotated_a), (out_b, k_b, v_b, rotated_b) = results
    real = len(context_lens)
    assert rotated_a and not rotated_b, "the rotary kernel runs only without DECODE_FUSES_ROPE"
    assert torch.equal(k_a.view(torch.uint8), k_b.view(torch.uint8)), "K cache"
    assert torch.equal(v_a.view(torch.uint8), v_b.view(torch.uint8)), "V cache"
    assert torch.equal(out_a[:real], out_b[:real]), "output"
