"""W8A8 block-scaled GEMM on CUDA, for fp8 checkpoints (the Qwen3-*-FP8 format, quantization.py).

y = x @ W^T with W e4m3 [N, K] and one fp32 scale per 128 x 128 block (weight_scale_inv [N/128, K/128])
and x quantized at run time per token in groups of 128 columns (x_s [M, K/128]), as DeepSeek-V3 and
vLLM do:

- `quantize_per_token_group`: a program per token and up to 16 of its groups computes each group's
  amax, its scale amax / 448 and the e4m3 values (rounded to nearest even,
  attention.triton_kernels.quantize_e4m3);
- `w8a8_block_matmul`: tiles of BLOCK_M x BLOCK_N with BLOCK_K = 128, so each K step has one
  activation scale per row and one weight scale per 128 columns of N: acc += dot(a, b) * a_s * b_s,
  accumulated in fp32 and written in the output dtype.

The activation may come already quantized (an `Fp8Input`, from triton_ops' fused RMSNorm or
SiLU-and-mul, in the layout `fp8_input_rows_multiple` names for its size): then fp8_linear runs the
GEMM alone.

`fp8_linear` takes the Triton GEMM for decode-sized batches and, from SCALED_MM_MIN_TOKENS tokens
on, torch._scaled_mm's blockwise-scaled CUTLASS GEMM where this torch and GPU have it (sm90, bf16
out), except where GEMM_TABLE names a faster Triton configuration for the shape: on the H200 at
Qwen3-8B's shapes (bench/fp8_gemm.py --sweep-v2) the Triton kernels are faster up to 128 tokens
and torch's from 256 on (gate_up at 256: 47.8 us against 63.8), with o at 256 and qkv at 512 the
exceptions. The GEMMs agree to the summation order (the same quantized operands, fp32
accumulation).

`w8a8_block_matmul_v2_kernel` (config KERNEL "v2": GEMM_TABLE's entries) is the same GEMM with BLOCK_N dividing 128, so that a tile's weight scale is one scalar
per K step: acc = fma(dot(a, b), a_s * b_s, acc), one FFMA per accumulator element where the first
kernel spends an FMUL, an FFMA and a shared-memory round trip (the weight scales' layout change,
two barriers) per K step; with TMA the operands come through tensor descriptors (no per-thread
addresses or masks). Compiled for sm90 at 64 x 128 tiles, 4 warps: 171 instructions per K step and
154 registers with TMA, 229 / 178 with pointer loads, against the first kernel's 310 / 238
(bench/fp8_gemm.py --sass). Triton waits for each K step's wgmma before scaling it (the scale is
applied to its result) in both kernels; more programs per SM overlap one's FMAs with another's
wgmma. The rounding differs from the first kernel's ((dot * a_s) * b_s + acc) by an ulp a step.

`KERNEL: "gluon"` (fp8_gemm_gluon.py) is v2's GEMM, sums and order written in Gluon so that a
warpgroup scales one K step's product while its next wgmma runs; where it cannot run (off sm90,
operands TMA cannot read, the interpreter) the v2 kernel takes its tiles. On the H200 it is no
faster than v2 at Qwen3-8B's shapes from 256 tokens on, and 0-2.5 us faster than the first kernel's
split-K rule at 1-32 tokens (bench/RESULTS.md, 2026-12-05); GEMM_TABLE names it nowhere yet.

`KERNEL: "swap"` (`w8a8_block_matmul_swap_kernel`) is for decode's few tokens, where the GEMM only
streams the weight: it computes the tile transposed (acc[n, m] = W[n, :] . x[m, :]), so that 64-128
weight rows are the wgmma's M side and 16-64 tokens its N side (m64n16k32 for up to 16 tokens,
where the other kernels pad the tokens to 64 rows or fall back to mma.sync at 16). With SPLIT_K > 1
each split stores its fp32 sums and the tile's last split to finish (an int32 ticket a tile) adds
them in split order and writes the output: one kernel, and the same bits every run, where the
other kernels' split-K is a zeroed fp32 buffer, atomic adds in any order and a copy kernel.
Untimed: SWAP_MAX_TOKENS keeps it off.

With SCALED_MM_SPLIT_K (off until timed), a torch._scaled_mm GEMM whose output tiles would leave
most SMs idle runs as two GEMMs over the halves of K at once, on two streams (`scaled_mm_split_k`).
"""

from __future__ import annotations

import warnings
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from executor_service.attention.triton_kernels import quantize_e4m3

GROUP = 128


@triton.jit
def quantize_per_token_group_kernel(
    x_ptr, q_ptr, s_ptr, stride_xm, stride_qm, stride_sm, stride_sg, K,
    GROUP_SIZE: tl.constexpr, GROUPS: tl.constexpr,
):  # fmt: skip
    # grid: (num_tokens, ceil(K / (GROUPS * GROUP_SIZE))); a program quantizes GROUPS groups of a row
    m = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    k = g[:, None] * GROUP_SIZE + tl.arange(0, GROUP_SIZE)[None, :]
    mask = k < K
    x = tl.load(x_ptr + m * stride_xm + k, mask=mask, other=0.0).to(tl.float32)
    scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), 1), 1e-10), 448.0)
    q = quantize_e4m3(x, scale[:, None])
    tl.store(q_ptr + m * stride_qm + k, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + m * stride_sm + g * stride_sg, scale, mask=g * GROUP_SIZE < K)


