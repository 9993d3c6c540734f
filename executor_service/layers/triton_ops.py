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
It launches a program per token, which stores K after a barrier and a re-read of the k it returned,
so that the cache holds the store's bytes of that k. (A program per token and role, query heads,
key heads with K's store, V's store, was slower on the H200: 9.56 against 8.78 us a launch at
W1's batch of 256, bench/RESULTS.md 2026-12-05, and was removed.)

Where the next layer is an fp8 linear (CausalLM.fuse_fp8_quantization), RMSNorm and SiLU-and-mul
quantize their output for its W8A8 GEMM instead of storing it (`quantize_rows_multiple`): per token
in groups of 128, the rounding and the bytes of fp8_gemm_triton.quantize_per_token_group on the
unfused output, laid out for the GEMM that fp8_linear takes at that size; they return an Fp8Input.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from executor_service.attention.triton_kernels import (
    cache_store_args,
    norm_rope,
    quantize_e4m3,
    store_token_kv,
    store_v_tiles,
)
from executor_service.layers.fp8_gemm_triton import GROUP, Fp8Input, quantized_buffers

FP8_GROUP: tl.constexpr = tl.constexpr(GROUP)  # columns per activation scale of the fp8 GEMMs

# Launch shapes of RMSNorm and SiLU-and-mul by row width (hidden size; SiLU-and-mul's output
# columns): rms_norm runs a program a row in RMS_NORM_WARPS[hidden] warps (Triton's 4 where there
# is no entry), silu_and_mul programs of SILU_AND_MUL_TILES[size] = (columns, warps) ((at most
# 1,024, 4) where there is none). Empty until timed: bench/fused_ops.py sweeps both on the GPU and
# prints the entries that beat these defaults. The warps of RMSNorm change the order of its sum of
# squares (the last bit of a row's scale); SiLU-and-mul's tiles change no bit.
RMS_NORM_WARPS: dict[int, int] = {}
SILU_AND_MUL_TILES: dict[int, tuple[int, int]] = {}


def silu_and_mul_tile(size: int) -> tuple[int, int]:
    """(columns a program, warps) of silu_and_mul's launch for `size` output columns: a power of 2
    of at least 128 columns (a quantizing program's are whole groups of 128)."""
    block, num_warps = SILU_AND_MUL_TILES.get(size, (min(1024, triton.next_power_of_2(size)), 4))
    if size in SILU_AND_MUL_TILES and (block < GROUP or block & (block - 1)):
        raise ValueError(
            f"SILU_AND_MUL_TILES[{size}]: {block} columns a program is not a power of 2 >= {GROUP}"
        )
    return block, num_warps


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
    q_ptr,  # with QUANT: the output quantized for an fp8 GEMM instead (_quantize_groups)
    s_ptr,
    stride_qm,
    stride_sm,
    stride_sg,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    QUANT: tl.constexpr = False,
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
    # (with QUANT out_ptr is x: the output rounded to x's dtype, as the GEMM's input would be stored)
    out = (normed.to(tl.float32) * w.to(tl.float32)).to(out_ptr.dtype.element_ty)
    if QUANT:  # quantized for an fp8 GEMM instead of stored
        groups = tl.arange(0, BLOCK // FP8_GROUP)
        _quantize_groups(out, row, groups, q_ptr, s_ptr, stride_qm, stride_sm, stride_sg, hidden_size, BLOCK)
    else:
        tl.store(out_ptr + row * stride_o + cols, out, mask=mask)


@triton.jit
def _quantize_groups(
    values, row, groups, q_ptr, s_ptr, stride_qm, stride_sm, stride_sg, K, BLOCK: tl.constexpr
):
    """Row `row`'s `values` (BLOCK of them: columns groups[0] * 128 on, zeros past K) quantized
    and stored as fp8_gemm_triton.quantize_per_token_group_kernel does, to the same bytes."""
    y = tl.reshape(values.to(tl.float32), [BLOCK // FP8_GROUP, FP8_GROUP])
    k = groups[:, None] * FP8_GROUP + tl.arange(0, FP8_GROUP)[None, :]
    scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(y), 1), 1e-10), 448.0)
    q = quantize_e4m3(y, scale[:, None])
    tl.store(q_ptr + row * stride_qm + k, q.to(q_ptr.dtype.element_ty), mask=k < K)
    tl.store(s_ptr + row * stride_sm + groups * stride_sg, scale, mask=groups * FP8_GROUP < K)


def fusable_quantization(x: torch.Tensor, k: int, dtype: torch.dtype) -> bool:
    """Whether the fused ops below can quantize their output of k columns themselves: a whole number
    of groups of 128, in the dtype x has (the one the GEMM's output takes)."""
    return k % GROUP == 0 and dtype == x.dtype


