"""Scratch: plain-Triton (tl) reformulations of the fp8 decode loop, counted in SASS on the CPU.

A trimmed copy of executor_service/attention/triton_kernels.py's paged_attention_kernel for the
fp8 decode launch only (BLOCK_Q 1, one split, e4m3 K and transposed V, fp16 dots), with a VARIANT
switch, compiled for sm90 like bench/kernel_sass.py (whose compile and loop counting it reuses).
Nothing here is used by the engine.

    python bench/fp8_decode_tl_variants.py            # every variant's loop, instructions per 128 keys
    python bench/fp8_decode_tl_variants.py --check    # the variants under TRITON_INTERPRET=1 vs torch

SASS instructions of the loop per 128-key tile (group 2 padded to 16 rows, HEAD_DIM 128, block size
32, BLOCK_N 128, 4 warps; runtime strides unless said; production paged_attention_kernel: 764):

    variant                                              3 stages        2 stages     q in the loop
    0  production formulation (trimmed copy)             755 (128 regs)  772 (161)    reloaded from smem
    1  K widened by inline PTX                           985             1021         reloaded
    2  K and V widened by inline PTX                     1214            1274         reloaded
    3  q carried through the loop                        775             781          reloaded
    4  QK^T in two head-dim halves                       967             996          reloaded
    5  K read as int16 pairs, widened by PTX             765             775          reloaded
    6  as 5, V too                                       863             787          reloaded
    7  keys split in 4 groups of 32 (3-D batched dots)   571 (226 regs)  559 (242)    registers
    8  as 7, Gluon's permuted K rows + relabelled V      671             614          registers
    10 as 7, full tiles unmasked, last tile peeled       503 (234 regs)  494 (240)    registers
    10 with the cache strides as constants               509 (223 regs)  465 (217)    registers
    11 as 10, rescaled only when a max grew by > 2**8    549 (254 regs)  537 (252)    registers
       (of which run when the rescale is skipped)                        459
    11 with the cache strides as constants               552             506 (228)    registers
       (of which run when the rescale is skipped)                        428

Variants 1-6 keep Triton's kWidth 4 operands (its layout passes trace the 8-bit origin through
inline asm and joins) and its per-tile q reload. Variant 7's batched formulation is what changes it:
each group of 32 keys (Triton puts one on each warp, warpsPerCTA [4, 1, 1]) keeps its own softmax
state, so p goes from the score accumulator to the P @ V operand within a warp, there are no
cross-warp reductions per tile, and q is a loop-invariant register operand (no local_load of q in
the loop's TTGIR). Its price: every warp holds a 16 x 128 fp32 accumulator (64 registers a thread,
64 FMUL a tile to rescale it) and the four are combined after the loop.

Checked under the interpreter (`--check`; no inline asm there, so variants 0, 4, 7-11) against a
float64 torch reference, 4 sequences of 1, 200, 256 and 300 keys, block size 32, one block of
larger keys late in the last (its max jumps: variant 11's rescale branch taken mid-sequence): max
abs error 8e-4..9.5e-4 against outputs of up to 0.24 (bf16 output; variant 0, the production
formulation, 9.4e-4), and variant 9, deliberately wrong, 0.26 (the check sees a key mismatch).
Not run on a GPU: bench/fp8_decode_proto_gpu.py times variants 10 and 11 there.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import kernel_sass
import triton
import triton.language as tl

# VARIANT:
#   0 the production formulation (q's dot operand reloaded from shared memory every tile)
#   1 K widened to fp16 by inline PTX before it meets the dot (not hoisted past the shared memory:
#     K's operand fp16 with kWidth 2, so q's too)
#   2 as 1, and V too
#   3 q carried through the loop (multiplied by a runtime 1.0 each tile), so its dot operand is a
#     loop value instead of a loop-invariant reload
#   4 q and K^T split by head-dim halves: two dots of K 64
#   5 K read as int16 (two e4m3 bytes each) and widened by PTX into two fp16 outputs, joined back
#     to [BLOCK_N, HEAD_DIM]: no 8-bit type upstream of the dot, so Triton's kWidth is 2
#   6 as 5, and V too
VARIANTS = {
    0: "production (tl.dot, conversion hoisted into the operand load)",
    1: "K widened by inline PTX before the dot (fp16 K operand, kWidth 2)",
    2: "K and V widened by inline PTX before the dots",
    3: "q carried through the loop (q * runtime 1.0 every tile)",
    4: "QK^T split in two head-dim halves",
    5: "K loaded as int16 byte pairs, widened by PTX into two fp16 halves joined (16-bit origin: kWidth 2)",
    6: "as 5, and V too",
    7: "keys split in 4 groups of 32 (a batch axis of 3-D dots), each its own softmax state",
    8: "as 7, with the Gluon prototype's permuted K rows and relabelled V",
    9: "as 8 without V's relabelling (wrong on purpose: the check's negative control)",
    10: "as 7, the loop's tiles all full (unmasked), the partial last one after it",
    11: "as 10, the accumulator rescaled only when a row's max grew by more than 2**8 (Gluon's LAZY)",
}


# The prototypes' argument types and 16-byte aligned strides, for kernel_sass.compile_sm90 (the
# Gluon prototype's too).
PROTO_TYPES = {
    "q_ptr": "*bf16",
    "k_cache_ptr": "*fp8e4nv",
    "v_cache_ptr": "*fp8e4nv",
    "out_ptr": "*bf16",
    "block_tables_ptr": "*i32",
    "context_lens_ptr": "*i32",
    "qk_scale": "fp32",
    "v_scale": "fp32",
    "one": "fp32",
}
PROTO_ALIGNED = (
    "stride_qt", "stride_qh", "stride_ot", "stride_oh", "stride_cb", "stride_cs", "stride_ch",
    "stride_vb", "stride_vh", "stride_vd",
)  # fmt: skip


@triton.jit
def _widen_asm(x):
    """e4m3 -> fp16 by PTX, two values an instruction: opaque to Triton's layout passes."""
    return tl.inline_asm_elementwise(
        "cvt.rn.f16x2.e4m3x2 $0, $1;",
        "=r,h",
        [x],
        dtype=tl.float16,
        is_pure=True,
        pack=2,
    )


