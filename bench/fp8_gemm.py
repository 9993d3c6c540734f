"""The W8A8 block-scaled GEMM (executor_service/layers/fp8_gemm_triton.py) on the GPU, at Qwen3-8B's
linear shapes and decode / prefill token counts: time (activation quantization included) against the
bf16 GEMM (torch.matmul on the dequantized weights) and against torch._scaled_mm where this torch
takes 128-block scales, and the relative error of each against the bf16 GEMM.

    python bench/fp8_gemm.py [--sweep | --sweep-v2 | --sass]

Times are of CUDA-graph replays (as the engine's decode steps run), so that a few-microsecond
kernel is not measured as Python's launch overhead. --sweep times a grid of launch configurations
(tile sizes, stages, split-K) of the Triton GEMM at each shape and token count. --sweep-v2 times the
v2 kernel's candidates (V2_CANDIDATES) and the Gluon kernel's (GLUON_CANDIDATES) at m = 64-512
(--tokens) against the first kernel's default, bf16 torch.matmul and torch._scaled_mm, every GEMM
on activations quantized beforehand (the quantization is its own column), and prints the best per
shape and GEMM_TABLE lines for where a candidate wins. --sass
(no GPU needed) compiles the first kernel at gemm_config's m = 256 configs, the v2 candidates and
the swap kernel's tiles for sm90 and prints registers, shared memory and the SASS of the K loop (instructions per K step,
wgmma, FFMA / FMUL, barriers, wgmma waits).
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import re
import sys
import tempfile
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.kernel_sass import cuobjdump, loops
from executor_service.fp8 import dequantize_weight_blocks, quantize_weight_blocks
from executor_service.layers.fp8_gemm_triton import (
    GROUP,
    fp8_linear,
    gemm_config,
    m_bucket,
    quantize_per_token_group,
    scaled_mm_applies,
    scaled_mm_blockwise,
    scaled_mm_split_k,
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


# The v2 kernel's candidates: (BLOCK_M, BLOCK_N, num_warps, num_stages, TMA, SPLIT_K). With 4 warps
# 64 x 128 and 128 x 64 take one warpgroup, with 8 warps 128 x 128 and 256 x 64 two (64 fp32
# accumulators and 64 of the K step's partial product a thread: 154-157 registers, one 8-warp
# program an SM); 64 x 64 a warpgroup (8 or 16 warps) takes 90. Tiles of 128 x 256 would need 256
# registers a thread. Shared memory: (BLOCK_M + BLOCK_N) * 128 bytes a stage.
V2_CANDIDATES = (
    (64, 64, 4, 4, 1, 1),
    (64, 64, 4, 6, 1, 1),
    (64, 128, 4, 3, 1, 1),
    (64, 128, 4, 4, 1, 1),
    (64, 128, 4, 4, 0, 1),  # pointer loads: what TMA is worth
    (128, 64, 4, 3, 1, 1),
    (128, 64, 4, 4, 1, 1),
    (128, 128, 8, 3, 1, 1),
    (128, 128, 8, 4, 1, 1),
    (128, 128, 8, 3, 0, 1),
    (64, 128, 8, 4, 1, 1),  # each warpgroup 64 x 64: 90 registers, two programs an SM
    (128, 128, 16, 3, 1, 1),  # four warpgroups of 64 x 64 (90 registers)
    (128, 128, 16, 4, 1, 1),
    (256, 64, 16, 3, 1, 1),
    (256, 64, 8, 3, 1, 1),
    (256, 64, 8, 4, 1, 1),
    (64, 128, 4, 4, 1, 2),  # split-K, for the grids of few tiles (down: K = 12288, N = 4096)
    (128, 128, 8, 4, 1, 2),
    (128, 128, 8, 4, 1, 3),
    # Tiles of every row at m = 129-256: each weight byte crosses L2 to an SM once (at 64 rows a
    # tile, four times: 100 MB of qkv's 25 MB at m = 256, about 13 us of L2 bandwidth), the
    # activation's 1 MB once per 128 columns. Four warpgroups of 64 x 128 (128 registers, 144 KB at
    # 3 stages, 192 KB at 4); split-K fills the SMs (qkv: 48 column tiles).
    (256, 128, 16, 3, 1, 1),
    (256, 128, 16, 4, 1, 1),
    (256, 128, 16, 3, 1, 2),
    (256, 128, 16, 4, 1, 2),
    (256, 128, 16, 3, 1, 3),
    (256, 64, 8, 4, 1, 2),
    # Decode's few tokens (read through 64-row boxes that TMA zero-fills past M): bound by streaming
    # the weights (qkv at 1 token: 17.1 us, 1.5 TB/s, through the first kernel split over K), so
    # narrow column tiles for more programs and deep rings for more bytes in flight (12 KB a stage
    # at 64 x 32), with and without split-K.
    (64, 32, 4, 8, 1, 1),
    (64, 32, 4, 12, 1, 1),
    (64, 32, 4, 8, 1, 2),
    (64, 64, 4, 8, 1, 2),
)
SWEEP_V2_TOKENS = (64, 128, 256, 512)
# torch._scaled_mm with K in two halves, the second on a side stream (fp8_gemm_triton.SCALED_MM_SPLIT_K)
SPLIT_ROW = "scaled_mm, K halves, 2 streams"


def v2_config(bm: int, bn: int, warps: int, stages: int, tma: int, split_k: int) -> dict:
    return {"KERNEL": "v2", "BLOCK_M": bm, "BLOCK_N": bn, "num_warps": warps, "num_stages": stages,
            "TMA": bool(tma), "SPLIT_K": split_k}  # fmt: skip


def v2_label(bm: int, bn: int, warps: int, stages: int, tma: int, split_k: int) -> str:
    return (
        f"v2 {bm}x{bn} w{warps} s{stages}{' tma' if tma else ' ptr'}{f' k/{split_k}' if split_k > 1 else ''}"
    )


# The Gluon kernel's (executor_service/layers/fp8_gemm_gluon.py: PRODUCTS K steps' wgmmas in flight,
# each scaled while the ones after it multiply): (BLOCK_M, BLOCK_N, num_warps, num_stages, SPLIT_K,
# PRODUCTS), each warpgroup 64 rows; the sum and the products in registers (four products only at
# 64 x 64 a warpgroup, and not at 16 warps' 128 registers a thread).
GLUON_CANDIDATES = (
    (64, 64, 4, 6, 1, 2),
    (64, 64, 4, 6, 1, 4),
    (64, 128, 4, 3, 1, 2),
    (64, 128, 4, 4, 1, 2),
    (128, 64, 8, 4, 1, 4),
    (128, 128, 8, 4, 1, 2),
    (256, 64, 16, 4, 1, 2),
    (256, 64, 16, 4, 2, 2),
    (64, 128, 4, 4, 2, 2),
    (128, 128, 8, 4, 3, 2),
    (64, 32, 4, 8, 1, 2),  # decode's few tokens, as V2_CANDIDATES' last ones
    (64, 64, 4, 8, 2, 4),
)


# The swap kernel's (tokens as the wgmma's narrow side; fp8_gemm_triton's module docstring), for
# m tokens: BLOCK_M the tokens rounded up to 16-128 (one row tile), 64 or 128 weight rows a tile,
# rings of 4 or 6 stages ((BLOCK_M + BLOCK_N) * 128 bytes a stage: 18 KB at 16 x 128), K split in up
# to 8 shares summed in the kernel (3 and 6 too: qkv's 48 tiles of 128 rows in 8 shares are 384
# programs, 1.45 waves of two an SM; in 5 or 6, one). At 128 tokens, 8 warps (two warpgroups of 64
# weight rows).
SWAP_BLOCK_N, SWAP_STAGES, SWAP_SPLITS = (64, 128), (4, 6), (1, 2, 3, 4, 6, 8)


def swap_candidates(m: int) -> dict[str, dict]:
    bm = min(max(16, triton.next_power_of_2(m)), 128)
    out = {}
    for bn, stages, split_k in itertools.product(SWAP_BLOCK_N, SWAP_STAGES, SWAP_SPLITS):
        warps = 8 if bm == 128 and bn == 128 else 4
        if (bm + bn) * 128 * stages > 200 * 1024:  # past sm90's 227 KB with the epilogue's
            continue
        label = f"swap {bm}x{bn} w{warps} s{stages}{f' k/{split_k}' if split_k > 1 else ''}"
        out[label] = {"KERNEL": "swap", "BLOCK_M": bm, "BLOCK_N": bn, "num_warps": warps,
                      "num_stages": stages, "TMA": True, "SPLIT_K": split_k}  # fmt: skip
    return out


def candidates(m: int | None = None, kernels: tuple[str, ...] = ("v2", "gluon", "swap")) -> dict[str, dict]:
    """Every sweep candidate's configuration by its label ("v2 ...", "gluon ...", and for m tokens
    "swap ..."), of the kernels named."""
    from bench.fp8_gemm_gluon import config as gluon_config

    out = {v2_label(*c): v2_config(*c) for c in V2_CANDIDATES} if "v2" in kernels else {}
    for bm, bn, warps, stages, split_k, products in GLUON_CANDIDATES if "gluon" in kernels else ():
        label = f"gluon {bm}x{bn} w{warps} s{stages} p{products}{f' k/{split_k}' if split_k > 1 else ''}"
        out[label] = {"KERNEL": "gluon", **gluon_config(bm, bn, warps, stages, split_k, products)}
    if m is not None and "swap" in kernels:
        out.update(swap_candidates(m))
    return out


def time_fast(fn) -> float:
    """time_ms with shorter warm-up and repetitions (the sweeps' hundreds of timings)."""
    fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return triton.testing.do_bench(graph.replay, warmup=10, rep=60, return_mode="median")


def sweep_v2(
    weights: dict,
    tokens: tuple[int, ...] = SWEEP_V2_TOKENS,
    kernels: tuple[str, ...] = ("v2", "gluon", "swap"),
    table_out: str | None = None,
) -> None:
    """Every candidate of the kernels named (V2_CANDIDATES, GLUON_CANDIDATES, swap_candidates) at
    every shape and token count (tiles of more rows than tokens left out), with the first kernel's
    default, bf16 and torch._scaled_mm on the same quantized operands; one table per shape (us),
    then the best of each, and GEMM_TABLE lines where a candidate beats what fp8_linear runs today
    (also written to table_out as JSON for bench/throughput.py --fp8-gemm-table)."""
    best_lines, table_lines, table = [], [], []
    for name, (n, k) in SHAPES.items():
        w_q, w_s, w = weights[name]
        rows: dict[str, dict[int, float]] = collections.defaultdict(dict)
        for m in tokens:
            x = torch.randn(m, k, device=w_q.device, dtype=torch.bfloat16)
            a_q, a_s = quantize_per_token_group(x)
            a_q4, a_s4 = quantize_per_token_group(x, rows_multiple=4)
            ref = w8a8_block_matmul(a_q, a_s, w_q, w_s, torch.bfloat16)
            rows["bf16 matmul"][m] = time_fast(lambda: x @ w.T)  # noqa: B023
            rows["quantize (per token group)"][m] = time_fast(lambda: quantize_per_token_group(x))  # noqa: B023
            rows["quantize, a group a program"][m] = time_fast(
                lambda: quantize_per_token_group(x, per_program=1)  # noqa: B023
            )
            try:

                def mm(a_q4=a_q4, a_s4=a_s4, w_q=w_q, w_s=w_s):
                    return torch._scaled_mm(
                        a_q4, w_q.t(), scale_a=a_s4, scale_b=w_s.t(), out_dtype=torch.bfloat16
                    )

                whole = mm()
                rows["torch._scaled_mm"][m] = time_fast(mm)
            except (RuntimeError, NotImplementedError, TypeError, ValueError) as e:
                print(f"  {name} m={m} torch._scaled_mm: {str(e).splitlines()[0][:100]}")
                whole = None
            if whole is not None and k % (8 * GROUP) == 0:  # scaled_mm_splits_k's rule but for the SMs

                def split(a_q4=a_q4, a_s4=a_s4, w_q=w_q, w_s=w_s):
                    return scaled_mm_split_k(a_q4, a_s4, w_q, w_s, torch.bfloat16)

                try:
                    err = rel(split(), whole)
                    if err <= 1e-2:
                        rows[SPLIT_ROW][m] = time_fast(split)
                    else:
                        print(f"  {name} m={m} {SPLIT_ROW}: WRONG, rel err {err:.2g} against the whole")
                except (RuntimeError, NotImplementedError, TypeError, ValueError) as e:
                    print(f"  {name} m={m} {SPLIT_ROW}: {str(e).splitlines()[0][:100]}")
            # What the Triton GEMM runs at m today: gemm_config's rule, or GEMM_TABLE's entry.
            rows["v1 default (gemm_config)"][m] = time_fast(
                lambda: w8a8_block_matmul(a_q, a_s, w_q, w_s, torch.bfloat16)  # noqa: B023
            )
            for label, cfg in candidates(m, kernels).items():
                if cfg["KERNEL"] != "swap" and cfg["BLOCK_M"] > max(m, 64):
                    continue
                # NaN in the block the output will most likely get from the caching allocator: a
                # tile the kernel does not write shows as wrong, not as the last candidate's sums.
                torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=w_q.device)
                try:
                    got = w8a8_block_matmul(a_q, a_s, w_q, w_s, torch.bfloat16, cfg)
                    err = rel(got, ref)
                    t = time_fast(lambda: w8a8_block_matmul(a_q, a_s, w_q, w_s, torch.bfloat16, cfg))  # noqa: B023
                except Exception as e:  # out of shared memory, say
                    print(f"  {name} m={m} {label}: {type(e).__name__}: {str(e)[:100]}", flush=True)
                    continue
                if not err <= 1e-2:  # bf16 outputs a rounding apart: ~1e-3 (NaN is wrong too)
                    print(f"  {name} m={m} {label}: WRONG, rel err {err:.2g} against the first kernel")
                    continue
                rows[label][m] = t
        print(f"\n{name} (n={n}, k={k}): us, GEMM alone on quantized activations", flush=True)
        print(f"  {'':34s}" + "".join(f"{f'm={m}':>9s}" for m in tokens))
        for label, times in rows.items():
            print(f"  {label:34s}" + "".join(f"{times[m] * 1e3:9.1f}" if m in times else f"{'-':>9s}"
                                             for m in tokens))  # fmt: skip
        for m in tokens:
            v2 = {lab: t[m] for lab, t in rows.items() if lab.startswith(("v2", "gluon", "swap")) and m in t}
            if not v2:
                continue
            lab = min(v2, key=v2.get)
            v1 = rows["v1 default (gemm_config)"][m]
            bf16, smm = rows["bf16 matmul"][m], rows["torch._scaled_mm"].get(m)
            fp8, quant = min(v2[lab], smm or 1e9, v1), rows["quantize (per token group)"][m]
            best_lines.append(
                f"best {name} m={m}: {lab} {v2[lab] * 1e3:.1f} us; v1 {v1 * 1e3:.1f}, "
                f"scaled_mm {smm * 1e3 if smm else float('nan'):.1f} "
                f"(K halves on 2 streams {rows[SPLIT_ROW].get(m, float('nan')) * 1e3:.1f}), bf16 {bf16 * 1e3:.1f} "
                f"(fp8's best against bf16 {bf16 / fp8:.2f}x, {bf16 / (fp8 + quant):.2f}x with the quantization)"
            )
            if v2[lab] < v1 and (smm is None or v2[lab] < smm) and m_bucket(m) is not None:
                line = f"    ({m_bucket(m)}, {n}, {k}): {candidates(m, kernels)[lab]},"
                table.append([m_bucket(m), n, k, candidates(m, kernels)[lab]])
                if scaled_mm_applies(m, n, k, torch.bfloat16, torch.device("cuda")):
                    # GEMM_TABLE is the Triton GEMM's: fp8_linear takes torch._scaled_mm here
                    line += "  # with fp8_linear taking the Triton GEMM at this size"
                table_lines.append(line)
    print()
    print("\n".join(best_lines))
    print(
        "table (GEMM_TABLE entries where a candidate beats today's GEMM, the first kernel's default and torch._scaled_mm):"
    )
    print("\n".join(table_lines))
    if table_out:
        Path(table_out).write_text(json.dumps(table, indent=1))
        print(f"{len(table)} entries written to {table_out}")


