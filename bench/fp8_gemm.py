"""The W8A8 block-scaled GEMM (executor_service/layers/fp8_gemm_triton.py) on the GPU, at Qwen3-8B's
linear shapes and decode / prefill token counts: time (activation quantization included) against the
bf16 GEMM (torch.matmul on the dequantized weights) and against torch._scaled_mm where this torch
takes 128-block scales, and the relative error of each against the bf16 GEMM.

    python bench/fp8_gemm.py [--sweep]

Times are of CUDA-graph replays (as the engine's decode steps run), so that a few-microsecond
kernel is not measured as Python's launch overhead. --sweep times a grid of launch configurations
(tile sizes, stages, split-K) of the Triton GEMM at each shape and token count.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from executor_service.fp8 import dequantize_weight_blocks, quantize_weight_blocks
from executor_service.layers.fp8_gemm_triton import (
    fp8_linear,
    quantize_per_token_group,
    scaled_mm_applies,
    scaled_mm_blockwise,
    w8a8_block_matmul,
)

# Qwen3-8B: qkv (4096 -> 6144), o (4096 -> 4096), gate_up (4096 -> 24576), down (12288 -> 4096).
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
TOKENS = (1, 16, 64, 128, 256, 2048, 8192)


def time_ms(fn) -> float:
    """fn replayed from a CUDA graph, median of the replays."""
    fn()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return triton.testing.do_bench(graph.replay, warmup=25, rep=200, return_mode="median")


def sweep(name: str, n: int, k: int, w_q: torch.Tensor, w_s: torch.Tensor) -> None:
    for m in (1, 64, 256, 2048):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        a_q, a_s = quantize_per_token_group(x)
        grid = {
            1: itertools.product((16,), (32, 64, 128), (4,), (3, 5), (1, 2, 4, 8)),
            64: itertools.product((16, 64), (32, 64, 128), (4,), (3, 5), (1, 2, 4)),
            256: itertools.product((64, 128), (64, 128), (4, 8), (3, 4), (1,)),
            2048: itertools.product((128,), (64, 128), (4, 8), (3, 4), (1,)),
        }[m]
        results = []
        for bm, bn, warps, stages, split_k in grid:
            cfg = {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": warps, "num_stages": stages, "SPLIT_K": split_k}
            try:
                t = time_ms(lambda: w8a8_block_matmul(a_q, a_s, w_q, w_s, torch.bfloat16, cfg))  # noqa: B023
            except Exception as e:  # out of shared memory, say
                print(f"  {name} m={m} {cfg}: {type(e).__name__}")
                continue
            results.append((t, cfg))
        weight_bytes = n * k
        for t, cfg in sorted(results, key=lambda r: r[0])[:3]:
            print(
                f"sweep {name} m={m}: {t * 1e3:.1f} us ({weight_bytes / t / 1e9:.2f} TB/s of weights) {cfg}",
                flush=True,
            )


def _scaled_mm_recipes(x, w_q, w_s):
    """torch.nn.functional.scaled_mm with explicit BlockWise1x128 / BlockWise128x128 recipes, the
    activations laid out as for torch._scaled_mm."""
    import torch.nn.functional as F

    a_q, a_s = quantize_per_token_group(x, rows_multiple=4)
    out = F.scaled_mm(
        a_q, w_q.t(), a_s, F.ScalingType.BlockWise1x128, w_s.t(), F.ScalingType.BlockWise128x128,
        output_dtype=torch.bfloat16,
    )  # fmt: skip
    return out[: x.shape[0]]


# torch._scaled_mm as fp8_linear calls it, and F.scaled_mm with explicit recipes.
SCALED_MM = {"torch._scaled_mm": scaled_mm_blockwise, "F.scaled_mm blockwise": _scaled_mm_recipes}


def scaled_mm(x: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor, how: str):
    """One of torch's scaled matmuls with per-token-group activation scales (quantization included)
    and 128x128 weight scales; the reason in a string where this torch refuses them."""
    try:
        return SCALED_MM[how](x, w_q, w_s)
    except (RuntimeError, TypeError, ValueError, AttributeError, NotImplementedError) as e:
        return (str(e).splitlines() or [type(e).__name__])[0][:120]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="time a grid of GEMM launch configurations")
    args = parser.parse_args()
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    for name, (n, k) in SHAPES.items():
        w_q, w_s = quantize_weight_blocks(torch.randn(n, k, device="cuda") * 0.02)
        w = dequantize_weight_blocks(w_q, w_s, torch.bfloat16)
        if args.sweep:
            sweep(name, n, k, w_q, w_s)
            continue
        for m in TOKENS:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = x @ w.T
            ours = fp8_linear(x, w_q, w_s)
            path = "torch._scaled_mm" if scaled_mm_applies(m, n, k, x.dtype, x.device) else "triton"
            a_q, a_s = quantize_per_token_group(x)
            t_triton = time_ms(lambda: w8a8_block_matmul(a_q, a_s, w_q, w_s, torch.bfloat16))  # noqa: B023
            t_bf16 = time_ms(lambda: x @ w.T)  # noqa: B023
            t_fp8 = time_ms(lambda: fp8_linear(x, w_q, w_s))  # noqa: B023
            line = (
                f"{name} m={m} n={n} k={k}: bf16 {t_bf16 * 1e3:.1f} us, fp8_linear ({path}) {t_fp8 * 1e3:.1f} us "
                f"({t_bf16 / t_fp8:.2f}x, rel err {rel(ours, ref):.4f}), the triton GEMM alone "
                f"{t_triton * 1e3:.1f} us"
            )
            for how in SCALED_MM:
                mm = scaled_mm(x, w_q, w_s, how)
                if isinstance(mm, torch.Tensor):
                    t_mm = time_ms(lambda how=how: scaled_mm(x, w_q, w_s, how))  # noqa: B023
                    line += f", {how} {t_mm * 1e3:.1f} us ({t_bf16 / t_mm:.2f}x, rel err {rel(mm, ref):.4f})"
                else:
                    line += f", {how} not usable: {mm}"
            print(line, flush=True)


if __name__ == "__main__":
    main()
