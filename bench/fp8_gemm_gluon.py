"""A W8A8 block-scaled GEMM in Gluon (Hopper) that tries to scale one K step's product while the
next step's wgmma runs, with what ptxas made of it; a prototype, not used by the engine.

The GEMM is executor_service/layers/fp8_gemm_triton.py's: y = x @ W^T, x e4m3 [M, K] with one fp32
scale per token and 128 columns, W e4m3 [N, K] with one per 128 x 128 block, so each K step of 128
has its own scale per row (a_s * b_s, b_s one scalar when BLOCK_N divides 128): acc += dot_k *
scale_k in fp32, the v2 kernel's rounding (fma(dot, a_s * b_s, acc) a step, in order).

The question: Triton's tl.dot waits for each K step's wgmma before its FFMAs (`WARPGROUP.DEPBAR.LE
gsb0, 0x0` in every K loop of the Triton kernels: bench/fp8_gemm.py --sass), so a warpgroup's
tensor-core work and its scaling alternate; only other programs on the SM (two 64 x 128 programs
of 4 warps fit) fill the gaps. Gluon issues wgmma itself (`warpgroup_mma(..., is_async=True)`,
`warpgroup_mma_wait(num_outstanding=1)`), so a kernel can start step k's product into fresh
registers (use_acc=False), wait until one wgmma is outstanding and scale step k - 1's.

What ptxas 13 makes of it, compiled for sm90 on a machine without a GPU (the first two forms were
tried while writing this file and not kept; `python bench/fp8_gemm_gluon.py --sass` prints the
third's notes and K loop):

- A product carried in flight through the K loop's back edge (start k, wait for k - 1, scale it,
  carry k) is copied into the loop's phi registers before its wgmma completes; ptxas then
  serializes every wgmma of the kernel (note C7514, "non wgmma instructions reading accumulator
  registers of a wgmma between start and end of the pipeline stage") and injects a wait after each
  (C7517). Alternating two named products (so that each is carried in its own registers) still
  copies at the loop entry: the same notes.
- Two K steps an iteration, nothing in flight across iterations (this kernel): no note; both
  steps' wgmmas issued back to back, then `wait(1 outstanding), FFMA x64, wait(0 outstanding),
  FFMA x64` at 64 x 128 and 4 warps: the first product is scaled while the second multiplies.
  That needs the scales loaded at the top of the iteration: loaded after the first wait (behind
  the refill's barriers) they held every FFMA until after the second wait.

So half of the K steps' scaling overlaps the warpgroup's own tensor-core work, where the Triton
kernels overlap none (other programs on the SM fill the gaps there: two 64 x 128 programs an SM).
Three or four products in flight (64 x 64 tiles have the registers) would overlap more; not tried.
`--gpu` checks this kernel against the Triton GEMM and times it beside v2 at Qwen3-8B's shapes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GROUP = 128  # the scale block along K and N


@triton.constexpr_function
def mma_warps(block_m, num_warps):
    """warps_per_cta of the wgmma layout: warpgroups stacked along M while they have 64 rows each,
    then side by side along N."""
    along_m = min(num_warps, max(4, block_m // 16))
    return [along_m, num_warps // along_m]


@triton.constexpr_function
def mma_instr_n(block_m, block_n, num_warps):
    """The wgmma instruction's N: the widest multiple of 8 (at most 256) dividing each warpgroup's
    share of the tile's columns."""
    share = block_n // mma_warps(block_m, num_warps)[1]
    n = min(256, share)
    while share % n:
        n -= 8
    return n


@gluon.jit
def _load_step(a_desc, b_desc, a_bufs, b_bufs, bars, kb, slot, off_m, off_n, pred):
    """TMA loads of K step kb's operand tiles into ring slot `slot` (when pred)."""
    bar = bars.index(slot)
    mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(
        a_desc, [off_m, kb * a_desc.block_type.shape[1]], bar, a_bufs.index(slot), pred=pred
    )
    tma.async_copy_global_to_shared(
        b_desc, [off_n, kb * b_desc.block_type.shape[1]], bar, b_bufs.index(slot), pred=pred
    )


@gluon.jit
def _start_step(a_bufs, b_bufs, zero, slot):
    """The wgmma of the step in ring slot `slot`, into fresh registers, left in flight."""
    return warpgroup_mma(
        a_bufs.index(slot), b_bufs.index(slot).permute((1, 0)), zero, use_acc=False, is_async=True
    )


@gluon.jit
def _step_scale(a_s_ptrs, m_mask, b_s_ptr, kb):
    """K step kb's scale of each row: the activation's times the weight block's."""
    return gl.load(a_s_ptrs + kb, mask=m_mask, other=0.0) * gl.load(b_s_ptr + kb)


