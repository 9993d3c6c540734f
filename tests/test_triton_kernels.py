"""The Triton kernels against torch_ref, on the GPU. Outputs and caches are poisoned with NaN first,
so an element a kernel forgets to write (or a cache slot it reads past the context) shows up.

The helpers at the top (`make_batch`, `reference`, `check_*`) are also driven on the CPU under
TRITON_INTERPRET=1 by test_triton_interpret.py."""

from __future__ import annotations

import math
import random

import pytest
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
    out = torch.full_like(batch["q"], NAN)
    meta = (ctx.block_tables, ctx.context_lens, ctx.cu_seqlens_q)
    tk.paged_decode(
        batch["q"], batch["k_cache"], batch["v_cache"], out, *meta, batch["scale"], num_splits=num_splits
    )
    assert_matches(out, batch, ref)


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
            batch["q"], batch["k_cache"], batch["v_cache"], out, *meta, batch["scale"], num_splits, rows=1
        )
    tk.paged_prefill(
        batch["q"], batch["k_cache"], batch["v_cache"], out, *meta, ctx.max_seqlen_q, batch["scale"],
        rows=2 if has_decode else 0, config=config,
    )  # fmt: skip
    assert_matches(out, batch, ref)


def to_fp8(batch: dict, k_scale: float, v_scale: float) -> dict:
    """The batch with e4m3 caches (the cached prefix quantized as a store would have; NaN stays NaN)."""
    from executor_service.fp8 import quantize_kv

    fp8 = dict(batch, kv_scales=(k_scale, v_scale))
    fp8["k_cache"] = quantize_kv(batch["k_cache"], k_scale)
    fp8["v_cache"] = quantize_kv(batch["v_cache"], v_scale)
    return fp8


def check_store_fp8(batch: dict) -> None:
    """The store kernel writes exactly fp8.quantize_kv's bytes (round to nearest even, saturated)."""
    from executor_service.attention import triton_kernels
    from executor_service.fp8 import quantize_kv

    ctx, (k_scale, v_scale) = batch["context"], batch["kv_scales"]
    k_cache, v_cache = batch["k_cache"], batch["v_cache"]
    triton_kernels.store_kv(batch["k"], batch["v"], k_cache, v_cache, ctx.slot_mapping, k_scale, v_scale)
    keep = ctx.slot_mapping >= 0
    slots = ctx.slot_mapping[keep]
    for cache, x, scale in ((k_cache, batch["k"], k_scale), (v_cache, batch["v"], v_scale)):
        got = cache.view(-1, *cache.shape[2:])[slots].view(torch.uint8)
        assert torch.equal(got, quantize_kv(x[keep], scale).view(torch.uint8))


def check_attention_fp8(batch: dict, num_splits: int = 1, config: dict | None = None) -> None:
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
    out = torch.full_like(q, NAN)
    meta = (ctx.block_tables, ctx.context_lens, ctx.cu_seqlens_q)
    caches = (batch["k_cache"], batch["v_cache"])
    has_decode, has_prefill = 1 in ctx.query_lens_host, any(n > 1 for n in ctx.query_lens_host)
    if has_decode:
        rows = 1 if has_prefill else 0
        tk.paged_decode(q, *caches, out, *meta, batch["scale"], num_splits, rows=rows, kv_scales=kv_scales)
    if has_prefill:
        tk.paged_prefill(
            q, *caches, out, *meta, ctx.max_seqlen_q, batch["scale"], rows=2 if has_decode else 0,
            config=config, kv_scales=kv_scales,
        )  # fmt: skip
    assert_matches(out, batch, ref)


def random_lengths(batch: int, max_context: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(1, max_context) for _ in range(batch)]


# ---------------------------------------------------------------------------------------------- GPU

pytestmark = pytest.mark.gpu
DTYPES = [torch.bfloat16, torch.float16]


@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_store_kv(block_size, dtype, head_dim):
    ctx_lens = random_lengths(40, 600, seed=1)
    q_lens = [min(c, n) for c, n in zip(ctx_lens, random_lengths(40, 70, seed=2), strict=True)]
    batch = make_batch(q_lens, ctx_lens, 8, 4, head_dim, block_size, dtype, "cuda", seed=3, num_padding=5)
    check_store(batch)


@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_splits", [1, 5])
def test_decode_gqa_and_splits(group, head_dim, num_splits):
    ctx_lens = random_lengths(33, 700, seed=group)  # not multiples of the block size
    batch = make_batch(
        [1] * 33, ctx_lens, 2 * group, 2, head_dim, 16, torch.bfloat16, "cuda", seed=head_dim, num_padding=3
    )
    check_decode(batch, num_splits)