def compile_sm90(cfg: dict):
    """The GEMM kernel cfg selects (v1 or v2), compiled for sm90 as the engine launches it at
    Qwen3-8B's shapes: bf16 out, every integer argument a multiple of 16 (M included: 64-512)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from executor_service.layers import fp8_gemm_triton as g

    kernel = cfg.get("KERNEL", "v1")
    fn = {"v2": g.w8a8_block_matmul_v2_kernel, "swap": g.w8a8_block_matmul_swap_kernel}.get(
        kernel, g.w8a8_block_matmul_kernel
    )
    constants = {"BLOCK_M": cfg["BLOCK_M"], "BLOCK_N": cfg["BLOCK_N"], "BLOCK_K": GROUP, "SCALE_N": GROUP,
                 "GROUP_M": 8, "SPLIT_K": cfg.get("SPLIT_K", 1)}  # fmt: skip
    if kernel == "swap":
        del constants["GROUP_M"]
    if kernel in ("v2", "swap"):
        constants["TMA"] = bool(cfg.get("TMA"))
    if kernel != "swap":
        constants["SUM_IN_KERNEL"] = bool(cfg.get("SUM_IN_KERNEL"))
    boxes = {"a_ptr": cfg["BLOCK_M"], "b_ptr": cfg["BLOCK_N"]}
    signature = {}
    for name in fn.arg_names:
        if name in constants:
            signature[name] = "constexpr"
        elif name in boxes:
            signature[name] = (
                f"tensordesc<fp8e4nv[{boxes[name]}, {GROUP}]>" if constants.get("TMA") else "*fp8e4nv"
            )
        elif name == "c_ptr":
            whole = constants["SPLIT_K"] == 1 or kernel == "swap" or constants.get("SUM_IN_KERNEL")
            signature[name] = "*bf16" if whole else "*fp32"
        elif name == "count_ptr":
            signature[name] = "*i32"
        else:
            signature[name] = "*fp32" if name.endswith("_ptr") else "i32"
    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, name in enumerate(fn.arg_names)
        if signature[name] in ("i32", "*fp32", "*bf16", "*fp8e4nv", "*i32")
        and not (kernel == "swap" and name == "M")  # not specialised (do_not_specialize)
    }
    source = ASTSource(
        fn=fn, signature=signature, attrs=attrs,
        constexprs={(fn.arg_names.index(k),): v for k, v in constants.items()},
    )  # fmt: skip
    target = GPUTarget("cuda", 90, 32)
    return triton.compile(
        source, target=target, options={"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}
    )


def k_loop(sass: str) -> list[str]:
    """The opcodes of the K loop: the shortest backward branch's body that holds a wgmma (GMMA).
    (The longest backward branch can be an mbarrier's retry path, placed after the epilogue.)"""
    bodies = [body for body in loops(sass) if any("GMMA" in op for op in body)]
    return min(bodies, key=len, default=[])


def sass_report(label: str, cfg: dict, top: int) -> None:
    kernel = compile_sm90(cfg)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(kernel.asm["cubin"])
        cubin.flush()
        usage = cuobjdump("--dump-resource-usage", cubin.name)
        body = k_loop(cuobjdump("-sass", cubin.name))
    ttgir = kernel.asm["ttgir"]
    ops = collections.Counter(op.split()[0] for op in body)
    count = lambda pred: sum(v for op, v in ops.items() if pred(op))  # noqa: E731
    regs = re.search(r"REG:(\d+)", usage)
    pendings = sorted(set(re.findall(r"pendings = (\d+)", ttgir)))
    print(
        f"{label}: {regs.group(1) if regs else '?'} registers, {kernel.metadata.shared} B shared; K step: "
        f"{len(body)} instructions, {count(lambda o: 'GMMA' in o)} wgmma "
        f"({', '.join(sorted({o for o in ops if 'GMMA' in o}))}), {ops['FFMA']} FFMA, {ops['FMUL']} FMUL, "
        f"{count(lambda o: o.startswith('BAR'))} BAR, {count(lambda o: o.startswith('LDGSTS'))} cp.async, "
        f"{count(lambda o: o.startswith('UTMALDG'))} TMA loads, {count(lambda o: o.startswith('LDS'))} LDS, "
        f"{count(lambda o: o.startswith('LDG'))} LDG; wgmma waits {count(lambda o: o.startswith('WARPGROUP.DEPBAR'))} "
        f"(TTGIR pendings {pendings}, "
        f"warp_group_dot {'yes' if 'ttng.warp_group_dot ' in ttgir else 'no'})",
        flush=True,
    )
    if top:
        print("   " + ", ".join(f"{v} {op}" for op, v in ops.most_common(top)))


def sass_all(top: int) -> None:
    seen = set()
    for name, (n, k) in SHAPES.items():
        cfg = gemm_config(256, n, k)
        key = tuple(sorted(cfg.items()))
        label = f"v1 {cfg['BLOCK_M']}x{cfg['BLOCK_N']} w{cfg['num_warps']} s{cfg['num_stages']}"
        print(f"{name} m=256: gemm_config -> {label}")
        if key not in seen:
            seen.add(key)
            sass_report(label, cfg, top)
    sass_report("v1 128x128 w8 s3 (m > 256)", gemm_config(512, 4096), top)
    for cand in V2_CANDIDATES:
        sass_report(v2_label(*cand), v2_config(*cand), top)
    for m in (16, 64):  # the swap kernel's tiles (the split only changes the epilogue)
        for label, cfg in swap_candidates(m).items():
            if cfg["SPLIT_K"] == 1:
                sass_report(label, cfg, top)


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
    parser.add_argument(
        "--sweep-v2", action="store_true", help="time the v2 kernel's candidates at m = 64-512"
    )
    parser.add_argument(
        "--tokens",
        default=",".join(map(str, SWEEP_V2_TOKENS)),
        help="--sweep-v2: the token counts, comma-separated (default %(default)s)",
    )
    parser.add_argument(
        "--kernels",
        default="v2,gluon,swap",
        help="--sweep-v2: the kernels whose candidates to time, comma-separated (default %(default)s)",
    )
    parser.add_argument("--table-out", help="--sweep-v2: write the winning GEMM_TABLE entries here (JSON)")
    parser.add_argument(
        "--sass", action="store_true", help="compile for sm90 (no GPU) and summarize the K loop"
    )
    parser.add_argument("--top", type=int, default=0, help="--sass: the most frequent opcodes to list")
    args = parser.parse_args()
    if args.sass:
        sass_all(args.top)
        return
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    if args.sweep_v2:
        weights = {}
        for name, (n, k) in SHAPES.items():
            w_q, w_s = quantize_weight_blocks(torch.randn(n, k, device="cuda") * 0.02)
            weights[name] = (w_q, w_s, dequantize_weight_blocks(w_q, w_s, torch.bfloat16))
        sweep_v2(
            weights,
            tuple(int(t) for t in args.tokens.split(",")),
            tuple(args.kernels.split(",")),
            args.table_out,
        )
        return
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
