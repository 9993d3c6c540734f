"""The Triton kernels against torch_ref, on the GPU. Outputs and caches are poisoned with NaN first,
so an element a kernel forgets to write (or a cache slot it reads past the context) shows up.

The helpers at the top (`make_batch`, `reference`, `check_*`) are also driven on the CPU under
TRITON_INTERPRET=1 by test_triton_interpret.py."""

from __future__ import annotations

import random

import pytest
import torch
from helpers.attention_checks import (
    NAN,
    assert_matches,
    check_decode,
    check_prefill,
    check_store,
    make_batch,
    reference,
)
from helpers.attention_fp8_checks import (
    check_attention_fp8,
    check_decode_fuses_rope,
    check_decode_new_key_regs,
    check_decode_stores_kv,
    check_store_fp8,
    nan_past_runs,
    to_fp8,
)
from helpers.fp8_mma_checks import check_decode_fp8_mma, check_tma_kv


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
@pytest.mark.parametrize("kind", ["mixed", "decode"])
@pytest.mark.parametrize("v_tiles", [False, True])
def test_store_kv_fp8_is_byte_exact(scales, block_size, dtype, kind, v_tiles, monkeypatch):
    """v_tiles: V stored by store_v_tiles_kernel (a long launch's), forced for this one."""
    from executor_service.attention import triton_kernels

    if v_tiles:
        monkeypatch.setattr(triton_kernels, "V_TILE_MIN_TOKENS", 0)
    ctx_lens = random_lengths(40, 600, seed=1)
    if kind == "mixed":
        q_lens = [min(c, n) for c, n in zip(ctx_lens, random_lengths(40, 70, seed=2), strict=True)]
    else:  # a decode step with every other token at its block's first slot (the lone token's rows)
        ctx_lens = [c - (c - 1) % block_size if i % 2 else c for i, c in enumerate(ctx_lens)]
        q_lens = [1] * 40
    batch = make_batch(q_lens, ctx_lens, 8, 4, 128, block_size, dtype, "cuda", seed=3, num_padding=5)
    batch["k"].mul_(200.0)  # past 448 * k_scale: saturates
    check_store_fp8(to_fp8(batch, *scales))


@pytest.mark.parametrize("scales", FP8_SCALES)
@pytest.mark.parametrize("group", [1, 2, 8])
@pytest.mark.parametrize("num_splits", [1, 5])
@pytest.mark.parametrize(
    "variant",
    [
        {},
        {"FP8_DOT_F16": False},
        # programs of one and two warps (bench/attention.py --sweep-warps)
        {"BLOCK_N": 32, "num_warps": 1, "num_stages": 3},
        {"BLOCK_N": 32, "num_warps": 1, "num_stages": 5},
        {"BLOCK_N": 64, "num_warps": 2, "num_stages": 5},
    ],
)
def test_decode_fp8(scales, group, num_splits, variant):
    ctx_lens = random_lengths(33, 700, seed=group)
    batch = make_batch([1] * 33, ctx_lens, 2 * group, 2, 128, 16, torch.bfloat16, "cuda", num_padding=3)
    check_attention_fp8(to_fp8(batch, *scales), num_splits, decode_config=variant)


@pytest.mark.parametrize("scales", FP8_SCALES)
@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("num_splits", [1, 5])
@pytest.mark.parametrize(
    "block_size,tile",
    [(16, {}), (32, {}), (32, {"BLOCK_N": 64}), (32, {"FULL_TILES": True}), (256, {"num_warps": 8})],
)
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_fp8_mma(scales, group, num_splits, block_size, tile, dtype):
    """Decode in e4m3 MMAs (FP8_MMA: sm90's wgmma) against the torch model of its arithmetic and
    exact attention (helpers/fp8_mma_checks.py), over block sizes, GQA groups and splits."""
    ctx_lens = random_lengths(33, 700, seed=group)
    batch = make_batch([1] * 33, ctx_lens, 2 * group, 2, 128, block_size, dtype, "cuda", num_padding=3)
    check_decode_fp8_mma(to_fp8(batch, *scales), num_splits, tile)