@pytest.mark.parametrize(
    ("num_seqs", "max_context", "block_size", "dtype", "num_splits"),
    [
        (1, 5000, 16, torch.bfloat16, 32),
        (1, 3, 256, torch.float16, 8),  # more splits than key tiles: empty splits
        (8, 2100, 256, torch.bfloat16, 9),
        (512, 300, 256, torch.float16, 1),
        (512, 90, 16, torch.bfloat16, 1),
        (64, 1500, 256, torch.bfloat16, 3),
    ],
)
def test_decode_shapes(num_seqs, max_context, block_size, dtype, num_splits):
    ctx_lens = random_lengths(num_seqs, max_context, seed=num_seqs)
    batch = make_batch([1] * num_seqs, ctx_lens, 16, 8, 128, block_size, dtype, "cuda", num_padding=7)
    check_decode(batch, num_splits)


def test_decode_all_padding():
    batch = make_batch([], [], 16, 8, 128, 16, torch.bfloat16, "cuda", num_padding=4)
    for splits in (1, 4):
        out = torch.full_like(batch["q"], NAN)
        from executor_service.attention import triton_kernels as tk

        ctx = batch["context"]
        meta = (ctx.block_tables, ctx.context_lens, ctx.cu_seqlens_q)
        tk.paged_decode(batch["q"], batch["k_cache"], batch["v_cache"], out, *meta, 0.1, num_splits=splits)
        assert (out == 0).all()


