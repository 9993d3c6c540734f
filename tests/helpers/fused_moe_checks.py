"""Shared by the tests: from test_fused_moe.py."""

from __future__ import annotations

import torch

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