@pytest.mark.parametrize("num_splits", [1, 5])
@pytest.mark.parametrize("group", [2, 4])
@pytest.mark.parametrize(
    "block_size,tile",
    [
        (64, {"BLOCK_N": 64}),
        (128, {"BLOCK_N": 64}),
        (128, {"BLOCK_N": 128}),
        (256, {"BLOCK_N": 64, "num_stages": 3}),
        (128, {"BLOCK_N": 64, "FULL_TILES": True}),
    ],
)
def test_decode_fp8_mma_tma(num_splits, group, block_size, tile):
    """FP8_MMA with its K and V^T tiles through TMA (TMA_KV): the same output bits as its pointer
    loads, and within the torch model of its arithmetic (helpers/fp8_mma_checks.py)."""
    ctx_lens = random_lengths(33, 700, seed=group)
    batch = make_batch(
        [1] * 33, ctx_lens, 2 * group, 2, 128, block_size, torch.bfloat16, "cuda", num_padding=3
    )
    batch = to_fp8(batch, 0.03, 2.5)
    check_tma_kv(batch, num_splits, tile)
    check_decode_fp8_mma(batch, num_splits, {**tile, "TMA_KV": True})


@pytest.mark.parametrize("num_splits", [1, 5])
@pytest.mark.parametrize("block_size,block_n", [(64, 64), (128, 128), (256, 64)])
def test_decode_fp8_tma_widening(num_splits, block_size, block_n):
    """The widening fp8 decode loop with its K and V^T tiles through TMA (TMA_KV without FP8_MMA):
    the pointer loads' bits, and exact attention over the e4m3 cache (check_attention_fp8)."""
    ctx_lens = random_lengths(33, 700, seed=3)
    batch = make_batch([1] * 33, ctx_lens, 4, 2, 128, block_size, torch.bfloat16, "cuda", num_padding=3)
    batch = to_fp8(batch, 0.03, 2.5)
    tile = {"FP8_MMA": False, "BLOCK_N": block_n}
    check_tma_kv(batch, num_splits, tile)
    check_attention_fp8(batch, num_splits, decode_config={**tile, "TMA_KV": True})


@pytest.mark.parametrize("num_splits", [1, 5])
def test_decode_fp8_mma_reads_v_in_runs_of_16(num_splits):
    """FP8_MMA reads V^T as the widening kernel does: NaN past each context's last run of 16 slots
    never reaches the output."""
    ctx_lens = random_lengths(40, 900, seed=11)
    batch = make_batch([1] * 40, ctx_lens, 16, 8, 128, 64, torch.bfloat16, "cuda", seed=12, num_padding=3)
    check_decode_fp8_mma(nan_past_runs(to_fp8(batch, 0.03, 2.5)), num_splits)


@pytest.mark.parametrize("block_size", [64, 256])
@pytest.mark.parametrize("num_splits", [1, 5])
def test_decode_fp8_reads_v_in_runs_of_16(block_size, num_splits):
    """An e4m3 V cache is read up to the end of the context's last run of 16 slots, not to its
    block's end: NaN in the slots past it (0x7F, which the GPU widens to NaN) leaves every output
    finite and exact, so a sequence in a large block pays for at most 15 slots past its context."""
    ctx_lens = random_lengths(40, 900, seed=11)
    batch = make_batch(
        [1] * 40, ctx_lens, 16, 8, 128, block_size, torch.bfloat16, "cuda", seed=12, num_padding=3
    )
    check_attention_fp8(nan_past_runs(to_fp8(batch, 0.03, 2.5)), num_splits)


