"""Shared by the tests: from test_fp8_gemm.py."""

from __future__ import annotations

import pytest
import torch

from executor_service.fp8 import FP8_DTYPE, FP8_MAX, dequantize_weight_blocks, quantize_weight_blocks


def reference_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token, per group of 128 columns: scale = amax / 448, q = e4m3(x / scale)."""
    m, k = x.shape
    groups = -(-k // 128)
    padded = torch.zeros(m, groups * 128, dtype=torch.float32, device=x.device)
    padded[:, :k] = x.float()
    g = padded.view(m, groups, 128)
    amax = g.abs().amax(-1).clamp(min=1e-10)
    # A tensor divisor: CUDA divides by a Python scalar as a multiply by its reciprocal (an ulp off
    # the kernel's correctly rounded division); tensor by tensor is IEEE division on every device.
    scale = amax / torch.full_like(amax, FP8_MAX)
    q = (g / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(m, -1)[:, :k], scale


def check_quantize(m: int, k: int, dtype: torch.dtype, device: str) -> None:
    from executor_service.layers.fp8_gemm_triton import quantize_per_token_group

    gen = torch.Generator().manual_seed(m * 31 + k)
    x = (torch.randn(m, k, generator=gen) * torch.logspace(-2, 2, k)).to(dtype).to(device)
    ref_q, ref_s = reference_quantize(x)
    # The default grid, then 2 and 4 groups a program: a row's groups split between programs, and
    # programs past the last group (masked loads, scales not stored).
    for per in (None, 2, 4):
        q, s = quantize_per_token_group(x, per_program=per)
        assert torch.equal(s, ref_s), f"scales differ at {per} groups a program"
        assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)), f"values differ at {per}"
    # torch._scaled_mm's layout: rows padded to a multiple of 4 (zeros of scale 1), scales column-major.
    q4, s4 = quantize_per_token_group(x, rows_multiple=4)
    pad = -m % 4
    assert q4.shape == (m + pad, k) and s4.shape == (m + pad, s.shape[1]) and s4.stride(0) == 1
    assert torch.equal(s4[:m], ref_s) and torch.equal(q4[:m].view(torch.uint8), ref_q.view(torch.uint8))
    assert (s4[m:] == 1).all() and (q4[m:].float() == 0).all()


def check_gemm(m: int, n: int, k: int, dtype: torch.dtype, device: str, config: dict | None = None) -> float:
    """The fp8 linear against fp32 math on the dequantized activations and weights; returns the
    relative error against the unquantized GEMM (what fp8 costs, for the bench)."""
    from executor_service.layers.fp8_gemm_triton import fp8_linear, w8a8_block_matmul

    gen = torch.Generator().manual_seed(m + n + k)
    x = torch.randn(m, k, generator=gen).to(dtype).to(device)
    w = (torch.randn(n, k, generator=gen) * 0.05).to(device)
    w_q, w_s = quantize_weight_blocks(w)
    a_q, a_s = reference_quantize(x)
    out = w8a8_block_matmul(a_q, a_s, w_q, w_s, dtype, config)
    ref = _dequantize_rows(a_q, a_s) @ dequantize_weight_blocks(w_q, w_s, torch.float32).T
    tol = 1e-2 if dtype != torch.float32 else 1e-4
    torch.testing.assert_close(out.float(), ref, atol=tol * ref.abs().max().item(), rtol=tol)
    from executor_service.layers.fp8_gemm_triton import gemm_config, scaled_mm_applies

    split = {**gemm_config(m, n, k), **(config or {})}.get("SPLIT_K", 1)
    if (
        split == 1 and config is None and not scaled_mm_applies(m, n, k, dtype, x.device)
    ):  # the same sums in the same order
        torch.testing.assert_close(fp8_linear(x, w_q, w_s), out, atol=0, rtol=0)
    else:  # other tiles, atomic adds of split-K in any order, or torch._scaled_mm's GEMM
        torch.testing.assert_close(
            fp8_linear(x, w_q, w_s).float(), out.float(), atol=tol * ref.abs().max().item(), rtol=tol
        )
    exact = x.float() @ w.float().T
    return ((out.float() - exact).norm() / exact.norm()).item()


def check_swap_gemm(m: int, n: int, k: int, dtype: torch.dtype, device: str, config: dict) -> None:
    """The swap kernel (tokens as the wgmma's narrow side; split-K summed in the kernel by each
    tile's last split): within rounding of the dequantized math (check_gemm), the same bits when run
    again (the splits summed in split order, not in atomic adds' order), its tile counters back at
    zero for the next GEMM, and the v2 kernel's sums at the same tiles (to the bit on the CPU, where
    both run numpy's dot; within rounding on a GPU)."""
    from executor_service.layers import fp8_gemm_triton as g

    check_gemm(m, n, k, dtype, device, config)
    gen = torch.Generator().manual_seed(7 * m + n + k)
    a_q, a_s = reference_quantize((torch.randn(m, k, generator=gen) * 3).to(dtype).to(device))
    a_q = a_q.contiguous()
    w_q, w_s = quantize_weight_blocks((torch.randn(n, k, generator=gen) * 0.05).to(device))
    first = g.w8a8_block_matmul(a_q, a_s, w_q, w_s, dtype, config)
    assert torch.equal(first, g.w8a8_block_matmul(a_q, a_s, w_q, w_s, dtype, config)), "not reproducible"
    if config.get("SPLIT_K", 1) > 1:
        assert not g.tile_counters(first.device).any(), "a tile's counter was left raised"
    v2_tiles = {**config, "KERNEL": "v2", "SPLIT_K": 1, "BLOCK_M": max(16, min(config["BLOCK_M"], 64))}
    v2 = g.w8a8_block_matmul(a_q, a_s, w_q, w_s, dtype, v2_tiles)
    if device == "cpu" and config.get("SPLIT_K", 1) == 1:
        assert torch.equal(first, v2), "the swap kernel's sums differ from v2's"
    else:
        tol = 1e-2 if dtype != torch.float32 else 1e-5
        torch.testing.assert_close(first.float(), v2.float(), atol=tol * v2.abs().max().item(), rtol=tol)


def check_split_k_in_kernel(m: int, n: int, k: int, dtype: torch.dtype, device: str, config: dict) -> None:
    """A v1 or v2 split-K GEMM summing its splits in the kernel (SUM_IN_KERNEL: each tile's last
    split adds the others' fp32 sums in split order): within rounding of the dequantized math
    (check_gemm), the same bits when run again, its tile counters back at zero, and the atomic adds'
    result (in fp32 on the CPU to the bit, where the interpreter adds the splits in split order too;
    into 16 bits the interpreter's cast is not torch's copy's, and on a GPU the adds' order varies:
    within rounding)."""
    from executor_service.layers import fp8_gemm_triton as g

    config = {**config, "SUM_IN_KERNEL": True}
    check_gemm(m, n, k, dtype, device, config)
    gen = torch.Generator().manual_seed(5 * m + n + k)
    a_q, a_s = reference_quantize((torch.randn(m, k, generator=gen) * 3).to(dtype).to(device))
    w_q, w_s = quantize_weight_blocks((torch.randn(n, k, generator=gen) * 0.05).to(device))
    first = g.w8a8_block_matmul(a_q, a_s, w_q, w_s, dtype, config)
    assert torch.equal(first, g.w8a8_block_matmul(a_q, a_s, w_q, w_s, dtype, config)), "not reproducible"
    assert not g.tile_counters(first.device).any(), "a tile's counter was left raised"
    atomic = g.w8a8_block_matmul(a_q, a_s, w_q, w_s, dtype, {**config, "SUM_IN_KERNEL": False})
    if device == "cpu" and dtype == torch.float32:
        assert torch.equal(first, atomic), "the in-kernel sums differ from the atomic adds'"
    else:
        tol = 1e-2 if dtype != torch.float32 else 1e-5
        torch.testing.assert_close(
            first.float(), atomic.float(), atol=tol * atomic.abs().max().item(), rtol=tol
        )


def reference_fp8_linear(x, weight: torch.Tensor, weight_scale_inv: torch.Tensor) -> torch.Tensor:
    """The W8A8 linear in torch: the activations quantized as the kernel does (or, an Fp8Input, as
    the fused op before already did), then fp32 math on the dequantized operands, cast to x's dtype
    (what fp8_linear computes, in another summation order)."""
    from executor_service.layers.fp8_gemm_triton import Fp8Input

    if isinstance(x, Fp8Input):
        a = _dequantize_rows(x.q[: x.rows], x.scales[: x.rows])
        return (a @ dequantize_weight_blocks(weight, weight_scale_inv, torch.float32).T).to(x.dtype)
    shape = x.shape
    a_q, a_s = reference_quantize(x.reshape(-1, shape[-1]))
    out = _dequantize_rows(a_q, a_s) @ dequantize_weight_blocks(weight, weight_scale_inv, torch.float32).T
    return out.to(x.dtype).view(*shape[:-1], weight.shape[0])


def _dequantize_rows(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return q.float() * s.repeat_interleave(128, 1)[:, : q.shape[1]]


def check_fp8_linear_layers(device: str) -> None:
    """Packed q/k/v with e4m3 weights: the loaders place each shard's weight and block scales, the
    forward is the W8A8 GEMM; a row-parallel rank reads its blocks of columns; a shard that would
    split a block is refused."""
    from executor_service.layers.linear import QKVParallelLinear, RowParallelLinear

    gen = torch.Generator().manual_seed(0)
    with torch.device(device):
        qkv = QKVParallelLinear(256, 64, 4, 2)
    qkv.to_fp8((128, 128))
    dequantized = []
    for shard, rows in (("q", 256), ("k", 128), ("v", 128)):
        q, scale_inv = quantize_weight_blocks(torch.randn(rows, 256, generator=gen))
        qkv.weight_loader(qkv.weight, q, shard)
        qkv.weight_loader(qkv.weight_scale_inv, scale_inv, shard)
        dequantized.append(dequantize_weight_blocks(q, scale_inv, torch.float32))
    x = torch.randn(5, 256, generator=gen).to(device)
    ref = _dequantize_rows(*reference_quantize(x)) @ torch.cat(dequantized).to(device).T
    torch.testing.assert_close(qkv(x), ref, atol=1e-3, rtol=1e-4)

    with pytest.raises(ValueError, match="columns of 64 would split the fp8 checkpoint's blocks of 128"):
        RowParallelLinear(256, 128, tp_rank=0, tp_size=4).to_fp8((128, 128))
    with torch.device(device):
        row = RowParallelLinear(512, 128, tp_rank=1, tp_size=2)
    row.to_fp8((128, 128))
    q, scale_inv = quantize_weight_blocks(torch.randn(128, 512, generator=gen))
    row.weight_loader(row.weight, q)
    row.weight_loader(row.weight_scale_inv, scale_inv)
    assert torch.equal(row.weight_scale_inv.cpu(), scale_inv[:, 2:4])
    assert torch.equal(row.weight.cpu().view(torch.uint8), q[:, 256:].view(torch.uint8))


def check_fp8_linear_quantized_input(m: int, n: int, k: int, dtype: torch.dtype, device: str) -> int:
    """fp8_linear of an activation already quantized (an Fp8Input, in the layout
    fp8_input_rows_multiple gives for m tokens) is fp8_linear of the activation itself: to the bit
    where the GEMM is deterministic, within a rounding of the dtype where it splits K over atomic
    fp32 adds (m <= 64 on the GPU), whose order varies from run to run. The op before quantizing
    changes where the quantization runs, not the result. Returns the rows multiple used (4:
    torch._scaled_mm, 1: the Triton GEMM)."""
    from executor_service.layers.fp8_gemm_triton import (
        Fp8Input,
        fp8_input_rows_multiple,
        fp8_linear,
        gemm_config,
        quantize_per_token_group,
    )

    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=gen).to(dtype).to(device)
    weight, scale_inv = (t.to(device) for t in quantize_weight_blocks(torch.randn(n, k, generator=gen)))
    rows = fp8_input_rows_multiple(m, n, k, dtype, weight.device)
    got = fp8_linear(Fp8Input(*quantize_per_token_group(x, rows), m, rows, dtype), weight, scale_inv)
    want = fp8_linear(x, weight, scale_inv)
    assert got.shape == want.shape == (m, n) and got.dtype == dtype, (got.shape, got.dtype)
    what = f"{m}x{n}x{k} {dtype}, rows multiple {rows}: differs from fp8_linear(x)"
    if gemm_config(m, n, k).get("SPLIT_K", 1) > 1 and device != "cpu":
        eps = torch.finfo(dtype).eps
        torch.testing.assert_close(
            got.float(), want.float(), rtol=eps, atol=eps * want.abs().max().item(), msg=what
        )
    else:
        assert torch.equal(got, want), what
    return rows
