"""Shared by the tests: from test_triton_ops.py."""

from __future__ import annotations

import os

import torch

from executor_service.layers.activation import SiluAndMul
from executor_service.layers.norm import RMSNorm
from executor_service.layers.rotary import RotaryEmbedding

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, what
    assert not actual.isnan().any(), f"{what}: NaN (an element was not written)"
    if actual.dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5, msg=what)
    else:
        # One rounding step of the dtype: exp/rsqrt differ in their last fp32 bits between Triton
        # and CUDA, which moves a bf16 result by at most one unit in rare elements.
        eps = torch.finfo(actual.dtype).eps
        if INTERPRETED and actual.dtype == torch.bfloat16:  # truncation at each of up to 6 roundings
            torch.testing.assert_close(actual.float(), expected.float(), rtol=8 * eps, atol=2e-2, msg=what)
            return
        torch.testing.assert_close(actual.float(), expected.float(), rtol=2 * eps, atol=1e-3, msg=what)
        mismatched = (actual != expected).float().mean().item()
        assert mismatched < 0.02, f"{what}: {mismatched:.1%} of elements differ from the reference"


def _close_rotated(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Rotary output: where x1 * cos and x2 * sin cancel, one rounding step of those products is
    large against the result, so bf16/fp16 elements are held to two steps of the terms. (On the H200
    19% of bf16 elements differ from the unfused layers' by such a step: the fused kernel's
    intermediate roundings need not fall where PyTorch's do.) A rotation keeps each (x1, x2) pair's length, so the
    terms' size is that of the expected pair."""
    if actual.dtype == torch.float32:
        _close(actual, expected, what)
        return
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, what
    assert not actual.isnan().any(), f"{what}: NaN (an element was not written)"
    half = expected.shape[-1] // 2
    e = expected.float()
    pair = torch.hypot(e[..., :half], e[..., half:])
    pair = torch.cat([pair, pair], dim=-1)
    eps = torch.finfo(actual.dtype).eps * (8 if INTERPRETED and actual.dtype == torch.bfloat16 else 2)
    excess = (actual.float() - e).abs() - eps * pair - 1e-5
    assert (excess <= 0).all(), (
        f"{what}: {int((excess > 0).sum())} elements off by more than {eps:g} of their pair"
    )


def check_rms_norm(num_tokens: int, hidden: int, dtype: torch.dtype, device: str, seed: int = 0) -> None:
    from executor_service.layers.triton_ops import rms_norm

    gen = torch.Generator().manual_seed(seed)
    norm = RMSNorm(hidden, eps=1e-6)
    norm.weight.data = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype)
    norm.to(device)
    # A strided input (a slice of a wider buffer), as the model's views are.
    x = (3 * torch.randn(num_tokens, hidden + 8, generator=gen)).to(dtype).to(device)[:, :hidden]
    residual = torch.randn(num_tokens, hidden, generator=gen).to(dtype).to(device)
    x_before, residual_before = x.clone(), residual.clone()
    _close(rms_norm(x, norm.weight, norm.eps), norm(x), f"rms_norm {dtype} {num_tokens}x{hidden}")
    out, summed = rms_norm(x, norm.weight, norm.eps, residual)
    ref_out, ref_summed = norm(x, residual)
    if not (INTERPRETED and dtype == torch.bfloat16):
        assert torch.equal(summed, ref_summed), "x + residual is one rounding, as torch's"
    _close(out, ref_out, f"add + rms_norm {dtype} {num_tokens}x{hidden}")
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before), "inputs were written"


def check_silu_and_mul(num_tokens: int, size: int, dtype: torch.dtype, device: str, seed: int = 0) -> None:
    from executor_service.layers.triton_ops import silu_and_mul

    gen = torch.Generator().manual_seed(seed)
    x = (4 * torch.randn(num_tokens, 2 * size, generator=gen)).to(dtype).to(device)
    _close(silu_and_mul(x), SiluAndMul()(x), f"silu_and_mul {dtype} {num_tokens}x{size}")


