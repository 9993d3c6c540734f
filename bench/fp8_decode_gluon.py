"""Scratch: a Gluon prototype of the fp8 (e4m3) decode loop, compiled for sm90 on the CPU.

Nothing here is used by the engine. The same decode as executor_service/attention/triton_kernels.py's
paged_attention_kernel for an e4m3 cache (BLOCK_N 128, 4 warps, group 2 padded to 16 rows, head_dim
128, V cache transposed per block), written with explicit layouts: see fp8_decode_gluon_kernel.
Compiled for sm90 (GPUTarget("cuda", 90, 32)) and counted like bench/kernel_sass.py:

    python bench/fp8_decode_gluon.py [--stages 2 3 4] [--block-size 32] [--dump /tmp/g]

One program = one sequence x one KV head, 4 warps; warp w owns keys 32w .. 32w + 31 of each
128-key tile (a batched mma_v2 over a [4, ...] axis whose layout puts one batch on each warp), with
its own online softmax (fp32), combined across warps once after the loop. q is converted once to
the A-operand layout (kWidth 4) and stays in registers. K and V^T are gathered through the block
table by cp.async into a STAGES-deep shared-memory ring (one block id a warp a tile), read back by
ldmatrix as e4m3 and widened to fp16 in registers. p never touches shared memory: the score
accumulator is the P @ V dot's A operand with kWidth 2 as it stands, and V's ldmatrix fragments
(kWidth 4) hold the very keys each thread needs because K's rows are loaded in a permuted order
(row c = 16i + 8h + 2t + b holds key 16i + 4t + 2h + b); V is then relabelled by reshape/permute
(checked trivial: no data movement). Full tiles run unmasked; the partial last one is peeled.

SASS instructions of the loop per 128 keys (block size 32; production paged_attention_kernel: 764
with 151 IMAD.MOV.U32; 23.9 a KB; bf16's kernel 14.4 a KB):

                                                                    3 stages   2 stages
    first version (every tile masked, K copies masked, runtime strides,
      the stage index by tile % STAGES)                                 567        534
    the stage index carried instead                                     537        538
    + full tiles unmasked, the last one peeled (`--no-peel`: without)   489        509
    + K copies unmasked (`--k-mask`: with)                              475        476
    + cache strides as compile-time constants (the default now)         449        450

i.e. 14.1 a KB: 128 F2FP.F16.E4M3.UNPACK_B, 64 HMMA.16816.F32, 66 FMUL (64 the accumulator's
rescale), 16 LDGSTS.128 + 16 LDSM.x4, 4 IMAD.MOV.U32, 2 BAR.SYNC; 168 registers a thread, no spills
(`--maxnreg 168` spills: 461, 5 local-memory instructions); 64 KB (2 stages) / 96 KB (3) of shared
memory: 3 programs an SM at 2 stages (registers and shared memory both allow 3), 2 at 3 stages.
`--sub 2` (256-key tiles: two 128-key groups under one softmax update, halving the accumulator's
rescale and the per-tile work): 794 a tile, 397 per 128 keys (12.4 a KB), but 215 registers and
128 KB of shared memory at 2 stages, so one program an SM. Needs BLOCK_SIZE % 32 == 0, GROUP <= 16;
no split-KV (one program per KV head and sequence), no seq_order, decode rows only.
`--lazy` (LAZY: the running max, and with it the accumulator's 64-FMUL rescale, moves only when
some row's max grew by more than 2**8 in p, tested once for the program: a cross-warp max and a
branch): 486 static, of which 408 run on a tile that skips the rescale (the usual case once the
first tiles set the max); with `--sub 2` 377 per 128 keys when skipped. Its math is
bench/fp8_decode_tl_variants.py's variant 11 (checked under the interpreter).

Correctness: Triton's interpreter does not run Gluon and this machine has no GPU, so the kernel
itself has not run. Its algorithm (the key split, K's row permutation and V's relabelling, the
combine) is the same as bench/fp8_decode_tl_variants.py's variant 8, which passes the interpreter
check against torch (and variant 9, the relabelling left out, fails it). The launcher
(launch_gluon) binds and compiles through the JIT path (a fake sm90 driver) to the same 450.
On the GPU: bench/fp8_decode_proto_gpu.py checks it against paged_decode and times it.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

# Each warp owns 32 keys of every 128: its own softmax state and accumulator.
WARPS = gl.constexpr(4)
LAZY_LOG2 = gl.constexpr(8.0)  # with LAZY: how far (log2) a row's max may run ahead of m_i


@gluon.jit
def _issue_tile(
    k_smem,
    v_smem,
    k_cache_ptr,
    v_cache_ptr,
    bt_row,
    group_start,
    context_len,
    kv_head,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_vb,
    stride_vh,
    stride_vd,
    BLOCK_SIZE: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    KL: gl.constexpr,
    VL: gl.constexpr,
    K_MASK: gl.constexpr,
):
    """cp.async of the 128 keys from group_start on: K [WARPS, 32, HEAD_DIM] (rows in the permuted
    order, see the kernel) and V^T [WARPS, HEAD_DIM, 32], into one buffer each. A warp's 32 keys lie
    in one cache block (BLOCK_SIZE % 32 == 0): one block id a warp, read once."""
    KEYS: gl.constexpr = 32
    # K: row c of warp w holds key group_start + w * KEYS + perm(c)
    kw = gl.arange(0, WARPS, layout=gl.SliceLayout(1, gl.SliceLayout(2, KL)))
    kc = gl.arange(0, KEYS, layout=gl.SliceLayout(0, gl.SliceLayout(2, KL)))
    kd = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, gl.SliceLayout(1, KL)))
    kperm = (kc & 1) | (((kc >> 3) & 1) << 1) | (((kc >> 1) & 3) << 2) | (kc & ~15)
    first = group_start + kw * KEYS  # [WARPS]
    kblock = gl.load(bt_row + first // BLOCK_SIZE, mask=first < context_len, other=0).to(gl.int64)
    krow = gl.expand_dims(gl.expand_dims(first % BLOCK_SIZE, 1) + gl.expand_dims(kperm, 0), 2)  # [W, KEYS, 1]
    kkey = gl.expand_dims(gl.expand_dims(first, 1) + gl.expand_dims(kperm, 0), 2)
    k_off = (
        gl.expand_dims(gl.expand_dims(kblock * stride_cb + kv_head * stride_ch, 1), 2)
        + krow * stride_cs
        + gl.expand_dims(gl.expand_dims(kd, 0), 1)
    )
    if K_MASK:
        async_copy.async_copy_global_to_shared(k_smem, k_cache_ptr + k_off, mask=kkey < context_len)
    else:  # rows past the context read whatever their slot (or block 0) holds: their scores are masked
        async_copy.async_copy_global_to_shared(k_smem, k_cache_ptr + k_off)
    # V^T: warp w's keys are keys (first % BLOCK_SIZE) .. + KEYS of its block, contiguous
    vw = gl.arange(0, WARPS, layout=gl.SliceLayout(1, gl.SliceLayout(2, VL)))
    vd = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, gl.SliceLayout(2, VL)))
    vk = gl.arange(0, KEYS, layout=gl.SliceLayout(0, gl.SliceLayout(1, VL)))
    vfirst = group_start + vw * KEYS
    vblock = gl.load(bt_row + vfirst // BLOCK_SIZE, mask=vfirst < context_len, other=0).to(gl.int64)
    vbase = vblock * stride_vb + kv_head * stride_vh + vfirst % BLOCK_SIZE
    v_off = (
        gl.expand_dims(gl.expand_dims(vbase, 1), 2)
        + gl.expand_dims(gl.expand_dims(vd, 0), 2) * stride_vd
        + gl.expand_dims(gl.expand_dims(vk, 0), 1)
    )
    v_off = gl.max_contiguous(gl.multiple_of(v_off, [1, 1, 16]), [1, 1, 16])
    v_mask = gl.expand_dims(gl.expand_dims(vfirst < context_len, 1), 2)
    async_copy.async_copy_global_to_shared(v_smem, v_cache_ptr + v_off, mask=v_mask)


@gluon.jit
def _scores(q, k_smem, s_key, group_start, context_len, MASKED: gl.constexpr):
    """Raw scores [WARPS, GROUP_PAD, 32] of one 128-key group from its K buffer."""
    mma: gl.constexpr = s_key.type.layout
    kt = k_smem.permute([0, 2, 1]).load(gl.DotOperandLayout(1, mma, 4)).to(gl.float16)  # [W, D, 32]
    s = mma_v2(q, kt, gl.zeros([WARPS, q.shape[1], 32], gl.float32, layout=mma))
    if MASKED:
        s = gl.where(s_key + group_start < context_len, s, float("-inf"))
    return s


@gluon.jit
def _pv(p, v_smem, acc, HEAD_DIM: gl.constexpr):
    """acc + p @ V of one 128-key group from its V^T buffer."""
    mma: gl.constexpr = acc.type.layout
    # V as loaded ([W, 32 keys in cache order, D], kWidth 4) relabelled to the scores' column order
    v = v_smem.permute([0, 2, 1]).load(gl.DotOperandLayout(1, mma, 4))
    v = gl.permute(gl.reshape(v, [WARPS, 2, 4, 2, 2, HEAD_DIM]), [0, 1, 3, 2, 4, 5])
    v = gl.convert_layout(
        gl.reshape(v, [WARPS, 32, HEAD_DIM]), gl.DotOperandLayout(1, mma, 2), assert_trivial=True
    )
    p16 = gl.convert_layout(p.to(gl.float16), gl.DotOperandLayout(0, mma, 2), assert_trivial=True)
    return mma_v2(p16, v.to(gl.float16), acc)


@gluon.jit
def _attend_tile(
    q, k_smem, v_smem, stage, m_i, l_i, acc, s_key, tile, context_len, qk_scale,
    BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, SUB: gl.constexpr, MASKED: gl.constexpr,
    LAZY: gl.constexpr,
):  # fmt: skip
    """One tile (SUB groups of 128 keys, 32 a warp each) from its stage: scores, one online-softmax
    update, P @ V. LAZY: the running max (and so the accumulator's rescale) moves only when some
    row's max grew by more than 2**LAZY_LOG2 in p (one test for the whole program, a branch around
    the rescale); p then stays below 2**LAZY_LOG2 (fp16: fine), m_i may lag the true max."""
    start = tile * BLOCK_N
    s0 = _scores(q, k_smem.index(stage * SUB), s_key, start, context_len, MASKED)
    m_new = gl.maximum(m_i, gl.max(s0, 2))
    if SUB == 2:
        s1 = _scores(q, k_smem.index(stage * SUB + 1), s_key, start + 128, context_len, MASKED)
        m_new = gl.maximum(m_new, gl.max(s1, 2))
    if LAZY:
        # (m_new - m_i) is NaN for a row of -inf so far and now (no key yet): no move needed
        grow = ((m_new - m_i) * qk_scale > LAZY_LOG2).to(gl.int32)
        if gl.max(gl.max(grow, 1), 0) > 0:
            alpha = gl.exp2(m_i * qk_scale - gl.where(m_new == float("-inf"), 0.0, m_new) * qk_scale)
            acc = acc * gl.expand_dims(alpha, 2)
            l_i = l_i * alpha
            m_i = m_new
        m_new = m_i
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new) * qk_scale
    else:
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new) * qk_scale  # qk_scale applied in the exp2
        alpha = gl.exp2(m_i * qk_scale - m_safe)
        acc = acc * gl.expand_dims(alpha, 2)
        l_i = l_i * alpha
    p0 = gl.exp2(s0 * qk_scale - gl.expand_dims(m_safe, 2))
    l_new = gl.sum(p0, 2)
    acc = _pv(p0, v_smem.index(stage * SUB), acc, HEAD_DIM)
    if SUB == 2:
        p1 = gl.exp2(s1 * qk_scale - gl.expand_dims(m_safe, 2))
        l_new += gl.sum(p1, 2)
        acc = _pv(p1, v_smem.index(stage * SUB + 1), acc, HEAD_DIM)
    return m_new, l_i + l_new, acc


@gluon.jit
def fp8_decode_gluon_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    block_tables_ptr,
    context_lens_ptr,
    qk_scale,  # softmax scale * log2(e) * k_scale
    v_scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_bt,
    # the caches' strides: compile-time constants (a model's cache shape), so that ptxas folds the
    # copies' offsets into immediates (as runtime arguments: 475 loop instructions, not 450)
    stride_cb: gl.constexpr,
    stride_cs: gl.constexpr,
    stride_ch: gl.constexpr,
    stride_vb: gl.constexpr,
    stride_vh: gl.constexpr,
    stride_vd: gl.constexpr,
    BLOCK_SIZE: gl.constexpr,
    GROUP: gl.constexpr,
    GROUP_PAD: gl.constexpr,
    BLOCK_N: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    STAGES: gl.constexpr,
    SUB: gl.constexpr,  # groups of 128 keys a tile (1 or 2): BLOCK_N = 128 * SUB, 32 * SUB keys a warp
    PEEL: gl.constexpr,  # the last tile's masking out of the loop (the loop's tiles are all full)
    LAZY: gl.constexpr,  # the accumulator rescaled only when the max grew by more than 2**LAZY_LOG2
    K_MASK: gl.constexpr,  # K's cp.async masked by key (else only its scores are)
):
    """grid (num_kv_heads, num_seqs), one query token a sequence, 4 warps. Warp w computes the
    scores and P @ V of keys w * KEYS .. of every tile (a batched mma over a [WARPS, ...] axis), with
    its own online-softmax state; the warps' partial results are combined once after the loop.

    Layouts: q is held in registers as the A operand (kWidth 4, the width ldmatrix gives e4m3) for
    the whole loop. K and V^T go global -> shared by cp.async (STAGES deep) and shared -> registers by
    ldmatrix as e4m3, widened there. p stays in registers: the score accumulator is already the
    P @ V dot's A operand with kWidth 2, and V's ldmatrix fragments (kWidth 4) hold the same keys a
    thread needs because K's rows are loaded permuted (row c = 16i + 8h + 2t + b holds key
    16i + 4t + 2h + b): V's fragment is then relabelled (reshape / permute, no data movement)."""
    gl.static_assert(gl.num_warps() == WARPS)
    KEYS: gl.constexpr = 32  # a warp's keys of each 128-key group
    gl.static_assert(BLOCK_N == 128 * SUB)
    gl.static_assert(SUB == 1 or SUB == 2)
    gl.static_assert(BLOCK_SIZE % KEYS == 0)
    mma: gl.constexpr = gl.NVMMADistributedLayout(
        version=[2, 0], warps_per_cta=[WARPS, 1, 1], instr_shape=[1, 16, 8]
    )
    q_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=4)
    KL: gl.constexpr = gl.BlockedLayout([1, 1, 16], [1, 4, 8], [WARPS, 1, 1], [2, 1, 0])
    VL: gl.constexpr = gl.BlockedLayout([1, 1, 16], [1, 16, 2], [WARPS, 1, 1], [2, 1, 0])
    QL: gl.constexpr = gl.BlockedLayout([1, 1, 8], [1, 2, 16], [WARPS, 1, 1], [2, 1, 0])
    k_sl: gl.constexpr = gl.SwizzledSharedLayout(16, 1, 8, [2, 1, 0])
    v_sl: gl.constexpr = gl.SwizzledSharedLayout(16, 4, 2, [2, 1, 0])

    kv_head = gl.program_id(0)
    seq = gl.program_id(1)
    context_len = gl.load(context_lens_ptr + seq)
    bt_row = block_tables_ptr + seq.to(gl.int64) * stride_bt

    # q, every warp a copy: [WARPS, GROUP_PAD, HEAD_DIM] -> the A operand, once
    qr = gl.arange(0, GROUP_PAD, layout=gl.SliceLayout(0, gl.SliceLayout(2, QL)))
    qd = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, gl.SliceLayout(1, QL)))
    qw = gl.arange(0, WARPS, layout=gl.SliceLayout(1, gl.SliceLayout(2, QL)))
    q_row = gl.expand_dims(gl.expand_dims(qw * 0, 1) + gl.expand_dims(qr, 0), 2)  # [W, G, 1]
    q_off = seq * stride_qt + (kv_head * GROUP + q_row) * stride_qh + gl.expand_dims(gl.expand_dims(qd, 0), 1)
    q = gl.load(q_ptr + q_off, mask=q_row < GROUP, other=0.0).to(gl.float16)
    q = gl.convert_layout(q, q_layout)

    k_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES * SUB, WARPS, KEYS, HEAD_DIM], k_sl)
    v_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES * SUB, WARPS, HEAD_DIM, KEYS], v_sl)

    # the score columns' keys (K's permuted rows), relative to the tile
    sw = gl.arange(0, WARPS, layout=gl.SliceLayout(1, gl.SliceLayout(1, mma)))
    sc = gl.arange(0, KEYS, layout=gl.SliceLayout(0, gl.SliceLayout(1, mma)))
    sperm = (sc & 1) | (((sc >> 3) & 1) << 1) | (((sc >> 1) & 3) << 2) | (sc & ~15)
    s_key = gl.expand_dims(gl.expand_dims(sw * KEYS, 1) + gl.expand_dims(sperm, 0), 1)  # [W, 1, KEYS]

    m_i = gl.full([WARPS, GROUP_PAD], float("-inf"), gl.float32, layout=gl.SliceLayout(2, mma))
    l_i = gl.zeros([WARPS, GROUP_PAD], gl.float32, layout=gl.SliceLayout(2, mma))
    acc = gl.zeros([WARPS, GROUP_PAD, HEAD_DIM], gl.float32, layout=mma)

    num_tiles = gl.cdiv(context_len, BLOCK_N)
    for st in gl.static_range(STAGES - 1):
        for j in gl.static_range(SUB):
            _issue_tile(
                k_smem.index(st * SUB + j), v_smem.index(st * SUB + j), k_cache_ptr, v_cache_ptr, bt_row,
                st * BLOCK_N + j * 128, context_len, kv_head, stride_cb, stride_cs, stride_ch, stride_vb, stride_vh,
                stride_vd, BLOCK_SIZE, HEAD_DIM, KL, VL, K_MASK,
            )  # fmt: skip
        async_copy.commit_group()
    if PEEL:
        loop_tiles = context_len // BLOCK_N  # the full ones
    else:
        loop_tiles = num_tiles
    stage = 0  # tile % STAGES, carried (no division)
    prev = STAGES - 1  # (tile + STAGES - 1) % STAGES: the stage the next copies go to
    for tile in range(loop_tiles):
        async_copy.wait_group(STAGES - 2)  # this tile's copies are done (later ones may not be)
        gl.thread_barrier()  # everyone's copies visible; the previous tile's stage free
        for j in gl.static_range(SUB):
            _issue_tile(
                k_smem.index(prev * SUB + j), v_smem.index(prev * SUB + j), k_cache_ptr, v_cache_ptr, bt_row,
                (tile + STAGES - 1) * BLOCK_N + j * 128, context_len, kv_head, stride_cb, stride_cs, stride_ch,
                stride_vb, stride_vh, stride_vd, BLOCK_SIZE, HEAD_DIM, KL, VL, K_MASK,
            )  # fmt: skip
        async_copy.commit_group()
        m_i, l_i, acc = _attend_tile(
            q, k_smem, v_smem, stage, m_i, l_i, acc, s_key, tile, context_len, qk_scale,
            BLOCK_N, HEAD_DIM, SUB, not PEEL, LAZY,
        )  # fmt: skip
        prev = stage
        stage = gl.where(stage == STAGES - 1, 0, stage + 1)
    if PEEL:  # noqa: SIM102 (constexpr branch, pruned at compile time)
        if loop_tiles < num_tiles:  # the partial last tile
            async_copy.wait_group(STAGES - 2)
            gl.thread_barrier()
            m_i, l_i, acc = _attend_tile(
                q, k_smem, v_smem, stage, m_i, l_i, acc, s_key, loop_tiles, context_len, qk_scale,
                BLOCK_N, HEAD_DIM, SUB, True, LAZY,
            )  # fmt: skip
    async_copy.wait_group(0)

    # combine the warps' partial softmax states
    m_all = gl.max(m_i, 0)  # [G]
    m_all = gl.where(m_all == float("-inf"), 0.0, m_all)
    w = gl.exp2((m_i - gl.expand_dims(m_all, 0)) * qk_scale)  # [W, G]; 0 for a warp that saw no key
    l_all = gl.sum(l_i * w, 0)
    o = gl.sum(acc * gl.expand_dims(w, 2), 0)  # [G, D]
    out_l: gl.constexpr = gl.SliceLayout(0, mma)
    l_all = gl.convert_layout(gl.where(l_all > 0, l_all, 1.0), gl.SliceLayout(1, out_l))
    o = o / gl.expand_dims(l_all, 1) * v_scale
    orow = gl.arange(0, GROUP_PAD, layout=gl.SliceLayout(1, out_l))
    od = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, out_l))
    o_off = seq * stride_ot + gl.expand_dims(kv_head * GROUP + orow, 1) * stride_oh + gl.expand_dims(od, 0)
    gl.store(out_ptr + o_off, o.to(out_ptr.dtype.element_ty), mask=gl.expand_dims(orow < GROUP, 1))


