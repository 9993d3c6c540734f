"""The fused MoE layer on the GPU at the Qwen3-30B-A3B shape (128 experts, top 8, hidden 2048,
moe_intermediate 768, bf16): its effective weight bandwidth at decode sizes against the device's
copy rate, and its time against the reference loop over experts, at decode and prefill token counts.
`--sweep` times every tile configuration of a grid per token count, to tune CONFIGS in
executor_service/layers/fused_moe_triton.py.

    python bench/moe.py                 # prints "fused MoE at batch 256: ..." and one line per token count
    python bench/moe.py --sweep
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

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
    seconds = timed(lambda: dst.copy_(src))
    return 2 * src.numel() * src.element_size() / seconds


def inputs(num_tokens: int):
    gen = torch.Generator("cuda").manual_seed(0)
    x = torch.randn(num_tokens, HIDDEN, device="cuda", generator=gen).bfloat16()
    router = torch.randn(E, HIDDEN, device="cuda", generator=gen).bfloat16() * 0.05
    weights, ids = route(x, router, TOP_K, True)
    return x, weights, ids


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-tokens", type=int, nargs="*", default=[1, 8, 32, 64, 128, 256, 512, 2048, 8192])
    p.add_argument("--sweep", action="store_true", help="time a grid of tile configurations per token count")
    args = p.parse_args()
    w13 = (torch.randn(E, 2 * N, HIDDEN, device="cuda") * 0.02).bfloat16()
    w2 = (torch.randn(E, HIDDEN, N, device="cuda") * 0.02).bfloat16()
    expert_bytes = (w13[0].numel() + w2[0].numel()) * 2
    rate = copy_rate()
    print(f"device {torch.cuda.get_device_name()}: copy rate {rate / 1e12:.2f} TB/s (read + write)")
    for num_tokens in args.num_tokens:
        x, weights, ids = inputs(num_tokens)
        fused = timed(lambda x=x, weights=weights, ids=ids: fused_experts(x, w13, w2, weights, ids))
        loop = timed_eager(lambda x=x, weights=weights, ids=ids: experts_reference(x, w13, w2, weights, ids))
        touched = int(torch.unique(ids).numel())
        bandwidth = touched * expert_bytes / fused
        line = (
            f"fused MoE at batch {num_tokens}: {fused * 1e6:.0f} us, {touched} experts = "
            f"{touched * expert_bytes / 1e9:.2f} GB of weights at {bandwidth / 1e12:.2f} TB/s "
            f"({bandwidth / rate:.0%} of the copy rate); expert loop {loop * 1e6:.0f} us = "
            f"{loop / fused:.1f}x the fused kernel (config {get_config(num_tokens)})"
        )
        print(line, flush=True)
        if args.sweep:
            best = None
            grid = itertools.product([16, 32, 64, 128], [64, 128, 256], [64, 128], [4, 8], [2, 3, 4])
            for bm, bn, bk, warps, stages in grid:
                config = MoEConfig(bm, bn, bk, warps, stages)
                try:
                    seconds = timed(
                        lambda c=config, x=x, w=weights, i=ids: fused_experts(x, w13, w2, w, i, c), iters=10
                    )
                except Exception as e:  # out of shared memory: not a candidate
                    print(f"  {config}: {type(e).__name__}")
                    continue
                if best is None or seconds < best[0]:
                    best = (seconds, config)
            print(f"  best at {num_tokens}: {best[1]} {best[0] * 1e6:.0f} us", flush=True)


if __name__ == "__main__":
    main()
