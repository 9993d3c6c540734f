"""Attention kernels on the GPU: the Triton paged decode kernel alone (replayed from a CUDA graph,
like the engine's decode steps) and a causal prefill (eager), against
PyTorch's FlashAttention-2 (`varlen_attn`) on contiguous KV. Qwen3-0.6B shapes: 16 query heads,
8 KV heads, head_dim 128, bf16. Decode reports effective KV bandwidth: bytes of K and V read / time,
for a bf16 cache and an e4m3 one (kv_cache_dtype fp8: half the bytes; `decode kernel fp8 ...` counts
the fp8 bytes).

    python bench/attention.py [--sweep | --sweep-bf16 | --sweep-fp8 | --sweep-fp8-quick] [--heads 32 4]

--sweep also times a grid of decode launch configurations (BLOCK_N, num_warps, num_stages), bf16
and fp8. --sweep-stages times the decode tiles at 3 stages (one shared-memory buffer for K and V:
Triton splits the stages between the block-table load and the K/V loads it addresses) and at 5-7
(two or three). --sweep-warps times the fp8 kernel in programs of one or two warps.
"""

from __future__ import annotations

import argparse
import itertools
import random
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from executor_service.attention import triton_kernels as tk
from executor_service.attention.triton_paged import _VARLEN_PARAMS, prefill_varlen, varlen_attn
from executor_service.config import FP8_DEFAULT_BLOCK_SIZE
from executor_service.context import Context
from executor_service.fp8 import fp8_v_cache

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, DTYPE = 16, 8, 128, torch.bfloat16
FP8_BS = FP8_DEFAULT_BLOCK_SIZE  # the fp8 sweeps' block size: the engine's default for an e4m3 cache
FP8 = torch.float8_e4m3fn
SCALE = HEAD_DIM**-0.5


def time_ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median")


def time_graph_ms(fn) -> float:
    """Time fn replayed from a CUDA graph, as the engine runs decode: a short kernel timed eagerly
    measures Python launch overhead (two launches plus allocations for split-KV) instead."""
    fn()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return time_ms(graph.replay)