def compile_gluon(
    stages: int = 3,
    block_size: int = 32,
    sub: int = 1,
    lazy: bool = False,
    maxnreg: int = 0,
    peel: bool = True,
    k_mask: bool = False,
    num_kv_heads: int = 8,
):
    """The kernel for sm90 (no GPU needed): Qwen3-0.6B's shapes, caches of num_kv_heads heads."""
    import kernel_sass
    from fp8_decode_tl_variants import PROTO_ALIGNED, PROTO_TYPES
    from triton.experimental.gluon._runtime import GluonASTSource

    fn = fp8_decode_gluon_kernel
    constants = {
        "BLOCK_SIZE": block_size,
        "GROUP": 2,
        "GROUP_PAD": 16,
        "BLOCK_N": 128 * sub,
        "HEAD_DIM": 128,
        "STAGES": stages,
        "SUB": sub,
        "LAZY": lazy,
        "PEEL": peel,
        "K_MASK": k_mask,
    }
    constants.update(kernel_sass.cache_stride_constants(block_size, num_kv_heads, constants["HEAD_DIM"]))
    return kernel_sass.compile_sm90(
        fn, constants, PROTO_TYPES, PROTO_ALIGNED, WARPS.value, maxnreg=maxnreg, source_cls=GluonASTSource
    )


