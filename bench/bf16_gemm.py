"""A decode step's 16-bit GEMMs: cuBLAS (F.linear) against a Triton GEMM swept over its tiles, per
weight shape and token count, timed as the engine runs them: a CUDA graph of one GEMM per layer, each layer
with its own weights (so they come from DRAM, not L2), replayed; per-GEMM time = replay / layers.

Every candidate tile is checked against an fp32 GEMM, then timed; printed: the best three per shape
and token count, and the sum over one layer's GEMMs (cuBLAS against the best). The kernel computes a
BLOCK_M x BLOCK_N tile over all of K (no split), the M tiles of a weight tile side by side in the
grid, its operands through TMA descriptors or masked pointer loads. On the H200 (bench/RESULTS.md,
2026-12-04) it was within 6% of cuBLAS at every Qwen3-0.6B decode shape, so the engine keeps
F.linear: this script stays as the record and for other shapes.

    python bench/bf16_gemm.py [--shape qwen3-0.6b] [--tokens 16 64 128 256]
"""

from __future__ import annotations

import argparse
import itertools

import torch
import triton
import triton.language as tl


@triton.jit
def k_step_operands(a_ptr, w_ptr, rm, rn, k, M, N, K, stride_am, stride_wn):
    """One K step's operand tiles by pointer loads: a[rm, k] and w[rn, k] (a [M, K], w [N, K], rows
    contiguous), zeros past M, N and K."""
    a = tl.load(
        a_ptr + rm.to(tl.int64)[:, None] * stride_am + k[None, :],
        mask=(rm < M)[:, None] & (k < K)[None, :],
        other=0.0,
    )
    w = tl.load(
        w_ptr + rn.to(tl.int64)[:, None] * stride_wn + k[None, :],
        mask=(rn < N)[:, None] & (k < K)[None, :],
        other=0.0,
    )
    return a, w


@triton.jit
def linear_kernel(
    a_ptr,  # [M, K], or its TMA descriptor of [BLOCK_M, BLOCK_K] boxes (TMA)
    w_ptr,  # [N, K], or its descriptor of [BLOCK_N, BLOCK_K] boxes
    c_ptr,  # [M, N]
    M,
    N,
    K,
    stride_am,
    stride_wn,
    stride_cm,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    TMA: tl.constexpr,
):
    # grid: (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N)): the M tiles of a weight tile run side by side.
    off_m = tl.program_id(0) * BLOCK_M
    off_n = tl.program_id(1) * BLOCK_N
    rm = off_m + tl.arange(0, BLOCK_M)
    rn = off_n + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        k0 = kb * BLOCK_K
        if TMA:
            a = a_ptr.load([off_m, k0])
            w = w_ptr.load([off_n, k0])
        else:
            a, w = k_step_operands(a_ptr, w_ptr, rm, rn, k0 + rk, M, N, K, stride_am, stride_wn)
        acc = tl.dot(a, w.T, acc)
    c_ptrs = c_ptr + rm.to(tl.int64)[:, None] * stride_cm + rn[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(rm < M)[:, None] & (rn < N)[None, :])


