"""The MoE experts on CUDA in Triton kernels, with no host sync (a decode step is captured in a CUDA
graph):

1. align (two kernels): the (token, k) pairs sorted by expert, each expert's run padded to a
   multiple of BLOCK_M (a static size per token count: num_pairs + num_experts * (BLOCK_M - 1)), so
   that every BLOCK_M rows of the sorted list belong to one expert; experts with no token get no
   block. The first kernel counts each chunk's pairs per expert, the second places them;
2. gate/up: a grouped GEMM, one program per (block of BLOCK_M pairs, BLOCK_N intermediate columns),
   the gate and up tiles of the block's expert multiplied together, SiLU-and-mul in the epilogue;
3. down: a grouped GEMM over the intermediate activations with each pair's routing weight folded
   into the epilogue, written per pair in the model dtype;
4. the k pairs of each token summed in fp32, in a fixed order (the result of a token does not
   depend on the batch it is in).

Each weight tile of an expert is read once per block of its pairs: at decode (a few pairs per
expert) that is once, and the step reads the experts' weights at close to the copy rate. The two
GEMMs have their own tiles (gate/up: K = hidden, N = 2 x intermediate; down: K = intermediate,
N = hidden) and share BLOCK_M, the align's block. Tiles come from CONFIGS by the step's token count
(no autotuning: a captured graph must not tune); bench/moe.py --sweep measures them. Rounding
follows layers/moe.py's reference: the GEMM outputs, the activation and the weighted products are
rounded to the model dtype where the reference's are.

FP8 experts (an fp8 checkpoint's e4m3 w13 / w2 with one fp32 scale per 128 x 128 block) take the
same kernels as W8A8, like the dense GEMM of fp8_gemm_triton.py: gate/up quantizes the tokens' hidden
states and down the intermediate of each pair, per row in groups of 128 (quantize_per_token_group),
and with BLOCK_K = 128 each K step has one activation scale per row and one weight scale per 128
output columns: acc += dot(a, w) * a_s * w_s in fp32."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from executor_service.layers.fp8_gemm_triton import GROUP as FP8_BLOCK
from executor_service.layers.fp8_gemm_triton import quantize_per_token_group


@dataclass(frozen=True)
class MoEConfig:
    """One GEMM's tiles and launch shape."""

    BLOCK_M: int
    BLOCK_N: int
    BLOCK_K: int
    num_warps: int
    num_stages: int


def _tiles(bm: int, gate_up: tuple[int, int, int, int], down: tuple[int, int, int, int]):
    return MoEConfig(bm, *gate_up), MoEConfig(bm, *down)


# (largest token count, (gate/up tiles, down tiles)), measured on the H200 at the Qwen3-30B-A3B shape
# (bench/moe.py --sweep; BLOCK_N, BLOCK_K, warps, stages after BLOCK_M). Decode sizes give each
# expert a few pairs, so a short BLOCK_M; prefill chunks give it hundreds, so square tiles.
CONFIGS: list[tuple[int, tuple[MoEConfig, MoEConfig]]] = [
    (32, _tiles(16, (32, 256, 4, 2), (64, 128, 4, 3))),
    (192, _tiles(16, (64, 128, 4, 2), (128, 128, 4, 2))),
    (384, _tiles(32, (64, 128, 4, 2), (64, 128, 4, 2))),
    (1024, _tiles(64, (64, 64, 8, 3), (128, 64, 8, 4))),
    (1 << 62, _tiles(128, (128, 64, 8, 4), (256, 64, 8, 4))),
]


# Shared memory the pipelined tiles of one program may take: the H200's 227 KiB per block.
_SHARED_MEMORY_BYTES = 227 * 1024