@triton.jit
def _widen_pairs(x):
    """int16 holding two e4m3 bytes -> [..., 2] fp16 (low byte first)."""
    lo, hi = tl.inline_asm_elementwise(
        "{\n\t.reg .b32 t;\n\tcvt.rn.f16x2.e4m3x2 t, $2;\n\tmov.b32 {$0, $1}, t;\n\t}",
        "=h,=h,h",
        [x],
        dtype=(tl.float16, tl.float16),
        is_pure=True,
        pack=1,
    )
    return tl.join(lo, hi)


@triton.jit
def fp8_decode_variant_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    block_tables_ptr,
    context_lens_ptr,
    qk_scale,
    v_scale,
    one,  # 1.0 (VARIANT 3)
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_vb,
    stride_vh,
    stride_vd,
    stride_bt,
    BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    VARIANT: tl.constexpr,
):
    # grid: (num_kv_heads, num_seqs); one query token a sequence.
    kv_head = tl.program_id(0)
    seq = tl.program_id(1)
    context_len = tl.load(context_lens_ptr + seq)
    rows = tl.arange(0, GROUP_PAD)
    head = kv_head * GROUP + rows
    row_valid = rows < GROUP
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(
        q_ptr + seq * stride_qt + head[:, None] * stride_qh + d[None, :], mask=row_valid[:, None], other=0.0
    )
    q = q.to(tl.float16)
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    head_off = kv_head * stride_ch + d[None, :]
    n = tl.arange(0, BLOCK_N)
    for tile in range(0, tl.cdiv(context_len, BLOCK_N)):
        key = tile * BLOCK_N + n
        key_valid = key < context_len
        whole_block = (key // BLOCK_SIZE) * BLOCK_SIZE < context_len
        block = tl.load(bt_row + key // BLOCK_SIZE, mask=whole_block, other=0).to(tl.int64)
        kv_off = block[:, None] * stride_cb + (key % BLOCK_SIZE)[:, None] * stride_cs + head_off
        if VARIANT == 5 or VARIANT == 6:
            pair_off = block[:, None] * (stride_cb // 2) + (key % BLOCK_SIZE)[:, None] * (stride_cs // 2)
            pair_off += kv_head * (stride_ch // 2) + tl.arange(0, HEAD_DIM // 2)[None, :]
            k_pairs = tl.load(
                k_cache_ptr.to(tl.pointer_type(tl.int16)) + pair_off, mask=key_valid[:, None], other=0
            )
            k = tl.reshape(_widen_pairs(k_pairs), [BLOCK_N, HEAD_DIM])
        else:
            k = tl.load(k_cache_ptr + kv_off, mask=key_valid[:, None], other=0.0)
        vt_off = (
            block[None, :] * stride_vb
            + kv_head * stride_vh
            + d[:, None] * stride_vd
            + (key % BLOCK_SIZE)[None, :]
        )
        vt_off = tl.max_contiguous(tl.multiple_of(vt_off, (1, 16)), (1, 16))
        if VARIANT == 6:
            key_pair = tile * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
            pblock = tl.load(bt_row + key_pair // (BLOCK_SIZE // 2), mask=key_pair * 2 < context_len, other=0)
            vp_off = (
                pblock.to(tl.int64)[None, :] * (stride_vb // 2) + kv_head * (stride_vh // 2)
                + d[:, None] * (stride_vd // 2) + (key_pair % (BLOCK_SIZE // 2))[None, :]
            )  # fmt: skip
            vp_off = tl.max_contiguous(tl.multiple_of(vp_off, (1, 8)), (1, 8))
            vt_pairs = tl.load(v_cache_ptr.to(tl.pointer_type(tl.int16)) + vp_off)
            v = tl.trans(tl.reshape(_widen_pairs(vt_pairs), [HEAD_DIM, BLOCK_N]))
        else:
            vt = tl.load(v_cache_ptr + vt_off, mask=whole_block[None, :], other=0.0)
            v = tl.trans(vt)
        if VARIANT == 1 or VARIANT == 2:
            k = _widen_asm(k)
        elif VARIANT != 5 and VARIANT != 6:
            k = k.to(tl.float16)
        if VARIANT == 2:
            v = _widen_asm(v)
        elif VARIANT != 6:
            v = v.to(tl.float16)
        if VARIANT == 4:
            q_lo, q_hi = tl.split(tl.permute(tl.reshape(q, [GROUP_PAD, 2, HEAD_DIM // 2]), [0, 2, 1]))
            k_lo, k_hi = tl.split(tl.permute(tl.reshape(k, [BLOCK_N, 2, HEAD_DIM // 2]), [0, 2, 1]))
            s = tl.dot(q_lo, tl.trans(k_lo))
            s = tl.dot(q_hi, tl.trans(k_hi), s)
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * qk_scale
        s = tl.where(key_valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(tl.float16), v)
        m_i = m_new
        if VARIANT == 3:
            q = q * one.to(tl.float16)
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None] * v_scale
    o_off = seq * stride_ot + head[:, None] * stride_oh + d[None, :]
    tl.store(out_ptr + o_off, o.to(out_ptr.dtype.element_ty), mask=row_valid[:, None])


@triton.jit
def _split_tile(
    q3, k_cache_ptr, v_cache_ptr, bt_row, m_i, l_i, acc, tile, context_len, kv_head, qk_scale, perm,
    stride_cb, stride_cs, stride_ch, stride_vb, stride_vh, stride_vd,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, RELABEL: tl.constexpr,
    MASKED: tl.constexpr, LAZY: tl.constexpr = False,
):  # fmt: skip
    """One tile of fp8_decode_split_warps_kernel; MASKED: keys past the context may be in it; LAZY:
    bench/fp8_decode_gluon.py's LAZY (the max moves only when a row's grew by more than 2**8)."""
    W: tl.constexpr = 4
    KEYS: tl.constexpr = BLOCK_N // W
    w = tl.arange(0, W)
    c = tl.arange(0, KEYS)
    d = tl.arange(0, HEAD_DIM)
    key = tile * BLOCK_N + w[:, None] * KEYS + perm[None, :]  # [W, KEYS]: K's rows
    if MASKED:
        block = tl.load(bt_row + key // BLOCK_SIZE, mask=key < context_len, other=0).to(tl.int64)
    else:
        block = tl.load(bt_row + key // BLOCK_SIZE).to(tl.int64)
    k_off = (block * stride_cb + (key % BLOCK_SIZE) * stride_cs + kv_head * stride_ch)[:, :, None]
    k = tl.load(k_cache_ptr + k_off + d[None, None, :])  # unmasked: past the context, scores are masked
    s = tl.dot(q3, tl.permute(k.to(tl.float16), (0, 2, 1)))  # [W, G, KEYS], raw
    if MASKED:
        s = tl.where((key < context_len)[:, None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 2))
    if LAZY:
        grow = ((m_new - m_i) * qk_scale > 8.0).to(tl.int32)  # NaN (no key yet): no move
        if tl.max(tl.max(grow, 1), 0) > 0:
            alpha = tl.exp2(m_i * qk_scale - tl.where(m_new == float("-inf"), 0.0, m_new) * qk_scale)
            acc = acc * alpha[:, :, None]
            l_i = l_i * alpha
            m_i = m_new
        m_new = m_i
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new) * qk_scale
    else:
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new) * qk_scale
        alpha = tl.exp2(m_i * qk_scale - m_safe)
        acc = acc * alpha[:, :, None]
        l_i = l_i * alpha
    p = tl.exp2(s * qk_scale - m_safe[:, :, None])
    l_i = l_i + tl.sum(p, 2)
    vkey = tile * BLOCK_N + w[:, None] * KEYS + c[None, :]  # V^T's keys, in cache order
    vfirst = tile * BLOCK_N + w * KEYS
    if MASKED:
        vblock = tl.load(bt_row + vkey // BLOCK_SIZE, mask=(vfirst < context_len)[:, None], other=0)
    else:
        vblock = tl.load(bt_row + vkey // BLOCK_SIZE)
    v_off = (vblock.to(tl.int64) * stride_vb + kv_head * stride_vh + vkey % BLOCK_SIZE)[:, None, :]
    v_off = v_off + d[None, :, None] * stride_vd
    v_off = tl.max_contiguous(tl.multiple_of(v_off, (1, 1, 16)), (1, 1, 16))
    if MASKED:
        vt = tl.load(
            v_cache_ptr + v_off, mask=(vfirst < context_len)[:, None, None], other=0.0
        )  # [W, D, KEYS]
    else:
        vt = tl.load(v_cache_ptr + v_off)
    v = tl.permute(vt, (0, 2, 1))
    if RELABEL:
        v = tl.reshape(
            tl.permute(tl.reshape(v, [W, 2, 4, 2, 2, HEAD_DIM]), (0, 1, 3, 2, 4, 5)), [W, KEYS, HEAD_DIM]
        )
    acc = acc + tl.dot(p.to(tl.float16), v.to(tl.float16))
    return m_new, l_i, acc


@triton.jit
def fp8_decode_split_warps_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    block_tables_ptr,
    context_lens_ptr,
    qk_scale,
    v_scale,
    one,  # unused (the variant kernel's signature)
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_vb,
    stride_vh,
    stride_vd,
    stride_bt,
    BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    VARIANT: tl.constexpr,  # 7: keys in order; 8: the Gluon kernel's permuted K rows; 9: 8 broken; 10: 7 peeled
):
    """VARIANTS 7 and 8: bench/fp8_decode_gluon.py's algorithm in tl. The tile's keys split in W = 4
    groups of 32 (a batch axis of the dots: in the Gluon kernel, one a warp), each with its own
    online-softmax state and accumulator, combined after the loop. With VARIANT 8 K's rows are
    loaded permuted (row c = 16i + 8h + 2t + b holds key 16i + 4t + 2h + b) and V relabelled to
    match, exactly as the Gluon kernel does: run under the interpreter, a check of that index math."""
    W: tl.constexpr = 4
    KEYS: tl.constexpr = BLOCK_N // W
    kv_head = tl.program_id(0)
    seq = tl.program_id(1)
    context_len = tl.load(context_lens_ptr + seq)
    rows = tl.arange(0, GROUP_PAD)
    head = kv_head * GROUP + rows
    row_valid = rows < GROUP
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(
        q_ptr + seq * stride_qt + head[:, None] * stride_qh + d[None, :], mask=row_valid[:, None], other=0.0
    )
    q3 = tl.broadcast_to(q.to(tl.float16)[None, :, :], [W, GROUP_PAD, HEAD_DIM])
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    c = tl.arange(0, KEYS)
    if VARIANT == 8 or VARIANT == 9:
        perm = (c & 1) | (((c >> 3) & 1) << 1) | (((c >> 1) & 3) << 2) | (c & ~15)
    else:
        perm = c
    m_i = tl.full([W, GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([W, GROUP_PAD], tl.float32)
    acc = tl.zeros([W, GROUP_PAD, HEAD_DIM], tl.float32)
    num_tiles = tl.cdiv(context_len, BLOCK_N)
    loop_tiles = context_len // BLOCK_N if VARIANT >= 10 else num_tiles
    for tile in range(0, loop_tiles):
        m_i, l_i, acc = _split_tile(
            q3, k_cache_ptr, v_cache_ptr, bt_row, m_i, l_i, acc, tile, context_len, kv_head, qk_scale, perm,
            stride_cb, stride_cs, stride_ch, stride_vb, stride_vh, stride_vd,
            BLOCK_SIZE, BLOCK_N, HEAD_DIM, VARIANT == 8, VARIANT < 10, VARIANT == 11,
        )  # fmt: skip
    if VARIANT >= 10:  # noqa: SIM102 (constexpr branch)
        if loop_tiles < num_tiles:
            m_i, l_i, acc = _split_tile(
                q3, k_cache_ptr, v_cache_ptr, bt_row, m_i, l_i, acc, loop_tiles, context_len, kv_head, qk_scale,
                perm, stride_cb, stride_cs, stride_ch, stride_vb, stride_vh, stride_vd,
                BLOCK_SIZE, BLOCK_N, HEAD_DIM, False, True, VARIANT == 11,
            )  # fmt: skip
    m_all = tl.max(m_i, 0)
    m_all = tl.where(m_all == float("-inf"), 0.0, m_all)
    wt = tl.exp2((m_i - m_all[None, :]) * qk_scale)
    l_all = tl.sum(l_i * wt, 0)
    o = tl.sum(acc * wt[:, :, None], 0)
    o = o / tl.where(l_all > 0, l_all, 1.0)[:, None] * v_scale
    o_off = seq * stride_ot + head[:, None] * stride_oh + d[None, :]
    tl.store(out_ptr + o_off, o.to(out_ptr.dtype.element_ty), mask=row_valid[:, None])


def _kernel(variant: int):
    return fp8_decode_split_warps_kernel if variant in (7, 8, 9, 10, 11) else fp8_decode_variant_kernel


def compile_variant(
    variant: int,
    stages: int = 3,
    warps: int = 4,
    block_n: int = 128,
    block_size: int = 32,
    const_strides: bool = False,
    maxnreg: int = 0,
):
    """The variant for sm90 (no GPU needed); const_strides: the caches' strides compile-time
    constants (8 KV heads), as bench/fp8_decode_gluon.py has them."""
    fn = _kernel(variant)
    constants = {
        "BLOCK_SIZE": block_size,
        "GROUP": 2,
        "GROUP_PAD": 16,
        "BLOCK_N": block_n,
        "HEAD_DIM": 128,
        "VARIANT": variant,
    }
    if const_strides:
        constants.update(kernel_sass.cache_stride_constants(block_size, 8, 128))
    return kernel_sass.compile_sm90(fn, constants, PROTO_TYPES, PROTO_ALIGNED, warps, stages, maxnreg)


def q_reloaded_in_loop(ttgir: str) -> bool:
    """Whether a tensor stored to shared memory before the loop (q: a local_alloc with a value, of
    fp16 elements) is read back (local_load) inside it."""
    import re

    head, body = ttgir.split("scf.for", 1)
    stored = re.findall(r"(%[\w.]+) = ttg.local_alloc %[\w.]+ : \(tensor<[0-9x]+xf16", head)
    return any(re.search(rf"ttg.local_load {re.escape(name)}\b", body) for name in stored)


def check(variant: int) -> tuple[float, float]:
    """Run the variant under Triton's interpreter against a float64 torch reference: the max abs
    error and the reference's max abs value."""
    import torch
    from triton.runtime import interpreter

    # numpy >= 2.4 refuses int() of a 1-element array (a loop bound loaded from memory): as
    # tests/helpers/interpret.py's prelude does
    patch = interpreter._patch_lang_tensor
    if not getattr(patch, "_index_patched", False):

        def patched(tensor, scope):
            patch(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

        patched._index_patched = True
        interpreter._patch_lang_tensor = patched
    torch.manual_seed(variant)
    num_seqs, num_kv_heads, group, head_dim, block_size = 4, 2, 2, 128, 32
    context_lens = torch.tensor([1, 200, 256, 300], dtype=torch.int32)
    blocks_per_seq = 10
    num_blocks = num_seqs * blocks_per_seq + 1
    perm = torch.randperm(num_blocks - 1)[: num_seqs * blocks_per_seq] + 1
    block_tables = perm.view(num_seqs, blocks_per_seq).to(torch.int32)
    k_scale, v_scale = 0.5, 0.03  # scores of std ~2: a peaked softmax, so that mismatched keys show
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim) * 4
    # a block of larger keys late in the last sequence: its scores' max jumps (past LAZY's 2**8)
    k_cache[block_tables[num_seqs - 1, 7]] *= 6
    k_cache = k_cache.to(torch.float8_e4m3fn)
    v_t = (torch.randn(num_blocks, num_kv_heads, head_dim, block_size) * 2).to(torch.float8_e4m3fn)
    for s in range(num_seqs):  # zeros past the context in the last block, as the store leaves them
        c = int(context_lens[s])
        v_t[block_tables[s, (c - 1) // block_size], :, :, c % block_size or block_size :] = 0
    q = torch.randn(num_seqs, num_kv_heads * group, head_dim).to(torch.bfloat16)
    out = torch.zeros_like(q)
    scale = head_dim**-0.5
    grid = (num_kv_heads, num_seqs)
    _kernel(variant)[grid](
        q, k_cache, v_t, out, block_tables, context_lens, scale * 1.4426950408889634 * k_scale, v_scale, 1.0,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_t.stride(0), v_t.stride(1), v_t.stride(2), block_tables.stride(0),
        BLOCK_SIZE=block_size, GROUP=group, GROUP_PAD=16, BLOCK_N=128, HEAD_DIM=head_dim, VARIANT=variant,
    )  # fmt: skip
    worst = biggest = 0.0
    for s in range(num_seqs):
        c = int(context_lens[s])
        slots = [int(block_tables[s, i // block_size]) * block_size + i % block_size for i in range(c)]
        kk = k_cache.view(-1, num_kv_heads, head_dim)[slots].double() * k_scale
        vv = v_t.permute(0, 3, 1, 2).reshape(-1, num_kv_heads, head_dim)[slots].double() * v_scale
        for h in range(num_kv_heads * group):
            qh = q[s, h].double()
            w = torch.softmax(kk[:, h // group] @ qh * scale, 0)
            ref = w @ vv[:, h // group]
            worst = max(worst, (out[s, h].double() - ref).abs().max().item())
            biggest = max(biggest, ref.abs().max().item())
    return worst, biggest


def launch_variant(
    q, k_cache, v_cache, out, block_tables, context_lens, scale, kv_scales, variant=10, stages=2
):
    """Decode (one query token a sequence) over an e4m3 cache with a variant (runtime strides): q, out
    [num_seqs, num_heads, head_dim]; k_cache [num_blocks, block_size, kv_heads, head_dim]; v_cache
    [num_blocks, kv_heads, head_dim, block_size] (fp8.fp8_v_cache). Group <= 16, BLOCK_N 128."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group = num_heads // num_kv_heads
    k_scale, v_scale = kv_scales
    _kernel(variant)[(num_kv_heads, num_seqs)](
        q, k_cache, v_cache, out, block_tables, context_lens, scale * 1.4426950408889634 * k_scale, v_scale, 1.0,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        BLOCK_SIZE=block_size, GROUP=group, GROUP_PAD=16, BLOCK_N=128, HEAD_DIM=head_dim, VARIANT=variant,
        num_warps=4, num_stages=stages,
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", type=int, nargs="*", default=sorted(VARIANTS))
    parser.add_argument("--stages", type=int, nargs="*", default=[3])
    parser.add_argument("--check", action="store_true", help="run under TRITON_INTERPRET=1 against torch")
    parser.add_argument("--const-strides", action="store_true", help="the caches' strides as constants")
    parser.add_argument("--maxnreg", type=int, default=0)
    parser.add_argument("--top", type=int, default=6)
    args = parser.parse_args()
    if args.check:
        assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
        for v in args.variants:
            err, ref = check(v)
            print(f"variant {v}: max abs error {err:.2e} (reference max {ref:.2e}) ({VARIANTS[v]})")
        return
    for v in args.variants:
        for stages in args.stages:
            kernel = compile_variant(v, stages, const_strides=args.const_strides, maxnreg=args.maxnreg)
            ops, regs = kernel_sass.loop_stats(kernel)
            top = ", ".join(f"{c} {op}" for op, c in collections.Counter(ops).most_common(args.top))
            spills = sum(op.startswith(("LDL", "STL")) for op in ops)
            print(
                f"variant {v} stages {stages}: {len(ops)} loop instructions, {regs} registers ({spills} spill "
                "instructions in the loop), "
                f"q reloaded in loop: {q_reloaded_in_loop(kernel.asm['ttgir'])} ({VARIANTS[v]})\n    {top}"
            )


if __name__ == "__main__":
    main()