@gluon.jit
def _finish_step(done, scale, acc, a_desc, b_desc, a_bufs, b_bufs, bars, kb_lo, step, steps, off_m, off_n,
                 NUM_STAGES: gl.constexpr):  # fmt: skip
    """Step `step`'s product, complete: its slot refilled with the step NUM_STAGES on, and the
    product scaled into acc."""
    ahead = step + NUM_STAGES
    _load_step(
        a_desc, b_desc, a_bufs, b_bufs, bars, kb_lo + ahead, step % NUM_STAGES, off_m, off_n, ahead < steps
    )
    return gl.fma(done, gl.expand_dims(scale, 1), acc)


@gluon.jit
def w8a8_block_matmul_gluon_kernel(
    a_desc,  # [M, K] e4m3, boxes [BLOCK_M, 128]
    b_desc,  # [N, K] e4m3, boxes [BLOCK_N, 128]
    c_ptr,  # [M, N]: the output dtype, or fp32 (zeroed) with SPLIT_K > 1
    a_s_ptr,  # [M, K / 128] fp32
    b_s_ptr,  # [N / 128, K / 128] fp32
    M,
    N,
    K,
    stride_cm,
    stride_asm,
    stride_bsn,
    SPLIT_K: gl.constexpr,
    NUM_STAGES: gl.constexpr,
    GROUP_M: gl.constexpr,
    num_warps: gl.constexpr,
):
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    gl.static_assert(BLOCK_K == 128, "one activation scale a row and K step")
    gl.static_assert(128 % BLOCK_N == 0, "one weight scale a tile and K step")
    gl.static_assert(NUM_STAGES >= 2, "a step's load is issued when the one before it is finished")

    # The tile, in fp8_gemm_triton's grouped order, and this split's K steps [kb_lo, kb_hi).
    pid = gl.program_id(0)
    num_m = gl.cdiv(M, BLOCK_M)
    num_n = gl.cdiv(N, BLOCK_N)
    first_m = pid // (GROUP_M * num_n) * GROUP_M
    size_m = gl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_n)) % size_m
    pid_n = (pid % (GROUP_M * num_n)) // size_m
    off_m = pid_m * BLOCK_M
    off_n = pid_n * BLOCK_N
    num_kb = gl.cdiv(K, BLOCK_K)
    per_split = gl.cdiv(num_kb, SPLIT_K)
    kb_lo = gl.program_id(1) * per_split
    kb_hi = gl.minimum(kb_lo + per_split, num_kb)
    steps = kb_hi - kb_lo

    layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0],
        warps_per_cta=mma_warps(BLOCK_M, num_warps),
        instr_shape=[16, mma_instr_n(BLOCK_M, BLOCK_N, num_warps), 32],
    )
    rows: gl.constexpr = gl.SliceLayout(1, layout)
    cols: gl.constexpr = gl.SliceLayout(0, layout)
    rm = off_m + gl.arange(0, BLOCK_M, layout=rows)
    m_mask = rm < M
    a_s_ptrs = a_s_ptr + rm.to(gl.int64) * stride_asm
    b_s_ptr += (off_n // 128).to(gl.int64) * stride_bsn

    if steps > 0:
        a_bufs = gl.allocate_shared_memory(a_desc.dtype, [NUM_STAGES, BLOCK_M, BLOCK_K], a_desc.layout)
        b_bufs = gl.allocate_shared_memory(b_desc.dtype, [NUM_STAGES, BLOCK_N, BLOCK_K], b_desc.layout)
        bars = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(NUM_STAGES):
            mbarrier.init(bars.index(s), count=1)
        fence_async_shared()
        for s in gl.static_range(NUM_STAGES):
            _load_step(a_desc, b_desc, a_bufs, b_bufs, bars, kb_lo + s, s, off_m, off_n, s < steps)

        zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout)
        acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout)
        # Two K steps an iteration: both products started, then the first scaled while the second
        # multiplies. No wgmma is in flight across iterations: a product carried in flight through
        # the loop's back edge is copied there, which ptxas answers by serializing every wgmma
        # (its C7514 note).
        for j in range(0, steps // 2):
            i = 2 * j
            # The scales first: their loads' latency passes while the wgmmas run.
            scale_first = _step_scale(a_s_ptrs, m_mask, b_s_ptr, kb_lo + i)
            scale_second = _step_scale(a_s_ptrs, m_mask, b_s_ptr, kb_lo + i + 1)
            mbarrier.wait(bars.index(i % NUM_STAGES), (i // NUM_STAGES) & 1)
            first = _start_step(a_bufs, b_bufs, zero, i % NUM_STAGES)
            mbarrier.wait(bars.index((i + 1) % NUM_STAGES), ((i + 1) // NUM_STAGES) & 1)
            second = _start_step(a_bufs, b_bufs, zero, (i + 1) % NUM_STAGES)
            done = warpgroup_mma_wait(num_outstanding=1, deps=(first,))
            acc = _finish_step(done, scale_first, acc, a_desc, b_desc, a_bufs, b_bufs, bars, kb_lo, i, steps,
                               off_m, off_n, NUM_STAGES)  # fmt: skip
            # acc passes through the wait, so that the first product's FFMAs stay before it.
            done, acc = warpgroup_mma_wait(num_outstanding=0, deps=(second, acc))
            acc = _finish_step(done, scale_second, acc, a_desc, b_desc, a_bufs, b_bufs, bars, kb_lo, i + 1, steps,
                               off_m, off_n, NUM_STAGES)  # fmt: skip
        if steps % 2 == 1:  # the last step alone
            i = steps - 1
            scale = _step_scale(a_s_ptrs, m_mask, b_s_ptr, kb_lo + i)
            mbarrier.wait(bars.index(i % NUM_STAGES), (i // NUM_STAGES) & 1)
            last = _start_step(a_bufs, b_bufs, zero, i % NUM_STAGES)
            done = warpgroup_mma_wait(num_outstanding=0, deps=(last,))
            acc = _finish_step(done, scale, acc, a_desc, b_desc, a_bufs, b_bufs, bars, kb_lo, i, steps, off_m, off_n,
                               NUM_STAGES)  # fmt: skip
        for s in gl.static_range(NUM_STAGES):
            mbarrier.invalidate(bars.index(s))

        rn = off_n + gl.arange(0, BLOCK_N, layout=cols)
        c_ptrs = c_ptr + gl.expand_dims(rm.to(gl.int64) * stride_cm, 1) + gl.expand_dims(rn, 0)
        mask = gl.expand_dims(m_mask, 1) & gl.expand_dims(rn < N, 0)
        if SPLIT_K == 1:
            gl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)
        else:
            gl.atomic_add(c_ptrs, acc, mask=mask, sem="relaxed")


def operand_layout(rows: int) -> gl.NVMMASharedLayout:
    """The shared-memory layout (128-byte swizzle) of an e4m3 [rows, 128] operand box."""
    return gl.NVMMASharedLayout.get_default_for([rows, GROUP], gl.float8e4nv)


def launch_gluon(a_q, a_s, weight, weight_scale_inv, c, cfg: dict, grid: tuple[int, int]) -> None:
    """w8a8_block_matmul_gluon_kernel with cfg's tiles (BLOCK_M a multiple of 64, BLOCK_N dividing
    128), stages, warps and split into c; the operands must suit TMA (fp8_gemm_triton.tma_applies)."""
    block_m, block_n = cfg["BLOCK_M"], cfg["BLOCK_N"]
    if block_m % 64 or GROUP % block_n or block_n % 8:
        raise ValueError(f"the Gluon GEMM takes BLOCK_M a multiple of 64 and BLOCK_N dividing {GROUP}, not "
                         f"{block_m} x {block_n}")  # fmt: skip
    a_desc = TensorDescriptor.from_tensor(a_q, [block_m, GROUP], operand_layout(block_m))
    b_desc = TensorDescriptor.from_tensor(weight, [block_n, GROUP], operand_layout(block_n))
    m, k = a_q.shape
    n = weight.shape[0]
    w8a8_block_matmul_gluon_kernel[grid](
        a_desc, b_desc, c, a_s, weight_scale_inv, m, n, k,
        c.stride(0), a_s.stride(0), weight_scale_inv.stride(0),
        SPLIT_K=cfg.get("SPLIT_K", 1), NUM_STAGES=cfg["num_stages"], GROUP_M=cfg.get("GROUP_M", 8),
        num_warps=cfg["num_warps"],
    )  # fmt: skip


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


# (BLOCK_M, BLOCK_N, num_warps, num_stages, SPLIT_K): one warpgroup a 64-row slice of the tile.
CONFIGS = ((64, 128, 4, 4, 1), (64, 64, 4, 6, 1), (128, 128, 8, 4, 1), (128, 64, 4, 4, 1), (64, 128, 4, 4, 2))


def config(bm: int, bn: int, warps: int, stages: int, split_k: int) -> dict:
    return {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": warps, "num_stages": stages, "SPLIT_K": split_k}


def compile_sm90(cfg: dict):
    """The kernel for sm90 without a GPU (bench/kernel_sass.compile_sm90): bf16 out (fp32 with
    SPLIT_K > 1), integer arguments multiples of 16."""
    from triton.experimental.gluon._runtime import GluonASTSource

    from bench.kernel_sass import compile_sm90 as compile_for_sm90

    fn = w8a8_block_matmul_gluon_kernel
    constants = {"SPLIT_K": cfg["SPLIT_K"], "NUM_STAGES": cfg["num_stages"], "GROUP_M": 8,
                 "num_warps": cfg["num_warps"]}  # fmt: skip
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
    """The two-step K loop's wgmmas, waits (with how many groups they leave outstanding) and FFMAs
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
    print(f"   K loop (two steps): {loop_order(code)}", flush=True)


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
