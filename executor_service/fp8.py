"""FP8 (e4m3) numerics shared by the KV cache and the block-scaled weights, in torch.

KV cache: x is stored as e4m3(x / scale), saturated to +-448 (a cast alone would make NaN of what
overflows), one scale per layer for K and one for V; read back as (e4m3 as fp32 * scale) cast to the
compute dtype. The Triton kernels round the same way (round to nearest even), so they are tested
against these functions exactly. An e4m3 V cache keeps each block transposed, [num_blocks,
num_kv_heads, head_dim, block_size] (fp8_v_cache, v_cache_slots): a block's keys are then
contiguous for each dimension, which is the reduction axis of attention's P @ V, so the kernel loads
V in 16-byte vectors (from the slot-major layout sm90 could only read one byte at a time into the
dot's operand layout).

Weights (the Qwen3-*-FP8 format, transformers' `finegrained_fp8`): an e4m3 weight [out, in] and
`weight_scale_inv` [ceil(out / 128), ceil(in / 128)] fp32, one scale per 128 x 128 block;
weight = e4m3 * weight_scale_inv of its block."""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448


def quantize_kv(x: torch.Tensor, scale: float) -> torch.Tensor:
    """e4m3(x / scale), saturating: what the store kernels write."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize_kv(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """What the attention kernels read: fp32(x) * scale in the compute dtype."""
    return (x.float() * scale).to(dtype)


def fp8_v_cache(v: torch.Tensor) -> torch.Tensor:
    """A V cache [num_blocks, block_size, num_kv_heads, head_dim] of e4m3 values in the layout an
    e4m3 V cache keeps: [num_blocks, num_kv_heads, head_dim, block_size], contiguous."""
    return v.permute(0, 2, 3, 1).contiguous()


def v_cache_slots(v_cache: torch.Tensor) -> torch.Tensor:
    """Any V cache viewed as [num_blocks, block_size, num_kv_heads, head_dim] (no copy): an e4m3 one
    is kept transposed per block (fp8_v_cache), a 16-bit one slot-major already."""
    return v_cache.permute(0, 3, 1, 2) if v_cache.dtype == FP8_DTYPE else v_cache


def quantize_weight_blocks(
    weight: torch.Tensor, block: tuple[int, int] = (128, 128)
) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in] -> (e4m3 weight, weight_scale_inv [ceil(out/bn), ceil(in/bk)] fp32), each
    block scaled so that its largest magnitude maps to 448 (how the Qwen3-*-FP8 checkpoints are made)."""
    bn, bk = block
    out_f, in_f = weight.shape
    rows, cols = -(-out_f // bn), -(-in_f // bk)
    padded = torch.zeros(rows * bn, cols * bk, dtype=torch.float32, device=weight.device)
    padded[:out_f, :in_f] = weight.float()
    blocks = padded.view(rows, bn, cols, bk)
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12)
    scale_inv = amax / torch.full_like(
        amax, FP8_MAX
    )  # a tensor: CUDA divides a scalar as a reciprocal multiply
    q = (blocks / scale_inv[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(rows * bn, cols * bk)[:out_f, :in_f].contiguous(), scale_inv


def dequantize_weight_blocks(
    weight: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype, block: tuple[int, int] = (128, 128)
) -> torch.Tensor:
    """e4m3 weight [out, in] * its blocks' scale_inv, computed in fp32, then cast to `dtype`."""
    bn, bk = block
    out_f, in_f = weight.shape
    scale = scale_inv.float().repeat_interleave(bn, 0)[:out_f].repeat_interleave(bk, 1)[:, :in_f]
    return (weight.float() * scale).to(dtype)