def fit_shared_memory(config: MoEConfig, weight_tiles: int, element_size: int) -> MoEConfig:
    """For wider elements (fp32, the tests' dtype) BLOCK_K and then the stages shrink until the A
    tile and the weight_tiles weight tiles (gate/up: 2, down: 1) of every stage fit."""

    def shared(c: MoEConfig) -> int:
        return c.num_stages * (c.BLOCK_M + weight_tiles * c.BLOCK_N) * c.BLOCK_K * element_size

    while shared(config) > _SHARED_MEMORY_BYTES and config.BLOCK_K > 16:
        config = dataclasses.replace(config, BLOCK_K=config.BLOCK_K // 2)
    while shared(config) > _SHARED_MEMORY_BYTES and config.num_stages > 2:
        config = dataclasses.replace(config, num_stages=config.num_stages - 1)
    return config


def get_config(num_tokens: int, element_size: int = 2, fp8: bool = False) -> tuple[MoEConfig, MoEConfig]:
    """(gate/up tiles, down tiles) for a step of num_tokens tokens. fp8 (e4m3 operands, one byte):
    the same tiles with BLOCK_K = 128, one block scale per K step (not tuned separately yet)."""
    configs = next(configs for limit, configs in CONFIGS if num_tokens <= limit)
    if fp8:
        return tuple(
            fit_shared_memory(dataclasses.replace(c, BLOCK_K=FP8_BLOCK), tiles, 1)
            for c, tiles in zip(configs, (2, 1), strict=True)
        )
    gate_up, down = configs
    return fit_shared_memory(gate_up, 2, element_size), fit_shared_memory(down, 1, element_size)


def align_block_size_reference(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """topk_ids [num_tokens, top_k] -> (sorted_ids [max_padded] int32: pair indices t * top_k + k
    grouped by expert in order, each group padded with num_pairs to a multiple of block_m; expert_ids
    [max_padded / block_m] int32: each block's expert; num_padded [1] int32: rows in use). In torch
    ops (about 25 kernels); align_block_size computes the same in two."""
    flat = topk_ids.flatten()
    num_pairs = flat.numel()
    device = flat.device
    max_padded = num_pairs + num_experts * (block_m - 1)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    sorted_experts = flat[order]
    # A pair's rank among its expert's pairs, then its row in the padded layout.
    rank = torch.arange(num_pairs, device=device) - (torch.cumsum(counts, 0) - counts)[sorted_experts]
    rows = (padded_end - padded)[sorted_experts] + rank
    sorted_ids = torch.full((max_padded,), num_pairs, dtype=torch.int32, device=device)
    sorted_ids[rows] = order.to(torch.int32)
    block_starts = torch.arange(0, triton.cdiv(max_padded, block_m) * block_m, block_m, device=device)
    expert_ids = torch.searchsorted(padded_end, block_starts, right=True).clamp_(max=num_experts - 1)
    return sorted_ids, expert_ids.to(torch.int32), padded_end[-1:].to(torch.int32)


# The align kernels' programs (at most), the pairs each handles per step of its loop, and the
# placing kernel's warps.
_ALIGN_PROGRAMS = 64
_ALIGN_SUB = 64
ALIGN_WARPS = 4


@triton.jit(do_not_specialize=["num_pairs", "chunk"])
def _count_kernel(topk_ids_ptr, counts_ptr, num_pairs, chunk, E_POW2: tl.constexpr, SUB: tl.constexpr):
    # counts [programs, E_POW2]: how many of program p's pairs [p * chunk, (p + 1) * chunk) go to each expert.
    pid = tl.program_id(0)
    experts = tl.arange(0, E_POW2)
    counts = tl.zeros((E_POW2,), dtype=tl.int32)
    for start in range(0, chunk, SUB):
        offs = pid * chunk + start + tl.arange(0, SUB)
        ids = tl.load(topk_ids_ptr + offs, mask=offs < num_pairs, other=-1)
        counts += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
    tl.store(counts_ptr + pid * E_POW2 + experts, counts)


@triton.jit(do_not_specialize=["num_pairs", "chunk", "num_programs", "max_padded", "num_blocks"])
def _align_kernel(
    topk_ids_ptr,
    counts_ptr,
    sorted_ids_ptr,
    expert_ids_ptr,
    num_padded_ptr,
    num_pairs,
    num_experts,
    chunk,
    num_programs,
    max_padded,
    num_blocks,
    E_POW2: tl.constexpr,
    PROGRAMS_POW2: tl.constexpr,
    SUB: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    pid = tl.program_id(0)
    experts = tl.arange(0, E_POW2)
    programs = tl.arange(0, PROGRAMS_POW2)
    counts = tl.load(
        counts_ptr + programs[:, None] * E_POW2 + experts[None, :],
        mask=programs[:, None] < num_programs,
        other=0,
    )
    total = tl.sum(counts, axis=0)  # [E_POW2]: pairs per expert
    before = tl.sum(tl.where(programs[:, None] < pid, counts, 0), axis=0)  # of earlier programs
    padded = (total + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    end = tl.cumsum(padded, axis=0)
    start = end - padded
    num_padded = tl.sum(padded, axis=0)
    # This program's pairs, in order: row = expert's start + pairs before it of the same expert.
    base = start + before
    for s in range(0, chunk, SUB):
        offs = pid * chunk + s + tl.arange(0, SUB)
        in_range = offs < num_pairs
        ids = tl.load(topk_ids_ptr + offs, mask=in_range, other=-1)
        onehot = (ids[:, None] == experts[None, :]).to(tl.int32)  # [SUB, E_POW2]
        rows = tl.sum(onehot * (tl.cumsum(onehot, axis=0) - 1 + base[None, :]), axis=1)
        tl.store(sorted_ids_ptr + rows, offs.to(tl.int32), mask=in_range)
        base += tl.sum(onehot, axis=0)
    if pid == 0:
        tl.store(num_padded_ptr, num_padded)
        # Each expert's padding rows [start + total, end).
        pad = (start + total)[:, None] + tl.arange(0, BLOCK_M)[None, :]
        tl.store(sorted_ids_ptr + pad, num_pairs, mask=pad < end[:, None])
    # Rows past the last block, and each block's expert (the last expert's for blocks past the end).
    for r in range(pid * 1024, max_padded, num_programs * 1024):
        rows = r + tl.arange(0, 1024)
        tl.store(sorted_ids_ptr + rows, num_pairs, mask=(rows >= num_padded) & (rows < max_padded))
    for b in range(pid * 64, num_blocks, num_programs * 64):
        blocks = b + tl.arange(0, 64)
        expert = tl.sum((end[None, :] <= blocks[:, None] * BLOCK_M).to(tl.int32), axis=1)
        tl.store(expert_ids_ptr + blocks, tl.minimum(expert, num_experts - 1), mask=blocks < num_blocks)


def align_block_size(
    topk_ids: torch.Tensor,
    num_experts: int,
    block_m: int,
    counts: torch.Tensor | None = None,
    num_warps: int = ALIGN_WARPS,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """As align_block_size_reference, in two Triton kernels; in one with counts, the router's
    per-program expert counts (route(counts=...)), each program then placing its ROUTE_BLOCK_T
    tokens' pairs."""
    flat = topk_ids.flatten()
    num_pairs = flat.numel()
    device = flat.device
    max_padded = num_pairs + num_experts * (block_m - 1)
    num_blocks = triton.cdiv(max_padded, block_m)
    e_pow2 = triton.next_power_of_2(num_experts)
    if counts is None:
        chunk = _ALIGN_SUB * triton.cdiv(triton.cdiv(num_pairs, _ALIGN_SUB), _ALIGN_PROGRAMS)
        sub = _ALIGN_SUB
        programs = triton.cdiv(num_pairs, chunk)
        counts = torch.empty((programs, e_pow2), dtype=torch.int32, device=device)
        _count_kernel[(programs,)](flat, counts, num_pairs, chunk, E_POW2=e_pow2, SUB=sub)
    else:
        chunk = ROUTE_BLOCK_T * topk_ids.shape[1]
        sub = min(_ALIGN_SUB, chunk & -chunk)  # the largest power of two that divides the chunk
        programs = triton.cdiv(num_pairs, chunk)
        if tuple(counts.shape) != (programs, e_pow2):
            raise ValueError(
                f"counts of shape {tuple(counts.shape)} for {num_pairs} pairs: expected {(programs, e_pow2)}"
            )
    sorted_ids = torch.empty(max_padded, dtype=torch.int32, device=device)
    expert_ids = torch.empty(num_blocks, dtype=torch.int32, device=device)
    num_padded = torch.empty(1, dtype=torch.int32, device=device)
    _align_kernel[(programs,)](
        flat,
        counts,
        sorted_ids,
        expert_ids,
        num_padded,
        num_pairs,
        num_experts,
        chunk,
        programs,
        max_padded,
        num_blocks,
        E_POW2=e_pow2,
        PROGRAMS_POW2=triton.next_power_of_2(programs),
        SUB=sub,
        BLOCK_M=block_m,
        num_warps=num_warps,
    )
    return sorted_ids, expert_ids, num_padded


# num_pairs only bounds masks: left unspecialized, an odd token count reuses the even count's
# compiled variant (the warm-up's), instead of compiling one during serving.
@triton.jit(do_not_specialize=["num_pairs"])
def _moe_gemm_kernel(
    a_ptr,
    w_ptr,
    out_ptr,
    topk_weights_ptr,
    sorted_ids_ptr,
    expert_ids_ptr,
    num_padded_ptr,
    num_pairs,
    N,
    K,
    stride_am,
    stride_we,
    stride_wn,
    stride_wk,
    stride_om,
    a_scale_ptr,
    w_scale_ptr,
    stride_asm,
    stride_wse,
    stride_wsn,
    up_scale_rows,
    A_ROWS_PER_TOKEN: tl.constexpr,  # top_k when A is indexed by token (gate/up), 1 by pair (down)
    GATE_UP: tl.constexpr,  # W holds gate rows [0, N) then up rows [N, 2N): SiLU-and-mul epilogue
    FP8: tl.constexpr,  # A and W e4m3 with block scales: BLOCK_K == SCALE_BLOCK
    SCALE_BLOCK: tl.constexpr,  # elements per scale along N and K (128)
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # grid: (max_padded / BLOCK_M, cdiv(N, BLOCK_N)); a program computes BLOCK_M pairs (one expert's)
    # times BLOCK_N output columns.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return  # a block past the experts' padded runs
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ids_ptr + offs_m).to(tl.int64)
    valid = pair < num_pairs
    a_row = pair // A_ROWS_PER_TOKEN
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_row[:, None] * stride_am + offs_k[None, :]
    # W tiles [BLOCK_K, BLOCK_N] of the expert's [N, K] rows (transposed reads).
    w_ptrs = w_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk
    # FP8: A's scales [rows, K / SCALE_BLOCK], W's [E, rows / SCALE_BLOCK, K / SCALE_BLOCK] (the up
    # rows' from row up_scale_rows on); one of each per row / column in a K step.
    if FP8:
        a_s_ptrs = a_scale_ptr + a_row * stride_asm
        w_s_ptrs = w_scale_ptr + expert * stride_wse + (offs_n // SCALE_BLOCK) * stride_wsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_mask = offs_k < K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=valid[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if FP8:
            a_s = tl.load(a_s_ptrs + k, mask=valid, other=0.0)[:, None]
            w_s = tl.load(w_s_ptrs + k, mask=n_mask, other=0.0)[None, :]
            acc += tl.dot(a, w) * a_s * w_s
        else:
            acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
        if GATE_UP:
            w_up = tl.load(w_ptrs + N * stride_wn, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            if FP8:
                w_s_up = tl.load(w_s_ptrs + up_scale_rows * stride_wsn + k, mask=n_mask, other=0.0)
                acc_up += tl.dot(a, w_up) * a_s * w_s_up[None, :]
            else:
                acc_up = tl.dot(a, w_up, acc_up, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_wk
    dtype = out_ptr.dtype.element_ty
    if GATE_UP:
        gate = acc.to(dtype).to(tl.float32)
        up = acc_up.to(dtype).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        out = (act * up).to(dtype)
    else:
        weight = tl.load(topk_weights_ptr + pair, mask=valid, other=0.0).to(tl.float32)
        out = acc.to(dtype).to(tl.float32) * weight[:, None]
    out_ptrs = out_ptr + pair[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=valid[:, None] & n_mask[None, :])


@triton.jit
def _route_logits(x_ptr, w_ptr, offs_t, t_mask, experts, e_mask, k_start, k_end, stride_x, stride_w,
                  DOT_PRECISION: tl.constexpr, BLOCK_T: tl.constexpr, E_POW2: tl.constexpr,
                  BLOCK_K: tl.constexpr):  # fmt: skip
    # The router logits of BLOCK_T tokens over hidden columns [k_start, k_end): [BLOCK_T, E_POW2] fp32
    # (products of the model-dtype operands are exact in fp32, accumulated in fp32).
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_T, E_POW2), dtype=tl.float32)
    for k in range(k_start, k_end, BLOCK_K):
        k_mask = offs_k < k_end - k
        a = tl.load(
            x_ptr + offs_t[:, None] * stride_x + k + offs_k[None, :], mask=t_mask[:, None] & k_mask[None, :]
        )
        w = tl.load(
            w_ptr + experts[None, :] * stride_w + k + offs_k[:, None], mask=e_mask[None, :] & k_mask[:, None]
        )
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def _route_top_k(logits, offs_t, t_mask, experts, e_mask, weights_ptr, ids_ptr, counts_ptr, stride_c,
                 TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, E_POW2: tl.constexpr,
                 TOPK_POW2: tl.constexpr, BLOCK_T: tl.constexpr, WRITE_COUNTS: tl.constexpr):  # fmt: skip
    # The fp32 sums rounded to the model dtype (the weights' dtype), as transformers' router GEMM
    # returns them (in bf16 that decides near ties, and makes exact ties common: ~5% of tokens at
    # 128 experts have one at the top-8 boundary); then softmax in fp32, top-k (lowest expert first
    # among equals, where torch.topk, the unfused path's and transformers', leaves their order
    # unspecified), and with WRITE_COUNTS this program's pairs per expert for the align.
    logits = logits.to(weights_ptr.dtype.element_ty).to(tl.float32)
    logits = tl.where(e_mask[None, :], logits, float("-inf"))
    probs = tl.exp(logits - tl.max(logits, axis=1)[:, None])
    probs = probs / tl.sum(probs, axis=1)[:, None]
    cols = tl.arange(0, TOPK_POW2)
    top = tl.zeros((BLOCK_T, TOPK_POW2), dtype=tl.float32)
    top_ids = tl.zeros((BLOCK_T, TOPK_POW2), dtype=tl.int32)
    counts = tl.zeros((E_POW2,), dtype=tl.int32)
    for k in tl.static_range(TOP_K):
        best = tl.max(probs, axis=1)
        idx = tl.min(tl.where(probs == best[:, None], experts[None, :], E_POW2), axis=1)
        top = tl.where(cols[None, :] == k, best[:, None], top)
        top_ids = tl.where(cols[None, :] == k, idx[:, None], top_ids)
        probs = tl.where(experts[None, :] == idx[:, None], -1.0, probs)
        if WRITE_COUNTS:
            counts += tl.sum(((idx[:, None] == experts[None, :]) & t_mask[:, None]).to(tl.int32), axis=0)
    if RENORMALIZE:
        top = top / tl.sum(top, axis=1)[:, None]
    out = offs_t[:, None] * TOP_K + cols[None, :]
    mask = t_mask[:, None] & (cols[None, :] < TOP_K)
    tl.store(weights_ptr + out, top.to(weights_ptr.dtype.element_ty), mask=mask)
    tl.store(ids_ptr + out, top_ids.to(tl.int64), mask=mask)
    if WRITE_COUNTS:
        tl.store(counts_ptr + tl.program_id(0) * stride_c + experts, counts, mask=experts < stride_c)


# num_tokens only bounds masks: left unspecialized, an odd token count reuses the even count's
# compiled variant (the warm-up's), instead of compiling one during serving.
@triton.jit(do_not_specialize=["num_tokens"])
def _route_kernel(
    x_ptr,
    w_ptr,
    weights_ptr,
    ids_ptr,
    counts_ptr,  # with WRITE_COUNTS: [programs, E_POW2] int32, the align's per-program expert counts
    num_tokens,
    num_experts,
    K,
    stride_x,
    stride_w,
    stride_c,
    TOP_K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    E_POW2: tl.constexpr,
    TOPK_POW2: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr,
    WRITE_COUNTS: tl.constexpr,
):
    # One program routes BLOCK_T tokens over the whole hidden dimension.
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = offs_t < num_tokens
    experts = tl.arange(0, E_POW2)
    e_mask = experts < num_experts
    logits = _route_logits(x_ptr, w_ptr, offs_t, t_mask, experts, e_mask, 0, K, stride_x, stride_w,
                           DOT_PRECISION, BLOCK_T, E_POW2, BLOCK_K)  # fmt: skip
    _route_top_k(logits, offs_t, t_mask, experts, e_mask, weights_ptr, ids_ptr, counts_ptr, stride_c,
                 TOP_K, RENORMALIZE, E_POW2, TOPK_POW2, BLOCK_T, WRITE_COUNTS)  # fmt: skip


@triton.jit(do_not_specialize=["num_tokens"])
def _route_partial_kernel(x_ptr, w_ptr, partial_ptr, num_tokens, num_experts, K, k_per_split, stride_x,
                          stride_w, DOT_PRECISION: tl.constexpr, E_POW2: tl.constexpr,
                          BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    # Split K: program (t, s) writes the logits of BLOCK_T tokens over hidden columns
    # [s * k_per_split, (s + 1) * k_per_split) to partial [splits, num_tokens, E_POW2] fp32.
    split = tl.program_id(1)
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = offs_t < num_tokens
    experts = tl.arange(0, E_POW2)
    k_start = split * k_per_split
    logits = _route_logits(x_ptr, w_ptr, offs_t, t_mask, experts, experts < num_experts, k_start,
                           tl.minimum(k_start + k_per_split, K), stride_x, stride_w, DOT_PRECISION, BLOCK_T,
                           E_POW2, BLOCK_K)  # fmt: skip
    rows = (split * num_tokens + offs_t)[:, None] * E_POW2 + experts[None, :]
    tl.store(partial_ptr + rows, logits, mask=t_mask[:, None])


@triton.jit(do_not_specialize=["num_tokens"])
def _route_reduce_kernel(partial_ptr, weights_ptr, ids_ptr, counts_ptr, num_tokens, num_experts, stride_c,
                         SPLITS: tl.constexpr, TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr,
                         E_POW2: tl.constexpr, TOPK_POW2: tl.constexpr, BLOCK_T: tl.constexpr,
                         WRITE_COUNTS: tl.constexpr):  # fmt: skip
    # The split logits summed in split order (a token's logits do not depend on its batch), then
    # softmax and top-k as the one-kernel router.
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = offs_t < num_tokens
    experts = tl.arange(0, E_POW2)
    logits = tl.zeros((BLOCK_T, E_POW2), dtype=tl.float32)
    for split in tl.static_range(SPLITS):
        rows = (split * num_tokens + offs_t)[:, None] * E_POW2 + experts[None, :]
        logits += tl.load(partial_ptr + rows, mask=t_mask[:, None], other=0.0)
    _route_top_k(logits, offs_t, t_mask, experts, experts < num_experts, weights_ptr, ids_ptr, counts_ptr,
                 stride_c, TOP_K, RENORMALIZE, E_POW2, TOPK_POW2, BLOCK_T, WRITE_COUNTS)  # fmt: skip


# The router's (BLOCK_K, num_warps, num_stages, K splits) for 16-bit activations. With one split, a
# program routes its 16 tokens over the whole hidden dimension, each program reading all of the
# router's weight (0.5 MB at Qwen3-30B-A3B's 128 x 2048): 16 programs at 256 tokens. With splits,
# splits times as many programs compute the logits per slice of the hidden dimension, and a second
# kernel sums them (in split order) before the softmax and top-k. On the H200 at that router, with
# the align's counts (bench/moe.py --sweep-route): 8 splits 11.3 / 11.5 / 12.0 us at 8 / 64 / 256
# tokens against 14.3 / 14.3 / 14.2 for one split of (256, 4, 3). One configuration for every
# batch: a token's logits, summed in the same order, do not depend on the batch it is in.
ROUTE_CONFIG = (128, 4, 3, 8)


# Tokens per router program: fixed, so that a token's routing does not depend on its batch.
ROUTE_BLOCK_T = 16


def route_counts(num_tokens: int, num_experts: int, device) -> torch.Tensor | None:
    """A buffer for route() to count each program's pairs per expert in, which spares the align its
    counting kernel; None when the router has more programs than the align reads counts of."""
    programs = triton.cdiv(num_tokens, ROUTE_BLOCK_T)
    if not 0 < programs <= _ALIGN_PROGRAMS:
        return None
    return torch.empty((programs, triton.next_power_of_2(num_experts)), dtype=torch.int32, device=device)


def route(
    hidden_states: torch.Tensor,
    router_weight: torch.Tensor,
    top_k: int,
    renormalize: bool,
    config: tuple[int, int, int, int] | None = None,
    counts: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """As layers/moe.route in one kernel, or two with K splits (it takes about 8): [num_tokens,
    hidden] -> (weights [num_tokens, top_k] in the model dtype, expert ids [num_tokens, top_k] int64).
    config: ROUTE_CONFIG's (BLOCK_K, num_warps, num_stages, splits). With counts (from route_counts),
    also each program's pairs per expert, for align_block_size."""
    num_tokens, hidden = hidden_states.shape
    num_experts = router_weight.shape[0]
    if hidden_states.stride(1) != 1 or router_weight.stride(1) != 1:
        raise ValueError("route needs row-contiguous activations and router weights")
    weights = torch.empty((num_tokens, top_k), dtype=hidden_states.dtype, device=hidden_states.device)
    ids = torch.empty((num_tokens, top_k), dtype=torch.int64, device=hidden_states.device)
    block_t = ROUTE_BLOCK_T
    programs = triton.cdiv(num_tokens, block_t)
    e_pow2 = max(16, triton.next_power_of_2(num_experts))
    if counts is not None and (
        tuple(counts.shape) != (programs, triton.next_power_of_2(num_experts)) or not counts.is_contiguous()
    ):
        raise ValueError(
            f"counts of shape {tuple(counts.shape)}: route_counts({num_tokens}, {num_experts}) makes them"
        )
    if num_tokens == 0:
        return weights, ids
    block_k, num_warps, num_stages, splits = config or ROUTE_CONFIG
    element_size = hidden_states.element_size()
    if element_size > 2:
        block_k = min(block_k, 64)

    # The router's tiles are a GEMM's: [BLOCK_T, BLOCK_K] of tokens and one [BLOCK_K, E_POW2] of the
    # weight. With more experts (160, 256) BLOCK_K, then the stages, shrink to fit shared memory.
    tiles = fit_shared_memory(MoEConfig(block_t, e_pow2, block_k, num_warps, num_stages), 1, element_size)
    block_k, num_stages = tiles.BLOCK_K, tiles.num_stages
    dot_precision = "ieee" if hidden_states.dtype == torch.float32 else "tf32"
    count_args = {"counts_ptr": counts, "stride_c": 0 if counts is None else counts.stride(0)}
    top_k_args = {
        "TOP_K": top_k,
        "RENORMALIZE": renormalize,
        "E_POW2": e_pow2,
        "TOPK_POW2": triton.next_power_of_2(top_k),
        "BLOCK_T": block_t,
        "WRITE_COUNTS": counts is not None,
    }
    if splits == 1:
        _route_kernel[(programs,)](
            hidden_states, router_weight, weights, ids, num_tokens=num_tokens, num_experts=num_experts,
            K=hidden, stride_x=hidden_states.stride(0), stride_w=router_weight.stride(0),
            DOT_PRECISION=dot_precision, BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages,
            **count_args, **top_k_args,
        )  # fmt: skip
        return weights, ids
    # Each split a whole number of BLOCK_K columns, the same slices whatever the batch.
    k_per_split = triton.cdiv(triton.cdiv(hidden, splits), block_k) * block_k
    splits = triton.cdiv(hidden, k_per_split)
    partial = torch.empty((splits, num_tokens, e_pow2), dtype=torch.float32, device=hidden_states.device)
    _route_partial_kernel[(programs, splits)](
        hidden_states, router_weight, partial, num_tokens, num_experts, hidden, k_per_split,
        hidden_states.stride(0), router_weight.stride(0), DOT_PRECISION=dot_precision, E_POW2=e_pow2,
        BLOCK_T=block_t, BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    _route_reduce_kernel[(programs,)](
        partial, weights, ids, num_tokens=num_tokens, num_experts=num_experts, SPLITS=splits,
        **count_args, **top_k_args,
    )  # fmt: skip
    return weights, ids


@triton.jit
def _sum_topk_kernel(y_ptr, out_ptr, hidden, TOP_K: tl.constexpr, BLOCK: tl.constexpr):
    # y [num_tokens * TOP_K, hidden] -> out [num_tokens, hidden]: the k rows of a token, in order, in fp32.
    token = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < hidden
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        acc += tl.load(y_ptr + (token * TOP_K + k) * hidden + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + token * hidden + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _launch(a, w, out, topk_weights, aligned, num_pairs, n, rows_per_token, gate_up, config, scales) -> None:
    sorted_ids, expert_ids, num_padded = aligned
    grid = (expert_ids.numel(), triton.cdiv(n, config.BLOCK_N))
    a_s, w_s = scales or (None, None)
    if a_s is not None and (config.BLOCK_K != FP8_BLOCK or a_s.stride(1) != 1 or w_s.stride(2) != 1):
        raise ValueError(
            f"the fp8 GEMM takes BLOCK_K {FP8_BLOCK} (not {config.BLOCK_K}) and row-contiguous scales"
        )
    _moe_gemm_kernel[grid](
        a, w, out, topk_weights, sorted_ids, expert_ids, num_padded, num_pairs, n, a.shape[1],
        a.stride(0), w.stride(0), w.stride(1), w.stride(2), out.stride(0),
        a_s, w_s,
        0 if a_s is None else a_s.stride(0),
        0 if w_s is None else w_s.stride(0),
        0 if w_s is None else w_s.stride(1),
        triton.cdiv(n, FP8_BLOCK),  # gate/up: the up rows' scales follow the gate rows' blocks
        A_ROWS_PER_TOKEN=rows_per_token,
        GATE_UP=gate_up,
        FP8=a_s is not None,
        SCALE_BLOCK=FP8_BLOCK,
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        BLOCK_M=config.BLOCK_M,
        BLOCK_N=config.BLOCK_N,
        BLOCK_K=config.BLOCK_K,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )  # fmt: skip


def gate_up(x, w13, aligned, top_k: int, config: MoEConfig, w13_scale=None) -> torch.Tensor:
    """-> [num_pairs, N]: silu(gate) * up of each pair. With w13_scale (w13 e4m3), x is quantized per
    token in groups of 128 first."""
    num_pairs = x.shape[0] * top_k
    n = w13.shape[1] // 2
    intermediate = torch.empty((num_pairs, n), dtype=x.dtype, device=x.device)
    a, scales = x, None
    if w13_scale is not None:
        a, a_s = quantize_per_token_group(x)
        scales = (a_s, w13_scale)
    _launch(a, w13, intermediate, None, aligned, num_pairs, n, top_k, True, config, scales)
    return intermediate


def down(intermediate, w2, topk_weights, aligned, config: MoEConfig, w2_scale=None) -> torch.Tensor:
    """-> [num_pairs, hidden]: each pair's expert output times its routing weight, in the model dtype.
    With w2_scale (w2 e4m3), the intermediate is quantized per pair in groups of 128 first."""
    num_pairs, hidden = intermediate.shape[0], w2.shape[1]
    out = torch.empty((num_pairs, hidden), dtype=intermediate.dtype, device=intermediate.device)
    weights = topk_weights.reshape(-1).contiguous()
    a, scales = intermediate, None
    if w2_scale is not None:
        a, a_s = quantize_per_token_group(intermediate)
        scales = (a_s, w2_scale)
    _launch(a, w2, out, weights, aligned, num_pairs, hidden, 1, False, config, scales)
    return out


def sum_topk(y: torch.Tensor, top_k: int) -> torch.Tensor:
    """[num_tokens * top_k, hidden] -> [num_tokens, hidden]."""
    hidden = y.shape[1]
    out = torch.empty((y.shape[0] // top_k, hidden), dtype=y.dtype, device=y.device)
    block = min(1024, triton.next_power_of_2(hidden))
    _sum_topk_kernel[(out.shape[0], triton.cdiv(hidden, block))](y, out, hidden, TOP_K=top_k, BLOCK=block)
    return out


def fused_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    config: MoEConfig | tuple[MoEConfig, MoEConfig] | None = None,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    expert_counts: torch.Tensor | None = None,
) -> torch.Tensor:
    """As layers/moe.experts_reference: x [num_tokens, hidden], w13 [E, 2 * N, hidden], w2 [E, hidden,
    N], topk_* [num_tokens, top_k] -> [num_tokens, hidden]. config: the (gate/up, down) tiles, or one
    MoEConfig for both; CONFIGS' by default. With w13_scale [E, 2 * ceil(N / 128), ceil(hidden / 128)]
    and w2_scale [E, ceil(hidden / 128), ceil(N / 128)] (fp32 block scales of e4m3 w13 and w2), the
    W8A8 GEMMs: activations quantized per row in groups of 128, fp32 accumulation. expert_counts:
    route()'s per-program counts for align_block_size, if it wrote them."""
    num_tokens = x.shape[0]
    top_k = topk_ids.shape[1]
    fp8 = w13_scale is not None
    if x.stride(1) != 1 or w13.stride(2) != 1 or w2.stride(2) != 1:
        raise ValueError("fused_experts needs row-contiguous activations and weights")
    if fp8 != (w2_scale is not None):
        raise ValueError("fp8 experts need both w13_scale and w2_scale")
    if num_tokens == 0:
        return torch.empty_like(x)
    if config is None:
        config = get_config(num_tokens, x.element_size(), fp8)
    gate_up_config, down_config = (config, config) if isinstance(config, MoEConfig) else config
    if gate_up_config.BLOCK_M != down_config.BLOCK_M:
        raise ValueError(
            f"the gate/up and down tiles share the align's BLOCK_M ({gate_up_config.BLOCK_M} != {down_config.BLOCK_M})"
        )
    aligned = align_block_size(topk_ids, w13.shape[0], gate_up_config.BLOCK_M, expert_counts)
    intermediate = gate_up(x, w13, aligned, top_k, gate_up_config, w13_scale)
    return sum_topk(down(intermediate, w2, topk_weights, aligned, down_config, w2_scale), top_k)


def warm_up(
    w13: torch.Tensor,
    w2: torch.Tensor,
    top_k: int,
    max_num_tokens: int,
    dtype: torch.dtype,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
) -> None:
    """Compile every tile configuration a step of up to max_num_tokens tokens (activations of dtype) can pick."""
    for limit, _ in CONFIGS:
        num_tokens = min(limit, max_num_tokens)
        x = torch.zeros((num_tokens, w13.shape[2]), dtype=dtype, device=w13.device)
        ids = torch.arange(num_tokens * top_k, device=w13.device).view(num_tokens, top_k) % w13.shape[0]
        weights = torch.ones(ids.shape, dtype=dtype, device=w13.device)
        fused_experts(x, w13, w2, weights, ids, w13_scale=w13_scale, w2_scale=w2_scale)
        if limit >= max_num_tokens:
            break