def groups_per_program(m: int, groups: int) -> int:
    """How many groups of a row one quantize program takes: enough programs for every SM to hold
    four (a program per group is a wave of latency-bound programs per 2,000 groups: 10 us at 256 x
    4096 on the H200), at most 16 groups (2,048 values, 16 a thread at 4 warps) and no more than the
    row has."""
    per = triton.next_power_of_2(max(1, m * groups // (4 * _NUM_SMS)))
    return max(1, min(per, 16, triton.next_power_of_2(groups)))


class Fp8Input(NamedTuple):
    """An activation already quantized for fp8_linear (by the op before it: triton_ops' fused
    RMSNorm or SiLU-and-mul): quantize_per_token_group's (q, scales) of `rows` tokens, laid out for
    the GEMM fp8_input_rows_multiple chose (4: torch._scaled_mm's), and the dtype it stands for."""

    q: torch.Tensor
    scales: torch.Tensor
    rows: int
    rows_multiple: int
    dtype: torch.dtype


def quantized_buffers(
    m: int, k: int, rows_multiple: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_per_token_group's outputs, empty: e4m3 [M', K] and fp32 scales [M', ceil(K / 128)]
    (column-major with rows_multiple > 1), M' = m rounded up to rows_multiple, the padding rows
    zeros of scale 1."""
    groups = triton.cdiv(k, GROUP)
    padded = triton.cdiv(m, rows_multiple) * rows_multiple
    q = torch.empty(padded, k, dtype=torch.float8_e4m3fn, device=device)
    if rows_multiple > 1:
        s = torch.empty(groups, padded, dtype=torch.float32, device=device).t()
    else:
        s = torch.empty(m, groups, dtype=torch.float32, device=device)
    if padded > m:
        q[m:].zero_()
        s[m:].fill_(1.0)
    return q, s


def quantize_per_token_group(
    x: torch.Tensor, rows_multiple: int = 1, per_program: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], fp32 scales [M, ceil(K / 128)]): x ~= q * scale of its group.
    rows_multiple > 1 (torch._scaled_mm's layout): M padded to a multiple of it with zero rows of
    scale 1, the scales column-major. per_program overrides groups_per_program (the
    benchmark's comparison, the tests)."""
    m, k = x.shape
    groups = triton.cdiv(k, GROUP)
    q, s = quantized_buffers(m, k, rows_multiple, x.device)
    if m:
        per = per_program or groups_per_program(m, groups)
        quantize_per_token_group_kernel[(m, triton.cdiv(groups, per))](
            x, q, s, x.stride(0), q.stride(0), s.stride(0), s.stride(1), k, GROUP_SIZE=GROUP, GROUPS=per
        )
    return q, s


@triton.jit
def _grouped_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Program pid's (row tile, column tile) in grouped order: GROUP_M row tiles share each column
    tile of W while it is in L2."""
    num_m, num_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    first_m = pid // (GROUP_M * num_n) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_n)) % size_m
    pid_n = (pid % (GROUP_M * num_n)) // size_m
    return pid_m, pid_n


@triton.jit
def _split_k_range(K, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, split):
    """The K steps [lo, hi) of split `split` of SPLIT_K (the last may be short, or empty)."""
    num_kb = tl.cdiv(K, BLOCK_K)
    kb_per_split = tl.cdiv(num_kb, SPLIT_K)
    lo = split * kb_per_split
    return lo, tl.minimum(lo + kb_per_split, num_kb)


@triton.jit
def _sum_splits(c_ptrs, parts, part_stride, count_ptr, acc, mask, SPLIT_K: tl.constexpr):
    """A split-K tile's sums (this program: tile program_id(0), split program_id(1)) into the
    output: each split stores its fp32 sums at parts (a split's [M, N] part_stride apart); the
    tile's last split to finish adds them up in split order (the same result every run, unlike
    atomic adds) and stores them in c's dtype, so the GEMM is one kernel: no zeroed fp32 output
    before it, no copy into the output dtype after it. count_ptr: an int32 a tile, zero between
    GEMMs (the last split resets its tile's)."""
    tile = tl.program_id(0)
    tl.store(parts + tl.program_id(1) * part_stride, acc, mask=mask)
    tl.debug_barrier()  # all of the program's sums stored before its split is counted (release)
    done = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
    if done == SPLIT_K - 1:
        total = tl.zeros(acc.shape, tl.float32)
        for s in tl.static_range(SPLIT_K):  # from L2: the other SMs' stores
            total += tl.load(parts + s * part_stride, mask=mask, other=0.0, cache_modifier=".cg")
        tl.store(c_ptrs, total.to(c_ptrs.dtype.element_ty), mask=mask)
        tl.atomic_xchg(count_ptr + tile, 0, sem="relaxed", scope="gpu")  # for the next GEMM


@triton.jit
def _write_tile(
    c_ptr, part_ptr, count_ptr, rm, rn, M, N, stride_cm, acc, mask, SPLIT_K: tl.constexpr,
    SUM_IN_KERNEL: tl.constexpr,
):  # fmt: skip
    """The tile's result into c: stored in c's dtype; with SPLIT_K > 1 added to fp32 c (zeroed)
    atomically, or with SUM_IN_KERNEL summed in the kernel into c's dtype (_sum_splits, as the swap
    kernel does)."""
    c_ptrs = c_ptr + rm.to(tl.int64)[:, None] * stride_cm + rn[None, :]
    if SPLIT_K == 1:
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)
    elif SUM_IN_KERNEL:
        parts = part_ptr + rm.to(tl.int64)[:, None] * N + rn[None, :]
        _sum_splits(c_ptrs, parts, M.to(tl.int64) * N, count_ptr, acc, mask, SPLIT_K)
    else:
        tl.atomic_add(c_ptrs, acc, mask=mask, sem="relaxed")


@triton.jit
def w8a8_block_matmul_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    part_ptr,  # SUM_IN_KERNEL: [SPLIT_K, M, N] fp32, each split's sums (_write_tile)
    count_ptr,  # SUM_IN_KERNEL: int32 a tile, zero between GEMMs
    a_s_ptr,
    b_s_ptr,
    M,
    N,
    K,
    stride_am,
    stride_bn,
    stride_cm,
    stride_asm,
    stride_bsn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # == the scale block along K (128)
    SCALE_N: tl.constexpr,  # rows of W per weight scale (128)
    GROUP_M: tl.constexpr,
    SPLIT_K: tl.constexpr,  # > 1: each program sums a 1/SPLIT_K share of K into fp32 c (zeroed), atomically
    SUM_IN_KERNEL: tl.constexpr = False,  # with SPLIT_K > 1: into c's dtype, summed in split order instead
):
    # a [M, K] e4m3 row-major, b [N, K] e4m3 (the checkpoint's layout), c [M, N].
    pid_m, pid_n = _grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    kb_lo, kb_hi = _split_k_range(K, BLOCK_K, SPLIT_K, tl.program_id(1))

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_mask, n_mask = rm < M, rn < N
    a_ptrs = a_ptr + rm.to(tl.int64)[:, None] * stride_am + rk[None, :]
    b_ptrs = b_ptr + rn.to(tl.int64)[None, :] * stride_bn + rk[:, None]
    a_s_ptrs = a_s_ptr + rm.to(tl.int64) * stride_asm
    b_s_ptrs = b_s_ptr + (rn // SCALE_N).to(tl.int64) * stride_bsn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    a_ptrs += kb_lo * BLOCK_K
    b_ptrs += kb_lo * BLOCK_K
    for kb in range(kb_lo, kb_hi):
        k_mask = rk < K - kb * BLOCK_K
        a = tl.load(a_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        a_s = tl.load(a_s_ptrs + kb, mask=m_mask, other=0.0)
        b_s = tl.load(b_s_ptrs + kb, mask=n_mask, other=0.0)
        acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    mask = m_mask[:, None] & n_mask[None, :]
    _write_tile(c_ptr, part_ptr, count_ptr, rm, rn, M, N, stride_cm, acc, mask, SPLIT_K, SUM_IN_KERNEL)


@triton.jit
def _load_tile(
    ptr_or_desc, off_r, rows, k0, K, stride, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, TMA: tl.constexpr
):
    """Rows off_r.. of an [rows, K] e4m3 matrix, columns k0..k0 + BLOCK_K: [BLOCK_R, BLOCK_K], zero
    outside the matrix (a TMA descriptor's box, or masked pointer loads)."""
    if TMA:
        tile = ptr_or_desc.load([off_r, k0])
    else:
        r = off_r + tl.arange(0, BLOCK_R)
        k = k0 + tl.arange(0, BLOCK_K)
        ptrs = ptr_or_desc + r.to(tl.int64)[:, None] * stride + k[None, :]
        tile = tl.load(ptrs, mask=(r < rows)[:, None] & (k < K)[None, :], other=0.0)
    return tile


@triton.jit
def w8a8_block_matmul_v2_kernel(
    a_ptr,  # [M, K] e4m3, or its TMA descriptor of [BLOCK_M, BLOCK_K] boxes (TMA)
    b_ptr,  # [N, K] e4m3, or its descriptor of [BLOCK_N, BLOCK_K] boxes
    c_ptr,
    part_ptr,  # SUM_IN_KERNEL: as w8a8_block_matmul_kernel's
    count_ptr,
    a_s_ptr,
    b_s_ptr,
    M,
    N,
    K,
    stride_am,
    stride_bn,
    stride_cm,
    stride_asm,
    stride_bsn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,  # <= SCALE_N and dividing it: one weight scale per tile and K step
    BLOCK_K: tl.constexpr,  # == the scale block along K (128)
    SCALE_N: tl.constexpr,
    GROUP_M: tl.constexpr,
    SPLIT_K: tl.constexpr,
    TMA: tl.constexpr,
    SUM_IN_KERNEL: tl.constexpr = False,
):
    pid_m, pid_n = _grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    kb_lo, kb_hi = _split_k_range(K, BLOCK_K, SPLIT_K, tl.program_id(1))
    off_m = pid_m * BLOCK_M
    off_n = pid_n * BLOCK_N

    rm = off_m + tl.arange(0, BLOCK_M)
    m_mask = rm < M
    a_s_ptrs = a_s_ptr + rm.to(tl.int64) * stride_asm
    # One weight scale per tile and K step (BLOCK_N divides SCALE_N): a scalar load.
    b_s_ptr += (off_n // SCALE_N).to(tl.int64) * stride_bsn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for kb in range(kb_lo, kb_hi):
        a = _load_tile(a_ptr, off_m, M, kb * BLOCK_K, K, stride_am, BLOCK_M, BLOCK_K, TMA)
        b = _load_tile(b_ptr, off_n, N, kb * BLOCK_K, K, stride_bn, BLOCK_N, BLOCK_K, TMA)
        scale = tl.load(a_s_ptrs + kb, mask=m_mask, other=0.0) * tl.load(b_s_ptr + kb)
        acc = tl.fma(tl.dot(a, b.T), scale[:, None], acc)
    rn = off_n + tl.arange(0, BLOCK_N)
    mask = m_mask[:, None] & (rn < N)[None, :]
    _write_tile(c_ptr, part_ptr, count_ptr, rm, rn, M, N, stride_cm, acc, mask, SPLIT_K, SUM_IN_KERNEL)


@triton.jit(do_not_specialize=["M"])  # one compile for every decode batch size
def w8a8_block_matmul_swap_kernel(
    a_ptr,  # [M, K] e4m3 (the tokens), or its TMA descriptor of [BLOCK_M, BLOCK_K] boxes (TMA)
    b_ptr,  # [N, K] e4m3 (the weight), or its descriptor of [BLOCK_N, BLOCK_K] boxes
    c_ptr,  # [M, N] in the output dtype
    part_ptr,  # SPLIT_K > 1: [SPLIT_K, M, N] fp32, each split's sums of each tile
    count_ptr,  # SPLIT_K > 1: int32 a tile, zero between GEMMs: how many of its splits have stored
    a_s_ptr,
    b_s_ptr,
    M,
    N,
    K,
    stride_am,
    stride_bn,
    stride_cm,
    stride_asm,
    stride_bsn,
    BLOCK_M: tl.constexpr,  # tokens: the wgmma's N (16-256)
    BLOCK_N: tl.constexpr,  # weight rows: the wgmma's M (64 a warpgroup); <= SCALE_N and dividing it
    BLOCK_K: tl.constexpr,  # == the scale block along K (128)
    SCALE_N: tl.constexpr,
    SPLIT_K: tl.constexpr,
    TMA: tl.constexpr,
):
    # The tile is computed transposed, acc[n, m] = sum_k W[n, k] x[m, k], so that the weight's rows
    # fill the tensor cores' 64-row side and a decode batch of a few tokens is the narrow side.
    num_m = tl.cdiv(M, BLOCK_M)
    tile = tl.program_id(0)
    split = tl.program_id(1)
    off_m = (tile % num_m) * BLOCK_M  # the row tiles of one column tile side by side: W read once from L2
    off_n = (tile // num_m) * BLOCK_N
    kb_lo, kb_hi = _split_k_range(K, BLOCK_K, SPLIT_K, split)

    rm = off_m + tl.arange(0, BLOCK_M)
    m_mask = rm < M
    a_s_ptrs = a_s_ptr + rm.to(tl.int64) * stride_asm
    b_s_ptr += (off_n // SCALE_N).to(tl.int64) * stride_bsn
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for kb in range(kb_lo, kb_hi):
        b = _load_tile(b_ptr, off_n, N, kb * BLOCK_K, K, stride_bn, BLOCK_N, BLOCK_K, TMA)
        a = _load_tile(a_ptr, off_m, M, kb * BLOCK_K, K, stride_am, BLOCK_M, BLOCK_K, TMA)
        scale = tl.load(a_s_ptrs + kb, mask=m_mask, other=0.0) * tl.load(b_s_ptr + kb)
        acc = tl.fma(tl.dot(b, a.T), scale[None, :], acc)
    rn = off_n + tl.arange(0, BLOCK_N)
    mask = (rn < N)[:, None] & m_mask[None, :]
    c_ptrs = c_ptr + rm.to(tl.int64)[None, :] * stride_cm + rn[:, None]
    if SPLIT_K == 1:
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)
    else:
        parts = part_ptr + rm.to(tl.int64)[None, :] * N + rn[:, None]
        _sum_splits(c_ptrs, parts, M.to(tl.int64) * N, count_ptr, acc, mask, SPLIT_K)


# Per (token bucket, n, k): a config that replaces gemm_config's rule there, from
# `bench/fp8_gemm.py --sweep-v2` (its "table" lines). m in (32, 64] takes bucket 64, (64, 128] 128,
# and so on from 1 token to (4096, 8192] 8192 (prefill chunks); larger counts keep the rule.
M_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
_V2_64x64_S6 = {"KERNEL": "v2", "BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 6, "TMA": True}
GEMM_TABLE: dict[tuple[int, int, int], dict] = {
    # Qwen3-8B on the H200, 2026-12-02 (bench/RESULTS.md): us against the first kernel's rule and
    # torch._scaled_mm at the same m. qkv:
    (64, 6144, 4096): _V2_64x64_S6,  # 17.9 against 20.3 / -
    (128, 6144, 4096): _V2_64x64_S6,  # 18.8 against 25.5 / 19.6
    (512, 6144, 4096): {**_V2_64x64_S6, "BLOCK_N": 128, "num_stages": 3},  # 30.5 against 60.0 / 31.5
    # o
    (64, 4096, 4096): _V2_64x64_S6,  # 15.3 against 17.2 / -
    (128, 4096, 4096): _V2_64x64_S6,  # 15.6 against 19.8 / 18.2
    (256, 4096, 4096): _V2_64x64_S6,  # 18.2 against 24.3 / 18.6
    # gate_up
    (64, 24576, 4096): {**_V2_64x64_S6, "num_stages": 4},  # 38.4 against 41.5 / -
    # down
    (128, 4096, 12288): {**_V2_64x64_S6, "BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 4,
                         "SPLIT_K": 3},  # 36.2 against 50.0 / 39.6
}  # fmt: skip


def m_bucket(m: int) -> int | None:
    return next((b for b in M_BUCKETS if b // 2 < m <= b), None)


def gemm_config(m: int, n: int, k: int | None = None) -> dict:
    """Launch configuration by the number of tokens m and output features n, from
    `bench/fp8_gemm.py --sweep` on an H200 (Qwen3-8B's shapes, CUDA-graph replays). Decode sizes are
    bound by reading the weights: with few column tiles (n / BLOCK_N programs, fewer than two per
    SM) K is split so that every SM streams weights (qkv, o and down at m = 1: 17 / 15 / 26 us
    against 29 / 89 / 74 without); from m = 256 on, tiles of 64-128 rows, no split. GEMM_TABLE's
    entry for (m_bucket(m), n, k) where it has one."""
    if m <= SWAP_MAX_TOKENS:
        return swap_config(m, n)
    if k is not None and (m_bucket(m), n, k) in GEMM_TABLE:
        return dict(GEMM_TABLE[m_bucket(m), n, k])
    if m <= 64:
        block_m = 16 if m <= 16 else 64
        programs = triton.cdiv(n, 64)
        split_k = min(triton.next_power_of_2(triton.cdiv(2 * _NUM_SMS, programs)), 8 if m <= 16 else 4)
        return {"BLOCK_M": block_m, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3, "SPLIT_K": split_k}
    if m <= 256:
        return {"BLOCK_M": 64, "BLOCK_N": 128 if n >= 16384 else 64, "num_warps": 4, "num_stages": 4}
    return {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3}


_NUM_SMS = 132  # H200 / H100 SXM; only the split-K choice and the quantize grid depend on it

# Whether the v1 and v2 kernels' split-K GEMMs sum their splits in the kernel (_write_tile's
# SUM_IN_KERNEL: each tile's last split adds the others' fp32 sums in split order, as the swap kernel
# does) instead of atomic adds into a zeroed fp32 buffer copied into the output after: the same bits
# every run, and two kernels fewer a GEMM (the zeroing and the copy: ~1.1 and ~1.2 us each at a
# 16-token decode step on an H100, three such GEMMs a layer; bench/RESULTS.md, 2026-12-06). Off
# until timed on the GPU (bench/throughput.py --fp8-gemm-sum-in-kernel).
SPLIT_K_SUM_IN_KERNEL = False

# Up to this many tokens gemm_config takes swap_config's rule over the others (GEMM_TABLE's too):
# 0, off, until the swap kernel has been timed on the GPU (bench/fp8_gemm.py --sweep-v2 --kernels
# swap; bench/throughput.py --fp8-gemm-swap-below N sets it for a W4 run).
SWAP_MAX_TOKENS = 0


def swap_config(m: int, n: int) -> dict:
    """A first rule for the swap kernel at decode sizes: every token in one tile (16-64 wide), 128
    weight rows a tile, and K split until there are about two programs an SM (at most 8 shares)."""
    block_m = min(max(16, triton.next_power_of_2(m)), 64)
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, GROUP)
    split_k = min(triton.next_power_of_2(triton.cdiv(2 * _NUM_SMS, tiles)), 8)
    return {"KERNEL": "swap", "BLOCK_M": block_m, "BLOCK_N": GROUP, "num_warps": 4,
            "num_stages": 6 if block_m <= 32 else 4, "SPLIT_K": split_k, "TMA": True}  # fmt: skip


def w8a8_block_matmul(
    a_q: torch.Tensor,
    a_s: torch.Tensor,
    weight: torch.Tensor,
    weight_scale_inv: torch.Tensor,
    out_dtype: torch.dtype,
    config: dict | None = None,
) -> torch.Tensor:
    """(a_q * a_s) @ (weight * weight_scale_inv)^T in fp32, as out_dtype: [M, K] x [N, K] -> [M, N]."""
    m, k = a_q.shape
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=out_dtype, device=a_q.device)
    if m == 0:
        return out
    cfg = {**gemm_config(m, n, k), **(config or {})}
    kernel = cfg.get("KERNEL", "v1")
    if kernel == "swap":
        _launch_swap(a_q, a_s, weight, weight_scale_inv, out, cfg)
        return out
    split_k = cfg.get("SPLIT_K", 1)
    grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]), split_k)
    gluon = kernel == "gluon" and gluon_applies(a_q, weight)
    # Split over K: the partial sums meet in fp32, added atomically into a zeroed c and copied into
    # out after (the order of the atomic adds varies: not bitwise reproducible run to run, so only
    # where bench/fp8_gemm.py --sweep found it faster), or with SPLIT_K_SUM_IN_KERNEL (or the
    # config's SUM_IN_KERNEL; not the Gluon kernel) summed by each tile's last split, in split order.
    in_kernel = split_k > 1 and not gluon and cfg.get("SUM_IN_KERNEL", SPLIT_K_SUM_IN_KERNEL)
    if in_kernel and grid[0] > SWAP_MAX_TILES:
        raise ValueError(
            f"the fp8 GEMM sums split-K in the kernel for at most {SWAP_MAX_TILES} tiles, not {grid[0]}"
        )
    if split_k == 1 or in_kernel:
        c = out
        parts = torch.empty(split_k, m, n, dtype=torch.float32, device=a_q.device) if in_kernel else out
        counters = tile_counters(a_q.device) if in_kernel else out
    else:
        c = parts = counters = torch.zeros(m, n, dtype=torch.float32, device=a_q.device)
    if gluon:
        from executor_service.layers.fp8_gemm_gluon import launch_gluon

        launch_gluon(a_q, a_s, weight, weight_scale_inv, c, cfg, grid)
    elif kernel in ("v2", "gluon"):  # the Gluon kernel's sums in its order, where it cannot run
        cfg = {"TMA": True, **cfg, "SUM_IN_KERNEL": bool(in_kernel)}
        _launch_v2(a_q, a_s, weight, weight_scale_inv, c, cfg, grid, parts, counters)
    else:
        w8a8_block_matmul_kernel[grid](
            a_q, weight, c, parts, counters, a_s, weight_scale_inv, m, n, k,
            a_q.stride(0), weight.stride(0), c.stride(0), a_s.stride(0), weight_scale_inv.stride(0),
            BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=GROUP, SCALE_N=GROUP, GROUP_M=8,
            SPLIT_K=split_k, SUM_IN_KERNEL=bool(in_kernel), num_warps=cfg["num_warps"],
            num_stages=cfg["num_stages"],
        )  # fmt: skip
    if c is not out:
        out.copy_(c)
    return out


def gluon_applies(a_q: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether fp8_gemm_gluon's kernel can run: an sm90 GPU (wgmma is sm90's alone) and operands
    TMA reads (tma_applies)."""
    if not a_q.is_cuda or torch.cuda.get_device_capability(a_q.device) != (9, 0):
        return False
    return tma_applies(a_q, weight)


def tma_applies(a_q: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether both e4m3 operands can be read through TMA descriptors: a GPU that has TMA (sm90 on),
    rows contiguous, 16-byte aligned bases and row strides (K a multiple of 16)."""
    if a_q.is_cuda and torch.cuda.get_device_capability(a_q.device) < (9, 0):
        return False  # TMA is Hopper's
    return all(t.stride(1) == 1 and t.stride(0) % 16 == 0 and t.data_ptr() % 16 == 0 for t in (a_q, weight))


def _operands(kernel: str, a_q, weight, block_m: int, block_n: int, tma: bool) -> tuple:
    """(a, b, TMA) as the v2 and swap kernels take them: TMA descriptors of [block_m, 128] and
    [block_n, 128] boxes where `tma` and tma_applies, else the tensors themselves (masked pointer
    loads). ValueError for a BLOCK_N that does not divide the weight's scale block (both kernels
    take one weight scale a tile)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    if GROUP % block_n:
        raise ValueError(
            f"the {kernel} kernel takes BLOCK_N dividing {GROUP} (one weight scale a tile), not {block_n}"
        )
    if not (tma and tma_applies(a_q, weight)):
        return a_q, weight, False
    return (
        TensorDescriptor.from_tensor(a_q, [block_m, GROUP]),
        TensorDescriptor.from_tensor(weight, [block_n, GROUP]),
        True,
    )


def _launch_v2(a_q, a_s, weight, weight_scale_inv, c, cfg, grid, parts=None, counters=None) -> None:
    """w8a8_block_matmul_v2_kernel with cfg's tiles; TMA descriptors for the operands where cfg asks
    for them (TMA) and tma_applies, masked pointer loads otherwise; parts and counters: its
    SUM_IN_KERNEL workspace (w8a8_block_matmul's)."""
    m, k = a_q.shape
    n = weight.shape[0]
    block_m, block_n = cfg["BLOCK_M"], cfg["BLOCK_N"]
    a_arg, b_arg, tma = _operands("v2", a_q, weight, block_m, block_n, cfg.get("TMA", False))
    w8a8_block_matmul_v2_kernel[grid](
        a_arg, b_arg, c, c if parts is None else parts, c if counters is None else counters,
        a_s, weight_scale_inv, m, n, k,
        a_q.stride(0), weight.stride(0), c.stride(0), a_s.stride(0), weight_scale_inv.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=GROUP, SCALE_N=GROUP, GROUP_M=cfg.get("GROUP_M", 8),
        SPLIT_K=cfg.get("SPLIT_K", 1), TMA=tma, SUM_IN_KERNEL=bool(cfg.get("SUM_IN_KERNEL", False)),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip


# The swap kernel's split-K counters: an int32 a tile per device, zero between GEMMs (each tile's
# last split resets its own). Made once, outside any CUDA graph capture, and never replaced, so a
# captured GEMM's counters stay where the graph wrote them.
SWAP_MAX_TILES = 1 << 16
_tile_counters: dict[torch.device, torch.Tensor] = {}


def tile_counters(device: torch.device) -> torch.Tensor:
    if device not in _tile_counters:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "the fp8 GEMM's split-K counters are made by an eager GEMM, before any capture: run "
                "the model once outside the CUDA graph first"
            )
        _tile_counters[device] = torch.zeros(SWAP_MAX_TILES, dtype=torch.int32, device=device)
    return _tile_counters[device]


def _launch_swap(a_q, a_s, weight, weight_scale_inv, out, cfg) -> None:
    """w8a8_block_matmul_swap_kernel into out: cfg's BLOCK_M tokens by BLOCK_N weight rows a tile,
    SPLIT_K programs a tile summing their shares in the kernel (fp32 partial sums in a workspace)."""
    m, k = a_q.shape
    n = weight.shape[0]
    block_m, block_n, split_k = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg.get("SPLIT_K", 1)
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    if split_k > 1 and tiles > SWAP_MAX_TILES:
        raise ValueError(f"the swap kernel splits K for at most {SWAP_MAX_TILES} tiles, not {tiles}")
    a_arg, b_arg, tma = _operands("swap", a_q, weight, block_m, block_n, cfg.get("TMA", True))
    if split_k > 1:
        parts = torch.empty(split_k, m, n, dtype=torch.float32, device=a_q.device)
        counters = tile_counters(a_q.device)
    else:
        parts = counters = out  # not read
    w8a8_block_matmul_swap_kernel[(tiles, split_k)](
        a_arg, b_arg, out, parts, counters, a_s, weight_scale_inv, m, n, k,
        a_q.stride(0), weight.stride(0), out.stride(0), a_s.stride(0), weight_scale_inv.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=GROUP, SCALE_N=GROUP, SPLIT_K=split_k, TMA=tma,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip


# From this many tokens on, fp8_linear takes torch._scaled_mm where it can (the module docstring),
# for weights of at least SCALED_MM_MIN_DIM in and out features: torch 2.11's blockwise GEMM
# returned wrong sums on the H200 at 256 x 256 (a relative error of 1.2 against the Triton GEMM;
# 384 x 512 and up agree to 1e-3).
SCALED_MM_MIN_TOKENS = 128
SCALED_MM_MIN_DIM = 1024

# Per device index: whether torch._scaled_mm takes 1 x 128 activation and 128 x 128 weight scales.
_blockwise_supported: dict[int, bool] = {}


def scaled_mm_applies(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether fp8_linear of m tokens of dtype on device through an [n, k] weight goes to
    torch._scaled_mm: bf16 on a GPU whose torch has the blockwise-scaled GEMM (probed once per
    device, never during a capture), where GEMM_TABLE names no faster Triton GEMM."""
    if m < SCALED_MM_MIN_TOKENS or min(n, k) < SCALED_MM_MIN_DIM or (m_bucket(m), n, k) in GEMM_TABLE:
        return False
    if dtype != torch.bfloat16 or device.type != "cuda":
        return False
    return _probed(_blockwise_supported, device, _probe_scaled_mm)


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _probed(answers: dict[int, bool], device: torch.device, probe) -> bool:
    """probe(device)'s answer, asked once per device index and kept in answers; False without asking
    during a CUDA-graph capture (a probe's GEMMs and syncs cannot run there)."""
    index = _device_index(device)
    if index not in answers:
        if torch.cuda.is_current_stream_capturing():
            return False
        answers[index] = probe(device)
    return answers[index]


def _probe_scaled_mm(device: torch.device) -> bool:
    """One small blockwise torch._scaled_mm against the Triton GEMM (the torch and the GPU support it
    and read the scales as fp8_linear lays them out)."""
    if torch.cuda.get_device_capability(device) != (9, 0) or not hasattr(torch, "_scaled_mm"):
        return False
    gen = torch.Generator(device).manual_seed(0)
    x = torch.randn(SCALED_MM_MIN_TOKENS, SCALED_MM_MIN_DIM, device=device, generator=gen).bfloat16()
    weight = torch.randn(SCALED_MM_MIN_DIM, SCALED_MM_MIN_DIM, device=device, generator=gen)
    weight = weight.to(torch.float8_e4m3fn)
    scales = (
        torch.rand(SCALED_MM_MIN_DIM // GROUP, SCALED_MM_MIN_DIM // GROUP, device=device, generator=gen) + 0.5
    )
    try:
        got = scaled_mm_blockwise(x, weight, scales)
    except (RuntimeError, NotImplementedError, TypeError, ValueError):
        return False
    want = w8a8_block_matmul(*quantize_per_token_group(x), weight, scales, x.dtype)
    return bool(torch.allclose(got.float(), want.float(), rtol=1e-2, atol=1e-2 * want.abs().max().item()))


def scaled_mm_blockwise(
    x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor
) -> torch.Tensor:
    """fp8_linear's GEMM through torch._scaled_mm (where scaled_mm_applies): x quantized per token
    in groups of 128, its scales column-major and M a multiple of 4; the weight and its scales
    transposed: the layout torch's sm90 blockwise GEMM reads."""
    a_q, a_s = quantize_per_token_group(x, rows_multiple=4)
    return _scaled_mm_quantized(a_q, a_s, x.shape[0], weight, weight_scale_inv, x.dtype)


def _scaled_mm_quantized(
    a_q: torch.Tensor,
    a_s: torch.Tensor,
    rows: int,
    weight: torch.Tensor,
    weight_scale_inv: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """torch._scaled_mm of an activation quantized in its layout (rows padded to 4), unpadded."""
    if scaled_mm_splits_k(a_q.shape[0], weight.shape[0], weight.shape[1], a_q.device):
        return scaled_mm_split_k(a_q, a_s, weight, weight_scale_inv, out_dtype)[:rows]
    out = torch._scaled_mm(a_q, weight.t(), scale_a=a_s, scale_b=weight_scale_inv.t(), out_dtype=out_dtype)
    return out[:rows]


# torch._scaled_mm's GEMM leaves SMs idle where its output has fewer tiles than the GPU has SMs: at
# 256 tokens Qwen3-8B's down projection (n 4096, k 12288) is 64 tiles of 128 x 128 for 132 SMs and
# streams its weights at 1.2 TB/s (40.5 us on the H200, 2026-12-05). With SCALED_MM_SPLIT_K, where
# two such GEMMs fit the SMs side by side, fp8_linear runs the two halves of K at once, one on a
# side stream (a fork and a join, which CUDA graphs capture as two branches), each summing in fp32,
# and adds them: the same fp32 accumulation split in two, rounded once. Off until the GPU times it
# (bench/fp8_gemm.py --sweep-v2's "torch._scaled_mm, K in halves on two streams" row;
# bench/throughput.py --fp8-scaled-mm-split-k).
SCALED_MM_SPLIT_K = False
# Per device index: its side stream, and whether the split agrees with the whole GEMM there.
_side_streams: dict[int, torch.cuda.Stream] = {}
_split_k_agrees: dict[int, bool] = {}


def scaled_mm_splits_k(m: int, n: int, k: int, device: torch.device) -> bool:
    """Whether torch._scaled_mm of m (padded) rows through an [n, k] weight runs as two K halves at
    once (SCALED_MM_SPLIT_K): two GEMMs' 128 x 128 tiles fit the SMs, each half holds a whole number
    of 4 scale groups (its scales' offset 16-byte aligned), and the split agreed with the whole GEMM
    when probed on this device (once, never during a capture)."""
    if not SCALED_MM_SPLIT_K or device.type != "cuda" or k % (8 * GROUP):
        return False
    if 2 * triton.cdiv(m, 128) * triton.cdiv(n, 128) > _NUM_SMS:
        return False
    return _probed(_split_k_agrees, device, _probe_split_k)


def weight_scale_halves(weight_scale_inv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The weight's block scales (N/128, K/128) for each half of K, each contiguous (torch's
    blockwise GEMM takes no row stride for them), kept on the tensor after the first eager call
    until the tensor is written in place (its version counter; an inference tensor, which has none,
    keeps its first); a call inside a CUDA-graph capture copies them in the graph instead (a copy
    made there holds nothing until a replay)."""
    now = -1 if weight_scale_inv.is_inference() else weight_scale_inv._version
    version, halves = getattr(weight_scale_inv, "_k_halves", (None, None))
    if version != now:
        groups = weight_scale_inv.shape[1] // 2
        halves = (weight_scale_inv[:, :groups].contiguous(), weight_scale_inv[:, groups:].contiguous())
        if not (weight_scale_inv.is_cuda and torch.cuda.is_current_stream_capturing()):
            weight_scale_inv._k_halves = (now, halves)
    return halves


def k_halves(
    a_q: torch.Tensor, a_s: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """torch._scaled_mm's operands (activation, weight^T, their scales) for each half of K: views
    of the activation (rows, K), its column-major scales (rows, K/128) and the weight (N, K), and
    the weight's scales of that half (weight_scale_halves), transposed as _scaled_mm_quantized
    passes them."""
    half = a_q.shape[1] // 2
    groups = half // GROUP
    return [
        (a_q[:, ks], weight[:, ks].t(), a_s[:, gs], scales.t())
        for ks, gs, scales in zip(
            (slice(None, half), slice(half, None)),
            (slice(None, groups), slice(groups, None)),
            weight_scale_halves(weight_scale_inv),
            strict=True,
        )
    ]


@triton.jit
def _add_halves_kernel(sums_ptr, out_ptr, numel, BLOCK: tl.constexpr):
    # grid: (cdiv(numel, BLOCK),); sums: [2, numel] fp32 -> out: numel in out's dtype
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    total = tl.load(sums_ptr + offs, mask=mask) + tl.load(sums_ptr + numel + offs, mask=mask)
    tl.store(out_ptr + offs, total.to(out_ptr.dtype.element_ty), mask=mask)


def scaled_mm_split_k(
    a_q: torch.Tensor,
    a_s: torch.Tensor,
    weight: torch.Tensor,
    weight_scale_inv: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """(a_q * a_s) @ (weight * weight_scale_inv)^T as two torch._scaled_mm calls over the halves of
    K, the second on a side stream while the first runs, each into an fp32 buffer allocated on the
    current stream (which waits for the side stream before it reads or frees them, even if a GEMM
    raises), then added and rounded to out_dtype in one kernel."""
    (a0, w0, s0, t0), (a1, w1, s1, t1) = k_halves(a_q, a_s, weight, weight_scale_inv)
    m, n = a_q.shape[0], weight.shape[0]
    sums = torch.empty(2, m, n, dtype=torch.float32, device=a_q.device)
    main = torch.cuda.current_stream(a_q.device)
    index = _device_index(a_q.device)
    side = _side_streams.get(index)
    if side is None:
        side = _side_streams[index] = torch.cuda.Stream(a_q.device)
    side.wait_stream(main)
    try:
        with torch.cuda.stream(side):
            torch._scaled_mm(a1, w1, scale_a=s1, scale_b=t1, out_dtype=torch.float32, out=sums[1])
        torch._scaled_mm(a0, w0, scale_a=s0, scale_b=t0, out_dtype=torch.float32, out=sums[0])
    finally:
        main.wait_stream(side)
    out = torch.empty(m, n, dtype=out_dtype, device=a_q.device)
    _add_halves_kernel[(triton.cdiv(m * n, 2048),)](sums, out, m * n, BLOCK=2048)
    return out


def _probe_split_k(device: torch.device) -> bool:
    """One split GEMM against the whole (the torch takes fp32 outputs and the halves' operands)."""
    gen = torch.Generator(device).manual_seed(1)
    m, n, k = 256, 1024, 8 * GROUP
    a_q, a_s = quantize_per_token_group(
        torch.randn(m, k, device=device, generator=gen).bfloat16(), rows_multiple=4
    )
    weight = torch.randn(n, k, device=device, generator=gen).to(torch.float8_e4m3fn)
    scales = torch.rand(n // GROUP, k // GROUP, device=device, generator=gen) + 0.5
    try:
        got = scaled_mm_split_k(a_q, a_s, weight, scales, torch.bfloat16)
        want = torch._scaled_mm(a_q, weight.t(), scale_a=a_s, scale_b=scales.t(), out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError, TypeError, ValueError) as e:
        warnings.warn(f"torch._scaled_mm in two K halves is off on {device}: {e}", stacklevel=2)
        return False
    return bool(torch.allclose(got.float(), want.float(), rtol=1e-2, atol=1e-2 * want.abs().max().item()))


def fp8_input_rows_multiple(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device) -> int:
    """How fp8_linear lays out the quantized activation of m tokens for an [n, k] weight: 4 (padded
    rows, column-major scales) for torch._scaled_mm, 1 for the Triton GEMM. The op before a fused
    quantization asks, so that its output is what fp8_linear would have quantized itself."""
    return 4 if scaled_mm_applies(m, n, k, dtype, device) else 1


def fp8_linear(
    x: torch.Tensor | Fp8Input, weight: torch.Tensor, weight_scale_inv: torch.Tensor
) -> torch.Tensor:
    """x [..., K] (bf16/fp16/fp32) @ dequantized(weight)^T -> [..., N] in x's dtype. An Fp8Input
    (quantized by the op before) goes to the GEMM its layout was made for."""
    if isinstance(x, Fp8Input):
        if x.rows_multiple > 1:
            return _scaled_mm_quantized(x.q, x.scales, x.rows, weight, weight_scale_inv, x.dtype)
        return w8a8_block_matmul(x.q, x.scales, weight, weight_scale_inv, x.dtype)
    shape = x.shape
    x = x.reshape(-1, shape[-1])
    if scaled_mm_applies(x.shape[0], *weight.shape, x.dtype, x.device):
        out = scaled_mm_blockwise(x, weight, weight_scale_inv)
    else:
        out = w8a8_block_matmul(*quantize_per_token_group(x), weight, weight_scale_inv, x.dtype)
    return out.view(*shape[:-1], weight.shape[0])