@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("group", [1, 2, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_prefill_prefix_and_chunks(block_size, group, head_dim):
    # Prefix hits (cached multiple of the block size) and later chunks (any cached length).
    ctx_lens = [300, 517, 64, 1000, 33, 129]
    q_lens = [44, 517 - 256, 64, 200, 1, 1]  # the last two are decode rows: a mixed batch
    batch = make_batch(q_lens, ctx_lens, 2 * group, 2, head_dim, block_size, torch.bfloat16, "cuda", seed=5)
    check_prefill(batch)


@pytest.mark.parametrize(
    ("dtype", "head_dim"), [(torch.bfloat16, 128), (torch.float16, 128), (torch.bfloat16, 80)]
)
@pytest.mark.parametrize("num_splits", [1, 4])
def test_prefill_mixed_with_padding(dtype, head_dim, num_splits):
    ctx_lens = random_lengths(20, 900, seed=7)
    q_lens = [1 if i % 2 else min(c, 1 + i * 7) for i, c in enumerate(ctx_lens)]
    batch = make_batch(q_lens, ctx_lens, 16, 8, head_dim, 16, dtype, "cuda", seed=8, num_padding=2)
    check_prefill(batch, num_splits)


@pytest.mark.parametrize("case", ["no_prefix", "no_prefix_mha", "prefix", "mixed", "decode"])
def test_backend_matches_torch_ref(case):
    """The whole backend (routing, varlen_attn for prefill without prefix) against torch_ref."""
    from executor_service.attention.torch_ref import TorchRefBackend
    from executor_service.attention.triton_paged import TritonPagedBackend

    num_kv_heads = 16 if case == "no_prefix_mha" else 8  # MHA: varlen_attn serves even on torch 2.11
    q_lens, ctx_lens, pad = {
        "no_prefix": ([100, 7, 513], [100, 7, 513], 0),
        "no_prefix_mha": ([100, 7, 513], [100, 7, 513], 0),
        "prefix": ([100, 7, 513], [356, 7, 600], 0),
        "mixed": ([100, 1, 1, 513], [100, 400, 17, 513], 0),
        "decode": ([1] * 30, random_lengths(30, 2000, seed=3), 2),
    }[case]
    batch = make_batch(
        q_lens, ctx_lens, 16, num_kv_heads, 128, 16, torch.bfloat16, "cuda", seed=11, num_padding=pad
    )
    ref = reference(batch)
    out = TritonPagedBackend().forward(
        batch["q"],
        batch["k"],
        batch["v"],
        batch["k_cache"],
        batch["v_cache"],
        batch["context"],
        batch["scale"],
    )
    assert_matches(out, batch, ref)
    torch_out = TorchRefBackend().forward(
        batch["q"],
        batch["k"],
        batch["v"],
        batch["k_cache"],
        batch["v_cache"],
        batch["context"],
        batch["scale"],
    )
    n = ref.shape[0]
    torch.testing.assert_close(out[:n], torch_out[:n], atol=2e-2, rtol=2e-2)


def test_decode_is_cuda_graph_capturable():
    from executor_service.attention.triton_paged import TritonPagedBackend

    batch = make_batch(
        [1] * 6, [5, 300, 17, 1, 64, 900], 16, 8, 128, 16, torch.bfloat16, "cuda", num_padding=2
    )
    ref = reference(batch)
    backend = TritonPagedBackend()
    args = (
        batch["q"],
        batch["k"],
        batch["v"],
        batch["k_cache"],
        batch["v_cache"],
        batch["context"],
        batch["scale"],
    )
    backend.forward(*args)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(*args)
    out.fill_(NAN)
    graph.replay()
    torch.cuda.synchronize()
    assert_matches(out, batch, ref)


# ------------------------------------------------------------------------------------- GPU, fp8 KV

FP8_SCALES = [(1.0, 1.0), (0.03, 2.5)]


@pytest.mark.parametrize("scales", FP8_SCALES)
@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv_fp8_is_byte_exact(scales, block_size, dtype):
    ctx_lens = random_lengths(40, 600, seed=1)
    q_lens = [min(c, n) for c, n in zip(ctx_lens, random_lengths(40, 70, seed=2), strict=True)]
    batch = make_batch(q_lens, ctx_lens, 8, 4, 128, block_size, dtype, "cuda", seed=3, num_padding=5)
    batch["k"].mul_(200.0)  # past 448 * k_scale: saturates
    check_store_fp8(to_fp8(batch, *scales))


@pytest.mark.parametrize("scales", FP8_SCALES)
@pytest.mark.parametrize("group", [1, 2, 8])
@pytest.mark.parametrize("num_splits", [1, 5])
def test_decode_fp8(scales, group, num_splits):
    ctx_lens = random_lengths(33, 700, seed=group)
    batch = make_batch([1] * 33, ctx_lens, 2 * group, 2, 128, 16, torch.bfloat16, "cuda", num_padding=3)
    check_attention_fp8(to_fp8(batch, *scales), num_splits)


@pytest.mark.parametrize("scales", FP8_SCALES)
@pytest.mark.parametrize("block_size", [16, 256])
def test_prefill_and_mixed_fp8(scales, block_size):
    ctx_lens = [300, 517, 64, 1000, 33, 129]
    q_lens = [44, 517 - 256, 64, 200, 1, 1]
    batch = make_batch(
        q_lens, ctx_lens, 16, 8, 128, block_size, torch.bfloat16, "cuda", seed=5, num_padding=2
    )
    check_attention_fp8(to_fp8(batch, *scales), 4)


@pytest.mark.parametrize("case", ["prefix", "mixed", "decode"])
def test_backend_fp8_matches_torch_backend(case):
    """The Triton backend against the torch backend, both on e4m3 caches and the same scales (steps
    with a cached prefix: without one, varlen_attn reads this step's K/V before quantization)."""
    from executor_service.attention.torch_ref import TorchRefBackend
    from executor_service.attention.triton_paged import TritonPagedBackend

    q_lens, ctx_lens, pad = {
        "prefix": ([100, 7, 513], [356, 7 + 16, 600], 0),
        "mixed": ([100, 1, 1, 513], [116, 400, 17, 600], 0),
        "decode": ([1] * 30, random_lengths(30, 2000, seed=3), 2),
    }[case]
    batch = to_fp8(
        make_batch(q_lens, ctx_lens, 16, 8, 128, 16, torch.bfloat16, "cuda", seed=11, num_padding=pad),
        0.5,
        1.5,
    )
    keys = ("q", "k", "v", "k_cache", "v_cache", "context", "scale")
    torch_batch = dict(batch, k_cache=batch["k_cache"].clone(), v_cache=batch["v_cache"].clone())
    out = TritonPagedBackend().forward(*(batch[k] for k in keys), 0.5, 1.5)
    ref = TorchRefBackend().forward(*(torch_batch[k] for k in keys), 0.5, 1.5)
    n = sum(batch["context"].query_lens_host) - pad
    assert torch.equal(batch["k_cache"].view(torch.uint8), torch_batch["k_cache"].view(torch.uint8))
    torch.testing.assert_close(out[:n], ref[:n], atol=2e-2, rtol=2e-2)


def test_decode_fp8_is_cuda_graph_capturable():
    from executor_service.attention.triton_paged import TritonPagedBackend

    batch = to_fp8(
        make_batch([1] * 6, [5, 300, 17, 1, 64, 900], 16, 8, 128, 16, torch.bfloat16, "cuda", num_padding=2),
        0.25,
        0.5,
    )
    expected = batch["k_cache"].clone(), batch["v_cache"].clone()
    backend = TritonPagedBackend()
    keys = ("q", "k", "v", "k_cache", "v_cache", "context", "scale")
    args = (*(batch[k] for k in keys), 0.25, 0.5)
    eager = backend.forward(*args)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(*args)
    out.fill_(NAN)
    batch["k_cache"].copy_(expected[0])
    batch["v_cache"].copy_(expected[1])
    graph.replay()
    torch.cuda.synchronize()
    n = 6
    assert torch.equal(out[:n], eager[:n])
