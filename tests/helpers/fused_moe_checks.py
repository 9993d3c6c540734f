"""Shared by the tests: from test_fused_moe.py."""

from __future__ import annotations

import torch
import torch.nn.functional as F

LOADS = [(1, None), (2, None), (5, 3), (16, None), (33, 1), (64, None), (130, 5)]


def make_moe(
    num_tokens: int, num_experts: int, top_k: int, hidden: int, n: int, dtype, device, used=None, seed=0
):
    """Activations, packed weights and a routing that sends tokens only to `used` experts (drawn on
    the device: the H200 shapes' weights are 2.4 GB)."""
    gen = torch.Generator(device).manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen, device=device).to(dtype)
    w13 = (torch.randn(num_experts, 2 * n, hidden, generator=gen, device=device) / hidden**0.5).to(dtype)
    w2 = (torch.randn(num_experts, hidden, n, generator=gen, device=device) / n**0.5).to(dtype)
    used = used or num_experts
    pool = torch.randperm(num_experts, generator=gen, device=device)[: max(used, top_k)]
    choice = torch.stack(
        [torch.randperm(len(pool), generator=gen, device=device)[:top_k] for _ in range(num_tokens)]
    )
    topk_ids = pool[choice]
    topk_weights = torch.rand(num_tokens, top_k, generator=gen, device=device).softmax(-1).to(dtype)
    return x, w13, w2, topk_weights, topk_ids


def check_fused_moe(num_tokens, num_experts, top_k, hidden, n, dtype, device, used=None, config=None):
    from executor_service.layers.fused_moe_triton import fused_experts
    from executor_service.layers.moe import experts_reference

    x, w13, w2, weights, ids = make_moe(num_tokens, num_experts, top_k, hidden, n, dtype, device, used)
    got = fused_experts(x, w13, w2, weights, ids, config)
    ref = experts_reference(x.float(), w13.float(), w2.float(), weights.float(), ids)
    tol = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 4e-2}[dtype]
    what = f"fused_experts {dtype} {num_tokens} tokens, {num_experts} experts ({used or 'all'} used)"
    torch.testing.assert_close(got.float(), ref, atol=tol, rtol=tol, msg=lambda m: f"{what}: {m}")


# -- fp8 experts ------------------------------------------------------------------------------


def quantize_experts(w13: torch.Tensor, w2: torch.Tensor):
    """Packed experts -> (e4m3 w13, w13_scale, e4m3 w2, w2_scale) as the loader places an fp8
    checkpoint's: gate and up quantized as separate tensors, so the up rows' blocks start after the
    gate rows' ceil(N / 128)."""
    from executor_service.fp8 import quantize_weight_blocks

    n = w13.shape[1] // 2
    q13, s13, q2, s2 = [], [], [], []
    for e in range(w13.shape[0]):
        (gq, gs), (uq, us) = quantize_weight_blocks(w13[e, :n]), quantize_weight_blocks(w13[e, n:])
        q13.append(torch.cat([gq, uq]))
        s13.append(torch.cat([gs, us]))
        dq, ds = quantize_weight_blocks(w2[e])
        q2.append(dq)
        s2.append(ds)
    return torch.stack(q13), torch.stack(s13), torch.stack(q2), torch.stack(s2)


def dequantize_experts(w13_q, w13_s, w2_q, w2_s) -> tuple[torch.Tensor, torch.Tensor]:
    """-> fp32 (w13, w2) of e4m3 experts and their block scales (quantize_experts' layout)."""
    from executor_service.fp8 import dequantize_weight_blocks

    n, nb = w13_q.shape[1] // 2, w13_s.shape[1] // 2
    w13 = torch.stack([
        torch.cat([dequantize_weight_blocks(q[:n], s[:nb], torch.float32),
                   dequantize_weight_blocks(q[n:], s[nb:], torch.float32)])
        for q, s in zip(w13_q, w13_s, strict=True)
    ])  # fmt: skip
    w2 = torch.stack([dequantize_weight_blocks(q, s, torch.float32) for q, s in zip(w2_q, w2_s, strict=True)])
    return w13, w2


