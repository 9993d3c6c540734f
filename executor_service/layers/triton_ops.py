"""Fused elementwise Triton kernels for the GPU path: residual add + RMSNorm, SiLU-and-mul, and the
per-head q/k RMSNorm (where the family has it) followed by rotary embedding.

Each reproduces the rounding of the PyTorch layers it replaces (executor_service/layers/norm.py,
activation.py, rotary.py), which follow Hugging Face's Qwen3: statistics in fp32, every
intermediate the reference stores in the model dtype rounded to it here too. In fp32 the results
agree to the last bits; in bf16 they differ only where Triton's and CUDA's exp or rsqrt do.

Under CUDA graphs a decode step of Qwen3-0.6B runs about 50 tiny elementwise kernels per layer on
the unfused path; these replace them with three launches per layer. With the Triton attention
backend the rotary kernel also writes the token's K and V into the paged KV cache (the attention
backend's store, attention/triton_kernels.store_token_kv: the same bytes), one launch fewer a layer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from executor_service.attention.triton_kernels import cache_store_args, store_token_kv


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    hidden_size,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # grid: (num_tokens,)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden_size
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # the sum, rounded as torch does
        tl.store(residual_out_ptr + row * stride_ro + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(xf * xf, axis=0) / hidden_size + eps)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    normed = (xf * inv_rms).to(x.dtype)
    out = (normed.to(tl.float32) * w.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + cols, out, mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x, residual: [num_tokens, hidden]. Without `residual`: norm(x). With it: (norm(x + residual),
    x + residual), both new tensors (the inputs are not written)."""
    num_tokens, hidden = x.shape
    if x.stride(1) != 1 or (residual is not None and residual.stride(1) != 1):
        raise ValueError("rms_norm needs row-contiguous inputs")
    # weight * normed promotes like torch: an fp32 weight on a bf16 model gives fp32.
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    residual_out = torch.empty(x.shape, dtype=x.dtype, device=x.device) if residual is not None else out
    if num_tokens:
        _rms_norm_kernel[(num_tokens,)](
            x,
            residual if residual is not None else x,
            weight,
            out,
            residual_out,
            x.stride(0),
            residual.stride(0) if residual is not None else 0,
            out.stride(0),
            residual_out.stride(0),
            hidden,
            eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK=triton.next_power_of_2(hidden),
        )
    return out if residual is None else (out, residual_out)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, size, BLOCK: tl.constexpr):
    # grid: (num_tokens, cdiv(size, BLOCK)); x row = [gate | up]
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < size
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + size + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    out = (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)
    tl.store(out_ptr + row * stride_o + cols, out, mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[num_tokens, 2 * size] -> silu(gate) * up, [num_tokens, size]."""
    num_tokens, double = x.shape
    if x.stride(1) != 1:
        raise ValueError("silu_and_mul needs row-contiguous inputs")
    size = double // 2
    out = torch.empty((num_tokens, size), dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(size))
    if num_tokens:
        _silu_and_mul_kernel[(num_tokens, triton.cdiv(size, block))](
            x, out, x.stride(0), out.stride(0), size, BLOCK=block
        )
    return out


# num_tokens (read only by the K/V store's zeroing) is the step's token count: not specialised, or
# a count of 1 or a multiple of 16 would each compile a variant of their own.
@triton.jit(do_not_specialize=["num_tokens"])
def _qk_norm_rope_kernel(
    qkv_ptr,
    positions_ptr,
    q_weight_ptr,
    k_weight_ptr,
    cos_sin_ptr,
    q_out_ptr,
    k_out_ptr,
    stride_qkv,
    stride_cs,
    eps,
    k_cache_ptr,  # with STORE_KV: the paged KV cache, as attention/triton_kernels.store_kv
    v_cache_ptr,
    slot_mapping_ptr,
    stride_cb,
    stride_cs_cache,
    stride_ch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    stride_vcd,
    block_size,
    k_scale,
    v_scale,
    num_tokens,
    NUM_HEADS: tl.constexpr,
    NUM_QK_HEADS: tl.constexpr,  # query heads then key heads, contiguous in a qkv row
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HAS_NORM: tl.constexpr,
    STORE_KV: tl.constexpr = False,  # also write the token's K and V (the qkv row's last heads) to the cache
    BLOCK_KVH: tl.constexpr = 1,  # the KV heads rounded up to a power of 2
    KV_FP8: tl.constexpr = False,
    BLOCK_S: tl.constexpr = 1,
    WHOLE_ROWS: tl.constexpr = False,
):
    # grid: (num_tokens,); a program normalises (HAS_NORM) and rotates every query and key head of one token.
    t = tl.program_id(0).to(tl.int64)
    HALF: tl.constexpr = HEAD_DIM // 2
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, HALF)[None, :]
    mask = h < NUM_QK_HEADS
    src = qkv_ptr + t * stride_qkv + h * HEAD_DIM + d
    x1 = tl.load(src, mask=mask, other=0.0)
    x2 = tl.load(src + HALF, mask=mask, other=0.0)
    dtype = x1.dtype
    f1 = x1.to(tl.float32)
    f2 = x2.to(tl.float32)
    is_q = h < NUM_HEADS
    if HAS_NORM:
        # Per-head RMSNorm, as layers/norm.py: fp32 statistics, normed rounded, times the weight rounded.
        inv_rms = tl.rsqrt((tl.sum(f1 * f1, axis=1) + tl.sum(f2 * f2, axis=1)) / HEAD_DIM + eps)
        w1 = tl.where(is_q, tl.load(q_weight_ptr + d), tl.load(k_weight_ptr + d)).to(tl.float32)
        w2 = tl.where(is_q, tl.load(q_weight_ptr + HALF + d), tl.load(k_weight_ptr + HALF + d)).to(tl.float32)
        n1 = ((f1 * inv_rms[:, None]).to(dtype).to(tl.float32) * w1).to(dtype).to(tl.float32)
        n2 = ((f2 * inv_rms[:, None]).to(dtype).to(tl.float32) * w2).to(dtype).to(tl.float32)
    else:
        n1, n2 = f1, f2
    # Rotary, neox halves, as layers/rotary.py: x * cos + rotate_half(x) * sin, cos and sin in the
    # model dtype, each product and the sum rounded. (Bitwise equality with the unfused layers is not
    # kept on the GPU: tests/test_triton_ops.py holds the result to a rounding step of the terms.)
    pos = tl.load(positions_ptr + t)
    cos = tl.load(cos_sin_ptr + pos * stride_cs + d).to(dtype).to(tl.float32)
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HEAD_DIM + d).to(dtype).to(tl.float32)
    o1 = ((n1 * cos).to(dtype).to(tl.float32) + (-n2 * sin).to(dtype).to(tl.float32)).to(dtype)
    o2 = ((n2 * cos).to(dtype).to(tl.float32) + (n1 * sin).to(dtype).to(tl.float32)).to(dtype)
    q_dst = q_out_ptr + (t * NUM_HEADS + h) * HEAD_DIM + d
    k_dst = k_out_ptr + (t * (NUM_QK_HEADS - NUM_HEADS) + h - NUM_HEADS) * HEAD_DIM + d
    dst = tl.where(is_q, q_dst, k_dst)
    tl.store(dst, o1, mask=mask)
    tl.store(dst + HALF, o2, mask=mask)
    if STORE_KV:
        slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
        if slot >= 0:  # (-1: CUDA-graph padding)
            # The K rows just stored, read back whole (visible to every thread of the program
            # after the barrier), and V from the qkv row: store_kv's inputs, so its bytes.
            tl.debug_barrier()
            NUM_KV_HEADS: tl.constexpr = NUM_QK_HEADS - NUM_HEADS
            hk = tl.arange(0, BLOCK_KVH)[:, None]
            dk = tl.arange(0, HEAD_DIM)[None, :]
            kv_mask = hk < NUM_KV_HEADS
            k = tl.load(k_out_ptr + (t * NUM_KV_HEADS + hk) * HEAD_DIM + dk, mask=kv_mask)
            v = tl.load(qkv_ptr + t * stride_qkv + (NUM_QK_HEADS + hk) * HEAD_DIM + dk, mask=kv_mask)
            store_token_kv(
                k, v, t, slot, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
                stride_cb, stride_cs_cache, stride_ch, stride_vcb, stride_vcs, stride_vch, stride_vcd,
                block_size, k_scale, v_scale, num_tokens,
                NUM_KV_HEADS, HEAD_DIM, BLOCK_KVH, HEAD_DIM, KV_FP8, BLOCK_S, WHOLE_ROWS,
            )  # fmt: skip


def qk_norm_rope(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    cos_sin_cache: torch.Tensor,
    eps: float,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    kv_cache: tuple | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """qkv [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim] -> rotary(norm(q)) [num_tokens,
    num_heads, head_dim] and rotary(norm(k)) [num_tokens, num_kv_heads, head_dim], new contiguous
    tensors. cos_sin_cache: [max_position, head_dim], the cos of each frequency twice, then its sin
    twice. Without q/k weights (families with no q/k norm) it only rotates.

    kv_cache: (k_cache, v_cache, slot_mapping, k_scale, v_scale): also store each token's K (as
    returned) and V (qkv's last heads) in the paged cache, exactly as
    attention.triton_kernels.store_kv(k, v, ...) would."""
    if qkv.stride(1) != 1 or cos_sin_cache.stride(1) != 1 or head_dim < 2 or head_dim & (head_dim - 1):
        raise ValueError("qk_norm_rope needs row-contiguous inputs and a power-of-two head_dim")
    num_tokens = qkv.shape[0]
    qk_heads = num_heads + num_kv_heads
    q = torch.empty((num_tokens, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    k = torch.empty((num_tokens, num_kv_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if not num_tokens:
        return q, k
    store = {}
    cache_args = [qkv, qkv, positions, *([0] * 8), 1.0, 1.0, num_tokens]  # unused without a cache
    if kv_cache is not None:
        k_cache, v_cache, slot_mapping, k_scale, v_scale = kv_cache
        args, constants = cache_store_args(k_cache, v_cache, k_scale, v_scale, num_tokens)
        cache_args = [k_cache, v_cache, slot_mapping, *args]
        store = {"STORE_KV": True, "BLOCK_KVH": triton.next_power_of_2(num_kv_heads), **constants}
    _qk_norm_rope_kernel[(num_tokens,)](
        qkv,
        positions,
        q_weight if q_weight is not None else qkv,
        k_weight if k_weight is not None else qkv,
        cos_sin_cache,
        q,
        k,
        qkv.stride(0),
        cos_sin_cache.stride(0),
        eps,
        *cache_args,
        NUM_HEADS=num_heads,
        NUM_QK_HEADS=qk_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(qk_heads),
        HAS_NORM=q_weight is not None,
        **store,
    )
    return q, k
