"""Triton kernels over the paged KV cache: store, paged attention (decode and prefill), split-KV reduce.

Cache layout (one layer): k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim]; every
kernel takes strides, so q/k/v may be strided views (the qkv split) and the caches layer slices.

One attention kernel serves decode and prefill. A program owns one sequence, one KV head and a tile
of BLOCK_Q query tokens; its query tile packs those tokens with all GROUP query heads of the KV head
as rows (row r = token r // GROUP_PAD, head r % GROUP_PAD), so each K/V byte is read once per tile.
Decode launches it with BLOCK_Q = 1 and GROUP_PAD >= 16 (rows for tl.dot), optionally split over
the keys (flash-decoding) with a reduce kernel after; prefill launches it with BLOCK_Q > 1 and a
causal mask, reading the cached prefix and this chunk's keys through the block table.

An e4m3 cache (kv_cache_dtype fp8) is the same kernels with KV_FP8: the store writes
e4m3(x / scale), rounded in fp32 (round_to_e4m3); attention loads half the bytes, widens K and V to
fp16 (or q's dtype) in registers (exact), folds k_scale into the softmax scale and multiplies the
output by v_scale, accumulating in fp32 as for 16-bit caches (with FP8_DOT_F16, the decode
default, in fp16: a bf16 query must lie within fp16's range, |q| < 65504). Its V cache keeps each
block transposed, [num_blocks, num_kv_heads, head_dim,
block_size] (fp8.v_cache_slots): P @ V reduces over the keys, and sm90 can only gather 8-bit
operands along their reduction axis byte by byte from a slot-major tile, while keys that are
contiguous load as 16-byte vectors. The kernels read a block's V slots past the context (whole
blocks keep the vectors): the store kernel keeps them zero (a block's first slot written zeroes
the slots after it that the same launch does not write), so no per-key masking is needed.

With FP8_MMA (a decode config key, sm90) the decode loop multiplies the e4m3 cache as it is, in wgmma's
e4m3 MMAs, transposed so that the keys are the MMA's 64-row side (fp8_mma_tile): the query and the
probabilities each as two e4m3 parts (split_e4m3; about bf16's precision, where FlashAttention-3's fp8
path rounds each to one), so it is not the widening kernel's arithmetic: tests hold it to a torch
model of its own (tests/helpers/fp8_mma_checks.py) and to exact attention within its rounding.

With DECODE_STORES_KV (on: 0.6-0.7% of W1's device time on an H100) a decode step over an e4m3 cache runs no store kernel:
each decode program first stores its head's K and V of the step's token (store_decode_kv, the
same bytes), then a barrier, then its loop, which reads them back. With DECODE_FUSES_ROPE too, the
program takes q and K straight from the qkv projection and normalises and rotates them itself
(norm_rope, as the fused rotary kernel does; on: another ~0.5%), so a decode step's layer runs no
rotary kernel.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from executor_service.fp8 import v_cache_slots

LOG2E = 1.4426950408889634


@triton.jit
def round_to_e4m3(x):
    """fp32 -> the nearest e4m3 value (ties to even, saturated to +-448), still in fp32, so that the
    cast to float8e4nv after it is exact. The cast would round the same way on the GPU, but Triton's
    interpreter truncates (and loses the carry into the exponent): rounding here keeps the kernels
    testable on the CPU, for a few integer ops on a memory-bound store."""
    x = tl.minimum(tl.maximum(x, -448.0), 448.0)
    bits = x.to(tl.uint32, bitcast=True)
    # Normal e4m3 keeps 3 of fp32's 23 mantissa bits: round the other 20 to nearest even.
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000).to(tl.float32, bitcast=True)
    # Below 2**-6 e4m3 is subnormal, a grid of 2**-9: adding 1.5 * 2**23 rounds |x| * 512 to an
    # integer; the sign bit goes back on after (so -0.0001 is -0.0, as the cast gives; Triton's
    # negation is 0 - x, which would give +0.0).
    magic = 12582912.0
    subnormal = ((tl.abs(x) * 512.0 + magic) - magic) * (1.0 / 512.0)
    subnormal = (subnormal.to(tl.uint32, bitcast=True) | (bits & 0x80000000)).to(tl.float32, bitcast=True)
    return tl.where(tl.abs(x) < 0.015625, subnormal, normal)


@triton.jit
def quantize_e4m3(x, scale):
    """x / scale rounded to e4m3 (div_rn, then round_to_e4m3: fp8.quantize_kv's bytes once cast),
    in fp32: what every store and quantization of an e4m3 value here computes."""
    return round_to_e4m3(tl.math.div_rn(x.to(tl.float32), scale))


@triton.jit
def norm_rope(x1, x2, w1, w2, cos, sin, eps, HEAD_DIM: tl.constexpr, HAS_NORM: tl.constexpr):
    """The two halves (x1, x2: [heads, HEAD_DIM // 2] in the model dtype) of each head's q or k,
    RMS-normalised with the weight's halves w1, w2 (HAS_NORM), then rotated by the position's cos
    and sin ([1, HEAD_DIM // 2] rows of the table): the halves of the result, in the model dtype.
    The fused rotary kernel (layers/triton_ops.py) and the decode kernel's ROPE share it; both are
    launched with enable_fp_fusion=False, since a product fused into the sum after it (an FMA,
    which each kernel's compile pairs its own way) rounds once where the layers round twice."""
    dtype = x1.dtype
    f1 = x1.to(tl.float32)
    f2 = x2.to(tl.float32)
    if HAS_NORM:
        # Per-head RMSNorm, as layers/norm.py: fp32 statistics, normed rounded, times the weight rounded.
        inv_rms = tl.rsqrt((tl.sum(f1 * f1, axis=1) + tl.sum(f2 * f2, axis=1)) / HEAD_DIM + eps)
        n1 = ((f1 * inv_rms[:, None]).to(dtype).to(tl.float32) * w1.to(tl.float32)).to(dtype).to(tl.float32)
        n2 = ((f2 * inv_rms[:, None]).to(dtype).to(tl.float32) * w2.to(tl.float32)).to(dtype).to(tl.float32)
    else:
        n1, n2 = f1, f2
    # Rotary, neox halves, as layers/rotary.py: x * cos + rotate_half(x) * sin, cos and sin in the
    # model dtype, each product and the sum rounded. (Bitwise equality with the unfused layers is not
    # kept on the GPU: tests/test_triton_ops.py holds the result to a rounding step of the terms.)
    cos = cos.to(dtype).to(tl.float32)
    sin = sin.to(dtype).to(tl.float32)
    o1 = ((n1 * cos).to(dtype).to(tl.float32) + (-n2 * sin).to(dtype).to(tl.float32)).to(dtype)
    o2 = ((n2 * cos).to(dtype).to(tl.float32) + (n1 * sin).to(dtype).to(tl.float32)).to(dtype)
    return o1, o2


@triton.jit
def cast_e4m3(x, INTERPRETER: tl.constexpr):
    """fp32 -> e4m3, to nearest even: the GPU's cast (one cvt.rn.satfinite for two values); under
    Triton's interpreter, whose cast loses the carry into the exponent (126.5 becomes 64, not 128),
    through round_to_e4m3 first. |x| must be <= 448."""
    if INTERPRETER:
        x = round_to_e4m3(x)
    return x.to(tl.float8e4nv)


@triton.jit
def exp2_ftz(x, INTERPRETER: tl.constexpr):
    """2^x by the GPU's approximation with subnormal results flushed to 0 (one MUFU.EX2, where
    tl.exp2 adds a range check and two multiplies to keep them): for probabilities, whose
    subnormals add nothing. tl.exp2 under the interpreter (no inline PTX)."""
    if INTERPRETER:
        return tl.exp2(x)
    return tl.inline_asm_elementwise(
        "ex2.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1
    )


@triton.jit
def split_e4m3(x, INTERPRETER: tl.constexpr):
    """Each row of x (fp32 [rows, cols]) as two e4m3 parts and a scale: x ~ (hi + lo) * scale, with
    hi 16 x an e4m3 value of at most 28 (so at most 448, and exact) and lo e4m3 of what that leaves
    (at most hi's half unit in the last place, so at most 28 too); scale = the row's largest |x| /
    448. The pair holds about 8 significant bits, bf16's, where one e4m3 holds 4: FP8_MMA's query."""
    amax = tl.maximum(tl.max(tl.abs(x), 1), 1e-30)[:, None]  # (a row of zeros: hi = lo = 0)
    inv = tl.math.div_rn(28.0, amax)
    hi = cast_e4m3(x * inv, INTERPRETER).to(tl.float32)
    lo = cast_e4m3((x - hi * tl.math.div_rn(amax, 28.0)) * (16.0 * inv), INTERPRETER)
    return cast_e4m3(hi * 16.0, INTERPRETER), lo, tl.reshape(tl.math.div_rn(amax, 448.0), [x.shape[0]])


@triton.jit
def stack_rows(a, b):
    """[R, C] and [R, C] -> [2R, C]: a's rows, then b's."""
    return tl.reshape(tl.permute(tl.join(a, b), (2, 0, 1)), [2 * a.shape[0], a.shape[1]])


@triton.jit
def stack_cols(a, b):
    """[R, C] and [R, C] -> [R, 2C]: a's columns, then b's."""
    return tl.reshape(tl.permute(tl.join(a, b), (0, 2, 1)), [a.shape[0], 2 * a.shape[1]])


@triton.jit
def col_halves(x):
    """[R, 2C] -> ([R, C], [R, C]): x's first columns, its last. In an MMA's accumulator layout a
    thread holds column c and c + C together, so this moves no data."""
    return tl.split(tl.permute(tl.reshape(x, [x.shape[0], 2, x.shape[1] // 2]), (0, 2, 1)))


@triton.jit
def fp8_mma_tile(
    k, vt, q_t, row_scale, key_valid, m_i, l_i, acc, MASKED: tl.constexpr, INTERPRETER: tl.constexpr
):
    """One tile of keys of decode over an e4m3 cache with e4m3 MMAs (FP8_MMA), transposed so that the
    keys are the MMA's M side (sm90's wgmma, which multiplies e4m3 operands straight from shared
    memory as loaded, needs 64 rows a warpgroup there, which a decode step's query rows are not).
    Its N side is both parts of each query row (2M columns: wgmma's e4m3 MMA takes 16 or more, a
    decode step's GQA group is 1-8 rows), so one MMA chain multiplies both, and P @ V likewise.
    k: [BLOCK_N, BLOCK_D] e4m3; vt: [BLOCK_D, BLOCK_N] e4m3 (the V^T cache's layout); q_t:
    [BLOCK_D, 2M], the query rows' split_e4m3 parts (hi, then lo); row_scale [M]: a row's scale
    times qk_scale; MASKED: key_valid [BLOCK_N] masks the keys past the context (its last tile).

    d = K (q_hi + q_lo)^T [BLOCK_N, M] is the scores in units of row_scale: m_i (the running max)
    is kept in those units, the exponent is one FMA, and its + 8 makes p 256 x the probability
    (p <= 256 < 448, e4m3's largest). p goes to P @ V as two e4m3 parts too, p ~ hi + lo / 16. l_i
    is [BLOCK_N, M], each thread's own sums of p (scaled by alpha as the tiles go), reduced once
    after the loop: no reduction across warps a tile for it. acc: [BLOCK_D, 2M] fp32 += V^T [p_hi,
    p_lo]: o^T is its first half + its second / 16 (after the loop). Returns (m_i, l_i, acc)."""
    hi, lo = col_halves(tl.dot(k, q_t))
    d = hi + lo
    if MASKED:  # the context's last tile: keys past its end weigh nothing
        d = tl.where(key_valid[:, None], d, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(d, 0))
    # A row can see no key of this tile (an empty split); keep it finite so it contributes nothing.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = exp2_ftz(tl.fma(d, row_scale[None, :], (8.0 - m_safe * row_scale)[None, :]), INTERPRETER)
    alpha = exp2_ftz((m_i - m_safe) * row_scale, INTERPRETER)[None, :]
    l_i = tl.fma(l_i, alpha, p)
    p_hi = cast_e4m3(p, INTERPRETER)
    p_lo = cast_e4m3((p - p_hi.to(tl.float32)) * 16.0, INTERPRETER)  # (at most p: hi's half step x 16)
    acc = tl.dot(vt, stack_cols(p_hi, p_lo), acc * stack_cols(alpha, alpha))
    return m_new, l_i, acc


@triton.jit
def fp8_kv_tile(
    k_cache_ptr, v_cache_ptr, k_desc, v_desc, bt_row, tile, key, kv_end, kv_head, num_kv_heads, d, d_valid,
    stride_cb, stride_cs, stride_ch, stride_vb, stride_vh, stride_vd, BLOCK_SIZE: tl.constexpr,
    BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr, V_RUN: tl.constexpr, MASKED: tl.constexpr, TMA: tl.constexpr,
):  # fmt: skip
    """K [BLOCK_N, BLOCK_D] and V^T [BLOCK_D, BLOCK_N] of key tile `tile` (keys `key`; BLOCK_N keys may
    span several cache blocks: each key's block is gathered) from e4m3 caches, for both decode loops
    of paged_attention_kernel. V^T comes from blocks kept [num_kv_heads, head_dim, block_size], each
    block's keys contiguous, in runs of V_RUN slots (a mask constant over a run keeps the 16-byte
    vectors; the last block's keys past the end need its id too), so at most V_RUN - 1 slots past
    the context are read whatever the block size; those slots hold zeros, so the keys there
    (probability 0) add nothing. Without MASKED every key is below kv_end, so no key is masked (the
    FP8_MMA loop's full tiles). With TMA the tile comes through the descriptors instead
    (fp8_kv_tile_tma: whole boxes, MASKED ignored)."""
    if TMA:
        return fp8_kv_tile_tma(
            k_desc, v_desc, bt_row, tile, kv_head, num_kv_heads, BLOCK_SIZE, key.shape[0], HEAD_DIM
        )
    if MASKED:
        block = tl.load(bt_row + key // BLOCK_SIZE, mask=(key // BLOCK_SIZE) * BLOCK_SIZE < kv_end, other=0)
    else:
        block = tl.load(bt_row + key // BLOCK_SIZE)
    block = block.to(tl.int64)
    head_off = kv_head * stride_ch + d[None, :]
    k_off = block[:, None] * stride_cb + (key % BLOCK_SIZE)[:, None] * stride_cs + head_off
    vt_off = (
        block[None, :] * stride_vb
        + kv_head * stride_vh
        + d[:, None] * stride_vd
        + (key % BLOCK_SIZE)[None, :]
    )
    if BLOCK_SIZE % 16 == 0:  # runs of 16 contiguous keys, each starting 16-byte aligned
        vt_off = tl.max_contiguous(tl.multiple_of(vt_off, (1, 16)), (1, 16))
    k_mask = d_valid[None, :]
    v_mask = d_valid[:, None]
    if MASKED:
        k_mask = k_mask & (key < kv_end)[:, None]
        v_mask = v_mask & ((key // V_RUN) * V_RUN < kv_end)[None, :]
    if BLOCK_D == HEAD_DIM and not MASKED:
        k = tl.load(k_cache_ptr + k_off)
        vt = tl.load(v_cache_ptr + vt_off)
    else:
        k = tl.load(k_cache_ptr + k_off, mask=k_mask, other=0.0)
        vt = tl.load(v_cache_ptr + vt_off, mask=v_mask, other=0.0)
    return k, vt


@triton.jit
def fp8_kv_tile_tma(k_desc, v_desc, bt_row, tile, kv_head, num_kv_heads, BLOCK_SIZE: tl.constexpr,
                    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):  # fmt: skip
    """fp8_kv_tile through TMA (the decode config's TMA_KV): K [BLOCK_N, HEAD_DIM] and V^T [HEAD_DIM,
    BLOCK_N] of key tile `tile`, which lies within one cache block (BLOCK_N divides BLOCK_SIZE), as
    one box each: k_desc over the K cache as [num_blocks * BLOCK_SIZE, num_kv_heads * HEAD_DIM],
    v_desc over the V^T cache as [num_blocks * num_kv_heads * HEAD_DIM, BLOCK_SIZE]. The copy engine
    computes the addresses and writes shared memory (where FP8_MMA's wgmma reads its operands; the
    widening loop reads them into registers): no thread computes a key's address. A tile reads the
    whole of its block's slots: keys past the context are masked out of the scores and their V^T
    slots hold zeros, as with fp8_kv_tile's runs."""
    start = tile * BLOCK_N
    block = tl.load(bt_row + start // BLOCK_SIZE)
    slot = start % BLOCK_SIZE
    k = k_desc.load([block * BLOCK_SIZE + slot, kv_head * HEAD_DIM])
    vt = v_desc.load([(block * num_kv_heads + kv_head) * HEAD_DIM, slot])
    return k, vt


@triton.jit
def fence_proxy_async(INTERPRETER: tl.constexpr):
    """Orders this thread's earlier global stores before later TMA reads (the async proxy) of the
    same bytes: the decode kernel's store of the step's K and V, before TMA_KV's loads read them."""
    if not INTERPRETER:
        tl.inline_asm_elementwise(
            "fence.proxy.async.global; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1
        )


@triton.jit
def store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_vcb,  # the V cache's strides as [num_blocks, block_size, num_kv_heads, head_dim] (fp8.v_cache_slots)
    stride_vcs,
    stride_vch,
    stride_vcd,
    block_size,
    k_scale,
    v_scale,
    num_tokens,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    KV_FP8: tl.constexpr,  # the cache is e4m3: store e4m3(x / scale), saturated
    BLOCK_S: tl.constexpr,  # block_size rounded up to a power of 2 (with KV_FP8)
    WHOLE_ROWS: tl.constexpr = False,  # BLOCK_S == block_size: a block's V rows have no padding
    STORE_V: tl.constexpr = True,  # False: store_v_tiles_kernel writes V's values (the zeroing stays here)
):
    # grid: (num_tokens,). Slot -1 (CUDA-graph padding) stores nothing; no host sync.
    t = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    if slot < 0:
        return
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < NUM_KV_HEADS) & (d < HEAD_DIM)
    k = tl.load(k_ptr + t.to(tl.int64) * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(v_ptr + t.to(tl.int64) * stride_vt + h * stride_vh + d, mask=mask)
    store_token_kv(
        k, v, t, slot, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
        stride_cb, stride_cs, stride_ch, stride_vcb, stride_vcs, stride_vch, stride_vcd,
        block_size, k_scale, v_scale, num_tokens,
        NUM_KV_HEADS, HEAD_DIM, BLOCK_H, BLOCK_D, KV_FP8, BLOCK_S, WHOLE_ROWS, STORE_V,
    )  # fmt: skip


@triton.jit
def store_token_kv(
    k,  # [BLOCK_H, BLOCK_D] one token's K and V in the model dtype (rows past NUM_KV_HEADS and
    v,  # columns past HEAD_DIM are not stored)
    t,  # the token's row in the launch (its slot_mapping entry)
    slot,  # its slot, >= 0
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_vcb,  # the V cache's strides as [num_blocks, block_size, num_kv_heads, head_dim]
    stride_vcs,
    stride_vch,
    stride_vcd,
    block_size,
    k_scale,
    v_scale,
    num_tokens,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    KV_FP8: tl.constexpr,
    BLOCK_S: tl.constexpr,
    WHOLE_ROWS: tl.constexpr,
    STORE_V: tl.constexpr = True,
):
    """One token's K and V into the paged cache (store_kv_kernel's body; the fused rotary kernel
    of layers/triton_ops.py calls it too), with an e4m3 cache's zeroing of its block; with STORE_V
    False V's values are left to store_v_tiles_kernel."""
    store_token_k(
        k, slot, k_cache_ptr, stride_cb, stride_cs, stride_ch, block_size, k_scale,
        NUM_KV_HEADS, HEAD_DIM, BLOCK_H, BLOCK_D, KV_FP8,
    )  # fmt: skip
    store_token_v(
        v, t, slot, v_cache_ptr, slot_mapping_ptr, stride_vcb, stride_vcs, stride_vch, stride_vcd,
        block_size, v_scale, num_tokens, NUM_KV_HEADS, HEAD_DIM, BLOCK_H, BLOCK_D, KV_FP8, BLOCK_S, WHOLE_ROWS,
        STORE_V,
    )  # fmt: skip


@triton.jit
def store_token_k(
    k,  # [BLOCK_H, BLOCK_D]: one token's K
    slot,  # the token's slot, >= 0
    k_cache_ptr,
    stride_cb,
    stride_cs,
    stride_ch,
    block_size,
    k_scale,
    NUM_KV_HEADS: tl.constexpr,
    COLS: tl.constexpr,  # the tile's columns to store (< BLOCK_D where head_dim is padded)
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    """A token's K into the paged cache: e4m3(k / k_scale) for an e4m3 cache."""
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    block, offset = slot // block_size, slot % block_size
    dst = block * stride_cb + offset * stride_cs + h * stride_ch + d
    if KV_FP8:
        k = quantize_e4m3(k, k_scale)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=(h < NUM_KV_HEADS) & (d < COLS))


@triton.jit
def store_token_v(
    v,  # [BLOCK_H, BLOCK_D] one token's V in the model dtype
    t,  # the token's row in the launch (its slot_mapping entry)
    slot,  # its slot, >= 0
    v_cache_ptr,
    slot_mapping_ptr,
    stride_vcb,  # the V cache's strides as [num_blocks, block_size, num_kv_heads, head_dim]
    stride_vcs,
    stride_vch,
    stride_vcd,
    block_size,
    v_scale,
    num_tokens,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    KV_FP8: tl.constexpr,
    BLOCK_S: tl.constexpr,
    WHOLE_ROWS: tl.constexpr,
    STORE_V: tl.constexpr = True,
):
    """A token's V into the paged cache; in an e4m3 cache (kept transposed) a token at its block's
    first slot also zeroes the slots after it that no token of the launch writes. STORE_V False:
    only that zeroing (and a lone token's whole rows); store_v_tiles_kernel writes the values."""
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < NUM_KV_HEADS) & (d < HEAD_DIM)
    block, offset = slot // block_size, slot % block_size
    v_dst = block * stride_vcb + offset * stride_vcs + h * stride_vch + d * stride_vcd
    if KV_FP8:
        v = quantize_e4m3(v, v_scale)
    if STORE_V:
        tl.store(v_cache_ptr + v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)
    if KV_FP8:  # noqa: SIM102 (constexpr branch)
        # A block's first slot: zero the V slots after it that no token of this launch writes (a
        # sequence's tokens are consecutive in the batch, with consecutive slots), so that the
        # attention kernels may read whole blocks.
        if offset == 0:
            o = tl.arange(0, BLOCK_S)
            later = tl.load(slot_mapping_ptr + t + o, mask=(o > 0) & (t + o < num_tokens), other=-1)
            unwritten = (o > 0) & (o < block_size) & (later != slot + o)
            h3 = tl.arange(0, BLOCK_H)[:, None, None]
            d3 = tl.arange(0, BLOCK_D)[None, :, None]
            zero_dst = block * stride_vcb + o[None, None, :] * stride_vcs + h3 * stride_vch + d3 * stride_vcd
            hd_mask = (h3 < NUM_KV_HEADS) & (d3 < HEAD_DIM)
            num_unwritten = tl.sum(unwritten.to(tl.int32), 0)
            if WHOLE_ROWS:
                lone = num_unwritten == block_size - 1
            else:
                lone = False
            if lone:
                # A lone token in its block (a decode step's): its V and the zeros after it as
                # whole rows of the transposed block, a mask constant along the slots (16-byte
                # stores instead of one byte a slot). The rows are built from the e4m3 bytes:
                # converting fp32 zeros to e4m3 beside V left other registers' bytes in the packed
                # 16-byte stores on sm90 (ptxas: F2FP ... MERGE_C), NaN or garbage past the token.
                v_bytes = v.to(v_cache_ptr.dtype.element_ty).to(tl.uint8, bitcast=True)
                rows = tl.where(
                    o[None, None, :] == 0, v_bytes[:, :, None], tl.zeros_like(v_bytes)[:, :, None]
                )
                tl.store(v_cache_ptr.to(tl.pointer_type(tl.uint8)) + zero_dst, rows, mask=hd_mask)
            elif num_unwritten > 0:  # (a prefill run that fills its block leaves none)
                zeros = tl.zeros([BLOCK_H, BLOCK_D, BLOCK_S], v_cache_ptr.dtype.element_ty)
                tl.store(v_cache_ptr + zero_dst, zeros, mask=hd_mask & unwritten[None, None, :])


# A launch of at least this many tokens into an e4m3 cache stores V through store_v_tiles_kernel
# (a prefill chunk's), fewer the per-token store; None: always the per-token store. Both write the
# same bytes. The per-token store writes one byte in each of head_dim rows of V^T a token (~0.2 ms of
# the fused rotary kernel's 310 us at 16,384 tokens on an H100); from 512 tokens the tiles: W1 fp8
# +0.6-1.0% on an H100 (`bash bench/gpu_run.sh w1-fp8-vtiles`, 2026-12-06; bench/RESULTS.md).
V_TILE_MIN_TOKENS: int | None = 512
V_TILE = 32  # launch rows a program of store_v_tiles_kernel stores


@triton.jit
def store_v_tiles_kernel(
    v_ptr,  # [num_tokens, num_kv_heads, head_dim] rows of V (last dim contiguous)
    v_cache_ptr,  # an e4m3 V cache, kept transposed: [num_blocks, num_kv_heads, head_dim, block_size]
    slot_mapping_ptr,
    stride_vt,
    stride_vh,
    stride_vcb,  # the V cache's strides as [num_blocks, block_size, num_kv_heads, head_dim]
    stride_vcs,
    stride_vch,
    stride_vcd,
    block_size,
    v_scale,
    num_tokens,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    TILE: tl.constexpr,
):
    """e4m3(v / v_scale) of TILE consecutive launch rows and one KV head into the transposed cache,
    as store_token_v writes them. grid: (cdiv(num_tokens, TILE), num_kv_heads). Laid out [TILE,
    BLOCK_D], the store's lanes run along the rows (Triton's layout for it, checked in an sm90
    compile by tests/test_fp8_kv.py): a prefill run's consecutive slots, so each
    warp writes a run of bytes of a block's row, where a program a token writes one byte in each
    of head_dim rows. Slot -1 (CUDA-graph padding) stores nothing; no zeroing here (the per-token
    store keeps it, STORE_V False)."""
    rows = tl.program_id(0) * TILE + tl.arange(0, TILE)
    h = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    slot = tl.load(slot_mapping_ptr + rows, mask=rows < num_tokens, other=-1).to(tl.int64)
    keep = slot >= 0
    block, offset = slot // block_size, slot % block_size
    mask = keep[:, None] & (d < HEAD_DIM)[None, :]
    v = tl.load(
        v_ptr + rows.to(tl.int64)[:, None] * stride_vt + h * stride_vh + d[None, :], mask=mask, other=0.0
    )
    v = quantize_e4m3(v, v_scale)
    dst = (
        block[:, None] * stride_vcb + offset[:, None] * stride_vcs + h * stride_vch + d[None, :] * stride_vcd
    )
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_v_tiles(v, v_cache, slot_mapping, v_scale, num_tokens: int) -> None:
    """store_v_tiles_kernel over the first num_tokens rows of v [*, num_kv_heads, head_dim]."""
    num_kv_heads, head_dim = v.shape[1], v.shape[2]
    store_v_tiles_kernel[(triton.cdiv(num_tokens, V_TILE), num_kv_heads)](
        v,
        v_cache,
        slot_mapping,
        v.stride(0),
        v.stride(1),
        *v_cache_slots(v_cache).stride(),
        v_cache.shape[3],
        float(v_scale),
        num_tokens,
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        TILE=V_TILE,
    )


@triton.jit
def new_k_codes(
    new_k_ptr, t, kv_head, stride_nkt, stride_nkh, k_scale, rope_row, k_norm_ptr, eps, CODE: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, ROPE: tl.constexpr, HAS_NORM: tl.constexpr,
):  # fmt: skip
    """A decode token's K for one KV head as e4m3 codes of type CODE, the bytes store_token_kv would
    write: with ROPE normalised and rotated first (the fused rotary kernel's norm_rope, in halves)
    and returned as its two halves ([1, HEAD_DIM // 2] each); without, the row ([BLOCK_D], zeros
    past HEAD_DIM) twice. store_decode_kv stores them; decode_new_k widens them."""
    k_row = new_k_ptr + t.to(tl.int64) * stride_nkt + kv_head * stride_nkh
    if ROPE:
        HALF: tl.constexpr = HEAD_DIM // 2
        hd = tl.arange(0, HALF)[None, :]
        cos, sin = tl.load(rope_row + hd), tl.load(rope_row + HEAD_DIM + hd)
        if HAS_NORM:
            w1, w2 = tl.load(k_norm_ptr + hd), tl.load(k_norm_ptr + HALF + hd)
        else:
            w1, w2 = cos, sin  # unused
        k1, k2 = norm_rope(
            tl.load(k_row + hd), tl.load(k_row + HALF + hd), w1, w2, cos, sin, eps, HEAD_DIM, HAS_NORM
        )
        k1, k2 = quantize_e4m3(k1, k_scale).to(CODE), quantize_e4m3(k2, k_scale).to(CODE)
    else:
        d = tl.arange(0, BLOCK_D)
        k1 = quantize_e4m3(tl.load(k_row + d, mask=d < HEAD_DIM, other=0.0), k_scale).to(CODE)
        k2 = k1
    return k1, k2


@triton.jit
def new_v_codes(
    new_v_ptr, t, kv_head, stride_nvt, stride_nvh, v_scale, CODE: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    """A decode token's V for one KV head as e4m3 codes of type CODE ([BLOCK_D], zeros past HEAD_DIM)."""
    d = tl.arange(0, BLOCK_D)
    v = tl.load(
        new_v_ptr + t.to(tl.int64) * stride_nvt + kv_head * stride_nvh + d, mask=d < HEAD_DIM, other=0.0
    )
    return quantize_e4m3(v, v_scale).to(CODE)


@triton.jit
def decode_new_k(
    new_k_ptr, t, kv_head, stride_nkt, stride_nkh, k_scale, rope_row, k_norm_ptr, eps, CODE: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, ROPE: tl.constexpr, HAS_NORM: tl.constexpr,
):  # fmt: skip
    """new_k_codes' key widened to fp32 as one row ([BLOCK_D]): the key the cache will hold, for the
    decode kernel to attend to its own step's key from registers (NEW_KEY_REGS)."""
    k1, k2 = new_k_codes(
        new_k_ptr, t, kv_head, stride_nkt, stride_nkh, k_scale, rope_row, k_norm_ptr, eps, CODE, HEAD_DIM,
        BLOCK_D, ROPE, HAS_NORM,
    )  # fmt: skip
    if ROPE:
        k = tl.reshape(tl.permute(tl.join(k1.to(tl.float32), k2.to(tl.float32)), (0, 2, 1)), [BLOCK_D])
    else:
        k = k1.to(tl.float32)
    return k


@triton.jit
def store_decode_kv(
    new_k_ptr,
    new_v_ptr,
    slot_mapping_ptr,
    k_cache_ptr,
    v_cache_ptr,
    t,  # the token's row (a decode sequence's only query row)
    kv_head,
    stride_nkt,
    stride_nkh,
    stride_nvt,
    stride_nvh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_vb,
    stride_vh,
    stride_vd,
    k_scale,
    v_scale,
    rope_row,  # with ROPE: the token's row of the rotary table
    k_norm_ptr,
    eps,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ROPE: tl.constexpr = False,  # K comes unnormalised and unrotated: norm_rope first
    HAS_NORM: tl.constexpr = False,
):
    """A decode token's K and V for one KV head into the e4m3 cache, the bytes store_token_kv
    writes: the attention program of that head stores them, so no store runs before attention.
    A token at its block's first slot is a lone token (a decode step appends one token a sequence):
    it writes whole rows of the block's transposed V, its V and zeros after."""
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    if slot >= 0:  # (-1: CUDA-graph padding)
        block, offset = slot // BLOCK_SIZE, slot % BLOCK_SIZE
        d = tl.arange(0, BLOCK_D)
        k_dst = k_cache_ptr + block * stride_cb + offset * stride_cs + kv_head * stride_ch
        k1, k2 = new_k_codes(
            new_k_ptr, t, kv_head, stride_nkt, stride_nkh, k_scale, rope_row, k_norm_ptr, eps,
            k_cache_ptr.dtype.element_ty, HEAD_DIM, BLOCK_D, ROPE, HAS_NORM,
        )  # fmt: skip
        if ROPE:  # the fused rotary kernel's K, stored as it would be
            HALF: tl.constexpr = HEAD_DIM // 2
            hd = tl.arange(0, HALF)[None, :]
            tl.store(k_dst + hd, k1)
            tl.store(k_dst + HALF + hd, k2)
        else:
            tl.store(k_dst + d, k1, mask=d < HEAD_DIM)
        base = block * stride_vb + kv_head * stride_vh
        v_row = new_v_ptr + t.to(tl.int64) * stride_nvt + kv_head * stride_nvh
        if offset == 0:
            # The block's V^T rows for this head, flat: row r, slot o at element r * BLOCK_SIZE + o
            # (a power of 2: paged_decode's condition for new_kv). Slot 0 takes the token's byte,
            # the others zero, selected as bytes after the conversion (store_token_v says why).
            i = tl.arange(0, BLOCK_D * BLOCK_SIZE)
            row, o = i // BLOCK_SIZE, i % BLOCK_SIZE
            x = tl.load(v_row + row, mask=(o == 0) & (row < HEAD_DIM), other=0.0)
            x = quantize_e4m3(x, v_scale).to(v_cache_ptr.dtype.element_ty)
            rows = tl.where(o == 0, x.to(tl.uint8, bitcast=True), 0).to(tl.uint8)
            dst = base + row * stride_vd + o
            tl.store(v_cache_ptr.to(tl.pointer_type(tl.uint8)) + dst, rows, mask=row < HEAD_DIM)
        else:
            v = new_v_codes(
                new_v_ptr, t, kv_head, stride_nvt, stride_nvh, v_scale, v_cache_ptr.dtype.element_ty, HEAD_DIM,
                BLOCK_D,
            )  # fmt: skip
            tl.store(v_cache_ptr + base + d * stride_vd + offset, v, mask=d < HEAD_DIM)


@triton.jit
def _program_seq(seq_order_ptr, ORDERED: tl.constexpr):
    """The sequence this program attends for: program_id(2), or its entry of seq_order. The GPU
    starts programs in grid order, so a step's longest contexts first keeps them off the tail:
    W1's mixed contexts at batch 256 decode 3-5% faster that way (bench/attention.py
    --sweep-mixed-lengths)."""
    if ORDERED:
        return tl.load(seq_order_ptr + tl.program_id(2))
    return tl.program_id(2)


# The block tables' row stride is the widest table of the step: not specialised (Triton would
# compile a variant for 1, for multiples of 16 and for the rest, each in the middle of serving).
@triton.jit(do_not_specialize=["stride_bt"])
def paged_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_desc,  # with TMA_KV: TMA descriptors of the caches (fp8_kv_tile_tma); else unused
    v_desc,
    out_ptr,
    partial_out_ptr,  # [num_seqs, num_heads, NUM_SPLITS, HEAD_DIM] fp32, only with NUM_SPLITS > 1
    partial_lse_ptr,  # [num_seqs, num_heads, NUM_SPLITS] fp32 (log2 domain)
    block_tables_ptr,
    context_lens_ptr,
    cu_seqlens_q_ptr,
    seq_order_ptr,  # with ORDERED: [num_seqs] the sequence of each program_id(2) (longest first)
    new_k_ptr,  # with STORE_KV: this step's K and V [num_tokens, num_kv_heads, head_dim] (K rotated,
    new_v_ptr,  # V a view of qkv), to store into the cache first
    slot_mapping_ptr,  # with STORE_KV: int64 [num_tokens], -1 for CUDA-graph padding rows
    k_scale,  # with STORE_KV: the K cache's scale (qk_scale carries it too, folded in)
    cos_sin_ptr,  # with ROPE: the rotary table [positions, 2 * HEAD_DIM] (layers/triton_ops.qk_norm_rope's)
    q_norm_ptr,  # with ROPE and HAS_NORM: the q and k RMSNorm weights [HEAD_DIM]
    k_norm_ptr,
    stride_rope,  # with ROPE: the table's row stride
    eps,  # with ROPE and HAS_NORM: the norms' epsilon
    qk_scale,  # softmax scale * log2(e) (* k_scale with an fp8 cache): scores go through exp2
    v_scale,  # with an fp8 cache: the output is scaled once instead of every V element
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_vb,  # an e4m3 V cache's block, head and dimension strides (its keys are contiguous)
    stride_vh,
    stride_vd,
    stride_bt,
    stride_nkt,  # with STORE_KV: new_k's and new_v's token and head strides
    stride_nkh,
    stride_nvt,
    stride_nvh,
    num_heads,
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,  # query tokens per tile
    BLOCK_N: tl.constexpr,  # keys per iteration, independent of block_size
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    ROWS: tl.constexpr,  # 0: every sequence; 1: only query length 1; 2: only query length > 1
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs (Triton would use TF32), ignored for 16-bit
    KV_FP8: tl.constexpr,  # e4m3 cache: K/V widened to q's dtype in registers, fp32 accumulation
    FP8_DOT_F16: tl.constexpr = False,  # with KV_FP8: widen K/V (and q, p) to fp16 instead (bench/attention.py)
    ORDERED: tl.constexpr = False,  # programs take sequences in seq_order's order
    STORE_KV: tl.constexpr = False,  # decode, e4m3 cache: store the step's K and V first (store_decode_kv)
    ROPE: tl.constexpr = False,  # with STORE_KV: q and the new K come unnormalised and unrotated (DECODE_FUSES_ROPE)
    HAS_NORM: tl.constexpr = False,  # with ROPE: q and k RMS-normalised first (Qwen3's q/k norms)
    FP8_MMA: tl.constexpr = False,  # decode, e4m3 cache: e4m3 MMAs (fp8_mma_tile), no widening
    INTERPRETER: tl.constexpr = False,  # with FP8_MMA or TMA_KV: under Triton's interpreter (no inline PTX)
    FULL_TILES: tl.constexpr = False,  # with FP8_MMA: a loop over the unmasked tiles, then one over the rest
    # (with TMA_KV, the rest by pointer loads)
    TMA_KV: tl.constexpr = False,  # decode, e4m3 cache: K and V^T tiles through TMA (fp8_kv_tile_tma)
    NEW_KEY_REGS: tl.constexpr = False,  # with STORE_KV: the step's key from registers, no barrier
):
    # grid: (num_kv_heads * NUM_SPLITS, num_query_tiles, num_seqs), never dependent on device values.
    # KV heads vary fastest, so programs running together read neighbouring bytes of the same blocks.
    kv_head = tl.program_id(0) // NUM_SPLITS
    split = tl.program_id(0) % NUM_SPLITS
    q_tile = tl.program_id(1)
    seq = _program_seq(seq_order_ptr, ORDERED)

    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    if ROWS == 1:  # noqa: SIM102 (constexpr branch, pruned at compile time)
        if q_len != 1:
            return
    if ROWS == 2:  # noqa: SIM102
        if q_len == 1:
            return
    if q_tile * BLOCK_Q >= q_len:
        return
    context_len = tl.load(context_lens_ptr + seq)
    # Query token i of the sequence sits at position context_len - q_len + i.
    first_pos = context_len - q_len + q_tile * BLOCK_Q

    M: tl.constexpr = BLOCK_Q * GROUP_PAD
    rows = tl.arange(0, M)
    token = q_tile * BLOCK_Q + rows // GROUP_PAD
    head = kv_head * GROUP + rows % GROUP_PAD
    row_valid = (token < q_len) & (rows % GROUP_PAD < GROUP)
    row_pos = first_pos + rows // GROUP_PAD
    d = tl.arange(0, BLOCK_D)
    # Mask head_dim only when padded: a mask constant along d keeps the 16-byte vector loads.
    if BLOCK_D == HEAD_DIM:
        d_valid = tl.full([BLOCK_D], 1, tl.int1)
    else:
        d_valid = d < HEAD_DIM

    # With ROPE: the rotary table's row at the decode token's position (context_len - 1).
    rope_row = cos_sin_ptr + tl.maximum(context_len - 1, 0).to(tl.int64) * stride_rope
    if ROPE:
        # q straight from the qkv projection: normalised and rotated here, exactly as the fused
        # rotary kernel would (norm_rope, in halves).
        HALF: tl.constexpr = HEAD_DIM // 2
        hd = tl.arange(0, HALF)
        cos = tl.load(rope_row + hd)[None, :]
        sin = tl.load(rope_row + HEAD_DIM + hd)[None, :]
        if HAS_NORM:
            w1, w2 = tl.load(q_norm_ptr + hd)[None, :], tl.load(q_norm_ptr + HALF + hd)[None, :]
        else:
            w1, w2 = cos, sin  # unused
        q_row = (q_start + token).to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh
        x1 = tl.load(q_ptr + q_row + hd[None, :], mask=row_valid[:, None], other=0.0)
        x2 = tl.load(q_ptr + q_row + HALF + hd[None, :], mask=row_valid[:, None], other=0.0)
        o1, o2 = norm_rope(x1, x2, w1, w2, cos, sin, eps, HEAD_DIM, HAS_NORM)
        q = tl.reshape(tl.permute(tl.join(o1, o2), (0, 2, 1)), [M, BLOCK_D])
    else:
        q_off = (q_start + token).to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
        q = tl.load(q_ptr + q_off, mask=row_valid[:, None] & d_valid[None, :], other=0.0)
    if NEW_KEY_REGS:
        # The step's own key and value (DECODE_NEW_KEY_REGS) as the cache will hold them, and the
        # key's score (log2 units) against the query rows as they are, before any split or widening.
        tl.static_assert(
            STORE_KV and KV_FP8 and BLOCK_Q == 1 and not TMA_KV, "NEW_KEY_REGS: STORE_KV's decode"
        )
        k_new = decode_new_k(
            new_k_ptr, q_start, kv_head, stride_nkt, stride_nkh, k_scale, rope_row, k_norm_ptr, eps,
            k_cache_ptr.dtype.element_ty, HEAD_DIM, BLOCK_D, ROPE, HAS_NORM,
        )  # fmt: skip
        s_new = tl.sum(q.to(tl.float32) * k_new[None, :], 1) * qk_scale
    if FP8_MMA:
        tl.static_assert(KV_FP8 and BLOCK_Q == 1, "FP8_MMA: decode over an e4m3 cache")
        q_hi, q_lo, q_scale = split_e4m3(q.to(tl.float32), INTERPRETER)
        q_t = tl.trans(stack_rows(q_hi, q_lo))
        row_scale = q_scale * qk_scale  # the scores' unit: q ~ (hi + lo) * q_scale
    elif KV_FP8 and FP8_DOT_F16:
        q = q.to(tl.float16)

    # Keys this tile needs: 0 .. its last query position (causal), split evenly in BLOCK_N tiles.
    kv_end = tl.minimum(first_pos + BLOCK_Q, context_len)
    num_tiles = tl.cdiv(kv_end, BLOCK_N)
    tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    tile_lo = split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)

    # The keys the loop attends to: with NEW_KEY_REGS, the split holding the step's key (a real
    # token's: slot >= 0) leaves it out, and starts from it instead (below).
    loop_end = kv_end
    merge_new = False
    if STORE_KV:  # (constexpr branch)
        # The split whose tiles hold the last key (the new token's) stores its K and V, then a
        # barrier makes the bytes visible to the program's own loads of that block. With
        # NEW_KEY_REGS no load of this program needs them: no barrier (DECODE_NEW_KEY_REGS says
        # which bytes its loop may still read from the token's block, and why they are finite).
        holds_last = (num_tiles > 0) & (num_tiles - 1 >= tile_lo) & (num_tiles - 1 < tile_hi)
        if holds_last:
            store_decode_kv(
                new_k_ptr, new_v_ptr, slot_mapping_ptr, k_cache_ptr, v_cache_ptr, q_start, kv_head,
                stride_nkt, stride_nkh, stride_nvt, stride_nvh, stride_cb, stride_cs, stride_ch,
                stride_vb, stride_vh, stride_vd, k_scale, v_scale,
                rope_row, k_norm_ptr, eps,
                BLOCK_SIZE, HEAD_DIM, BLOCK_D, ROPE, HAS_NORM,
            )  # fmt: skip
            if not NEW_KEY_REGS:
                if TMA_KV:
                    fence_proxy_async(INTERPRETER)
                tl.debug_barrier()
        if NEW_KEY_REGS:
            merge_new = holds_last & (tl.load(slot_mapping_ptr + q_start) >= 0)
            loop_end = tl.where(merge_new, kv_end - 1, kv_end)

    m_i = tl.full([M], float("-inf"), tl.float32)
    l_i = tl.zeros([M], tl.float32)
    if FP8_MMA:
        acc = tl.zeros([BLOCK_D, 2 * M], tl.float32)  # o^T from p's two parts (fp8_mma_tile)
        l_i = tl.zeros([BLOCK_N, M], tl.float32)  # each thread's sums (fp8_mma_tile)
    else:
        acc = tl.zeros([M, BLOCK_D], tl.float32)
    if NEW_KEY_REGS:
        # The step's own key first (in the split that holds it): the state the loop would have after
        # that key alone, in each loop's units. In FP8_MMA's, m in units of row_scale and the key's p
        # 256 (2^8: the exponent's + 8), all of it in the hi part, in one thread's sums (key 0).
        v_new = new_v_codes(
            new_v_ptr, q_start, kv_head, stride_nvt, stride_nvh, v_scale, k_cache_ptr.dtype.element_ty,
            HEAD_DIM, BLOCK_D,
        ).to(tl.float32)  # fmt: skip
        if FP8_MMA:
            m_i = tl.where(merge_new, s_new / row_scale, float("-inf"))
            l_i = tl.where(merge_new & (tl.arange(0, BLOCK_N) == 0)[:, None], 256.0, l_i)
            first = tl.where(merge_new, 256.0 * v_new, 0.0)[:, None] + tl.zeros([BLOCK_D, M], tl.float32)
            acc = stack_cols(first, tl.zeros([BLOCK_D, M], tl.float32))
        else:
            m_i = tl.where(merge_new, s_new, float("-inf"))
            l_i = tl.where(merge_new, 1.0, 0.0) + l_i
            acc = tl.where(merge_new, v_new[None, :] + acc, 0.0)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    head_off = kv_head * stride_ch + d[None, :]
    n = tl.arange(0, BLOCK_N)
    # An e4m3 V^T is read in runs of 16 slots (16-byte vectors) where blocks hold whole runs.
    V_RUN: tl.constexpr = 16 if BLOCK_SIZE % 16 == 0 else BLOCK_SIZE
    if TMA_KV:
        tl.static_assert(KV_FP8 and BLOCK_Q == 1, "TMA_KV: decode over an e4m3 cache")
        tl.static_assert(BLOCK_SIZE % BLOCK_N == 0 and BLOCK_D == HEAD_DIM, "TMA_KV: a tile a box")
    num_kv_heads = tl.num_programs(0) // NUM_SPLITS
    if FP8_MMA:
        # With FULL_TILES the tiles whose keys all lie within the context first, unmasked (fewer
        # instructions a tile, but a second loop for the context's last tile); then the rest, masked.
        full_hi = tile_lo
        if FULL_TILES:
            full_hi = tl.maximum(tl.minimum(tile_hi, loop_end // BLOCK_N), tile_lo)
        for tile in range(tile_lo, full_hi):
            key = tile * BLOCK_N + n
            k, vt = fp8_kv_tile(
                k_cache_ptr, v_cache_ptr, k_desc, v_desc, bt_row, tile, key, loop_end, kv_head, num_kv_heads, d,
                d_valid, stride_cb, stride_cs, stride_ch, stride_vb, stride_vh, stride_vd, BLOCK_SIZE, BLOCK_D,
                HEAD_DIM, V_RUN, False, TMA_KV,
            )  # fmt: skip
            m_i, l_i, acc = fp8_mma_tile(k, vt, q_t, row_scale, key, m_i, l_i, acc, False, INTERPRETER)
        for tile in range(full_hi, tile_hi):
            key = tile * BLOCK_N + n
            # With FULL_TILES this loop holds the context's last tile alone: pointer loads, which
            # stop at the context (K) and its last run of 16 slots (V^T) where a box reads them all.
            k, vt = fp8_kv_tile(
                k_cache_ptr, v_cache_ptr, k_desc, v_desc, bt_row, tile, key, loop_end, kv_head, num_kv_heads, d,
                d_valid, stride_cb, stride_cs, stride_ch, stride_vb, stride_vh, stride_vd, BLOCK_SIZE, BLOCK_D,
                HEAD_DIM, V_RUN, True, TMA_KV and not FULL_TILES,
            )  # fmt: skip
            m_i, l_i, acc = fp8_mma_tile(
                k, vt, q_t, row_scale, key < loop_end, m_i, l_i, acc, True, INTERPRETER
            )
    else:
        for tile in range(tile_lo, tile_hi):
            key = tile * BLOCK_N + n
            key_valid = key < loop_end
            if KV_FP8:
                k, vt = fp8_kv_tile(
                    k_cache_ptr, v_cache_ptr, k_desc, v_desc, bt_row, tile, key, loop_end, kv_head, num_kv_heads,
                    d, d_valid, stride_cb, stride_cs, stride_ch, stride_vb, stride_vh, stride_vd, BLOCK_SIZE,
                    BLOCK_D, HEAD_DIM, V_RUN, True, TMA_KV,
                )  # fmt: skip
                v = tl.trans(vt)  # slots past the context hold zeros (store_kv_kernel)
            else:
                # Gather the cache block of every key: BLOCK_N keys may span several blocks.
                block = tl.load(bt_row + key // BLOCK_SIZE, mask=key_valid, other=0).to(tl.int64)
                kv_off = block[:, None] * stride_cb + (key % BLOCK_SIZE)[:, None] * stride_cs + head_off
                if BLOCK_D == HEAD_DIM:
                    kv_mask = key_valid[:, None]
                else:
                    kv_mask = key_valid[:, None] & d_valid[None, :]
                k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0)
                v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0)
            if KV_FP8:  # e4m3 -> bf16/fp16/fp32 is exact; the scales are applied to s and o
                k = k.to(q.dtype)
                v = v.to(q.dtype)

            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [M, BLOCK_N], log2 domain
            s = tl.where((key[None, :] <= row_pos[:, None]) & key_valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # A row can see no key of this tile (causal); keep it finite so it contributes nothing.
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(s - m_safe[:, None])
            alpha = tl.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new

    if FP8_MMA:  # back to the other path's units: o [M, BLOCK_D], l and m in log2 units
        o_hi, o_lo = col_halves(acc)
        acc = tl.trans(o_hi + o_lo * 0.0625)
        l_i = tl.sum(l_i, 0)  # 256 x the probabilities' sum, as acc is 256 x theirs
        m_i = m_i * row_scale - 8.0  # so that m + log2(l) is the split's log-sum-exp
    # Context length 0 (padding rows) or an empty split: l = 0, acc = 0 -> zeros, never NaN.
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if KV_FP8:
        o = o * v_scale
    out_mask = row_valid[:, None] & d_valid[None, :]
    if NUM_SPLITS == 1:
        o_off = (q_start + token).to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
        tl.store(out_ptr + o_off, o.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        lse = tl.where(l_i > 0, m_i + tl.log2(l_i), float("-inf"))
        part = (seq.to(tl.int64) * num_heads + head) * NUM_SPLITS + split
        tl.store(partial_lse_ptr + part, lse, mask=row_valid)
        tl.store(partial_out_ptr + part[:, None] * HEAD_DIM + d[None, :], o, mask=out_mask)


@triton.jit
def split_kv_reduce_kernel(
    partial_out_ptr,
    partial_lse_ptr,
    out_ptr,
    cu_seqlens_q_ptr,
    stride_ot,
    stride_oh,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ROWS: tl.constexpr,
):
    # grid: (num_seqs, num_heads). Combines the splits of one decode query row by their log-sum-exp.
    seq = tl.program_id(0)
    head = tl.program_id(1)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    if ROWS == 1:
        q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
        if q_len != 1:
            return
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    part = (seq.to(tl.int64) * tl.num_programs(1) + head) * NUM_SPLITS + s
    lse = tl.load(partial_lse_ptr + part, mask=s < NUM_SPLITS, other=float("-inf"))
    lse_max = tl.max(lse, 0)
    w = tl.exp2(lse - tl.where(lse_max == float("-inf"), 0.0, lse_max))  # empty splits weigh 0
    o = tl.load(
        partial_out_ptr + part[:, None] * HEAD_DIM + d[None, :],
        mask=(s < NUM_SPLITS)[:, None] & (d < HEAD_DIM)[None, :],
        other=0.0,
    )
    total = tl.sum(w, 0)
    o = tl.sum(o * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    o_off = q_start.to(tl.int64) * stride_ot + head * stride_oh + d
    tl.store(out_ptr + o_off, o.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


# Launch configurations, chosen with bench/attention.py --sweep on an H200 (Qwen3-0.6B shapes).
# BLOCK_M is the prefill tile's rows: query tokens x query heads of one KV head.
DECODE_CONFIG = {"BLOCK_N": 64, "num_warps": 4, "num_stages": 3}
# An e4m3 cache: twice the keys per iteration for the same bytes, widened to fp16 (e4m3 -> fp16 is one
# conversion on sm90; bf16 goes through fp32): 2.51 TB/s of fp8 bytes against 1.79 with the bf16
# config at b256x1024 (H200, bench/attention.py --sweep-fp8), so 1.7x the bf16 kernel's speed. q is
# widened to fp16 too: exact for bf16 values within fp16's range (|q| < 65504, normal above 6e-5).
# The V cache kept transposed per block, read by whole blocks: the first kernel, uncapped (123
# registers a thread, 4 programs an SM; its loop compiled for sm90 issues 752 instructions per 128
# keys against 1,083 for a transposed kernel, s^T = K q^T, on the slot-major V cache; that kernel,
# 2.70 TB/s against 3.54 at block size 32 on the H200, is gone: bench/RESULTS.md, 2026-12-02).
# On the H200: 2.87 TB/s of fp8 bytes at b256x1024 and block size 16, 3.47 at 32 (an fp8 cache's
# default block size), 3.65 at 256 (bench/attention.py; the transposed kernel 2.30 at 16).
# FP8_MMA: the loop in e4m3 MMAs instead (fp8_mma_tile: no widening; q and p each as two e4m3 parts,
# about bf16's precision): compiled for sm90, 415 loop instructions per 128 keys at block size 32
# against 746 (bench/kernel_sass.py --fp8-mma), yet on an H100 (2026-12-05, bench/RESULTS.md) only
# 0-3% more TB/s, best in 64-key tiles at 2 stages (FP8_MMA_TILE): W1 fp8 +2.4% (29,389 against
# 28,693 output tok/s), +0.08 points of perplexity on a decode-only run. The engine's greedy tokens
# on a random bf16 model kept 142 of 192 positions against the widening kernel's, where two exact
# CPU runs of that model parted only by prefill chunking keep 174 (bench/fp8_mma_divergence.py
# --cpu-baseline: its path is near its ties); on an H100 the first partings' margins were 0, 0.031
# and 0.062 (bench/gpu_run.sh fp8-mma-divergence: near-ties, a few bf16 steps of a logprob). On by
# default since 2026-12-06: with 64-slot blocks and the tiled V store, W1 fp8 +3.9% on an H100
# (28,815-28,925 against 27,702-27,856 output tok/s). FULL_TILES:
# the tiles within the context in a loop without masks, then the last in one of its own (no faster
# on the H100).
# TMA_KV: each key tile's K and V^T copied by TMA into shared memory (fp8_kv_tile_tma), where a tile
# lies within one block (tma_kv_applies: blocks of 64 slots or more for 64-key tiles); FP8_MMA's
# wgmma reads them there. Compiled for sm90 (bench/kernel_sass.py --tma-kv, block size 128, store
# and rotary in): with FP8_MMA 221 loop instructions a 64-key tile against 271, and at 128-key tiles
# 294 against 422 at 72 registers against 136; the widening loop 437 against 525 at 64-key tiles
# (107 registers against 126), 721 against 745 at 128. Yet no faster on an H100 (2026-12-06: 2.69
# TB/s at b256x1024 and block size 64 against 2.70 by pointer loads; W1 fp8 27,915 against 27,931),
# so off (bench/gpu_run.sh fp8-tma-tests fp8-tma-quick). It reads whole boxes: the last tile's keys past the
# context too (their V^T slots hold the stores' zeros), where pointer loads stop at the context's
# last run of 16; with FP8_MMA's FULL_TILES that last tile takes the pointer loads. Fewer registers
# also let a cap fit more programs an SM without spilling (the widening loop at 80 registers and 2
# stages: six against today's four; bench/RESULTS.md, 2026-12-06).
DECODE_CONFIG_FP8 = {
    "BLOCK_N": 128, "num_warps": 4, "num_stages": 3, "FP8_DOT_F16": True, "FP8_MMA": True, "TMA_KV": False,
}  # fmt: skip
# FP8_MMA's own tile where it applies (fp8_mma_applies): elsewhere (another GPU than sm90, a head_dim
# past 128, ...) the widening loop keeps DECODE_CONFIG_FP8's. A config passed to paged_decode names
# its tile itself.
FP8_MMA_TILE = {"BLOCK_N": 64, "num_warps": 4, "num_stages": 2}
PREFILL_CONFIG = {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2}
MAX_SPLITS = 32
# Whether a decode step's K and V go into an e4m3 cache from the decode kernel (each program its
# head's bytes, before its loop reads them) rather than from a store before attention (the fused
# rotary kernel's: a barrier, K read back, and V^T written one byte into each of head_dim rows of its
# block, ~9 us a layer at W1's batch 256 against ~5 us with a slot-major V; bench/rope_store.py). W1
# with an fp8 cache on an H100 (2026-12-05, bench/RESULTS.md): 4.72 s in steps against 4.75, and 4.70
# against 4.73-4.74 at a 16,384-token budget.
DECODE_STORES_KV = True
# With DECODE_STORES_KV: the decode kernel also takes q and the new K straight from the qkv
# projection and normalises and rotates them itself (norm_rope), so a decode step's layer runs no
# rotary kernel at all (its ~9 us at W1's batch 256 and a kernel boundary). W1 with an fp8 cache on
# an H100 (2026-12-05, three rounds, bench/RESULTS.md): 4.737 s in steps on average against 4.763.
# Both kernels compiled without FMA fusion, its K codes and output are the fused rotary kernel's
# and the decode kernel's bit for bit without q/k norms (test_decode_fuses_rope_fp8), and within
# one rounding step of the norm's sum with them.
DECODE_FUSES_ROPE = True
# With DECODE_STORES_KV: the decode kernel attends to the step's own key from registers (the codes
# it stores, widened: decode_new_k, new_v_codes) as the state its loop starts from, a loop that
# leaves that key out, so no load waits on the store and no barrier stands between the store and the loop
# (NEW_KEY_REGS; a decode config's "NEW_KEY_REGS" overrides this). At Qwen3-8B's 32 / 8 heads on an
# H100 the store, rotary and barrier in front of the loop cost ~24 us a layer against the loop
# alone (bench/RESULTS.md, 2026-12-06). The loop may still read the token's V slot (and the zeros
# after it) within its last run of 16: a block holds zeros past its last token from that block's
# first store on, so those bytes are zero or the new code, finite either way, and weigh 0; a token
# at its block's first slot leaves the loop's keys a whole number of runs, so the block the store
# zeroes is not read at all. Not with TMA_KV (whole boxes). Off until timed on the GPU: the output
# differs from the read-back's by rounding (the key's score from q as it is, not as the MMA's parts).
DECODE_NEW_KEY_REGS = False


@dataclass(frozen=True)
class DecodeRope:
    """What the decode kernel needs to normalise and rotate q and the new K itself (DECODE_FUSES_ROPE):
    the rotary table of layers/triton_ops.qk_norm_rope ([positions, 2 * head_dim]: each frequency's
    cos twice, then its sin twice), the q/k RMSNorm weights (None: no q/k norm) and their epsilon."""

    cos_sin_cache: torch.Tensor
    q_weight: torch.Tensor | None
    k_weight: torch.Tensor | None
    eps: float


# When decode splits each sequence's keys (flash-decoding): under SPLIT_BELOW programs an SM, into
# enough splits for about SPLIT_TO programs an SM. A decode config may carry its own ("split_below",
# "split_to"): a kernel of fewer warps holds more programs an SM at once.
SPLIT_BELOW, SPLIT_TO = 2, 4


def decode_config(kv_dtype: torch.dtype) -> dict:
    """The decode kernel's launch configuration for a cache of kv_dtype."""
    return DECODE_CONFIG_FP8 if kv_dtype == torch.float8_e4m3fn else DECODE_CONFIG


def choose_num_splits(num_seqs: int, num_kv_heads: int, num_sms: int, config: dict | None = None) -> int:
    """Split the keys of each (sequence, KV head) when there are too few of them to fill the GPU
    (under `split_below` programs an SM): about `split_to` programs an SM, rounded down to a power
    of two (key tiles then divide evenly). `config`: the decode config, whose split policy applies
    (SPLIT_BELOW and SPLIT_TO if it names none). Depends only on shapes, so a captured CUDA graph
    keeps it."""
    config = config or {}
    programs = max(num_seqs * num_kv_heads, 1)
    if programs >= int(config.get("split_below", SPLIT_BELOW)) * num_sms:
        return 1
    want = min(MAX_SPLITS, triton.cdiv(int(config.get("split_to", SPLIT_TO)) * num_sms, programs))
    return 1 << (want.bit_length() - 1)


def store_kv(k, v, k_cache, v_cache, slot_mapping, k_scale=1.0, v_scale=1.0) -> None:
    """k, v: [num_tokens, num_kv_heads, head_dim] (last dim contiguous) -> cache slots; -1 skipped.
    An e4m3 cache gets e4m3(k / k_scale), e4m3(v / v_scale), as fp8.quantize_kv."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    cache_args, cache_constants = cache_store_args(k_cache, v_cache, k_scale, v_scale, num_tokens)
    store_kv_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        *cache_args,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        **cache_constants,
    )
    if not cache_constants["STORE_V"]:
        store_v_tiles(v, v_cache, slot_mapping, v_scale, num_tokens)


def cache_store_args(k_cache, v_cache, k_scale, v_scale, num_tokens: int) -> tuple[list, dict]:
    """What a kernel calling store_token_kv passes for the cache after its pointers: the K and V
    caches' strides, the block size, the scales and the launch's token count; and the store's
    compile-time constants (KV_FP8, BLOCK_S, WHOLE_ROWS, and STORE_V: False where the caller then
    stores V with store_v_tiles: an e4m3 cache and V_TILE_MIN_TOKENS tokens or more)."""
    block_size = k_cache.shape[1]
    args = [
        *k_cache.stride()[:3], *v_cache_slots(v_cache).stride(), block_size,
        float(k_scale), float(v_scale), num_tokens,
    ]  # fmt: skip
    constants = {
        "KV_FP8": k_cache.dtype == torch.float8_e4m3fn,
        "BLOCK_S": triton.next_power_of_2(block_size),
        "WHOLE_ROWS": triton.next_power_of_2(block_size) == block_size,
        "STORE_V": not (
            k_cache.dtype == torch.float8_e4m3fn
            and V_TILE_MIN_TOKENS is not None
            and num_tokens >= V_TILE_MIN_TOKENS
        ),
    }
    return args, constants


def _launch(
    q, k_cache, v_cache, out, block_tables, context_lens, cu_seqlens_q, scale, grid_q, kv_scales,
    seq_order=None, new_kv=None, rope=None, **meta,
):  # fmt: skip
    """Launch paged_attention_kernel and the split-KV reduce after it; seq_order: the sequences
    in the order the programs take them, or None for the batch's order; new_kv: (k, v,
    slot_mapping) for its STORE_KV, and rope (DecodeRope) for its ROPE."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    k_scale, v_scale = kv_scales if fp8 else (1.0, 1.0)
    if fp8 and (
        v_cache.shape[1:] != (k_cache.shape[2], q.shape[2], k_cache.shape[1]) or v_cache.stride(3) != 1
    ):
        raise ValueError(
            f"an e4m3 V cache is [num_blocks, num_kv_heads, head_dim, block_size] with contiguous keys "
            f"(fp8.fp8_v_cache), got shape {tuple(v_cache.shape)}, strides {v_cache.stride()}"
        )
    group = num_heads // k_cache.shape[2]
    num_splits = meta["NUM_SPLITS"]
    num_seqs = block_tables.shape[0]
    grid = (k_cache.shape[2] * num_splits, grid_q, num_seqs)
    partial_out = partial_lse = out  # unused without splits
    if num_splits > 1:
        partial_out = torch.empty(
            num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device
        )
        partial_lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=q.device)
    meta["DOT_PRECISION"] = "ieee" if q.dtype == torch.float32 else "tf32"
    meta["STORE_KV"] = new_kv is not None
    if rope is not None:
        meta.update(ROPE=True, HAS_NORM=rope.q_weight is not None)
    k_new, v_new, slot_mapping = new_kv if new_kv is not None else (q, q, context_lens)  # (unused without)
    k_desc, v_desc = tma_kv_descriptors(k_cache, v_cache, meta["BLOCK_N"]) if meta.get("TMA_KV") else (q, q)
    table, q_norm, k_norm = (q, q, q) if rope is None else (rope.cos_sin_cache, rope.q_weight, rope.k_weight)
    paged_attention_kernel[grid](
        q,
        k_cache,
        v_cache,
        k_desc,
        v_desc,
        out,
        partial_out,
        partial_lse,
        block_tables,
        context_lens,
        cu_seqlens_q,
        context_lens if seq_order is None else seq_order,
        k_new,
        v_new,
        slot_mapping,
        float(k_scale),
        table,
        q if q_norm is None else q_norm,
        q if k_norm is None else k_norm,
        table.stride(0),
        float(rope.eps) if rope is not None else 0.0,
        scale * LOG2E * k_scale,
        float(v_scale),
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        k_new.stride(0),
        k_new.stride(1),
        v_new.stride(0),
        v_new.stride(1),
        num_heads,
        BLOCK_SIZE=k_cache.shape[1],
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        KV_FP8=fp8,
        ORDERED=seq_order is not None,
        **meta,
    )
    if num_splits > 1:
        split_kv_reduce_kernel[(num_seqs, num_heads)](
            partial_out,
            partial_lse,
            out,
            cu_seqlens_q,
            out.stride(0),
            out.stride(1),
            NUM_SPLITS=num_splits,
            BLOCK_S=triton.next_power_of_2(num_splits),
            HEAD_DIM=head_dim,
            BLOCK_D=triton.next_power_of_2(head_dim),
            ROWS=meta["ROWS"],
        )


def paged_decode(
    q,
    k_cache,
    v_cache,
    out,
    block_tables,
    context_lens,
    cu_seqlens_q,
    scale,
    num_splits=1,
    rows=0,
    config=None,
    kv_scales=(1.0, 1.0),
    seq_order=None,
    new_kv=None,
    rope=None,
) -> None:
    """Attention of every sequence's single query token over its paged KV (grid fixed by shapes).

    q, out: [num_tokens, num_heads, head_dim]; row cu_seqlens_q[i] is sequence i's query.
    rows=1 touches only sequences of query length 1 (the decode rows of a mixed batch).
    kv_scales: (k_scale, v_scale) of an e4m3 cache, ignored otherwise.
    seq_order: int32 [num_seqs], a permutation of the sequences (Context.seq_order: longest
    context first), the order the GPU starts their programs in; None: the batch's order.
    new_kv: (k, v [num_tokens, num_kv_heads, head_dim], slot_mapping): store this step's K and V
    (store_kv's bytes) from the kernel itself, each program its head's, where decode_stores_kv says
    it can; the caller then runs no store.
    rope: a DecodeRope, with new_kv: q and new_kv's k are the qkv projection's, not yet normalised
    and rotated; the kernel does it (DECODE_FUSES_ROPE), as layers/triton_ops.qk_norm_rope would."""
    cfg = {**decode_config(k_cache.dtype), **(config or {})}
    if new_kv is not None and not decode_stores_kv(k_cache):
        raise ValueError("new_kv: the decode kernel stores K/V only into an e4m3 cache of power-of-2 blocks")
    if rope is not None and (new_kv is None or q.shape[2] & (q.shape[2] - 1)):
        raise ValueError("rope: the decode kernel rotates only with new_kv, at a power-of-2 head_dim")
    group = q.shape[1] // k_cache.shape[2]
    f16_query = q.dtype != torch.float32
    # maxnreg: a cap on registers per thread (more programs per SM, perhaps spilling)
    meta = {"maxnreg": cfg["maxnreg"]} if cfg.get("maxnreg") and f16_query else {}
    meta.update(BLOCK_Q=1, FP8_DOT_F16=cfg.get("FP8_DOT_F16", False) and f16_query)
    group_pad = max(16, triton.next_power_of_2(group))
    if cfg.get("FP8_MMA"):
        mma_cfg = {**cfg, **FP8_MMA_TILE, **(config or {})}
        if fp8_mma_applies(q, k_cache, mma_cfg["BLOCK_N"]):
            cfg = mma_cfg
            meta.update(FP8_MMA=True, INTERPRETER=_interpreting())
            meta["FULL_TILES"] = bool(cfg.get("FULL_TILES", False))
            group_pad //= 2  # a row's two parts are the MMA's 16 or more columns (fp8_mma_tile)
    # Over an e4m3 cache, compiled without FMA fusion: with ROPE, norm_rope rounds each product and
    # sum as the fused rotary kernel does, and the kernel's own math (two FFMAs a 128-key tile)
    # rounds the same with ROPE or without, so DECODE_FUSES_ROPE changes no output bit.
    meta["enable_fp_fusion"] = k_cache.dtype != torch.float8_e4m3fn
    if cfg.get("TMA_KV") and tma_kv_applies(k_cache, v_cache, q.shape[2], cfg["BLOCK_N"]):
        meta.update(TMA_KV=True, INTERPRETER=_interpreting())
    if new_kv is not None and cfg.get("NEW_KEY_REGS", DECODE_NEW_KEY_REGS) and not meta.get("TMA_KV"):
        meta["NEW_KEY_REGS"] = True  # (TMA's boxes read the token's block whole: they keep the barrier)
    _launch(
        q, k_cache, v_cache, out, block_tables, context_lens, cu_seqlens_q, scale, 1, kv_scales,
        GROUP_PAD=group_pad, NUM_SPLITS=num_splits, ROWS=rows,
        BLOCK_N=cfg["BLOCK_N"], num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        seq_order=seq_order, new_kv=new_kv, rope=rope, **meta,
    )  # fmt: skip


def fp8_mma_applies(q: torch.Tensor, k_cache: torch.Tensor, block_n: int) -> bool:
    """Whether decode over k_cache can take the e4m3 MMAs (FP8_MMA): an e4m3 cache, 16-bit queries,
    head_dim 64-128 and a multiple of 32 (an e4m3 MMA's K step; P @ V's M side is head_dim, 64 or
    more rows for wgmma; 256 would leave one program an SM), GQA groups of up to 16 query heads
    (each head's two parts are the MMA's N columns) and, on a GPU, sm90 (wgmma: elsewhere Triton
    widens e4m3 operands for the older MMA) with key tiles of 64 or 128 (its M side, a warpgroup's
    64 rows)."""
    if k_cache.dtype != torch.float8_e4m3fn or q.dtype not in (torch.float16, torch.bfloat16):
        return False
    head_dim, group = q.shape[2], q.shape[1] // k_cache.shape[2]
    if head_dim % 32 or not 64 <= head_dim <= 128 or group > 16:
        return False
    if q.device.type != "cuda":
        return True  # the interpreter's
    return torch.cuda.get_device_capability(q.device)[0] == 9 and block_n in (64, 128)


def _interpreting() -> bool:
    """Whether Triton's interpreter runs the kernels, which run no inline PTX (FP8_MMA's casts and
    exp2, TMA_KV's fence: the INTERPRETER constexpr)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on")


def tma_kv_applies(k_cache: torch.Tensor, v_cache: torch.Tensor, head_dim: int, block_n: int) -> bool:
    """Whether the decode kernel's tiles can come through TMA (the decode config's TMA_KV): an e4m3
    cache, each key tile within one cache block (block_n dividing the block size), one box of
    head_dim columns (64 or 128, a power of 2) and rows of 16 bytes or more (TMA's smallest), caches
    laid out whole (the 2-D views of fp8_kv_tile_tma) at 16-byte aligned addresses and strides; on a
    GPU, sm90 or later."""
    block_size = k_cache.shape[1]
    if k_cache.dtype != torch.float8_e4m3fn:
        return False
    if block_size % block_n or block_n < 16 or head_dim not in (64, 128) or k_cache.shape[3] != head_dim:
        return False
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        return False
    if k_cache.data_ptr() % 16 or v_cache.data_ptr() % 16 or block_size % 16:
        return False
    return k_cache.device.type != "cuda" or torch.cuda.get_device_capability(k_cache.device)[0] >= 9


def tma_kv_descriptors(k_cache: torch.Tensor, v_cache: torch.Tensor, block_n: int) -> tuple:
    """The TMA descriptors fp8_kv_tile_tma reads through: K as [num_blocks * block_size, num_kv_heads
    * head_dim] in [block_n, head_dim] boxes, V^T as [num_blocks * num_kv_heads * head_dim,
    block_size] in [head_dim, block_n] boxes (tma_kv_applies' caches)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    k_rows = k_cache.view(num_blocks * block_size, num_kv_heads * head_dim)
    v_rows = v_cache.view(num_blocks * num_kv_heads * head_dim, block_size)
    return (
        TensorDescriptor.from_tensor(k_rows, [block_n, head_dim]),
        TensorDescriptor.from_tensor(v_rows, [head_dim, block_n]),
    )


def decode_fuses_rope(k_cache: torch.Tensor, head_dim: int) -> bool:
    """Whether paged_decode normalises and rotates q and the new K itself (rope): DECODE_FUSES_ROPE
    where it stores K/V (decode_stores_kv), at a power-of-2 head_dim."""
    return DECODE_FUSES_ROPE and decode_stores_kv(k_cache) and head_dim & (head_dim - 1) == 0


def decode_stores_kv(k_cache: torch.Tensor) -> bool:
    """Whether paged_decode stores a decode step's K and V itself (new_kv): DECODE_STORES_KV and an
    e4m3 cache of power-of-2 blocks."""
    block_size = k_cache.shape[1]
    return DECODE_STORES_KV and k_cache.dtype == torch.float8_e4m3fn and block_size & (block_size - 1) == 0


def paged_prefill(
    q,
    k_cache,
    v_cache,
    out,
    block_tables,
    context_lens,
    cu_seqlens_q,
    max_seqlen_q,
    scale,
    rows=0,
    config=None,
    kv_scales=(1.0, 1.0),
) -> None:
    """Causal attention of each sequence's query tokens (the last q_len of its context_len positions)
    over its paged KV: the cached prefix and this chunk. rows=2 skips sequences of query length 1."""
    cfg = {**PREFILL_CONFIG, **(config or {})}
    group_pad = triton.next_power_of_2(q.shape[1] // k_cache.shape[2])
    block_q = max(cfg["BLOCK_M"] // group_pad, 1)
    group_pad = max(group_pad, 16 // block_q)  # at least 16 rows for tl.dot
    _launch(
        q, k_cache, v_cache, out, block_tables, context_lens, cu_seqlens_q, scale, triton.cdiv(max_seqlen_q, block_q),
        kv_scales, GROUP_PAD=group_pad, BLOCK_Q=block_q, NUM_SPLITS=1, ROWS=rows,
        BLOCK_N=cfg["BLOCK_N"], num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
