"""Shared by the tests: from test_triton_kernels.py."""

from __future__ import annotations

import math
import random

import torch

from executor_service.context import Context

NAN = float("nan")


def make_batch(
    query_lens: list[int],
    context_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: str,
    seed: int = 0,
    num_padding: int = 0,
) -> dict:
    """A step of a mixed batch: sequence i computes its last query_lens[i] of context_lens[i] positions;
    the earlier positions are already in the cache (a prefix hit or earlier chunks). `num_padding`
    CUDA-graph padding rows follow: query length 1, context length 0, slot -1, block table of -1.
    Unused cache slots hold NaN."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [math.ceil(c / block_size) for c in context_lens]
    num_blocks = sum(blocks_per_seq) + 3
    ids = list(range(num_blocks))
    rng.shuffle(ids)  # scattered, non-monotonic block tables
    tables, slots = [], []
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, NAN, dtype=dtype)
    v_cache = torch.full(shape, NAN, dtype=dtype)
    for n, c, nb in zip(query_lens, context_lens, blocks_per_seq, strict=True):
        table, ids = ids[:nb], ids[nb:]
        tables.append(table)
        for pos in range(c):
            slot = table[pos // block_size] * block_size + pos % block_size
            if pos < c - n:  # cached prefix
                k_cache.view(-1, num_kv_heads, head_dim)[slot] = torch.randn(
                    num_kv_heads, head_dim, generator=gen
                )
                v_cache.view(-1, num_kv_heads, head_dim)[slot] = torch.randn(
                    num_kv_heads, head_dim, generator=gen
                )
            else:
                slots.append(slot)
    query_lens = list(query_lens) + [1] * num_padding
    context_lens = list(context_lens) + [0] * num_padding
    tables += [[] for _ in range(num_padding)]
    slots += [-1] * num_padding
    num_tokens = sum(query_lens)
    width = max(max(map(len, tables)), 1)
    cu_q = [0]
    for n in query_lens:
        cu_q.append(cu_q[-1] + n)
    cu_k = [0]
    for c in context_lens:
        cu_k.append(cu_k[-1] + c)

    def dev(t):
        return t.to(device)

    context = Context(
        slot_mapping=dev(torch.tensor(slots, dtype=torch.long)),
        block_tables=dev(torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.int32)),
        context_lens=dev(torch.tensor(context_lens, dtype=torch.int32)),
        cu_seqlens_q=dev(torch.tensor(cu_q, dtype=torch.int32)),
        cu_seqlens_k=dev(torch.tensor(cu_k, dtype=torch.int32)),
        max_seqlen_q=max(query_lens),
        max_seqlen_k=max(context_lens),
        query_lens_host=query_lens,
        context_lens_host=context_lens,
    )
    # k and v as strided views of one qkv tensor, like the model's split.
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = dev(torch.randn(num_tokens, q_size + 2 * kv_size, generator=gen).to(dtype))
    return {
        "q": qkv[:, :q_size].reshape(num_tokens, num_heads, head_dim).contiguous(),
        "k": qkv[:, q_size : q_size + kv_size].view(num_tokens, num_kv_heads, head_dim),
        "v": qkv[:, q_size + kv_size :].view(num_tokens, num_kv_heads, head_dim),
        "k_cache": dev(k_cache),
        "v_cache": dev(v_cache),
        "context": context,
        "scale": head_dim**-0.5,
        "num_padding": num_padding,
    }


def reference(batch: dict) -> torch.Tensor:
    """torch_ref in fp32 over the caches after the store, for the rows that are not padding."""
    from executor_service.attention import torch_ref

    ctx, pad = batch["context"], batch["num_padding"]
    k_cache, v_cache = batch["k_cache"].float().clone(), batch["v_cache"].float().clone()
    torch_ref.store_kv(batch["k"].float(), batch["v"].float(), k_cache, v_cache, ctx.slot_mapping)
    n = len(ctx.query_lens_host) - pad
    real = Context(
        block_tables=ctx.block_tables[:n],
        query_lens_host=ctx.query_lens_host[:n],
        context_lens_host=ctx.context_lens_host[:n],
    )
    num_tokens = sum(real.query_lens_host)
    return torch_ref.paged_attention(batch["q"][:num_tokens].float(), k_cache, v_cache, real, batch["scale"])


def assert_matches(out: torch.Tensor, batch: dict, ref: torch.Tensor) -> None:
    """`out` matches the reference within bf16/fp16 tolerance; padding rows are zeros."""
    num_real = ref.shape[0]
    assert not out[:num_real].isnan().any(), "unwritten or NaN output rows"
    tol = 2e-2 if out.dtype == torch.bfloat16 else 1e-2
    torch.testing.assert_close(out[:num_real].float(), ref, atol=tol, rtol=tol)
    rel = (out[:num_real].float() - ref).norm() / ref.norm().clamp_min(1e-6)
    assert rel < tol, f"relative error {rel:.3g}"
    assert (out[num_real:] == 0).all(), "padding rows (context length 0) must be zeros"


def check_store(batch: dict) -> None:
    from executor_service.attention import triton_kernels

    ctx = batch["context"]
    k_cache, v_cache = batch["k_cache"], batch["v_cache"]
    before_k, before_v = k_cache.clone(), v_cache.clone()
    triton_kernels.store_kv(batch["k"], batch["v"], k_cache, v_cache, ctx.slot_mapping)
    flat_k = k_cache.view(-1, *k_cache.shape[2:])
    flat_v = v_cache.view(-1, *v_cache.shape[2:])
    keep = ctx.slot_mapping >= 0
    slots = ctx.slot_mapping[keep]
    assert torch.equal(flat_k[slots], batch["k"][keep])
    assert torch.equal(flat_v[slots], batch["v"][keep])
    untouched = torch.ones(flat_k.shape[0], dtype=torch.bool, device=flat_k.device)
    untouched[slots] = False
    # Everything else, the last slot included (where slot -1 would land), is as before: NaN or prefix.
    same_k = before_k.view_as(flat_k)[untouched].nan_to_num(7.0) == flat_k[untouched].nan_to_num(7.0)
    same_v = before_v.view_as(flat_v)[untouched].nan_to_num(7.0) == flat_v[untouched].nan_to_num(7.0)
    assert same_k.all() and same_v.all()


def check_decode(batch: dict, num_splits: int) -> None:
    from executor_service.attention import triton_kernels as tk

    ref = reference(batch)
    ctx = batch["context"]
    tk.store_kv(batch["k"], batch["v"], batch["k_cache"], batch["v_cache"], ctx.slot_mapping)
    meta = (ctx.block_tables, ctx.context_lens, ctx.cu_seqlens_q)
    # In the batch's order, then with the programs taking the longest contexts first (and, in
    # reverse, the shortest: any permutation gives every sequence its own output).
    for order in (None, longest_first(ctx.context_lens), longest_first(ctx.context_lens).flip(0)):
        out = torch.full_like(batch["q"], NAN)
        tk.paged_decode(
            batch["q"], batch["k_cache"], batch["v_cache"], out, *meta, batch["scale"],
            num_splits=num_splits, seq_order=order,
        )  # fmt: skip
        assert_matches(out, batch, ref)


def longest_first(context_lens: torch.Tensor) -> torch.Tensor:
    """Context.seq_order of these lengths (batch.prepare_batch's order)."""
    return torch.argsort(context_lens, descending=True, stable=True).to(torch.int32)


def check_prefill(batch: dict, num_splits: int = 1, config: dict | None = None) -> None:
    """Prefix hits / chunks; with decode rows in the batch, they go to the decode kernel (rows 1 / 2)."""
    from executor_service.attention import triton_kernels as tk

    ref = reference(batch)
    ctx = batch["context"]
    tk.store_kv(batch["k"], batch["v"], batch["k_cache"], batch["v_cache"], ctx.slot_mapping)
    out = torch.full_like(batch["q"], NAN)
    meta = (ctx.block_tables, ctx.context_lens, ctx.cu_seqlens_q)
    has_decode = 1 in ctx.query_lens_host
    if has_decode:
        tk.paged_decode(
            batch["q"], batch["k_cache"], batch["v_cache"], out, *meta, batch["scale"], num_splits, rows=1,
            seq_order=longest_first(ctx.context_lens),
        )  # fmt: skip
    tk.paged_prefill(
        batch["q"], batch["k_cache"], batch["v_cache"], out, *meta, ctx.max_seqlen_q, batch["scale"],
        rows=2 if has_decode else 0, config=config,
    )  # fmt: skip
    assert_matches(out, batch, ref)