def tma_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether both operands can be read through TMA descriptors: a GPU with TMA (sm90 on), rows
    contiguous, 16-byte aligned bases and row strides."""
    if x.is_cuda and torch.cuda.get_device_capability(x.device) < (9, 0):
        return False
    return all(
        t.stride(1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0
        for t in (x, weight)
    )


def triton_linear(
    x: torch.Tensor, weight: torch.Tensor, cfg: dict, out: torch.Tensor | None = None
) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T with cfg's tiles (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, TMA)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    m, k = x.shape
    n = weight.shape[0]
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    tma = bool(cfg.get("TMA", False)) and tma_applies(x, weight)
    a_arg = TensorDescriptor.from_tensor(x, [bm, bk]) if tma else x
    w_arg = TensorDescriptor.from_tensor(weight, [bn, bk]) if tma else weight
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    linear_kernel[grid](
        a_arg, w_arg, out, m, n, k, x.stride(0), weight.stride(0), out.stride(0),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, TMA=tma, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    return out


# (N, K) of a layer's GEMMs: qkv, o, gate_up, down.
SHAPES = {
    "qwen3-0.6b": {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)},
    "qwen3-8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)},
    "llama-3.2-1b": {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192)},
}
LAYERS = {"qwen3-0.6b": 28, "qwen3-8b": 36, "llama-3.2-1b": 16}


def candidates(m: int) -> list[dict]:
    out = []
    block_ms = [64] if m <= 64 else [64, 128]
    if m <= 16:
        block_ms = [16, 64]
    for bm, bn, bk, stages, tma in itertools.product(
        block_ms, (32, 64, 128, 256), (64, 128), (3, 5), (True, False)
    ):
        warps = 8 if bm * bn >= 128 * 128 else 4
        out.append(
            {
                "BLOCK_M": bm,
                "BLOCK_N": bn,
                "BLOCK_K": bk,
                "num_warps": warps,
                "num_stages": stages,
                "TMA": tma,
            }
        )
    return out


def label(cfg: dict) -> str:
    return (
        f"{cfg['BLOCK_M']}x{cfg['BLOCK_N']}x{cfg['BLOCK_K']} w{cfg['num_warps']} s{cfg['num_stages']}"
        f"{' tma' if cfg.get('TMA') else ' ptr'}"
    )


def time_layers_us(fn, weights: list[torch.Tensor]) -> float:
    """Per-GEMM time of fn(w) for each weight in turn, replayed from one CUDA graph."""
    for w in weights[:2]:
        fn(w)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in weights:
            fn(w)
    ms = triton.testing.do_bench(graph.replay, warmup=10, rep=80, return_mode="median")
    return ms * 1e3 / len(weights)


def bench_shape(name: str, n: int, k: int, m: int, layers: int, configs: list[dict]) -> tuple[float, list]:
    gen = torch.Generator("cuda").manual_seed(0)
    weights = [(torch.randn(n, k, device="cuda", generator=gen) * k**-0.5).bfloat16() for _ in range(layers)]
    x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    ref = x.float() @ weights[0].float().T
    cublas = time_layers_us(lambda w: torch.matmul(x, w.T, out=out), weights)
    results = []
    for cfg in configs:
        try:
            got = triton_linear(x, weights[0], cfg)
            err = ((got.float() - ref).abs().max() / ref.abs().max()).item()
            if err > 2e-2:
                print(f"  {name} m={m} {label(cfg)}: WRONG (max rel error {err:.3g})", flush=True)
                continue
            t = time_layers_us(lambda w, cfg=cfg: triton_linear(x, w, cfg, out), weights)
        except Exception as e:  # out of shared memory or registers
            print(f"  {name} m={m} {label(cfg)}: {type(e).__name__}", flush=True)
            continue
        results.append((t, cfg))
    results.sort(key=lambda r: r[0])
    del weights
    torch.cuda.empty_cache()
    return cublas, results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3-0.6b", choices=sorted(SHAPES))
    parser.add_argument("--tokens", type=int, nargs="+", default=[16, 64, 128, 256])
    args = parser.parse_args()
    shapes = SHAPES[args.shape]
    layers = LAYERS[args.shape]
    print(f"{torch.cuda.get_device_name()}, {args.shape}, {layers} layers a graph, bf16", flush=True)
    for m in args.tokens:
        total_cublas = total_best = 0.0
        for name, (n, k) in shapes.items():
            cublas, results = bench_shape(name, n, k, m, layers, candidates(m))
            weight_tb = n * k * 2 / cublas / 1e6
            print(f"{name} m={m}: cuBLAS {cublas:.2f} us ({weight_tb:.2f} TB/s of weights)", flush=True)
            for t, cfg in results[:3]:
                print(f"  {t:.2f} us ({cublas / t:.2f}x) {label(cfg)}", flush=True)
            best = results[0][0] if results and results[0][0] < cublas else cublas
            total_cublas += cublas
            total_best += best
        print(
            f"layer at m={m}: cuBLAS {total_cublas:.1f} us, with the best {total_best:.1f} us "
            f"({(total_cublas - total_best) * layers:.0f} us a step saved over {layers} layers)",
            flush=True,
        )


if __name__ == "__main__":
    main()
