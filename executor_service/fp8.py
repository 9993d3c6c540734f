"""FP8 (e4m3) numerics shared by the KV cache and the block-scaled weights, in torch.

KV cache: x is stored as e4m3(x / scale), saturated to +-448 (a cast alone would make NaN of what
overflows), one scale per layer for K and one for V; read back as (e4m3 as fp32 * scale) cast to the
compute dtype. The Triton kernels round the same way (round to nearest even), so they are tested
against these functions exactly. An e4m3 V cache keeps each block transposed in groups of
V_GROUP slots, [num_blocks, num_kv_heads, block_size / group, head_dim, group] (fp8_v_cache,
v_cache_slots, set_v_slots): a group's keys are contiguous for each dimension, which is the
reduction axis of attention's P @ V, so the kernel loads V in vectors of a group's keys (from the
slot-major layout sm90 could only read one byte at a time into the dot's operand layout), while a
decode step's append of one slot writes `group` times fewer 32-byte sectors than with the whole
block transposed (one byte in each of head_dim * group / 32 sectors instead of head_dim).

Weights (the Qwen3-*-FP8 format, transformers' `finegrained_fp8`): an e4m3 weight [out, in] and
`weight_scale_inv` [ceil(out / 128), ceil(in / 128)] fp32, one scale per 128 x 128 block;
weight = e4m3 * weight_scale_inv of its block."""

from __future__ import annotations

import math

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448


def quantize_kv(x: torch.Tensor, scale: float) -> torch.Tensor:
    """e4m3(x / scale), saturating: what the store kernels write."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize_kv(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """What the attention kernels read: fp32(x) * scale in the compute dtype."""
    return (x.float() * scale).to(dtype)


# Slots per transposed group of an e4m3 V cache (where the block size allows: v_group). Chosen
# on the H200 with bench/attention.py --sweep-v-group (bench/RESULTS.md).
V_GROUP = 8


def v_group(block_size: int, group: int = V_GROUP) -> int:
    """The group an e4m3 V cache of `block_size` slots a block uses: the largest divisor of the
    block size that divides `group` (so any block size works; 16 and 32 get the whole group)."""
    return math.gcd(block_size, group)


def fp8_v_cache(v: torch.Tensor, group: int | None = None) -> torch.Tensor:
    """A V cache [num_blocks, block_size, num_kv_heads, head_dim] of e4m3 values in the layout an
    e4m3 V cache keeps: [num_blocks, num_kv_heads, block_size / group, head_dim, group], contiguous
    (group: v_group(block_size) by default; block_size keeps each block transposed whole)."""
    num_blocks, block_size, num_kv_heads, head_dim = v.shape
    group = group or v_group(block_size)
    grouped = v.view(num_blocks, block_size // group, group, num_kv_heads, head_dim)
    return grouped.permute(0, 3, 1, 4, 2).contiguous()


def _slot_groups(v_cache: torch.Tensor) -> torch.Tensor:
    """An e4m3 V cache viewed as [num_blocks, block_size / group, group, num_kv_heads, head_dim]."""
    return v_cache.permute(0, 2, 4, 1, 3)


def v_cache_slots(v_cache: torch.Tensor, blocks: torch.Tensor | None = None) -> torch.Tensor:
    """Any V cache (or its `blocks` only) as [num_blocks, block_size, num_kv_heads, head_dim]: a
    16-bit one is slot-major already (a view); an e4m3 one (fp8_v_cache's layout) is copied, so
    write it with set_v_slots."""
    if v_cache.dtype != FP8_DTYPE:
        return v_cache if blocks is None else v_cache[blocks]
    groups = _slot_groups(v_cache)
    if blocks is not None:
        groups = groups[blocks]
    return groups.flatten(1, 2)


def set_v_slots(v_cache: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor, values) -> None:
    """v_cache[block, offset] = values ([n, num_kv_heads, head_dim], or a scalar) for each pair of
    blocks and offsets in a block, in any V cache's layout."""
    if v_cache.dtype != FP8_DTYPE:
        v_cache[blocks, offsets] = values
        return
    group = v_cache.shape[-1]
    _slot_groups(v_cache)[blocks, offsets // group, offsets % group] = values


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
