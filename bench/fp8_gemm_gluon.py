"""The Gluon W8A8 GEMM (executor_service/layers/fp8_gemm_gluon.py, `KERNEL: "gluon"`): its K loop as
compiled for sm90 without a GPU, and on the GPU its results and time against the v2 Triton kernel.

    python bench/fp8_gemm_gluon.py --sass   # no GPU: ptxas's notes and the K loop's wgmma / waits / FFMAs
    python bench/fp8_gemm_gluon.py --gpu    # checked into NaN-filled outputs, then timed

What the forms tried before this kernel's did to ptxas is in the module's docstring: a product
carried in flight through the loop's back edge serializes every wgmma (note C7514); the scales
loaded after the first wait hold every FFMA until after the second.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from executor_service.layers.fp8_gemm_gluon import (
    GROUP,
    launch_gluon,
    operand_layout,
    w8a8_block_matmul_gluon_kernel,
)


def gluon_matmul(a_q, a_s, weight, weight_scale_inv, out_dtype, cfg: dict, fill: float | None = None):
    """(a_q * a_s) @ (weight * weight_scale_inv)^T through the Gluon kernel, as out_dtype; `fill`:
    the output's value before the kernel (NaN in the check: a tile it does not write shows)."""
    m, n = a_q.shape[0], weight.shape[0]
    split_k = cfg.get("SPLIT_K", 1)
    out = torch.empty(m, n, dtype=out_dtype, device=a_q.device)
    if fill is not None:
        out.fill_(fill)
    c = out if split_k == 1 else torch.zeros(m, n, dtype=torch.float32, device=a_q.device)
    grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]), split_k)
    launch_gluon(a_q, a_s, weight, weight_scale_inv, c, cfg, grid)
    if split_k > 1:
        out.copy_(c)
    return out


# (BLOCK_M, BLOCK_N, num_warps, num_stages, SPLIT_K, PRODUCTS), a warpgroup each 64 rows of the
# tile: products in flight 2, or 4 where a warpgroup's share of the tile is 64 x 64 (the sum and
# four products: 160 fp32 registers a thread).
CONFIGS = (
    (64, 128, 4, 4, 1, 2),
    (64, 64, 4, 6, 1, 2),
    (64, 64, 4, 6, 1, 4),
    (128, 128, 8, 4, 1, 2),
    (128, 64, 8, 4, 1, 4),
    (256, 64, 16, 4, 1, 2),  # four products would serialize: 128 registers a thread at 16 warps (C7512)
    (64, 128, 4, 4, 2, 2),
)


def config(bm: int, bn: int, warps: int, stages: int, split_k: int, products: int = 2) -> dict:
    return {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": warps, "num_stages": stages, "SPLIT_K": split_k,
            "PRODUCTS": products}  # fmt: skip


def compile_sm90(cfg: dict):
    """The kernel for sm90 without a GPU (bench/kernel_sass.compile_sm90): bf16 out (fp32 with
    SPLIT_K > 1), integer arguments multiples of 16."""
    from triton.experimental.gluon._runtime import GluonASTSource

    from bench.kernel_sass import compile_sm90 as compile_for_sm90

    fn = w8a8_block_matmul_gluon_kernel
    constants = {"SPLIT_K": cfg["SPLIT_K"], "NUM_STAGES": cfg["num_stages"], "GROUP_M": 8,
                 "PRODUCTS": cfg.get("PRODUCTS", 2), "num_warps": cfg["num_warps"]}  # fmt: skip
    types = {
        name: f"tensordesc<fp8e4nv[{rows}, {GROUP}],{operand_layout(rows)!r}>"
        for name, rows in (("a_desc", cfg["BLOCK_M"]), ("b_desc", cfg["BLOCK_N"]))
    }
    types |= {
        "c_ptr": "*bf16" if cfg["SPLIT_K"] == 1 else "*fp32",
        "a_s_ptr": "*fp32",
        "b_s_ptr": "*fp32",
    }
    aligned = ("M", "N", "K", "stride_cm", "stride_asm", "stride_bsn")
    return compile_for_sm90(fn, constants, types, aligned, cfg["num_warps"], source_cls=GluonASTSource)


def ptxas_notes(ptx: str) -> list[str]:
    """ptxas's performance notes (C75xx: wgmma serialized, waits injected) on the kernel's PTX."""
    import os
    import subprocess
    import tempfile

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        run = subprocess.run([ptxas, "-arch=sm_90a", "-v", src, "-o", os.path.join(tmp, "k.cubin")],
                             capture_output=True, text=True, check=True)  # fmt: skip
    return [
        line.split(":", 1)[1].strip() for line in (run.stdout + run.stderr).splitlines() if "(C75" in line
    ]


