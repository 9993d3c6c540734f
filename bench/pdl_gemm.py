"""Whether Programmatic Dependent Launch hides a decode GEMM's ramp: a chain of layers, each a small
row kernel (an RMSNorm's shape of work) then a bf16 GEMM with that layer's own weights, captured in
one CUDA graph and replayed, the way the engine's decode step runs them.

bench/bf16_gemm.py found each of W1's decode GEMMs about 5 us over the time its weights take to
stream, whatever the tile: a kernel in a graph starts only once the one before it ends, and then
ramps up to full bandwidth. With PDL (sm90: `launch_pdl=True`, `gdc_launch_dependents` /
`gdc_wait`), the GEMM is launched while the row kernel runs, prefetches its weight tile into L2
(the weights do not depend on the kernel before), and waits only before it reads the activation.

Variants, each per layer (row kernel + GEMM), best tile of a few per shape:
  cublas     the row kernel, then F.linear (the engine today)
  triton     the row kernel, then the Triton GEMM, no PDL
  pdl        both launched with PDL, each triggering its dependents at its start
  pdl+pf     pdl, the GEMM prefetching its weight tile into L2 before it waits

Every Triton result is checked against fp32 first.

    python bench/pdl_gemm.py [--shape qwen3-0.6b] [--tokens 64 128 256]
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bf16_gemm import LAYERS, SHAPES, k_step_operands


@triton.jit
def row_kernel(x_ptr, y_ptr, n, stride_x, stride_y, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """y[row, :n] = x[row, :n] * rsqrt(mean(x[row, :n]^2) + eps): an RMSNorm's reads and writes."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * stride_x + cols, mask=cols < n, other=0.0).to(tl.float32)
    r = tl.rsqrt(tl.sum(x * x) / n + 1e-6)
    tl.store(y_ptr + row * stride_y + cols, (x * r).to(y_ptr.dtype.element_ty), mask=cols < n)


@triton.jit
def linear_kernel(
    a_ptr, w_ptr, c_ptr, M, N, K, stride_am, stride_wn, stride_cm,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    K_LINES: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr,
):  # fmt: skip
    """c = a @ w.T, one BLOCK_M x BLOCK_N tile over all of K a program."""
    pid_m = tl.program_id(0)
    off_m = pid_m * BLOCK_M
    off_n = tl.program_id(1) * BLOCK_N
    rn = off_n + tl.arange(0, BLOCK_N)
    if PREFETCH:  # noqa: SIM102 (a constexpr, then a runtime test: apart for Triton)
        if pid_m == 0:  # (the M tiles of a weight tile share it)
            # one prefetch per 128-byte line of the tile's weight rows (K_LINES >= the lines a row)
            lines = tl.minimum(tl.arange(0, K_LINES), K * 2 // 128 - 1)
            addr = w_ptr + rn.to(tl.int64)[:, None] * stride_wn + lines[None, :] * 64
            tl.inline_asm_elementwise(
                "prefetch.global.L2 [$1]; mov.u32 $0, 0;",
                "=r,l",
                [addr],
                dtype=tl.int32,
                is_pure=False,
                pack=1,
            )
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    rm = off_m + tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a, w = k_step_operands(a_ptr, w_ptr, rm, rn, k0 + rk, M, N, K, stride_am, stride_wn)
        acc = tl.dot(a, w.T, acc)
    c_ptrs = c_ptr + rm.to(tl.int64)[:, None] * stride_cm + rn[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(rm < M)[:, None] & (rn < N)[None, :])


def row(x: torch.Tensor, y: torch.Tensor, n: int, pdl: bool) -> None:
    row_kernel[(x.shape[0],)](
        x,
        y,
        n,
        x.stride(0),
        y.stride(0),
        BLOCK=triton.next_power_of_2(n),
        PDL=pdl,
        num_warps=4,
        launch_pdl=pdl,
    )


def linear(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, cfg: dict, pdl: bool, prefetch: bool) -> None:
    m, k = x.shape
    n = w.shape[0]
    grid = (triton.cdiv(m, cfg["BLOCK_M"]), triton.cdiv(n, cfg["BLOCK_N"]))
    linear_kernel[grid](
        x, w, out, m, n, k, x.stride(0), w.stride(0), out.stride(0),
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], K_LINES=triton.next_power_of_2(k * 2 // 128),
        PDL=pdl, PREFETCH=prefetch, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], launch_pdl=pdl,
    )  # fmt: skip


