"""The fused MoE layer on the GPU at the Qwen3-30B-A3B shape (128 experts, top 8, hidden 2048,
moe_intermediate 768, bf16): its effective weight bandwidth at decode sizes against the device's
copy rate, its parts (align, gate/up, down, sum over top_k), and its time against the reference loop
over experts, at decode and prefill token counts. `--sweep` times each GEMM alone over a grid of
tiles per token count and BLOCK_M (compiled first in parallel worker processes) and prints the
best pair per token count, to tune CONFIGS in executor_service/layers/fused_moe_triton.py.
`--fp8` adds the same experts in e4m3 with 128 x 128 block scales (an FP8 checkpoint's, the W8A8
GEMMs) beside bf16: their time, weight bandwidth and parts; with `--sweep`, it sweeps fp8's tiles
(BLOCK_K 128) instead.

    python bench/moe.py                 # prints "fused MoE at batch 256: ..." and one line per token count
    python bench/moe.py --fp8           # and "  fp8 experts: ..." under each
    python bench/moe.py --sweep --num-tokens 64 256 [--fp8]
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from executor_service.layers import fused_moe_triton as moe_kernels
from executor_service.layers.fused_moe_triton import MoEConfig, fused_experts, get_config
from executor_service.layers.moe import experts_reference, route

E, TOP_K, HIDDEN, N = 128, 8, 2048, 768


def timed(fn, iters: int = 20) -> float:
    """Seconds per call, from CUDA graph replays (no launch overhead, as in a decode step)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters / 1e3