def loop_order(sass: str) -> str:
    """The K loop's wgmmas, waits (with how many groups they leave outstanding) and FFMAs
    in issue order, runs counted: the shortest backward branch's body that waits with a wgmma
    outstanding (any with a wgmma where none does)."""
    import re

    lines = [m for m in (re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", x) for x in sass.splitlines()) if m]
    where = {int(m.group(1), 16): i for i, m in enumerate(lines)}
    bodies = []
    for i, m in enumerate(lines):
        target = re.search(r"\bBRA\s+0x([0-9a-f]+)", m.group(2))
        start = where.get(int(target.group(1), 16)) if target else None
        if start is not None and start < i:
            body = [x.group(2) for x in lines[start : i + 1]]
            bodies.append(body)
    # The two-step iteration is the one loop that leaves a wgmma outstanding.
    overlapped = [body for body in bodies if any(re.search(r"DEPBAR\.LE gsb0, 0x1\b", op) for op in body)]
    bodies = overlapped or [body for body in bodies if any("GMMA" in op for op in body)]
    runs: list[list] = []
    for op in min(bodies, key=len, default=[]):
        if "GMMA" in op:
            name = "wgmma"
        elif "WARPGROUP.DEPBAR.LE" in op:
            name = f"wait({int(op.split(',')[-1], 16)} outstanding)"
        elif re.match(r"(@!?P\w+\s+)?FFMA\b", op):
            name = "FFMA"
        else:
            continue
        if runs and runs[-1][0] == name and not name.startswith("wait"):
            runs[-1][1] += 1
        else:
            runs.append([name, 1])
    return ", ".join(f"{n} x{c}" if c > 1 else n for n, c in runs)


def sass(cfg: dict) -> None:
    import re
    import tempfile

    from bench.kernel_sass import cuobjdump

    kernel = compile_sm90(cfg)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(kernel.asm["cubin"])
        cubin.flush()
        usage = cuobjdump("--dump-resource-usage", cubin.name)
        code = cuobjdump("-sass", cubin.name)
    regs = re.search(r"REG:(\d+)", usage)
    print(f"{cfg}: {regs.group(1) if regs else '?'} registers, {kernel.metadata.shared} B shared; "
          f"ptxas notes: {ptxas_notes(kernel.asm['ptx']) or 'none'}", flush=True)  # fmt: skip
    print(f"   K loop (an iteration): {loop_order(code)}", flush=True)


def check(a_q, a_s, w_q, w_s, ref, cfg: dict) -> str:
    """'' where the Gluon GEMM (into an output of NaN) agrees with ref, the v2 GEMM: the same
    arithmetic in the same order, so to 1e-5 without split-K and 1e-3 with it (fp32 atomics);
    otherwise what is wrong."""
    from bench.fp8_gemm import rel

    err = rel(gluon_matmul(a_q, a_s, w_q, w_s, torch.bfloat16, cfg, fill=float("nan")), ref)
    return "" if err <= (1e-5 if cfg["SPLIT_K"] == 1 else 1e-3) else f" WRONG (rel err {err:.2g})"


def gpu() -> None:
    """Each CONFIGS entry against the Triton GEMM (v2, TMA) on shapes with partial tiles, odd K
    steps and empty splits, then at Qwen3-8B's shapes and 256 / 2048 tokens: checked, then us of
    CUDA-graph replays."""
    from bench.fp8_gemm import SHAPES, time_ms
    from executor_service.fp8 import quantize_weight_blocks
    from executor_service.layers.fp8_gemm_triton import quantize_per_token_group, w8a8_block_matmul

    v2 = {"KERNEL": "v2", "BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 4, "num_stages": 4, "TMA": True}
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")

    def operands(m, n, k):
        w_q, w_s = quantize_weight_blocks(torch.randn(n, k, device="cuda") * 0.02)
        a_q, a_s = quantize_per_token_group(torch.randn(m, k, device="cuda", dtype=torch.bfloat16))
        return a_q, a_s, w_q, w_s, w8a8_block_matmul(a_q, a_s, w_q, w_s, torch.bfloat16, v2)

    # 9 and 33 K steps (a 16-column last box), M and N no multiple of the tiles; one K step over 2
    # splits (an empty split).
    for m, n, k, splits in ((200, 320, 1040, (1, 2)), (200, 320, 4224, (1, 3)), (64, 256, 128, (2,))):
        ops = operands(m, n, k)
        for cand in CONFIGS:
            for split_k in splits:
                cfg = {**config(*cand), "SPLIT_K": split_k}
                print(f"check m={m} n={n} k={k} {cfg}: {check(*ops, cfg) or 'ok'}", flush=True)
    for name, (n, k) in SHAPES.items():
        for m in (256, 2048):
            a_q, a_s, w_q, w_s, ref = operands(m, n, k)
            t_v2 = time_ms(lambda: w8a8_block_matmul(a_q, a_s, w_q, w_s, torch.bfloat16, v2))  # noqa: B023
            line = f"{name} m={m}: v2 64x128 {t_v2 * 1e3:.1f} us"
            for cand in CONFIGS:
                cfg = config(*cand)
                try:
                    wrong = check(a_q, a_s, w_q, w_s, ref, cfg)
                    t = time_ms(lambda: gluon_matmul(a_q, a_s, w_q, w_s, torch.bfloat16, cfg))  # noqa: B023
                except Exception as e:  # out of shared memory, say
                    line += f"; {cand}: {type(e).__name__}: {str(e)[:80]}"
                    continue
                line += f"; {cand} {t * 1e3:.1f} us{wrong}"
            print(line, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--sass", action="store_true", help="compile for sm90 (no GPU): ptxas notes, K loop order"
    )
    parser.add_argument("--gpu", action="store_true", help="check against the Triton GEMM and time it")
    args = parser.parse_args()
    if args.gpu:
        gpu()
        return
    for cand in CONFIGS:
        sass(config(*cand))


if __name__ == "__main__":
    main()