def check_qk_norm_rope(
    num_tokens: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: str,
    seed: int = 0,
    with_norm: bool = True,
    rope: dict | float = 1_000_000.0,
) -> None:
    """Without the norm: rotary alone (Llama, Qwen2, Mistral); `rope` may carry a scaling."""
    from executor_service.layers.triton_ops import qk_norm_rope

    gen = torch.Generator().manual_seed(seed)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = (2 * torch.randn(num_tokens, q_size + 2 * kv_size, generator=gen)).to(dtype).to(device)
    positions = torch.randint(0, 4096, (num_tokens,), generator=gen).to(device)
    q_norm, k_norm = RMSNorm(head_dim, 1e-6), RMSNorm(head_dim, 1e-6)
    for norm in (q_norm, k_norm):
        norm.weight.data = (1 + 0.2 * torch.randn(head_dim, generator=gen)).to(dtype)
        norm.to(device)
    rotary = RotaryEmbedding(head_dim, 4096, rope).to(device)

    q, k, _ = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q, k = q.reshape(-1, num_heads, head_dim), k.reshape(-1, num_kv_heads, head_dim)
    ref_q, ref_k = rotary(positions, q_norm(q), k_norm(k)) if with_norm else rotary(positions, q, k)
    out_q, out_k = qk_norm_rope(
        qkv,
        positions,
        q_norm.weight if with_norm else None,
        k_norm.weight if with_norm else None,
        rotary.cos_sin_cache,
        1e-6,
        num_heads,
        num_kv_heads,
        head_dim,
    )
    what = (
        f"qk_norm_rope (norm {with_norm}) {dtype} {num_tokens} tokens, "
        f"{num_heads}/{num_kv_heads} heads of {head_dim}"
    )
    assert out_q.is_contiguous() and out_k.is_contiguous(), "the attention backends get dense q and k"
    if not with_norm and device == "cuda":
        # Rotary alone is elementwise: each product and sum rounded as layers/rotary.py rounds it.
        # (The interpreter's 16-bit casts are its own, so only the GPU is held to the bit.)
        assert torch.equal(out_q, ref_q), what + " (q): not bit for bit the rotary layer's"
        assert torch.equal(out_k, ref_k), what + " (k): not bit for bit the rotary layer's"
    _close_rotated(out_q, ref_q, what + " (q)")
    _close_rotated(out_k, ref_k, what + " (k)")


def check_qk_norm_rope_stores_kv(
    num_kv_heads: int, head_dim: int, dtype: torch.dtype, kv_dtype: torch.dtype, block_size: int,
    device: str, scales: tuple[float, float] = (1.0, 1.0), with_norm: bool = True,
) -> None:  # fmt: skip
    """qk_norm_rope with the KV cache: the same q and k as without it, and the cache's bytes those of
    the attention backend's store of that k and of qkv's V (torch_ref.store_kv, which the Triton
    store matches byte for byte): a prefill run into a new block (an e4m3 cache zeroes the rest of
    its V slots), decode tokens at a block's first slot and mid-block, a padding row (-1). Every
    cache slot starts as NaN, so that a slot written or zeroed wrongly shows."""
    from executor_service.attention import torch_ref
    from executor_service.fp8 import fp8_v_cache
    from executor_service.layers.triton_ops import qk_norm_rope

    gen = torch.Generator().manual_seed(7)
    num_heads = 2 * num_kv_heads
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    bs = block_size
    slots = [3 * bs + bs - 2, 3 * bs + bs - 1, 7 * bs, 7 * bs + 1, 7 * bs + 2, 9 * bs, 11 * bs + 5, -1]
    num_tokens = len(slots)
    qkv = (2 * torch.randn(num_tokens, q_size + 2 * kv_size, generator=gen)).to(dtype).to(device)
    positions = torch.tensor([30, 31, 32, 33, 34, 16, 5, 0], device=device)
    slot_mapping = torch.tensor(slots, device=device)
    weights = [(1 + 0.2 * torch.randn(head_dim, generator=gen)).to(dtype).to(device) for _ in range(2)]
    rotary = RotaryEmbedding(head_dim, 4096, 1_000_000.0).to(device)
    args = (qkv, positions, *(weights if with_norm else (None, None)), rotary.cos_sin_cache, 1e-6)
    shape = (12, bs, num_kv_heads, head_dim)
    if kv_dtype == torch.float8_e4m3fn:
        k_cache = torch.empty(shape, dtype=torch.uint8, device=device).fill_(0x7F).view(kv_dtype)
        v_cache = fp8_v_cache(torch.empty(shape, dtype=torch.uint8, device=device).fill_(0x7F).view(kv_dtype))
    else:
        k_cache = torch.full(shape, float("nan"), dtype=kv_dtype, device=device)
        v_cache = torch.full(shape, float("nan"), dtype=kv_dtype, device=device)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()

    q, k = qk_norm_rope(*args, num_heads, num_kv_heads, head_dim)
    v = qkv[:, q_size + kv_size :].view(num_tokens, num_kv_heads, head_dim)
    torch_ref.store_kv(k, v, k_ref, v_ref, slot_mapping, *scales)
    q_fused, k_fused = qk_norm_rope(
        *args,
        num_heads,
        num_kv_heads,
        head_dim,
        kv_cache=(k_cache, v_cache, slot_mapping, *scales),
    )
    what = f"qk_norm_rope storing KV ({dtype} into {kv_dtype}, block size {bs}, scales {scales})"
    assert torch.equal(q_fused, q) and torch.equal(k_fused, k), what + ": q / k changed"
    bits = torch.uint8 if kv_dtype == torch.float8_e4m3fn else torch.int16
    assert torch.equal(k_cache.view(bits), k_ref.view(bits)), what + ": K cache"
    assert torch.equal(v_cache.view(bits), v_ref.view(bits)), what + ": V cache"