def timed_eager(fn, iters: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters / 1e3


def copy_rate() -> float:
    """Device-to-device copy, bytes read + written per second (BENCH.md's 4.24 TB/s)."""
    src = torch.empty(1 << 28, dtype=torch.float32, device="cuda")  # 1 GiB, copied 16 bytes a thread
    dst = torch.empty_like(src)
    timed(lambda: dst.copy_(src), iters=200)  # the clocks up first
    seconds = timed(lambda: dst.copy_(src), iters=100)
    return 2 * src.numel() * src.element_size() / seconds


def inputs(num_tokens: int):
    gen = torch.Generator("cuda").manual_seed(0)
    x = torch.randn(num_tokens, HIDDEN, device="cuda", generator=gen).bfloat16()
    router = torch.randn(E, HIDDEN, device="cuda", generator=gen).bfloat16() * 0.05
    weights, ids = route(x, router, TOP_K, True)
    return x, weights, ids


def weights():
    w13 = (torch.randn(E, 2 * N, HIDDEN, device="cuda") * 0.02).bfloat16()
    w2 = (torch.randn(E, HIDDEN, N, device="cuda") * 0.02).bfloat16()
    return w13, w2


def fp8_weights(w13, w2):
    """-> (e4m3 w13, its scales, e4m3 w2, its scales): the experts as an FP8 checkpoint holds them."""
    from executor_service.fp8 import quantize_weight_blocks

    def quantize(w):
        pairs = [quantize_weight_blocks(w[e]) for e in range(w.shape[0])]
        return torch.stack([q for q, _ in pairs]), torch.stack([s for _, s in pairs])

    (w13_q, w13_s), (w2_q, w2_s) = quantize(w13), quantize(w2)  # N = 768: gate and up blocks apart
    return w13_q, w13_s, w2_q, w2_s


def parts_fp8(x, w13_q, w13_s, w2_q, w2_s, weights, ids, config) -> dict[str, float]:
    """Seconds of the fp8 path's own steps, each alone from a graph."""
    from executor_service.layers.fp8_gemm_triton import quantize_per_token_group

    gate_up_config, down_config = config
    aligned = moe_kernels.align_block_size(ids, E, gate_up_config.BLOCK_M)
    inter = moe_kernels.gate_up(x, w13_q, aligned, TOP_K, gate_up_config, w13_s)
    return {
        "quantize x": timed(lambda: quantize_per_token_group(x)),
        "gate/up": timed(lambda: moe_kernels.gate_up(x, w13_q, aligned, TOP_K, gate_up_config, w13_s)),
        "quantize intermediate": timed(lambda: quantize_per_token_group(inter)),
        "down": timed(lambda: moe_kernels.down(inter, w2_q, weights, aligned, down_config, w2_s)),
    }


def parts(x, w13, w2, weights, ids, config) -> dict[str, float]:
    """Seconds of each step of fused_experts, each alone from a graph."""
    gate_up_config, down_config = config
    aligned = moe_kernels.align_block_size(ids, E, gate_up_config.BLOCK_M)
    inter = moe_kernels.gate_up(x, w13, aligned, TOP_K, gate_up_config)
    y = moe_kernels.down(inter, w2, weights, aligned, down_config)
    router = torch.randn(E, HIDDEN, device="cuda").bfloat16()
    counts = moe_kernels.route_counts(x.shape[0], E, x.device)
    if counts is not None:
        _, counted_ids = moe_kernels.route(x, router, TOP_K, True, counts=counts)
    extra = {} if counts is None else {
        "route + counts": timed(lambda: moe_kernels.route(x, router, TOP_K, True, counts=counts)),
        "align from counts": timed(
            lambda: moe_kernels.align_block_size(counted_ids, E, gate_up_config.BLOCK_M, counts)
        ),
    }  # fmt: skip
    return {
        "torch align": timed(lambda: moe_kernels.align_block_size_reference(ids, E, gate_up_config.BLOCK_M)),
        "align": timed(lambda: moe_kernels.align_block_size(ids, E, gate_up_config.BLOCK_M)),
        "gate/up": timed(lambda: moe_kernels.gate_up(x, w13, aligned, TOP_K, gate_up_config)),
        "down": timed(lambda: moe_kernels.down(inter, w2, weights, aligned, down_config)),
        "sum": timed(lambda: moe_kernels.sum_topk(y, TOP_K)),
        "torch route": timed(lambda: route(x, router, TOP_K, True)),
        "route": timed(lambda: moe_kernels.route(x, router, TOP_K, True)),
        **extra,
    }


# -- the sweep -----------------------------------------------------------------------------------

SWEEP_BLOCK_M = {16: [16], 64: [16, 32, 64], 128: [16, 32, 64], 256: [16, 32, 64], 512: [16, 32, 64],
                 2048: [32, 64, 128], 8192: [64, 128]}  # fmt: skip


def tile_grid(block_m: int, weight_tiles: int, fp8: bool = False) -> list[MoEConfig]:
    """Candidate tiles of one GEMM (gate/up: 2 weight tiles, down: 1) that fit shared memory and keep
    the fp32 accumulators at most 128 registers a thread (fp8: one-byte operands, BLOCK_K 128)."""
    grid = []
    block_ks, size = ([128], 1) if fp8 else ([64, 128, 256], 2)
    for bn, bk, warps, stages in itertools.product([32, 64, 128, 256], block_ks, [4, 8], [2, 3, 4, 5]):
        smem = stages * (block_m + weight_tiles * bn) * bk * size
        acc = block_m * bn * weight_tiles / (warps * 32)
        if smem <= 227 * 1024 and 4 <= acc <= 128:
            grid.append(MoEConfig(block_m, bn, bk, warps, stages))
    return grid


def candidates(num_tokens_list, fp8: bool = False) -> list[tuple[str, MoEConfig]]:
    block_ms = sorted({bm for n in num_tokens_list for bm in SWEEP_BLOCK_M.get(n, [16, 32, 64])})
    return [
        (g, c) for bm in block_ms for g, wt in (("gate/up", 2), ("down", 1)) for c in tile_grid(bm, wt, fp8)
    ]


def experts(fp8: bool):
    """(w13, w2, w13 scales, w2 scales): bf16 experts, or e4m3 with block scales."""
    w13, w2 = weights()
    if not fp8:
        return w13, w2, None, None
    w13_q, w13_s, w2_q, w2_s = fp8_weights(w13, w2)
    return w13_q, w2_q, w13_s, w2_s


def compile_some(jobs, fp8: bool = False) -> list[tuple[str, MoEConfig]]:
    """In a worker process: launch each (GEMM, tiles) once, which compiles it into Triton's on-disk
    cache for the parent. -> the ones that failed (out of resources)."""
    torch.manual_seed(0)
    w13, w2, w13_s, w2_s = experts(fp8)
    x, weights_, ids = inputs(256)
    failed = []
    for gemm, config in jobs:
        try:
            aligned = moe_kernels.align_block_size(ids, E, config.BLOCK_M)
            if gemm == "gate/up":
                moe_kernels.gate_up(x, w13, aligned, TOP_K, config, w13_s)
            else:
                inter = torch.randn(ids.numel(), N, device="cuda").bfloat16()
                moe_kernels.down(inter, w2, weights_, aligned, config, w2_s)
            torch.cuda.synchronize()
        except Exception:  # out of shared memory or registers: not a candidate
            failed.append((gemm, config))
    return failed


def sweep(num_tokens_list, fp8: bool) -> None:
    jobs = candidates(num_tokens_list, fp8)
    workers = 14
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        shares = [(jobs[i::workers], fp8) for i in range(workers)]
        failed = set(itertools.chain(*pool.starmap(compile_some, shares)))
    print(
        f"sweep{' (fp8)' if fp8 else ''}: {len(jobs)} GEMM tiles compiled, {len(failed)} failed", flush=True
    )
    w13, w2, w13_s, w2_s = experts(fp8)
    for num_tokens in num_tokens_list:
        sweep_tokens(num_tokens, [job for job in jobs if job not in failed], w13, w2, w13_s, w2_s)


def sweep_tokens(num_tokens: int, jobs, w13, w2, w13_s=None, w2_s=None) -> None:
    x, weights_, ids = inputs(num_tokens)
    rows = []
    for bm in SWEEP_BLOCK_M.get(num_tokens, [16, 32, 64]):
        aligned = moe_kernels.align_block_size(ids, E, bm)
        inter = torch.randn(ids.numel(), N, device="cuda").bfloat16()
        best = {"gate/up": [], "down": []}
        for gemm, c in jobs:
            if c.BLOCK_M != bm:  # noqa: SIM300
                continue
            if gemm == "gate/up":
                seconds = timed(lambda c=c, a=aligned: moe_kernels.gate_up(x, w13, a, TOP_K, c, w13_s))
            else:
                seconds = timed(lambda c=c, a=aligned, i=inter: moe_kernels.down(i, w2, weights_, a, c, w2_s))
            best[gemm].append((seconds, c))
        for gemm, timings in best.items():
            timings.sort(key=lambda t: t[0])
            top = ", ".join(f"{_tiles(c)} {t * 1e6:.0f}" for t, c in timings[:3])
            print(f"  {num_tokens} tokens, BLOCK_M {bm}, {gemm}: {top} us", flush=True)
        (gu_time, gu), (down_time, dn) = best["gate/up"][0], best["down"][0]
        rows.append((gu_time + down_time, gu, dn))
    _, gate_up_config, down_config = min(rows, key=lambda r: r[0])
    scales = {"w13_scale": w13_s, "w2_scale": w2_s}
    best = (gate_up_config, down_config)
    layer = timed(lambda: fused_experts(x, w13, w2, weights_, ids, best, **scales))
    now = get_config(num_tokens, fp8=w13_s is not None)
    before = timed(lambda: fused_experts(x, w13, w2, weights_, ids, now, **scales))
    print(
        f"best at {num_tokens}: _tiles({gate_up_config.BLOCK_M}, {_tiles(gate_up_config)}, "
        f"{_tiles(down_config)}): layer {layer * 1e6:.0f} us (CONFIGS now: {before * 1e6:.0f} us)",
        flush=True,
    )


def _tiles(c: MoEConfig) -> tuple[int, int, int, int]:
    return (c.BLOCK_N, c.BLOCK_K, c.num_warps, c.num_stages)


def route_grid() -> list[tuple[int, int, int, int]]:
    """The router's (BLOCK_K, warps, stages, splits) candidates whose tiles fit shared memory and
    whose splits are at least one BLOCK_K of the hidden dimension wide."""

    def fits(bk: int, warps: int, stages: int) -> bool:  # route() would not shrink its tiles
        tiles = MoEConfig(moe_kernels.ROUTE_BLOCK_T, E, bk, warps, stages)
        return moe_kernels.fit_shared_memory(tiles, 1, 2) == tiles

    grid = itertools.product([64, 128, 256, 512], [4, 8], [2, 3, 4], [1, 2, 4, 8, 16])
    return [(bk, w, st, sp) for bk, w, st, sp in grid if fits(bk, w, st) and bk * sp <= HIDDEN]


def sweep_route(token_counts: list[int]) -> None:
    """The router's (BLOCK_K, warps, stages, splits) per token count, best first, against the
    default; then the align kernel's warps."""
    router = torch.randn(E, HIDDEN, device="cuda").bfloat16()
    for num_tokens in token_counts:
        x, _, _ = inputs(num_tokens)
        want = moe_kernels.route(x, router, TOP_K, True)
        counts = moe_kernels.route_counts(num_tokens, E, x.device)
        results = []
        for config in route_grid():
            try:
                got = moe_kernels.route(x, router, TOP_K, True, config)
                torch.testing.assert_close(got[1], want[1], atol=0, rtol=0)
                seconds = timed(
                    lambda x=x, c=config, n=counts: moe_kernels.route(x, router, TOP_K, True, c, n)
                )
                results.append((seconds, config))
            except Exception as e:  # out of resources, or a different routing
                print(f"  route {config}: {type(e).__name__}: {str(e)[:80]}")
        default = next(t for t, c in results if c == moe_kernels.ROUTE_CONFIG)
        best = sorted(results)[:5]
        print(
            f"route (with counts) at {num_tokens} tokens: default {moe_kernels.ROUTE_CONFIG} {default * 1e6:.1f} us; "
            "best " + ", ".join(f"{c} {t * 1e6:.1f}" for t, c in best),
            flush=True,
        )
        if counts is not None:
            _, ids = moe_kernels.route(x, router, TOP_K, True, counts=counts)
            block_m = get_config(num_tokens)[0].BLOCK_M
            align = {
                w: timed(lambda w=w, i=ids, b=block_m, n=counts: moe_kernels.align_block_size(i, E, b, n, w))
                for w in (1, 2, 4, 8)
            }
            print(
                f"align from counts at {num_tokens} tokens (default {moe_kernels.ALIGN_WARPS} warps): "
                + ", ".join(f"{w} warps {t * 1e6:.1f} us" for w, t in align.items()),
                flush=True,
            )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-tokens", type=int, nargs="*", default=[1, 8, 32, 64, 128, 256, 512, 2048, 8192])
    p.add_argument("--sweep", action="store_true", help="time a grid of tiles per GEMM and token count")
    p.add_argument("--fp8", action="store_true", help="also time e4m3 experts with block scales (W8A8)")
    p.add_argument("--sweep-route", action="store_true", help="time the router kernel's launch grid")
    args = p.parse_args()
    if args.sweep_route:
        sweep_route(args.num_tokens)
        return
    if args.sweep:
        sweep(args.num_tokens, args.fp8)
        return
    w13, w2 = weights()
    expert_bytes = (w13[0].numel() + w2[0].numel()) * 2
    if args.fp8:
        w13_q, w13_s, w2_q, w2_s = fp8_weights(w13, w2)
        fp8_expert_bytes = w13_q[0].numel() + w2_q[0].numel() + (w13_s[0].numel() + w2_s[0].numel()) * 4
        scales = {"w13_scale": w13_s, "w2_scale": w2_s}
    rate = copy_rate()
    print(f"device {torch.cuda.get_device_name()}: copy rate {rate / 1e12:.2f} TB/s (read + write)")
    for num_tokens in args.num_tokens:
        x, weights_, ids = inputs(num_tokens)
        config = get_config(num_tokens)
        fused = timed(lambda x=x, w=weights_, ids=ids: fused_experts(x, w13, w2, w, ids))
        loop = timed_eager(lambda x=x, w=weights_, ids=ids: experts_reference(x, w13, w2, w, ids))
        touched = int(torch.unique(ids).numel())
        bandwidth = touched * expert_bytes / fused
        split = ", ".join(f"{k} {v * 1e6:.1f}" for k, v in parts(x, w13, w2, weights_, ids, config).items())
        print(
            f"fused MoE at batch {num_tokens}: {fused * 1e6:.0f} us, {touched} experts = "
            f"{touched * expert_bytes / 1e9:.2f} GB of weights at {bandwidth / 1e12:.2f} TB/s "
            f"({bandwidth / rate:.0%} of the copy rate); expert loop {loop * 1e6:.0f} us = "
            f"{loop / fused:.1f}x the fused kernel\n  parts (us, each alone): {split}\n"
            f"  tiles: gate/up {config[0]}, down {config[1]}",
            flush=True,
        )
        if args.fp8:
            config = get_config(num_tokens, fp8=True)
            fp8 = timed(lambda x=x, w=weights_, ids=ids: fused_experts(x, w13_q, w2_q, w, ids, **scales))
            bandwidth = touched * fp8_expert_bytes / fp8
            split = ", ".join(
                f"{k} {v * 1e6:.1f}"
                for k, v in parts_fp8(x, w13_q, w13_s, w2_q, w2_s, weights_, ids, config).items()
            )
            print(
                f"  fp8 experts: {fp8 * 1e6:.0f} us = {fp8 / fused:.2f}x bf16, "
                f"{touched * fp8_expert_bytes / 1e9:.2f} GB of weights and scales at "
                f"{bandwidth / 1e12:.2f} TB/s ({bandwidth / rate:.0%} of the copy rate)\n"
                f"  fp8 parts (us, each alone): {split}\n  fp8 tiles: gate/up {config[0]}, down {config[1]}",
                flush=True,
            )


if __name__ == "__main__":
    main()