@pytest.mark.parametrize("block_size", [16, 32, 256])
@pytest.mark.parametrize("num_splits", [1, 5])
@pytest.mark.parametrize(
    "variant",
    [
        {},
        {"BLOCK_N": 64, "num_warps": 1, "num_stages": 3},
        {"FP8_MMA": True},
        {"FP8_MMA": True, "BLOCK_N": 64, "FULL_TILES": True},
        {"FP8_MMA": True, "BLOCK_N": 64, "TMA_KV": True},  # (TMA at block size 256; 16 and 32 fall back)
        {"FP8_MMA": False, "BLOCK_N": 64, "TMA_KV": True},  # (the widening loop's, likewise)
    ],
)
def test_decode_stores_kv_fp8(block_size, num_splits, variant):
    """The decode kernel storing the step's K and V (DECODE_STORES_KV) writes the store kernel's
    bytes and attends to the same output, every other token at its block's first slot."""
    ctx_lens = random_lengths(40, 900, seed=7)
    ctx_lens = [c - (c - 1) % block_size if i % 2 else c for i, c in enumerate(ctx_lens)]
    batch = make_batch(
        [1] * 40, ctx_lens, 16, 8, 128, block_size, torch.bfloat16, "cuda", seed=8, num_padding=3
    )
    check_decode_stores_kv(to_fp8(batch, 0.03, 2.5), num_splits, variant)


@pytest.mark.parametrize("block_size", [16, 64, 256])
@pytest.mark.parametrize("num_splits", [1, 5])
@pytest.mark.parametrize("group", [2, 4])
@pytest.mark.parametrize(
    "variant", [{"FP8_MMA": False}, {"FP8_MMA": True}, {"FP8_MMA": True, "BLOCK_N": 64, "FULL_TILES": True}]
)
def test_decode_new_key_regs_fp8(block_size, num_splits, group, variant):
    """The decode kernel attending to the step's key from registers with no barrier before its loop
    (DECODE_NEW_KEY_REGS): the store kernel's bytes, and the output within the fp32 reference and
    within a rounding step or two of the read-back's, with the stale bytes a serving cache holds (a
    race that let the loop read the token's slots, or a key counted twice or not at all, fails)."""
    ctx_lens = [2, 3] + random_lengths(38, 900, seed=13)
    ctx_lens = [c - (c - 1) % block_size if i % 2 else c for i, c in enumerate(ctx_lens)]
    batch = make_batch(
        [1] * 40, ctx_lens, 8 * group // 2, 4, 128, block_size, torch.bfloat16, "cuda", seed=14, num_padding=3
    )
    check_decode_new_key_regs(to_fp8(batch, 0.03, 2.5), num_splits, variant)


@pytest.mark.parametrize("with_norm", [True, False])
@pytest.mark.parametrize("num_splits", [1, 5])
@pytest.mark.parametrize("variant", [{}, {"FP8_MMA": True}])
def test_decode_fuses_rope_fp8(with_norm, num_splits, variant):
    """The decode kernel normalising and rotating q and the new K itself (DECODE_FUSES_ROPE) against
    the fused rotary kernel, the store and the decode kernel, every other token at its block's
    first slot: without q/k norms bit for bit (both kernels round each product and sum as written),
    with them within a rounding step of the norm's sum (each kernel sums in its own order)."""
    ctx_lens = random_lengths(40, 900, seed=9)
    ctx_lens = [c - (c - 1) % 32 if i % 2 else c for i, c in enumerate(ctx_lens)]
    batch = make_batch([1] * 40, ctx_lens, 16, 8, 128, 32, torch.bfloat16, "cuda", seed=10, num_padding=3)
    check_decode_fuses_rope(to_fp8(batch, 0.03, 2.5), num_splits, variant, with_norm, exact=not with_norm)


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


@pytest.mark.parametrize("mma", [False, True])
def test_decode_fp8_is_cuda_graph_capturable(mma, monkeypatch):
    from executor_service.attention import triton_kernels
    from executor_service.attention.triton_paged import TritonPagedBackend

    monkeypatch.setitem(triton_kernels.DECODE_CONFIG_FP8, "FP8_MMA", mma)

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