def check_fused_quantization(
    num_tokens: int, size: int, dtype: torch.dtype, device: str, seed: int = 0
) -> None:
    """rms_norm (with and without a residual) and silu_and_mul quantizing their output for an fp8
    GEMM: the same e4m3 bytes and scales as quantize_per_token_group of the unfused output, in both
    layouts (rows multiple 1: the Triton GEMM's; 4: torch._scaled_mm's, padding rows zero of scale 1),
    and the residual sum as unfused."""
    from executor_service.layers.fp8_gemm_triton import quantize_per_token_group
    from executor_service.layers.triton_ops import rms_norm, silu_and_mul

    gen = torch.Generator().manual_seed(seed)
    weight = (1 + 0.1 * torch.randn(size, generator=gen)).to(dtype).to(device)
    x = (3 * torch.randn(num_tokens, size + 8, generator=gen)).to(dtype).to(device)[:, :size]
    x[0, :7] = 0  # a row whose first group holds zeros
    residual = torch.randn(num_tokens, size, generator=gen).to(dtype).to(device)
    gate_up = (4 * torch.randn(num_tokens, 2 * size, generator=gen)).to(dtype).to(device)
    gate_up[-1, : size // 2] = 0  # gate zero in a row's first groups: a zero scale's floor
    for rows_multiple in (1, 4):
        cases = [
            ("rms_norm", rms_norm(x, weight, 1e-6), rms_norm(x, weight, 1e-6, None, rows_multiple), None),
            ("silu_and_mul", silu_and_mul(gate_up), silu_and_mul(gate_up, rows_multiple), None),
        ]
        out, summed = rms_norm(x, weight, 1e-6, residual)
        fused, fused_summed = rms_norm(x, weight, 1e-6, residual, rows_multiple)
        cases.append(("add + rms_norm", out, fused, (summed, fused_summed)))
        for what, unfused, got, sums in cases:
            what = f"{what} quantized {dtype} {num_tokens}x{size}, rows multiple {rows_multiple}"
            want_q, want_s = quantize_per_token_group(unfused, rows_multiple)
            assert got.rows == num_tokens and got.rows_multiple == rows_multiple and got.dtype == dtype, what
            assert got.q.shape == want_q.shape and got.scales.shape == want_s.shape, what
            assert got.scales.stride() == want_s.stride(), f"{what}: the scales' layout"
            assert torch.equal(got.q.view(torch.uint8), want_q.view(torch.uint8)), f"{what}: the e4m3 bytes"
            assert torch.equal(got.scales, want_s), f"{what}: the scales"
            if rows_multiple > 1 and got.q.shape[0] > num_tokens:
                assert not got.q[num_tokens:].view(torch.uint8).any(), f"{what}: padding rows"
                assert (got.scales[num_tokens:] == 1).all(), f"{what}: padding rows' scales"
            if sums is not None:
                assert torch.equal(sums[1], sums[0]), f"{what}: x + residual"