def relayout(x: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    """x's shape and values, its memory laid out with x's dimensions in `order`, outermost first (a
    strided view: the kernels take strides)."""
    inverse = [order.index(i) for i in range(len(order))]
    return x.permute(*order).contiguous().permute(*inverse)


# Memory layouts of the caches the kernels can read through their strides, for --sweep-layout:
# "K head-major": each block's keys of one KV head contiguous ([num_blocks, heads, block_size,
# head_dim] in memory, as an e4m3 V cache keeps a head's block); "V heads by dim": an e4m3 V cache
# with the KV heads inside each dimension row ([num_blocks, head_dim, heads, block_size]), so that
# the KV heads' programs, which run together, read neighbouring bytes as they do the K cache's.
LAYOUTS = {"K head-major": ("k", (0, 2, 1, 3)), "V heads by dim": ("v", (0, 2, 1, 3))}


def bench_store(
    num_tokens: int, run: int, block_size: int, kv_dtype: torch.dtype, decode_at: str = "random"
) -> tuple[float, float]:
    """store_kv of num_tokens tokens (bf16 K/V [num_tokens, 8, 128]) into a cache of kv_dtype, in
    runs of `run` consecutive slots (a prefill's; run 1: a decode step's tokens, one per sequence),
    each run in blocks drawn at random. A decode token sits anywhere in its block (decode_at
    "random"), never at its first slot ("mid-block": an e4m3 store zeroes no block) or always there
    ("block start": each token zeroes the rest of its block). Returns (us, GB/s of cache bytes
    written)."""
    num_runs = num_tokens // run
    blocks_per_run = triton.cdiv(run, block_size)
    num_blocks = num_runs * blocks_per_run * 4
    k = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    v = torch.randn_like(k)
    k_cache = torch.zeros(num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM, device="cuda", dtype=kv_dtype)
    v_cache = fp8_v_cache(torch.zeros_like(k_cache)) if kv_dtype == FP8 else torch.zeros_like(k_cache)
    order = torch.randperm(num_blocks, device="cuda")[: num_runs * blocks_per_run].view(num_runs, -1)
    within = torch.arange(run, device="cuda")
    # A decode token sits anywhere in its block; a prefill run starts its first block.
    low, high = {"random": (0, block_size), "mid-block": (1, block_size), "block start": (0, 1)}[decode_at]
    start = (
        torch.randint(low, high, (num_runs, 1), device="cuda")
        if run == 1
        else torch.zeros(num_runs, 1, device="cuda", dtype=torch.long)
    )
    pos = within[None, :] + start
    slots = (order.gather(1, pos // block_size) * block_size + pos % block_size).view(-1).to(torch.int32)
    us = time_ms(lambda: tk.store_kv(k, v, k_cache, v_cache, slots)) * 1e3
    written = 2 * num_tokens * NUM_KV_HEADS * HEAD_DIM * k_cache.element_size()
    return us, written / us / 1e3


def paged_decode_inputs(
    batch: int,
    context: int,
    block_size: int,
    kv_dtype: torch.dtype = DTYPE,
    sequential: bool = False,
    layouts: tuple[str, ...] = (),
    contexts: list[int] | None = None,
) -> dict:
    """A cache of batch x context keys; each sequence's blocks drawn at random from the whole cache
    (a long-running server's free list), or with sequential=True one after the other; `layouts`:
    names from LAYOUTS; `contexts`: each sequence's own length (at most context)."""
    blocks_per_seq = triton.cdiv(context, block_size)
    num_blocks = batch * blocks_per_seq
    shape = (num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, dtype=DTYPE, device="cuda").to(kv_dtype)
    v_cache = torch.randn(shape, dtype=DTYPE, device="cuda").to(kv_dtype)
    if kv_dtype == FP8:
        v_cache = fp8_v_cache(v_cache)  # an e4m3 V cache keeps each block transposed
    for name in layouts:
        which, order = LAYOUTS[name]
        if which == "k":
            k_cache = relayout(k_cache, order)
        else:
            v_cache = relayout(v_cache, order)
    if sequential:
        tables = torch.arange(num_blocks, device="cuda", dtype=torch.int32).view(batch, blocks_per_seq)
    else:
        tables = torch.randperm(num_blocks, device="cuda", dtype=torch.int32).view(batch, blocks_per_seq)
    return {
        "q": torch.randn(batch, NUM_HEADS, HEAD_DIM, dtype=DTYPE, device="cuda"),
        "k_cache": k_cache,
        "v_cache": v_cache,
        "block_tables": tables,
        "context_lens": (
            torch.full((batch,), context, dtype=torch.int32, device="cuda")
            if contexts is None
            else torch.tensor(contexts, dtype=torch.int32, device="cuda")
        ),
        "cu_seqlens_q": torch.arange(batch + 1, dtype=torch.int32, device="cuda"),
    }


def bench_decode(
    batch: int,
    context: int,
    block_size: int,
    config: dict | None = None,
    splits=None,
    kv_dtype=DTYPE,
    sequential: bool = False,
    layouts: tuple[str, ...] = (),
    contexts: list[int] | None = None,
):
    x = paged_decode_inputs(batch, context, block_size, kv_dtype, sequential, layouts, contexts)
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    splits = splits or tk.choose_num_splits(batch, NUM_KV_HEADS, num_sms)
    out = torch.empty_like(x["q"])
    meta = (x["block_tables"], x["context_lens"], x["cu_seqlens_q"])

    def run():
        tk.paged_decode(
            x["q"], x["k_cache"], x["v_cache"], out, *meta, SCALE, num_splits=splits, config=config,
            kv_scales=(0.5, 0.5),
        )  # fmt: skip

    ms = time_graph_ms(run)
    keys = batch * context if contexts is None else sum(contexts)
    kv_bytes = 2 * keys * NUM_KV_HEADS * HEAD_DIM * kv_dtype.itemsize
    return ms, kv_bytes / ms / 1e9, splits


def mixed_lengths(batch: int, generated: int, order: str, seed: int = 0) -> list[int]:
    """W1's contexts a decode step in: prompts of 100-1024 tokens (uniform) plus `generated`; in
    random order (as the engine batches them), longest first or shortest first."""
    rng = random.Random(seed)
    contexts = [rng.randint(100, 1024) + generated for _ in range(batch)]
    if order != "random":
        contexts.sort(reverse=order == "longest first")
    return contexts


def sweep_fp8_block_sizes(block_sizes=(32, 64, 128, 256)) -> None:
    """The fp8 decode kernel (today's config) at each block size: b256x1024 and W1's mixed contexts
    (+32 and +256 generated, longest first, no splits), in TB/s of the bytes the contexts hold. The
    kernel reads V^T in runs of 16 slots, so a larger block no longer costs its unused slots."""
    for block_size in block_sizes:
        _, tbs, _ = bench_decode(256, 1024, block_size, splits=1, kv_dtype=FP8)
        row = [f"b256x1024 {tbs:.2f}"]
        for generated in (32, 256):
            contexts = mixed_lengths(256, generated, "longest first")
            _, tbs, _ = bench_decode(
                256, max(contexts), block_size, splits=1, kv_dtype=FP8, contexts=contexts
            )
            row.append(f"mixed +{generated} {tbs:.2f}")
        print(f"fp8 block size {block_size}: " + ", ".join(row) + " TB/s", flush=True)


def sweep_mixed_lengths() -> None:
    """Decode at batch 256 over W1's mixed contexts against one context of the same mean: what the
    programs of the longest sequences, run last, cost (grid order, splits)."""
    for generated, (name, kv_dtype, block_size) in itertools.product(
        (32, 256), (("bf16", DTYPE, 16), ("fp8", FP8, FP8_BS))
    ):
        mean = sum(mixed_lengths(256, generated, "random")) // 256
        _, uniform, _ = bench_decode(256, mean, block_size, kv_dtype=kv_dtype)
        print(f"mixed {name} b256 +{generated}: one context of {mean}: {uniform:.2f} TB/s")
        for order, splits in itertools.product(("random", "longest first", "shortest first"), (1, 2, 4)):
            contexts = mixed_lengths(256, generated, order)
            _, tbs, _ = bench_decode(
                256, max(contexts), block_size, splits=splits, kv_dtype=kv_dtype, contexts=contexts
            )
            print(f"mixed {name} b256 +{generated} {order}, splits {splits}: {tbs:.2f} TB/s")


def sweep_context() -> None:
    """Decode over the same bytes cut into fewer, longer contexts (b256x1024 ... b32x8192, one
    program a sequence and KV head, no splits): whether a program's fixed cost (its block table, the
    first tiles' latency, the epilogue) is what the fp8 kernel loses at short contexts."""
    for (name, kv_dtype, block_size), (batch, context) in itertools.product(
        (("bf16", DTYPE, 16), ("fp8", FP8, FP8_BS)), ((256, 1024), (128, 2048), (64, 4096), (32, 8192))
    ):
        ms, tbs, _ = bench_decode(batch, context, block_size, splits=1, kv_dtype=kv_dtype)
        print(f"context {name} b{batch}x{context} bs{block_size} splits 1: {ms * 1e3:.1f} us, {tbs:.2f} TB/s")


def bench_varlen_decode(batch: int, context: int):
    """varlen_attn over contiguous KV. Without its enable_gqa (torch 2.11) the KV heads are repeated
    to the query heads beforehand, and the bandwidth counts the bytes it is handed."""
    if varlen_attn is None:
        return None
    q = torch.randn(batch, NUM_HEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
    k = torch.randn(batch * context, NUM_KV_HEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
    v = torch.randn_like(k)
    kwargs = {"scale": SCALE}
    if "enable_gqa" in _VARLEN_PARAMS:
        kwargs["enable_gqa"] = True
    else:
        k = k.repeat_interleave(NUM_HEADS // NUM_KV_HEADS, dim=1)
        v = v.repeat_interleave(NUM_HEADS // NUM_KV_HEADS, dim=1)
    cu_q = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    cu_k = cu_q * context
    ms = time_graph_ms(lambda: varlen_attn(q, k, v, cu_q, cu_k, 1, context, **kwargs))
    return ms, 2 * k.numel() * k.element_size() / ms / 1e9


def bench_prefill(num_seqs: int, length: int, block_size: int) -> None:
    num_tokens = num_seqs * length
    blocks_per_seq = triton.cdiv(length, block_size)
    shape = (num_seqs * blocks_per_seq, block_size, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, dtype=DTYPE, device="cuda")
    v_cache = torch.randn(shape, dtype=DTYPE, device="cuda")
    tables = torch.randperm(shape[0], device="cuda", dtype=torch.int32).view(num_seqs, blocks_per_seq)
    q = torch.randn(num_tokens, NUM_HEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
    k = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
    v = torch.randn_like(k)
    cu = torch.arange(num_seqs + 1, dtype=torch.int32, device="cuda") * length
    lens = torch.full((num_seqs,), length, dtype=torch.int32, device="cuda")
    ctx = Context(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=length, max_seqlen_k=length)
    out = torch.empty_like(q)
    flops = 4 * num_seqs * NUM_HEADS * HEAD_DIM * length * (length + 1) / 2  # causal half
    line = f"prefill {num_seqs}x{length} causal (block size {block_size}):"
    if varlen_attn is not None:
        ms = time_ms(lambda: prefill_varlen(q, k, v, ctx, SCALE, repeat_kv=True))
        line += f" varlen_attn {ms:.3f} ms ({flops / ms / 1e9:.0f} TFLOP/s);"
        if "enable_gqa" not in _VARLEN_PARAMS:  # the time above includes repeating the KV heads
            group = NUM_HEADS // NUM_KV_HEADS
            k16, v16 = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            ms = time_ms(lambda: prefill_varlen(q, k16, v16, ctx, SCALE))
            line += f" varlen_attn on KV repeated beforehand {ms:.3f} ms;"
    ms = time_ms(lambda: tk.paged_prefill(q, k_cache, v_cache, out, tables, lens, cu, length, SCALE))
    line += f" triton paged prefill {ms:.3f} ms ({flops / ms / 1e9:.0f} TFLOP/s)"
    print(line)


def tile_grid(batch: int):
    """(split count or None for the default, launch config) of the decode grid: split-KV choices
    only where the batch leaves SMs idle."""
    split_choices = (None,) if batch * NUM_KV_HEADS >= 264 else (None, 4, 8, 16, 32)
    for splits, block_n, warps, stages in itertools.product(split_choices, (32, 64, 128), (4, 8), (2, 3, 4)):
        yield splits, {"BLOCK_N": block_n, "num_warps": warps, "num_stages": stages}


def sweep_fp8_registers(caps=(0, 96, 104, 128), rounds: int = 2) -> None:
    """Today's fp8 decode config under register caps (maxnreg; 0: uncapped, ~124 registers a thread,
    so 4 programs of 4 warps an SM; 96 fits 5), at b256x1024 and W1's mixed contexts (+32 and +256
    generated, longest first), the caps in turn, rounds times."""
    cases = [("b256x1024", None)] + [
        (f"W1 +{generated}", mixed_lengths(256, generated, "longest first")) for generated in (32, 256)
    ]
    for _, cap in itertools.product(range(rounds), caps):
        cfg = {**tk.DECODE_CONFIG_FP8, "maxnreg": cap}
        row = []
        for what, contexts in cases:
            context = 1024 if contexts is None else max(contexts)
            _, tbs, _ = bench_decode(256, context, FP8_BS, cfg, splits=1, kv_dtype=FP8, contexts=contexts)
            row.append(f"{what} {tbs:.2f}")
        print(f"fp8 registers maxnreg {cap}: " + ", ".join(row) + " TB/s", flush=True)


def fp8_mma_grid(quick: bool = False):
    """The fp8 decode kernel in e4m3 MMAs (FP8_MMA): key tiles of 64 (one warpgroup's wgmma rows) and
    128, one or two warpgroups, 2-4 stages, the full tiles in a loop of their own (FULL_TILES) or not
    (quick: one warpgroup at 2 and 3 stages, both ways)."""
    grid = (
        ((64, 128), (4,), (2, 3), (False, True)) if quick else ((64, 128), (4, 8), (2, 3, 4), (False, True))
    )
    for block_n, warps, stages, full in itertools.product(*grid):
        if block_n // 16 >= warps:  # (wgmma's rows: 16 keys a warp at least)
            yield {
                **tk.DECODE_CONFIG_FP8, "FP8_MMA": True, "FULL_TILES": full, "BLOCK_N": block_n,
                "num_warps": warps, "num_stages": stages,
            }  # fmt: skip


def fp8_tma_grid(block_size: int):
    """The decode tiles through TMA (TMA_KV) where a tile fits in a block of block_size, against the
    same loops' pointer loads: FP8_MMA in its own tile (FP8_MMA_TILE), then through TMA in 64-key
    tiles at 1 and 2 stages (below 5 Triton gives the chain of a block-table load and the copies it
    addresses one buffer), with FULL_TILES (the context's last tile by pointer loads, which read no
    key past the context), and capped at 64 / 80 registers (nine / six programs an SM where shared
    memory allows: the copies free the address registers), and at 128 keys and 1 stage (35 KB);
    then the widening loop's 64-key tiles through TMA, as today's (3 stages) and capped at 96 (five
    programs an SM) and at 80 with 2 stages (six; no spill compiled for sm90); at blocks of 32,
    its 32-key tiles."""
    mma = {**tk.DECODE_CONFIG_FP8, "FP8_MMA": True, "num_warps": 4}
    yield {**mma, **tk.FP8_MMA_TILE}
    mma_tma = (
        (64, 1, 0, False), (64, 2, 0, False), (64, 2, 0, True), (64, 1, 64, False), (64, 2, 80, False),
        (128, 1, 0, False),
    )  # fmt: skip
    for block_n, stages, cap, full in mma_tma:
        if block_size % block_n == 0:
            yield {
                **mma, "TMA_KV": True, "FULL_TILES": full, "BLOCK_N": block_n, "num_stages": stages,
                "maxnreg": cap,
            }  # fmt: skip
    if block_size % 64 == 0:
        widening = {**tk.DECODE_CONFIG_FP8, "FP8_MMA": False, "TMA_KV": True, "BLOCK_N": 64}
        for stages, cap in ((3, 0), (3, 96), (2, 80)):
            yield {**widening, "num_stages": stages, "maxnreg": cap}
    elif block_size == 32:  # a 32-key tile a block (73 registers: seven programs an SM, small tiles)
        yield {**tk.DECODE_CONFIG_FP8, "FP8_MMA": False, "TMA_KV": True, "BLOCK_N": 32}


def fp8_mma_agreement(config: dict, block_size: int) -> float:
    """The relative error (norm) of the decode output under `config` against today's fp8 config on
    the same cache, b64x1024 (FP8_MMA rounds the probabilities to e4m3: about 1%)."""
    x = paged_decode_inputs(64, 1024, block_size, FP8)
    meta = (x["block_tables"], x["context_lens"], x["cu_seqlens_q"])
    outs = []
    for cfg in (None, config):
        out = torch.full_like(x["q"], float("nan"))
        tk.paged_decode(
            x["q"], x["k_cache"], x["v_cache"], out, *meta, SCALE, config=cfg, kv_scales=(0.5, 0.5)
        )
        outs.append(out.float())
    return ((outs[1] - outs[0]).norm() / outs[0].norm()).item()


def sweep_fp8_mma(block_sizes=(FP8_DEFAULT_BLOCK_SIZE,), quick: bool = False, tma: bool = False) -> None:
    """fp8_mma_grid (or with tma, fp8_tma_grid) against today's fp8 config: each one's output checked
    against today's (fp8_mma_agreement, refused past 3%), then TB/s at b256x1024, W1's mixed
    contexts (+32 and +256 generated, longest first; engine's splits) and b8x8192 (split), for each
    block size."""
    cases = [("b256x1024", 256, 1024, None)] + [
        (f"W1 +{g}", 256, None, mixed_lengths(256, g, "longest first")) for g in (32, 256)
    ] + [("b8x8192", 8, 8192, None)]  # fmt: skip
    for block_size in block_sizes:
        grid = fp8_tma_grid(block_size) if tma else fp8_mma_grid(quick)
        for cfg in [dict(tk.DECODE_CONFIG_FP8), *grid]:
            try:
                rel = fp8_mma_agreement(cfg, block_size)
                if not rel < 3e-2:
                    print(
                        f"fp8 mma bs{block_size} {cfg}: relative error {rel:.3g} against today's: refused",
                        flush=True,
                    )
                    continue
                row = []
                for what, batch, context, contexts in cases:
                    _, tbs, _ = bench_decode(
                        batch, context or max(contexts), block_size, cfg, kv_dtype=FP8, contexts=contexts
                    )
                    row.append(f"{what} {tbs:.2f}")
            except Exception as e:  # out of shared memory, say
                print(f"fp8 mma bs{block_size} {cfg}: {type(e).__name__}: {e}"[:300], flush=True)
                continue
            print(f"fp8 mma bs{block_size} (rel {rel:.1e}) " + ", ".join(row) + f" TB/s {cfg}", flush=True)


def fp8_tile_grid(quick: bool = False):
    """The first fp8 decode kernel's grid, uncapped: larger key tiles, and K/V widened to q's dtype
    or to fp16 (quick: the key tiles and warps at 3 stages, widened to fp16)."""
    grid = (
        ((64, 128, 256), (4, 8), (3,), (True,))
        if quick
        else ((32, 64, 128, 256), (4, 8), (2, 3, 4), (False, True))
    )
    for block_n, warps, stages, f16 in itertools.product(*grid):
        yield (
            None,
            {
                "BLOCK_N": block_n,
                "num_warps": warps,
                "num_stages": stages,
                "FP8_DOT_F16": f16,
                "maxnreg": 0,
            },
        )


def stages_grid(fp8: bool):
    """The decode kernel's tiles at 3 stages and at 5-7. Triton gives each load of a chain of
    indirect loads (the block table, then K and V) its share of num_stages - 1 stages of latency, so
    at 2-4 stages the K and V tiles get one buffer (the next tile's copy is issued only after this
    tile's math), and from 5 on two or more (the copy runs while the math does)."""
    block_ns = (64, 128) if fp8 else (32, 64)
    for block_n, warps, stages in itertools.product(block_ns, (4, 8), (3, 5, 6, 7)):
        cfg = {"BLOCK_N": block_n, "num_warps": warps, "num_stages": stages}
        if fp8:
            cfg.update(FP8_DOT_F16=True, maxnreg=0)
        yield None, cfg


def sweep_stages() -> None:
    """stages_grid at b256x1024 for both caches (their default block sizes), best first, then the
    best three of each at W1's mixed contexts (+32 generated, longest first) and at b8x8192."""
    for name, kv_dtype, block_size in (("fp8", FP8, FP8_BS), ("bf16", DTYPE, 16)):
        ranked = sweep_decode(256, 1024, block_size, kv_dtype, stages_grid(kv_dtype == FP8))
        for tbs, _, cfg in ranked:
            print(f"stages {name} b256x1024 bs{block_size}: {tbs:.2f} TB/s {cfg}", flush=True)
        contexts = mixed_lengths(256, 32, "longest first")
        for _, _, cfg in ranked[:3]:
            _, mixed, _ = bench_decode(
                256, max(contexts), block_size, cfg, splits=1, kv_dtype=kv_dtype, contexts=contexts
            )
            _, long, splits = bench_decode(8, 8192, block_size, cfg, kv_dtype=kv_dtype)
            print(
                f"stages {name} {cfg}: W1 contexts +32 longest first {mixed:.2f} TB/s, "
                f"b8x8192 {long:.2f} TB/s (splits {splits})",
                flush=True,
            )


def warps_grid():
    """The fp8 decode kernel in programs of one or two warps (BLOCK_N, num_warps, num_stages,
    maxnreg), each split over the keys 1, 2 or 4 ways, and today's default (4 warps). In a program
    of 4 warps the warps share a tile's keys, so each tile's row max, row sum and probabilities
    cross the warps through shared memory: 9 barriers a 128-key tile (bench/kernel_sass.py). One
    warp needs none of that (2 barriers a tile), at 168 registers 12 programs an SM; fewer warps a
    program make each program slower, so more splits may be needed to fill the waves."""
    for block_n, warps, stages, maxnreg in (
        (32, 1, 3, 0), (32, 1, 5, 0), (32, 1, 7, 0), (32, 1, 3, 128), (16, 1, 3, 0), (64, 1, 3, 0),
        (64, 1, 5, 0), (32, 2, 3, 0), (32, 2, 5, 0), (64, 2, 3, 0), (64, 2, 5, 0),
    ):  # fmt: skip
        cfg = {"FP8_DOT_F16": True, "BLOCK_N": block_n, "num_warps": warps, "num_stages": stages,
               "maxnreg": maxnreg}  # fmt: skip
        for splits in (1, 2, 4):
            yield splits, cfg
    for splits in (1, 2):
        yield splits, dict(tk.DECODE_CONFIG_FP8)


def sweep_warps() -> None:
    """warps_grid at b256x1024 (fp8, the engine's block size), best first; then the best four
    configurations at W1's mixed contexts (+32 and +256 generated, longest first) and at b8x8192,
    each over several splits; then the first ranking's top five again (the log's tail)."""
    ranked = sweep_decode(256, 1024, FP8_BS, FP8, warps_grid())
    for tbs, splits, cfg in ranked:
        print(f"warps fp8 b256x1024 bs{FP8_BS}: {tbs:.2f} TB/s (splits {splits}) {cfg}", flush=True)
    best: list[dict] = []
    for _, _, cfg in ranked:
        if cfg not in best:
            best.append(cfg)
    default = dict(tk.DECODE_CONFIG_FP8)
    cases = [(generated, splits) for generated in (32, 256) for splits in (1, 2, 4)] + [
        (None, s) for s in (8, 16, 32)
    ]
    for cfg in [*best[:4], *([] if default in best[:4] else [default])]:
        for generated, splits in cases:
            if generated is None:
                what, batch, context, contexts = "b8x8192", 8, 8192, None
            else:
                contexts = mixed_lengths(256, generated, "longest first")
                what, batch, context = f"W1 +{generated} longest first", 256, max(contexts)
            try:
                _, tbs, _ = bench_decode(
                    batch, context, FP8_BS, cfg, splits=splits, kv_dtype=FP8, contexts=contexts
                )
            except Exception as e:  # out of shared memory, say
                print(f"warps fp8 {what}, splits {splits}: {type(e).__name__} {cfg}", flush=True)
                continue
            print(f"warps fp8 {what}, splits {splits}: {tbs:.2f} TB/s {cfg}", flush=True)
    for tbs, splits, cfg in ranked[:5]:
        print(f"warps fp8 b256x1024 bs{FP8_BS} (top 5): {tbs:.2f} TB/s (splits {splits}) {cfg}", flush=True)


def sweep_decode(batch: int, context: int, block_size: int, kv_dtype: torch.dtype, grid):
    """(TB/s, splits used, config) of each configuration of the grid that launches, best first."""
    results = []
    for splits, cfg in grid:
        try:
            _, tbs, used = bench_decode(batch, context, block_size, cfg, splits, kv_dtype)
        except Exception as e:  # out of shared memory, say
            print(f"  {cfg}: {type(e).__name__}")
            continue
        results.append((tbs, used, cfg))
    return sorted(results, key=lambda r: -r[0])


def launch_for_profiler(batch: int = 256, context: int = 1024) -> None:
    """The decode kernel on a bf16 and an fp8 cache, launched eagerly (a profiler such as Nsight
    Compute sees each launch; gpu_run.sh's attention-ncu stage): twice each, the first compiles."""
    for kv_dtype in (DTYPE, FP8):
        x = paged_decode_inputs(batch, context, 16, kv_dtype)
        out = torch.empty_like(x["q"])
        meta = (x["block_tables"], x["context_lens"], x["cu_seqlens_q"])
        for _ in range(2):
            tk.paged_decode(x["q"], x["k_cache"], x["v_cache"], out, *meta, SCALE, kv_scales=(0.5, 0.5))
        torch.cuda.synchronize()


def main() -> None:
    global NUM_HEADS, NUM_KV_HEADS, FP8_BS
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="also time a grid of decode configurations")
    parser.add_argument(
        "--sweep-fp8",
        action="store_true",
        help="only the fp8 decode grid (at --fp8-block-size; K/V widened to q's dtype or fp16)",
    )
    parser.add_argument(
        "--fp8-block-size",
        type=int,
        default=FP8_DEFAULT_BLOCK_SIZE,
        help="the fp8 sweeps' block size (default: the engine's for an e4m3 cache)",
    )
    parser.add_argument("--sweep-bf16", action="store_true", help="only the bf16 decode grid (block size 16)")
    parser.add_argument(
        "--sweep-fp8-registers",
        action="store_true",
        help="today's fp8 decode config under register caps (maxnreg), b256x1024 and W1's contexts",
    )
    parser.add_argument(
        "--sweep-fp8-quick",
        action="store_true",
        help="six fp8 decode tiles at b256x1024 (at --fp8-block-size)",
    )
    parser.add_argument(
        "--sweep-layout",
        action="store_true",
        help="bf16 and fp8 decode at b256x1024 over block sizes 8-256, blocks random or sequential",
    )
    parser.add_argument(
        "--sweep-mixed-lengths",
        action="store_true",
        help="decode at b256 over W1's mixed contexts: grid orders and splits against one context",
    )
    parser.add_argument(
        "--sweep-fp8-block-sizes",
        action="store_true",
        help="the fp8 decode kernel at block sizes 32-256: b256x1024 and W1's mixed contexts",
    )
    parser.add_argument(
        "--sweep-context",
        action="store_true",
        help="bf16 and fp8 decode over the same bytes as b256x1024 in fewer, longer contexts (no splits)",
    )
    parser.add_argument(
        "--sweep-stages",
        action="store_true",
        help="the decode tiles at 3 and at 5-7 stages (two or more K/V buffers), both caches",
    )
    parser.add_argument(
        "--sweep-warps",
        action="store_true",
        help="the fp8 decode kernel in programs of one or two warps, over splits, against the default",
    )
    parser.add_argument(
        "--sweep-fp8-mma",
        action="store_true",
        help="the fp8 decode kernel in e4m3 MMAs (FP8_MMA) over tiles, against today's config",
    )
    parser.add_argument(
        "--sweep-fp8-mma-quick", action="store_true", help="--sweep-fp8-mma over eight configurations only"
    )
    parser.add_argument(
        "--sweep-fp8-tma",
        action="store_true",
        help="the decode tiles through TMA (TMA_KV) against their pointer loads (at --fp8-block-size >= 64)",
    )
    parser.add_argument(
        "--heads",
        type=int,
        nargs=2,
        metavar=("QUERY", "KV"),
        default=(NUM_HEADS, NUM_KV_HEADS),
        help="query and KV heads (default Qwen3-0.6B's 16 8; Qwen3-30B-A3B: 32 4)",
    )
    parser.add_argument(
        "--ncu",
        action="store_true",
        help="only launch the bf16 and fp8 decode kernels at b256x1024 eagerly, twice each (for ncu)",
    )
    parser.add_argument(
        "--store",
        action="store_true",
        help="only store_kv: a prefill's 8,192 tokens and a decode step's 256, bf16 and fp8 caches",
    )
    args = parser.parse_args()
    NUM_HEADS, NUM_KV_HEADS = args.heads
    FP8_BS = args.fp8_block_size
    if args.store:
        for (num_tokens, run), block_size, kv_dtype in itertools.product(
            ((8192, 512), (256, 1)), (16, FP8_DEFAULT_BLOCK_SIZE), (DTYPE, FP8)
        ):
            us, gbs = bench_store(num_tokens, run, block_size, kv_dtype)
            what = "prefill" if run > 1 else "decode"
            name = "fp8" if kv_dtype == FP8 else "bf16"
            print(
                f"store {what} {num_tokens} tokens {name} block size {block_size}: {us:.1f} us, {gbs:.0f} GB/s written"
            )
        # An e4m3 decode store with no block start (no zeroing) and with one in every token.
        for block_size, decode_at in itertools.product(
            (16, FP8_DEFAULT_BLOCK_SIZE), ("mid-block", "block start")
        ):
            us, gbs = bench_store(256, 1, block_size, FP8, decode_at)
            print(
                f"store decode 256 tokens fp8 block size {block_size}, {decode_at}: {us:.1f} us, {gbs:.0f} GB/s written"
            )
        return
    if args.ncu:
        launch_for_profiler()
        return
    print(f"{NUM_HEADS} query heads, {NUM_KV_HEADS} KV heads, head_dim {HEAD_DIM}")
    torch.manual_seed(0)
    if args.sweep_mixed_lengths:
        sweep_mixed_lengths()
        return
    if args.sweep_context:
        sweep_context()
        return
    if args.sweep_fp8_block_sizes:
        sweep_fp8_block_sizes()
        return
    if args.sweep_stages:
        sweep_stages()
        return
    if args.sweep_fp8_mma or args.sweep_fp8_mma_quick or args.sweep_fp8_tma:
        sweep_fp8_mma((FP8_BS,), quick=args.sweep_fp8_mma_quick, tma=args.sweep_fp8_tma)
        return
    if args.sweep_warps:
        sweep_warps()
        return
    if args.sweep_layout:
        variants = [
            ("bf16", DTYPE, None),
            ("fp8", FP8, None),
            ("fp8 BLOCK_N 64", FP8, {"BLOCK_N": 64}),
            ("fp8 BLOCK_N 256", FP8, {"BLOCK_N": 256, "num_stages": 2}),
            ("fp8 BLOCK_N 128 8 warps", FP8, {"num_warps": 8}),
        ]
        for (name, kv_dtype, cfg), block_size, sequential in itertools.product(
            variants, (8, 16, 32, 64, 256), (False, True)
        ):
            _, tbs, _ = bench_decode(256, 1024, block_size, cfg, kv_dtype=kv_dtype, sequential=sequential)
            order = "sequential" if sequential else "random"
            print(f"layout {name} b256x1024 bs{block_size} {order} blocks: {tbs:.2f} TB/s")
        # The caches' memory layouts (LAYOUTS), the default fp8 kernel, random blocks.
        for layouts, block_size in itertools.product(
            (("K head-major",), ("V heads by dim",), ("K head-major", "V heads by dim")), (16, 32, 64)
        ):
            _, tbs, _ = bench_decode(256, 1024, block_size, kv_dtype=FP8, layouts=layouts)
            print(f"layout fp8 {' + '.join(layouts)} b256x1024 bs{block_size} random blocks: {tbs:.2f} TB/s")
        return
    shapes = [(256, 1024), (8, 8192)]
    for batch, context in shapes:
        for block_size in (16, 256):
            ms, tbs, splits = bench_decode(batch, context, block_size)
            print(
                f"decode b{batch}x{context} block size {block_size}: {ms * 1e3:.1f} us, "
                f"{tbs:.2f} TB/s (splits {splits}, {tk.DECODE_CONFIG})"
            )
            if block_size == 16:
                headline = tbs
        ref = bench_varlen_decode(batch, context)
        if ref:
            print(f"varlen_attn contiguous b{batch}x{context}: {ref[0] * 1e3:.1f} us, {ref[1]:.2f} TB/s")
        # The headline is the engine's default block size, 16.
        print(f"decode kernel b{batch}x{context}: {headline:.2f} TB/s")
        # (an e4m3 cache's default block size is 32: executor_service/config.py)
        for block_size in (16, FP8_DEFAULT_BLOCK_SIZE, 256):
            ms, tbs, splits = bench_decode(batch, context, block_size, kv_dtype=FP8)
            print(
                f"decode fp8 b{batch}x{context} block size {block_size}: {ms * 1e3:.1f} us, "
                f"{tbs:.2f} TB/s of fp8 bytes (splits {splits}, {tk.DECODE_CONFIG_FP8})"
            )
            if block_size == FP8_DEFAULT_BLOCK_SIZE:
                headline = tbs
        print(f"decode kernel fp8 b{batch}x{context}: {headline:.2f} TB/s")
    if args.sweep_bf16:
        for batch, context in shapes:
            for tbs, used, cfg in sweep_decode(batch, context, 16, DTYPE, tile_grid(batch))[:6]:
                print(f"sweep bf16 b{batch}x{context} bs16: {tbs:.2f} TB/s splits {used} {cfg}")
        return
    if args.sweep_fp8_registers:
        sweep_fp8_registers()
        return
    if args.sweep_fp8 or args.sweep_fp8_quick:
        for batch, context in shapes[:1] if args.sweep_fp8_quick else shapes:
            for tbs, used, cfg in sweep_decode(
                batch, context, FP8_BS, FP8, fp8_tile_grid(args.sweep_fp8_quick)
            )[:6]:
                print(
                    f"sweep fp8 b{batch}x{context} bs{FP8_BS}: {tbs:.2f} TB/s of fp8 bytes splits {used} {cfg}"
                )
        return
    for block_size in (16, 256):
        bench_prefill(64, 512, block_size)
    if args.sweep:
        for (batch, context), block_size, kv_dtype in itertools.product(shapes, (16, 256), (DTYPE, FP8)):
            name = "fp8" if kv_dtype == FP8 else "bf16"
            for tbs, used, cfg in sweep_decode(batch, context, block_size, kv_dtype, tile_grid(batch))[:4]:
                print(f"sweep {name} b{batch}x{context} bs{block_size}: {tbs:.2f} TB/s splits {used} {cfg}")


if __name__ == "__main__":
    main()