def launch_gluon(
    q, k_cache, v_cache, out, block_tables, context_lens, scale, kv_scales, stages=2, sub=1, lazy=False
):
    """Decode (one query token a sequence, cu_seqlens_q = arange) over an e4m3 cache with the
    prototype: q, out [num_seqs, num_heads, head_dim]; k_cache [num_blocks, block_size, kv_heads,
    head_dim]; v_cache [num_blocks, kv_heads, head_dim, block_size] (fp8.fp8_v_cache)."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group = num_heads // num_kv_heads
    k_scale, v_scale = kv_scales
    fp8_decode_gluon_kernel[(num_kv_heads, num_seqs)](
        q, k_cache, v_cache, out, block_tables, context_lens, scale * 1.4426950408889634 * k_scale, v_scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2), BLOCK_SIZE=block_size, GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)),
        BLOCK_N=128 * sub, HEAD_DIM=head_dim, STAGES=stages, SUB=sub, PEEL=True, LAZY=lazy, K_MASK=False, num_warps=WARPS.value,
    )  # fmt: skip


def main() -> None:
    from kernel_sass import loop_stats

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, nargs="*", default=[3])
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--maxnreg", type=int, nargs="*", default=[0], help="register caps (0: none)")
    parser.add_argument("--sub", type=int, nargs="*", default=[1], help="128-key groups a tile (1, 2)")
    parser.add_argument("--lazy", action="store_true", help="rescale only when the max grew by > 2**8")
    parser.add_argument("--no-peel", action="store_true", help="mask every tile in the loop")
    parser.add_argument("--k-mask", action="store_true", help="mask K's copies by key")
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument("--dump", help="write the ttgir / ptx / sass to this prefix")
    args = parser.parse_args()
    for stages, maxnreg, sub in itertools.product(args.stages, args.maxnreg, args.sub):
        kernel = compile_gluon(
            stages, args.block_size, sub, args.lazy, maxnreg=maxnreg, peel=not args.no_peel, k_mask=args.k_mask,
        )  # fmt: skip
        ops, regs = loop_stats(kernel)
        print(
            f"gluon stages {stages}, block size {args.block_size}, {128 * sub} keys a tile, maxnreg "
            f"{maxnreg or 'none'}: {len(ops)} loop instructions ({len(ops) / sub:.0f} per 128 keys), {regs} registers, {kernel.metadata.shared} bytes of shared memory, "
            f"{sum(op.startswith(('LDL', 'STL')) for op in ops)} local-memory (spill) instructions"
        )
        for op, count in collections.Counter(ops).most_common(args.top):
            print(f"  {count:5d} {op}")
        if args.dump:
            import kernel_sass

            Path(args.dump + ".ttgir").write_text(kernel.asm["ttgir"])
            Path(args.dump + ".ptx").write_text(kernel.asm["ptx"])
            cubin = Path(args.dump + ".cubin")
            cubin.write_bytes(kernel.asm["cubin"])
            Path(args.dump + ".sass").write_text(kernel_sass.cuobjdump("-sass", str(cubin)))


if __name__ == "__main__":
    main()
