"""The MoE experts on CUDA in two Triton kernels, with no host sync (a decode step is captured in a
CUDA graph):

1. align: the (token, k) pairs sorted by expert, each expert's run padded to a multiple of BLOCK_M
   (torch ops; a static size per token count: num_pairs + num_experts * (BLOCK_M - 1)), so that every
   BLOCK_M rows of the sorted list belong to one expert; experts with no token get no block;
2. gate/up: a grouped GEMM, one program per (block of BLOCK_M pairs, BLOCK_N intermediate columns),
   the gate and up tiles of the block's expert multiplied together, SiLU-and-mul in the epilogue;
3. down: a grouped GEMM over the intermediate activations with each pair's routing weight folded
   into the epilogue, written per pair in fp32; the k pairs of a token are then summed.

Each weight tile of an expert is read once per block of its pairs: at decode (a few pairs per
expert) that is once, and the step reads the experts' weights at close to the copy rate. Tile sizes
come from CONFIGS by the step's token count (no autotuning: a captured graph must not tune);
bench/moe.py measures them. Rounding follows layers/moe.py's reference: the GEMM outputs, the
activation and the weighted products are rounded to the model dtype where the reference's are."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class MoEConfig:
    BLOCK_M: int
    BLOCK_N: int
    BLOCK_K: int
    num_warps: int
    num_stages: int


# (largest token count, tiles): decode sizes give each expert a few pairs, so a short BLOCK_M; prefill
# chunks give it hundreds, so square tiles. Tune on the H200 with bench/moe.py --sweep.
CONFIGS: list[tuple[int, MoEConfig]] = [
    (64, MoEConfig(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4)),
    (512, MoEConfig(BLOCK_M=16, BLOCK_N=128, BLOCK_K=128, num_warps=4, num_stages=3)),
    (2048, MoEConfig(BLOCK_M=32, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=4)),
    (8192, MoEConfig(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3)),
    (1 << 62, MoEConfig(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3)),
]


# Shared memory the pipelined tiles of one program may take: the H200's 227 KiB per block.
_SHARED_MEMORY_BYTES = 227 * 1024


def get_config(num_tokens: int, element_size: int = 2) -> MoEConfig:
    """The tiles for a step of num_tokens tokens; for wider elements (fp32, the tests' dtype) BLOCK_K
    and then the stages shrink until the A tile and the gate and up tiles of every stage fit."""
    config = next(config for limit, config in CONFIGS if num_tokens <= limit)

    def shared(c: MoEConfig) -> int:
        return c.num_stages * (c.BLOCK_M + 2 * c.BLOCK_N) * c.BLOCK_K * element_size

    while shared(config) > _SHARED_MEMORY_BYTES and config.BLOCK_K > 16:
        config = dataclasses.replace(config, BLOCK_K=config.BLOCK_K // 2)
    while shared(config) > _SHARED_MEMORY_BYTES and config.num_stages > 2:
        config = dataclasses.replace(config, num_stages=config.num_stages - 1)
    return config


def align_block_size(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """topk_ids [num_tokens, top_k] -> (sorted_ids [max_padded] int32: pair indices t * top_k + k
    grouped by expert, each group padded with num_pairs to a multiple of block_m; expert_ids
    [max_padded / block_m] int32: each block's expert; num_padded [1] int32: rows in use)."""
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
    block_starts = torch.arange(0, max_padded, block_m, device=device)
    expert_ids = torch.searchsorted(padded_end, block_starts, right=True).clamp_(max=num_experts - 1)
    return sorted_ids, expert_ids.to(torch.int32), padded_end[-1:].to(torch.int32)


@triton.jit
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
    A_ROWS_PER_TOKEN: tl.constexpr,  # top_k when A is indexed by token (gate/up), 1 by pair (down)
    GATE_UP: tl.constexpr,  # W holds gate rows [0, N) then up rows [N, 2N): SiLU-and-mul epilogue
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
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_mask = offs_k < K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=valid[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
        if GATE_UP:
            w_up = tl.load(w_ptrs + N * stride_wn, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            acc_up = tl.dot(a, w_up, acc_up, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_wk
    dtype = a_ptr.dtype.element_ty
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


def _launch(a, w, out, topk_weights, aligned, num_pairs, n, rows_per_token, gate_up, config) -> None:
    sorted_ids, expert_ids, num_padded = aligned
    grid = (expert_ids.numel(), triton.cdiv(n, config.BLOCK_N))
    _moe_gemm_kernel[grid](
        a,
        w,
        out,
        topk_weights,
        sorted_ids,
        expert_ids,
        num_padded,
        num_pairs,
        n,
        a.shape[1],
        a.stride(0),
        w.stride(0),
        w.stride(1),
        w.stride(2),
        out.stride(0),
        A_ROWS_PER_TOKEN=rows_per_token,
        GATE_UP=gate_up,
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        BLOCK_M=config.BLOCK_M,
        BLOCK_N=config.BLOCK_N,
        BLOCK_K=config.BLOCK_K,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )


def fused_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    config: MoEConfig | None = None,
) -> torch.Tensor:
    """As layers/moe.experts_reference: x [num_tokens, hidden], w13 [E, 2 * N, hidden], w2 [E, hidden,
    N], topk_* [num_tokens, top_k] -> [num_tokens, hidden]."""
    num_tokens, hidden = x.shape
    num_experts, n = w13.shape[0], w13.shape[1] // 2
    top_k = topk_ids.shape[1]
    if x.stride(1) != 1 or w13.stride(2) != 1 or w2.stride(2) != 1:
        raise ValueError("fused_experts needs row-contiguous activations and weights")
    if num_tokens == 0:
        return torch.empty_like(x)
    config = config or get_config(num_tokens, x.element_size())
    num_pairs = num_tokens * top_k
    aligned = align_block_size(topk_ids, num_experts, config.BLOCK_M)
    weights = topk_weights.reshape(-1).contiguous()
    # [num_pairs, N]: silu(gate) * up of each pair
    intermediate = torch.empty((num_pairs, n), dtype=x.dtype, device=x.device)
    _launch(x, w13, intermediate, weights, aligned, num_pairs, n, top_k, True, config)
    # [num_pairs, hidden]: each pair's weighted expert output, fp32 until the sum over k
    out = torch.empty((num_pairs, hidden), dtype=torch.float32, device=x.device)
    _launch(intermediate, w2, out, weights, aligned, num_pairs, hidden, 1, False, config)
    return out.view(num_tokens, top_k, hidden).sum(dim=1).to(x.dtype)


def warm_up(hidden: int, w13: torch.Tensor, w2: torch.Tensor, top_k: int, max_num_tokens: int) -> None:
    """Compile every tile configuration a step of up to max_num_tokens tokens can pick."""
    for limit, _ in CONFIGS:
        num_tokens = min(limit, max_num_tokens)
        x = torch.zeros((num_tokens, hidden), dtype=w13.dtype, device=w13.device)
        ids = torch.arange(num_tokens * top_k, device=w13.device).view(num_tokens, top_k) % w13.shape[0]
        fused_experts(x, w13, w2, torch.ones(ids.shape, dtype=w13.dtype, device=w13.device), ids)
        if limit >= max_num_tokens:
            break