def _quantized_output(x: torch.Tensor, k: int, rows_multiple: int) -> tuple[Fp8Input, tuple]:
    q, s = quantized_buffers(x.shape[0], k, rows_multiple, x.device)
    return Fp8Input(q, s, x.shape[0], rows_multiple, x.dtype), (q, s, q.stride(0), s.stride(0), s.stride(1))


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    quantize_rows_multiple: int = 0,
):
    """x, residual: [num_tokens, hidden]. Without `residual`: norm(x). With it: (norm(x + residual),
    x + residual), both new tensors (the inputs are not written). quantize_rows_multiple > 0 (where
    fusable_quantization holds): norm(x) as an Fp8Input for an fp8 GEMM, laid out for its rows
    multiple (fp8_gemm_triton.fp8_input_rows_multiple), instead of a tensor."""
    num_tokens, hidden = x.shape
    if x.stride(1) != 1 or (residual is not None and residual.stride(1) != 1):
        raise ValueError("rms_norm needs row-contiguous inputs")
    # weight * normed promotes like torch: an fp32 weight on a bf16 model gives fp32.
    dtype = torch.promote_types(x.dtype, weight.dtype)
    quant_args: tuple = (x, x, 0, 0, 0)
    if quantize_rows_multiple:
        if not fusable_quantization(x, hidden, dtype):
            raise ValueError(
                f"rms_norm cannot quantize {hidden} columns of {dtype} (see fusable_quantization)"
            )
        out, quant_args = _quantized_output(x, hidden, quantize_rows_multiple)
        out_buffer = x  # not written
    else:
        out = out_buffer = torch.empty(x.shape, dtype=dtype, device=x.device)
    residual_out = (
        torch.empty(x.shape, dtype=x.dtype, device=x.device) if residual is not None else out_buffer
    )
    if num_tokens:
        _rms_norm_kernel[(num_tokens,)](
            x,
            residual if residual is not None else x,
            weight,
            out_buffer,
            residual_out,
            x.stride(0),
            residual.stride(0) if residual is not None else 0,
            out_buffer.stride(0),
            residual_out.stride(0),
            hidden,
            eps,
            *quant_args,
            HAS_RESIDUAL=residual is not None,
            BLOCK=triton.next_power_of_2(hidden),
            QUANT=bool(quantize_rows_multiple),
            num_warps=RMS_NORM_WARPS.get(hidden, 4),
        )
    return out if residual is None else (out, residual_out)


@triton.jit
def _silu_and_mul_kernel(
    x_ptr, out_ptr, stride_x, stride_o, size, q_ptr, s_ptr, stride_qm, stride_sm, stride_sg,
    BLOCK: tl.constexpr, QUANT: tl.constexpr = False,
):  # fmt: skip
    # grid: (num_tokens, cdiv(size, BLOCK)); x row = [gate | up]
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < size
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + size + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    out = (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)
    if QUANT:  # with QUANT: quantized for an fp8 GEMM instead (a program's BLOCK is whole groups)
        groups = tl.program_id(1) * (BLOCK // FP8_GROUP) + tl.arange(0, BLOCK // FP8_GROUP)
        _quantize_groups(out, row, groups, q_ptr, s_ptr, stride_qm, stride_sm, stride_sg, size, BLOCK)
    else:
        tl.store(out_ptr + row * stride_o + cols, out, mask=mask)


def silu_and_mul(x: torch.Tensor, quantize_rows_multiple: int = 0):
    """[num_tokens, 2 * size] -> silu(gate) * up, [num_tokens, size]; as an Fp8Input with
    quantize_rows_multiple > 0 (as rms_norm's)."""
    num_tokens, double = x.shape
    if x.stride(1) != 1:
        raise ValueError("silu_and_mul needs row-contiguous inputs")
    size = double // 2
    block, num_warps = silu_and_mul_tile(size)
    quant_args: tuple = (x, x, 0, 0, 0)
    if quantize_rows_multiple:
        if not fusable_quantization(x, size, x.dtype):
            raise ValueError(f"silu_and_mul cannot quantize {size} columns (see fusable_quantization)")
        out, quant_args = _quantized_output(x, size, quantize_rows_multiple)
        out_buffer = x  # not written
    else:
        out = out_buffer = torch.empty((num_tokens, size), dtype=x.dtype, device=x.device)
    if num_tokens:
        _silu_and_mul_kernel[(num_tokens, triton.cdiv(size, block))](
            x, out_buffer, x.stride(0), out_buffer.stride(0), size, *quant_args,
            BLOCK=block, QUANT=bool(quantize_rows_multiple), num_warps=num_warps,
        )  # fmt: skip
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
    STORE_V: tl.constexpr = True,  # False: V's values are left to store_v_tiles (a long e4m3 launch)
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
    is_q = h < NUM_HEADS
    if HAS_NORM:
        w1 = tl.where(is_q, tl.load(q_weight_ptr + d), tl.load(k_weight_ptr + d))
        w2 = tl.where(is_q, tl.load(q_weight_ptr + HALF + d), tl.load(k_weight_ptr + HALF + d))
    else:
        w1, w2 = x1, x2  # unused
    pos = tl.load(positions_ptr + t)
    cos = tl.load(cos_sin_ptr + pos * stride_cs + d)
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HEAD_DIM + d)
    o1, o2 = norm_rope(x1, x2, w1, w2, cos, sin, eps, HEAD_DIM, HAS_NORM)
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
                NUM_KV_HEADS, HEAD_DIM, BLOCK_KVH, HEAD_DIM, KV_FP8, BLOCK_S, WHOLE_ROWS, STORE_V,
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
        store_args, constants = cache_store_args(k_cache, v_cache, k_scale, v_scale, num_tokens)
        cache_args = [k_cache, v_cache, slot_mapping, *store_args]
        store = {"STORE_KV": True, **constants}
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
        BLOCK_KVH=triton.next_power_of_2(num_kv_heads),
        HAS_NORM=q_weight is not None,
        # Each product and sum rounded as written (norm_rope): without this, ptxas fuses one
        # product into its sum (an FMA), and the result is no longer layers/rotary.py's.
        enable_fp_fusion=False,
        **store,
    )
    if store and not store["STORE_V"]:  # V's values: a long launch's, into an e4m3 cache
        v = qkv[:, qk_heads * head_dim :].view(num_tokens, num_kv_heads, head_dim)
        store_v_tiles(v, v_cache, slot_mapping, v_scale, num_tokens)
    return q, k
