"""A prototype: the e4m3 decode kernel taking two sequences a program, one loop over both.

The production decode kernel (executor_service/attention/triton_kernels.py) runs a program per
(sequence, KV head); at W1's contexts (600-800 keys, 5-7 tiles of 128) each program's pipeline
fills and drains in a few tiles. Here a program walks the tiles of sequence 2i and then of 2i+1 in
one loop, so that the loads of 2i+1's first tiles are in flight while 2i's last ones are computed;
the online-softmax state is saved and reset where the second sequence begins (selects on a
scalar, no branch in the loop). Same inputs, layouts and scales as paged_decode with one split.

    python bench/decode_pairs.py          # agreement with paged_decode, then TB/s beside it

Needs a CUDA GPU."""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import attention
from executor_service.attention import triton_kernels as tk


@triton.jit(do_not_specialize=["stride_bt"])
def paged_decode_pairs_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    block_tables_ptr,
    context_lens_ptr,
    seq_order_ptr,
    num_seqs,
    qk_scale,
    v_scale,
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
    ORDERED: tl.constexpr,
):
    kv_head = tl.program_id(0)
    pair = tl.program_id(2)
    i_a = 2 * pair
    i_b = i_a + 1
    has_b = i_b < num_seqs
    if ORDERED:
        seq_a = tl.load(seq_order_ptr + i_a)
        seq_b = tl.load(seq_order_ptr + i_b, mask=has_b, other=0)
    else:
        seq_a = i_a
        seq_b = tl.where(has_b, i_b, 0)
    ctx_a = tl.load(context_lens_ptr + seq_a)
    ctx_b = tl.where(has_b, tl.load(context_lens_ptr + seq_b), 0)
    tiles_a = tl.cdiv(ctx_a, BLOCK_N)
    tiles_b = tl.cdiv(ctx_b, BLOCK_N)

    g = tl.arange(0, GROUP_PAD)
    head = kv_head * GROUP + g
    g_valid = g < GROUP
    d = tl.arange(0, HEAD_DIM)
    # (one query token a sequence: the decode rows are sequences 0..num_seqs-1 of q)
    qa = tl.load(q_ptr + seq_a.to(tl.int64) * stride_qt + head[:, None] * stride_qh + d[None, :],
                 mask=g_valid[:, None], other=0.0).to(tl.float16)  # fmt: skip
    qb = tl.load(q_ptr + seq_b.to(tl.int64) * stride_qt + head[:, None] * stride_qh + d[None, :],
                 mask=g_valid[:, None] & has_b, other=0.0).to(tl.float16)  # fmt: skip

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    l_a = tl.zeros([GROUP_PAD], tl.float32)
    acc_a = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    n = tl.arange(0, BLOCK_N)
    head_off = kv_head * stride_ch + d[None, :]
    for t in range(0, tiles_a + tiles_b):
        in_b = t >= tiles_a
        first_b = t == tiles_a
        seq = tl.where(in_b, seq_b, seq_a)
        kv_end = tl.where(in_b, ctx_b, ctx_a)
        tile = tl.where(in_b, t - tiles_a, t)
        key = tile * BLOCK_N + n
        key_valid = key < kv_end
        whole_block = (key // BLOCK_SIZE) * BLOCK_SIZE < kv_end
        bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
        block = tl.load(bt_row + key // BLOCK_SIZE, mask=whole_block, other=0).to(tl.int64)
        kv_off = block[:, None] * stride_cb + (key % BLOCK_SIZE)[:, None] * stride_cs + head_off
        k = tl.load(k_cache_ptr + kv_off, mask=key_valid[:, None], other=0.0)
        vt_off = (
            block[None, :] * stride_vb + kv_head * stride_vh + d[:, None] * stride_vd
            + (key % BLOCK_SIZE)[None, :]
        )  # fmt: skip
        if BLOCK_SIZE % 16 == 0:
            vt_off = tl.max_contiguous(tl.multiple_of(vt_off, (1, 16)), (1, 16))
        vt = tl.load(v_cache_ptr + vt_off, mask=whole_block[None, :], other=0.0)
        v = tl.trans(vt).to(tl.float16)
        k = k.to(tl.float16)
        # Where the second sequence begins: keep the first's sums, start afresh.
        l_a = tl.where(first_b, l_i, l_a)
        acc_a = tl.where(first_b, acc, acc_a)
        m_i = tl.where(first_b, float("-inf"), m_i)
        l_i = tl.where(first_b, 0.0, l_i)
        acc = tl.where(first_b, 0.0, acc)
        q = tl.where(in_b, qb, qa)
        s = tl.dot(q, tl.trans(k)) * qk_scale
        s = tl.where(key_valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(tl.float16), v)
        m_i = m_new

    # Without tiles of b (no second sequence, or an empty one) the loop's state is a's.
    b_ran = tiles_b > 0
    l_a = tl.where(b_ran, l_a, l_i)
    acc_a = tl.where(b_ran, acc_a, acc)
    o_a = acc_a / tl.where(l_a > 0, l_a, 1.0)[:, None] * v_scale
    o_b = tl.where(b_ran, acc / tl.where(l_i > 0, l_i, 1.0)[:, None] * v_scale, 0.0)
    tl.store(out_ptr + seq_a.to(tl.int64) * stride_ot + head[:, None] * stride_oh + d[None, :],
             o_a.to(out_ptr.dtype.element_ty), mask=g_valid[:, None])  # fmt: skip
    tl.store(out_ptr + seq_b.to(tl.int64) * stride_ot + head[:, None] * stride_oh + d[None, :],
             o_b.to(out_ptr.dtype.element_ty), mask=g_valid[:, None] & has_b)  # fmt: skip


def decode_pairs(q, k_cache, v_cache, out, block_tables, context_lens, scale, kv_scales, seq_order=None,
                 block_n=128, num_warps=4, num_stages=3):  # fmt: skip
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    grid = (num_kv_heads, 1, triton.cdiv(num_seqs, 2))
    paged_decode_pairs_kernel[grid](
        q, k_cache, v_cache, out, block_tables, context_lens,
        context_lens if seq_order is None else seq_order, num_seqs,
        scale * tk.LOG2E * kv_scales[0], float(kv_scales[1]),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        BLOCK_SIZE=k_cache.shape[1], GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)),
        BLOCK_N=block_n, HEAD_DIM=head_dim, ORDERED=seq_order is not None,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--block-size", type=int, default=32)
    args = parser.parse_args()
    bs = args.block_size
    rng = random.Random(0)
    cases = [
        ("b256x1024 0.6B", [1024] * 256, 16, 8),
        ("b256 W1 mixed +32", [rng.randint(100, 1024) + 32 for _ in range(256)], 16, 8),
        ("b256 W1 mixed +256", [rng.randint(100, 1024) + 256 for _ in range(256)], 16, 8),
        ("b256x512 8B", [512] * 256, 32, 8),
        ("b256 W1 mixed 8B", [rng.randint(100, 1024) + 32 for _ in range(256)], 32, 8),
        ("b255 odd", [rng.randint(1, 700) for _ in range(255)], 16, 8),
    ]
    print(f"block size {bs}: us (TB/s of fp8 K+V bytes)")
    for name, contexts, nh, nkv in cases:
        print(compare(name, contexts, nh, nkv, bs), flush=True)


def compare(name: str, contexts: list[int], num_heads: int, num_kv_heads: int, block_size: int) -> str:
    """One case: paged_decode against the pairs kernel (asserting agreement), then their times."""
    scale = attention.SCALE
    kv_scales = (0.5, 0.25)
    attention.NUM_HEADS, attention.NUM_KV_HEADS = num_heads, num_kv_heads
    x = attention.paged_decode_inputs(
        len(contexts), max(contexts), block_size, attention.FP8, contexts=contexts
    )
    q, kc, vc, tables, lens, cu = (
        x[k] for k in ("q", "k_cache", "v_cache", "block_tables", "context_lens", "cu_seqlens_q")
    )
    order = torch.argsort(lens, descending=True).to(torch.int32)
    ref = torch.empty_like(q)
    got = torch.empty_like(q)

    def production():
        tk.paged_decode(q, kc, vc, ref, tables, lens, cu, scale, kv_scales=kv_scales, seq_order=order)

    def pairs(block_n=128, num_warps=4, num_stages=3):
        decode_pairs(
            q, kc, vc, got, tables, lens, scale, kv_scales, seq_order=order, block_n=block_n,
            num_warps=num_warps, num_stages=num_stages,
        )  # fmt: skip

    production()
    pairs()
    diff = (ref.float() - got.float()).abs().max().item()
    assert diff < 2e-2, (name, diff)
    nbytes = 2 * sum(contexts) * num_kv_heads * attention.HEAD_DIM
    t_ref = 1e3 * attention.time_graph_ms(production)
    row = f"{name}: max diff {diff:.1e}; production {t_ref:.1f} us ({nbytes / t_ref / 1e6:.2f})"
    for bn, warps, stages in ((128, 4, 3), (128, 4, 4), (64, 4, 3), (128, 8, 3)):
        t = 1e3 * attention.time_graph_ms(lambda bn=bn, w=warps, s=stages: pairs(bn, w, s))
        row += f"; pairs {bn}/{warps}w/{stages}s {t:.1f} ({nbytes / t / 1e6:.2f})"
    return row


if __name__ == "__main__":
    main()