def _w8a8_rows(x: torch.Tensor) -> torch.Tensor:
    """x quantized per row in groups of 128 as the kernels do, then dequantized (fp32)."""
    from helpers.fp8_gemm_checks import reference_quantize

    q, s = reference_quantize(x)
    return q.float() * s.repeat_interleave(128, 1)[:, : x.shape[1]]


def reference_fp8_gate_up(x, w13, topk_ids) -> torch.Tensor:
    """[num_pairs, N] silu(gate) * up in x's dtype: x quantized per token, w13 the dequantized experts
    (fp32), fp32 math rounded where the kernel rounds."""
    dtype, top_k, flat = x.dtype, topk_ids.shape[1], topk_ids.flatten()
    a = _w8a8_rows(x)
    out = torch.empty(flat.numel(), w13.shape[1] // 2, dtype=dtype, device=x.device)
    for expert in torch.unique(flat).tolist():
        pairs = torch.where(flat == expert)[0]
        gate, up = (a[pairs // top_k] @ w13[expert].T).to(dtype).float().chunk(2, dim=-1)
        out[pairs] = (F.silu(gate).to(dtype).float() * up).to(dtype)
    return out


def reference_fp8_down(intermediate, w2, topk_weights, topk_ids) -> torch.Tensor:
    """[num_pairs, hidden] in the intermediate's dtype: it quantized per pair, w2 the dequantized
    experts (fp32), times each pair's routing weight."""
    dtype, flat = intermediate.dtype, topk_ids.flatten()
    a = _w8a8_rows(intermediate)
    weights = topk_weights.reshape(-1, 1).float()
    out = torch.empty(flat.numel(), w2.shape[1], dtype=dtype, device=a.device)
    for expert in torch.unique(flat).tolist():
        pairs = torch.where(flat == expert)[0]
        out[pairs] = ((a[pairs] @ w2[expert].T).to(dtype).float() * weights[pairs]).to(dtype)
    return out


def reference_fp8_experts(x, w13_q, w13_s, w2_q, w2_s, topk_weights, topk_ids) -> torch.Tensor:
    """The fp8 experts in torch (fused_experts with scales, in another summation order)."""
    w13, w2 = dequantize_experts(w13_q, w13_s, w2_q, w2_s)
    y = reference_fp8_down(reference_fp8_gate_up(x, w13, topk_ids), w2, topk_weights, topk_ids)
    return y.float().view(*topk_ids.shape, -1).sum(1).to(x.dtype)


def check_fused_moe_fp8(num_tokens, num_experts, top_k, hidden, n, dtype, device, used=None, config=None):
    """The W8A8 expert GEMMs against reference_fp8_*: gate/up on the same tokens, down on the kernel's
    own intermediate (so a value on an e4m3 rounding boundary cannot flip between the two), the whole
    of fused_experts equal to its parts; and fp8 against the unquantized experts (what fp8 costs).
    Weights vary by orders of magnitude between blocks, so a wrong block scale shows."""
    from executor_service.layers import fused_moe_triton as k
    from executor_service.layers.moe import experts_reference

    x, w13, w2, weights, ids = make_moe(
        num_tokens, num_experts, top_k, hidden, n, torch.float32, device, used
    )
    x, weights = x.to(dtype), weights.to(dtype)
    gen = torch.Generator().manual_seed(n)
    w13 = w13 * torch.logspace(-1, 1, 2 * n)[torch.randperm(2 * n, generator=gen)].to(device)[:, None]
    w2 = w2 * torch.logspace(-1, 1, n)[torch.randperm(n, generator=gen)].to(device)[None, :]
    w13_q, w13_s, w2_q, w2_s = quantize_experts(w13, w2)
    gate_up_config, down_config = config or k.get_config(num_tokens, fp8=True)
    what = f"fp8 experts {dtype} {num_tokens} tokens, {num_experts} experts ({used or 'all'} used), N {n}"
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]

    def close(got, want, part):
        scale = want.float().abs().max().item()
        torch.testing.assert_close(got.float(), want.float(), atol=tol * scale, rtol=tol,
                                   msg=lambda m: f"{what}, {part}: {m}")  # fmt: skip

    deq13, deq2 = dequantize_experts(w13_q, w13_s, w2_q, w2_s)
    aligned = k.align_block_size(ids, num_experts, gate_up_config.BLOCK_M)
    inter = k.gate_up(x, w13_q, aligned, top_k, gate_up_config, w13_s)
    close(inter, reference_fp8_gate_up(x, deq13, ids), "gate/up")
    pairs = k.down(inter, w2_q, weights, aligned, down_config, w2_s)
    close(pairs, reference_fp8_down(inter, deq2, weights, ids), "down")
    got = k.fused_experts(x, w13_q, w2_q, weights, ids, (gate_up_config, down_config), w13_s, w2_s)
    torch.testing.assert_close(got, k.sum_topk(pairs, top_k), atol=0, rtol=0)
    exact = experts_reference(x.float(), w13.float(), w2.float(), weights.float(), ids)
    rel = ((got.float() - exact).norm() / exact.norm()).item()
    assert rel < 0.1, f"{what}: fp8 experts off the unquantized ones by {rel:.3g}"


def check_fp8_moe_layer(device: str, tp_size: int = 2) -> None:
    """FusedMoE in fp8 as the loader fills it (each rank its blocks of every expert's gate, up and
    down), fused: each rank's output is the torch W8A8 math on its slice, and the ranks' outputs sum
    to the W8A8 experts' of the whole intermediate dimension (the all-reduce of a TP group)."""
    from executor_service.fp8 import quantize_weight_blocks
    from executor_service.layers.moe import FusedMoE

    num_experts, top_k, hidden, inter = 4, 2, 192, 256
    x, w13, w2, weights, ids = make_moe(9, num_experts, top_k, hidden, inter, torch.float32, device)
    gate_up = [
        (quantize_weight_blocks(w13[e, :inter]), quantize_weight_blocks(w13[e, inter:]))
        for e in range(num_experts)
    ]
    downs = [quantize_weight_blocks(w2[e]) for e in range(num_experts)]
    outs = []
    for rank in range(tp_size):
        with torch.device(device):
            layer = FusedMoE(num_experts, top_k, hidden, inter, tp_rank=rank, tp_size=tp_size)
        layer.to_fp8((128, 128))
        layer.fused = True
        for e, ((gq, gs), (uq, us)) in enumerate(gate_up):
            for part, (q, s) in enumerate(((gq, gs), (uq, us), downs[e])):
                layer.weight_loader(layer.w13_weight if part < 2 else layer.w2_weight, q, (e, part))
                scale = layer.w13_weight_scale_inv if part < 2 else layer.w2_weight_scale_inv
                layer.weight_loader(scale, s, (e, part))
        layer.tp_size = 1  # the sum over ranks below stands for the all-reduce
        got = layer(x, weights, ids)
        want = reference_fp8_experts(
            x,
            layer.w13_weight,
            layer.w13_weight_scale_inv,
            layer.w2_weight,
            layer.w2_weight_scale_inv,
            weights,
            ids,
        )
        torch.testing.assert_close(got, want, atol=1e-4 * want.abs().max().item(), rtol=1e-4)
        outs.append(got)
    w13_q = torch.stack([torch.cat([gq, uq]) for (gq, _), (uq, _) in gate_up])
    w13_s = torch.stack([torch.cat([gs, us]) for (_, gs), (_, us) in gate_up])
    w2_q, w2_s = torch.stack([q for q, _ in downs]), torch.stack([s for _, s in downs])
    whole = reference_fp8_experts(x, w13_q, w13_s, w2_q, w2_s, weights, ids)
    torch.testing.assert_close(sum(outs), whole, atol=1e-4 * whole.abs().max().item(), rtol=1e-4)