def tiles(m: int) -> list[dict]:
    out = []
    for bm, bn, bk, stages in itertools.product(
        (64,) if m <= 64 else (64, 128), (32, 64, 128), (64, 128), (3, 4)
    ):
        out.append(
            dict(
                BLOCK_M=bm,
                BLOCK_N=bn,
                BLOCK_K=bk,
                num_stages=stages,
                num_warps=8 if bm * bn >= 128 * 128 else 4,
            )
        )
    return out


def time_graph_us(step, layers: int) -> float:
    """Per-layer time of `layers` calls of step(l), replayed from one CUDA graph."""
    step(0)
    step(1)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for layer in range(layers):
            step(layer)
    ms = triton.testing.do_bench(graph.replay, warmup=10, rep=100, return_mode="median")
    return ms * 1e3 / layers


def bench(name: str, n: int, k: int, m: int, layers: int) -> dict[str, tuple[float, str]]:
    gen = torch.Generator("cuda").manual_seed(0)
    weights = [(torch.randn(n, k, device="cuda", generator=gen) * k**-0.5).bfloat16() for _ in range(layers)]
    # the row kernel's input (the GEMM before's output, wide enough for its k columns), its output
    x = torch.randn(m, max(n, k), device="cuda", generator=gen).bfloat16()
    y = torch.empty(m, k, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    row(x, y, k, False)
    ref = y.float() @ weights[0].float().T
    best: dict[str, tuple[float, str]] = {}

    def step_cublas(layer: int) -> None:
        row(x, y, k, False)
        torch.matmul(y, weights[layer].T, out=out)

    best["cublas"] = (time_graph_us(step_cublas, layers), "")
    for cfg, (variant, pdl, prefetch) in itertools.product(
        tiles(m), (("triton", False, False), ("pdl", True, False), ("pdl+pf", True, True))
    ):
        tag = f"{cfg['BLOCK_M']}x{cfg['BLOCK_N']}x{cfg['BLOCK_K']} s{cfg['num_stages']}"
        try:
            linear(y, weights[0], out, cfg, pdl, prefetch)
            err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
            if err > 2e-2:
                print(f"  {name} m={m} {variant} {tag}: WRONG ({err:.3g})", flush=True)
                continue

            def step(layer: int, cfg=cfg, pdl=pdl, prefetch=prefetch) -> None:
                row(x, y, k, pdl)
                linear(y, weights[layer], out, cfg, pdl, prefetch)

            t = time_graph_us(step, layers)
        except Exception as e:  # out of resources
            print(f"  {name} m={m} {variant} {tag}: {type(e).__name__}: {str(e)[:120]}", flush=True)
            continue
        if variant not in best or t < best[variant][0]:
            best[variant] = (t, tag)
    weights.clear()
    torch.cuda.empty_cache()
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3-0.6b", choices=sorted(SHAPES))
    parser.add_argument("--tokens", type=int, nargs="+", default=[64, 128, 256])
    args = parser.parse_args()
    layers = LAYERS[args.shape]
    variants = ("cublas", "triton", "pdl", "pdl+pf")
    print(
        f"{torch.cuda.get_device_name()}, {args.shape}, {layers} layers a graph; us per layer (row kernel + GEMM)"
    )
    print("| GEMM (N x K) | m | " + " | ".join(variants) + " | best tiles |")
    print("|---|---|" + "---|" * len(variants) + "---|")
    for m in args.tokens:
        totals = dict.fromkeys(variants, 0.0)
        for name, (n, k) in SHAPES[args.shape].items():
            best = bench(name, n, k, m, layers)
            cells = []
            for v in variants:
                t = best.get(v, (float("nan"), ""))[0]
                totals[v] += t
                cells.append(f"{t:.2f}")
            tags = ", ".join(f"{v} {best[v][1]}" for v in variants[1:] if v in best)
            print(f"| {name} ({n} x {k}) | {m} | " + " | ".join(cells) + f" | {tags} |", flush=True)
        print(f"| a layer | {m} | " + " | ".join(f"{totals[v]:.1f}" for v in variants) + " | |", flush=True)


if __name__ == "__main__":
    main()
