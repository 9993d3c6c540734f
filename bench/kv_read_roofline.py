"""How fast the fp8 decode kernel's reads alone can go: K [BLOCK_N, head_dim] and V^T [head_dim,
BLOCK_N] e4m3 tiles of every (sequence, KV head) gathered through the block table at the addresses
paged_attention_kernel reads (attention/triton_kernels.fp8_kv_tile's; the same grid, KV heads
fastest), read as 32-bit words with the math replaced by an XOR (one instruction a word). Its TB/s
at b256x1024 is the ceiling the decode kernel's own figure can reach at that block size and tile
(issue 17's target: 3.8 TB/s of fp8 bytes; bf16 decode reads at ~4.23, the copy rate). A ceiling
well under 3.8 at the engine's block size means the gather, not the math, is what bounds it.

    python bench/kv_read_roofline.py                       # block sizes 16-128, a few tiles each
    python bench/kv_read_roofline.py --block-sizes 32 --batch 256 --context 1024

Where a tile lies within one block (block sizes of 64 and more), the same reads through TMA too
(read_kv_tma_kernel: a box for K and one for V^T a tile, as the decode config's TMA_KV copies them):
the ceiling for that path. Triton does not software-pipeline these copies (their words feed an
XOR, not a dot: each is waited for in its iteration), so the programs an SM (eight at 64-key boxes:
64 registers, 8 KB of shared memory) are what overlap them; the decode kernel's copies, which feed
its MMAs, are pipelined.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from executor_service.fp8 import fp8_v_cache

NUM_KV_HEADS, HEAD_DIM = 8, 128
DEVICE = "cuda"  # "cpu" under TRITON_INTERPRET=1 (--check-only)


@triton.jit
def read_kv_kernel(
    k_cache_ptr, v_cache_ptr, out_ptr, block_tables_ptr, context_lens_ptr, stride_cb, stride_cs, stride_ch,
    stride_vb, stride_vh, stride_vd, stride_bt, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):  # fmt: skip
    """The caches as 32-bit words (4 e4m3 values; strides in words): the K words [BLOCK_N,
    HEAD_DIM / 4] and V^T words [HEAD_DIM, BLOCK_N / 4] of each tile of keys, at the addresses
    fp8_kv_tile computes (each key's block gathered), XORed into one word a thread."""
    kv_head = tl.program_id(0)
    seq = tl.program_id(2)
    kv_end = tl.load(context_lens_ptr + seq)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    WORDS: tl.constexpr = HEAD_DIM // 4
    w = tl.arange(0, WORDS)
    d = tl.arange(0, HEAD_DIM)
    n = tl.arange(0, BLOCK_N)
    n4 = tl.arange(0, BLOCK_N // 4)
    acc_k = tl.zeros([BLOCK_N, WORDS], tl.int32)
    acc_v = tl.zeros([HEAD_DIM, BLOCK_N // 4], tl.int32)
    for tile in range(0, tl.cdiv(kv_end, BLOCK_N)):
        key = tile * BLOCK_N + n
        block = tl.load(bt_row + key // BLOCK_SIZE).to(tl.int64)
        k_off = (
            block[:, None] * stride_cb
            + (key % BLOCK_SIZE)[:, None] * stride_cs
            + kv_head * stride_ch
            + w[None, :]
        )
        key4 = tile * BLOCK_N + 4 * n4  # the first key of each V^T word
        block4 = tl.load(bt_row + key4 // BLOCK_SIZE).to(tl.int64)
        vt_off = (
            block4[None, :] * stride_vb
            + kv_head * stride_vh
            + d[:, None] * stride_vd
            + (key4 % BLOCK_SIZE)[None, :] // 4
        )
        if BLOCK_SIZE % 16 == 0:  # runs of 16 keys (4 words), 16-byte aligned, as fp8_kv_tile's V_RUN
            vt_off = tl.max_contiguous(tl.multiple_of(vt_off, (1, 4)), (1, 4))
        acc_k ^= tl.load(k_cache_ptr + k_off)
        acc_v ^= tl.load(v_cache_ptr + vt_off)
    # One word a program that depends on every word read (so no load is left out as dead code).
    folded = tl.xor_sum(tl.xor_sum(acc_k, 0), 0) ^ tl.xor_sum(tl.xor_sum(acc_v, 0), 0)
    tl.store(out_ptr + seq * tl.num_programs(0) + kv_head, folded)


@triton.jit
def read_kv_tma_kernel(
    k_desc, v_desc, out_ptr, block_tables_ptr, context_lens_ptr, stride_bt, BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
):  # fmt: skip
    """read_kv_kernel's words through TMA (a tile within one block): k_desc over the K cache's words
    as [num_blocks * BLOCK_SIZE, num_kv_heads * HEAD_DIM / 4] in [BLOCK_N, HEAD_DIM / 4] boxes,
    v_desc over V^T's as [num_blocks * num_kv_heads * HEAD_DIM, BLOCK_SIZE / 4] in [HEAD_DIM,
    BLOCK_N / 4] boxes (attention/triton_kernels.fp8_kv_tile_tma's boxes, in words)."""
    kv_head = tl.program_id(0)
    num_kv_heads = tl.num_programs(0)
    seq = tl.program_id(2)
    kv_end = tl.load(context_lens_ptr + seq)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    WORDS: tl.constexpr = HEAD_DIM // 4
    acc_k = tl.zeros([BLOCK_N, WORDS], tl.int32)
    acc_v = tl.zeros([HEAD_DIM, BLOCK_N // 4], tl.int32)
    for tile in range(0, tl.cdiv(kv_end, BLOCK_N)):
        start = tile * BLOCK_N
        block = tl.load(bt_row + start // BLOCK_SIZE)
        slot = start % BLOCK_SIZE
        acc_k ^= k_desc.load([block * BLOCK_SIZE + slot, kv_head * WORDS])
        acc_v ^= v_desc.load([(block * num_kv_heads + kv_head) * HEAD_DIM, slot // 4])
    folded = tl.xor_sum(tl.xor_sum(acc_k, 0), 0) ^ tl.xor_sum(tl.xor_sum(acc_v, 0), 0)
    tl.store(out_ptr + seq * num_kv_heads + kv_head, folded)


def inputs(batch: int, context: int, block_size: int) -> dict:
    """An e4m3 cache of batch x context keys, each sequence's blocks drawn at random from it (as
    bench/attention.py's paged_decode_inputs: a long-running server's free list)."""
    blocks_per_seq = triton.cdiv(context, block_size)
    num_blocks = batch * blocks_per_seq
    shape = (num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, device=DEVICE).to(torch.float8_e4m3fn)
    v_cache = fp8_v_cache(torch.randn(shape, device=DEVICE).to(torch.float8_e4m3fn))
    tables = torch.randperm(num_blocks, device=DEVICE, dtype=torch.int32).view(batch, blocks_per_seq)
    return {
        "k_cache": k_cache,
        "v_cache": v_cache,
        "block_tables": tables,
        "context_lens": torch.full((batch,), context, dtype=torch.int32, device=DEVICE),
    }


def read_kv(x: dict, out: torch.Tensor, block_n: int, num_warps: int, num_stages: int) -> None:
    k_cache, v_cache = x["k_cache"].view(torch.int32), x["v_cache"].view(torch.int32)
    batch = x["block_tables"].shape[0]
    read_kv_kernel[(NUM_KV_HEADS, 1, batch)](
        k_cache, v_cache, out, x["block_tables"], x["context_lens"], k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), x["block_tables"].stride(0),
        BLOCK_SIZE=x["k_cache"].shape[1], BLOCK_N=block_n, HEAD_DIM=HEAD_DIM, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip


def read_kv_tma(x: dict, out: torch.Tensor, block_n: int, num_warps: int, num_stages: int) -> None:
    from triton.tools.tensor_descriptor import TensorDescriptor

    num_blocks, block_size = x["k_cache"].shape[:2]
    k_words = x["k_cache"].view(torch.int32).view(num_blocks * block_size, NUM_KV_HEADS * HEAD_DIM // 4)
    v_words = x["v_cache"].view(torch.int32).view(num_blocks * NUM_KV_HEADS * HEAD_DIM, block_size // 4)
    k_desc = TensorDescriptor.from_tensor(k_words, [block_n, HEAD_DIM // 4])
    v_desc = TensorDescriptor.from_tensor(v_words, [HEAD_DIM, block_n // 4])
    batch = x["block_tables"].shape[0]
    read_kv_tma_kernel[(NUM_KV_HEADS, 1, batch)](
        k_desc, v_desc, out, x["block_tables"], x["context_lens"], x["block_tables"].stride(0),
        BLOCK_SIZE=block_size, BLOCK_N=block_n, HEAD_DIM=HEAD_DIM, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip


def xor_rows(x: torch.Tensor) -> torch.Tensor:
    """The XOR of each row's bytes, folding halves (zeros pad to a power of 2)."""
    width = triton.next_power_of_2(x.shape[1])
    x = torch.nn.functional.pad(x, (0, width - x.shape[1]))
    while x.shape[1] > 1:
        x = x[:, : x.shape[1] // 2] ^ x[:, x.shape[1] // 2 :]
    return x[:, 0]


def check(x: dict, out: torch.Tensor) -> None:
    """The kernel's word per program against the same XOR in torch (so the timings read what they say)."""
    k = x["k_cache"].view(torch.int32)  # [blocks, slots, heads, dim / 4]
    v = x["v_cache"].view(torch.int32)  # [blocks, heads, dim, slots / 4]
    tables, context = x["block_tables"].long(), int(x["context_lens"][0])
    batch = tables.shape[0]
    for seq in (0, batch - 1):
        ks = k[tables[seq]].permute(2, 0, 1, 3).reshape(NUM_KV_HEADS, -1, HEAD_DIM // 4)[:, :context]
        vs = v[tables[seq]].permute(1, 0, 3, 2).reshape(NUM_KV_HEADS, -1, HEAD_DIM)[:, : context // 4]
        want = xor_rows(torch.cat([ks.reshape(NUM_KV_HEADS, -1), vs.reshape(NUM_KV_HEADS, -1)], 1))
        got = out[seq * NUM_KV_HEADS : (seq + 1) * NUM_KV_HEADS]
        if not torch.equal(got, want):
            raise AssertionError(f"sequence {seq}: the kernel's XOR {got.tolist()} against {want.tolist()}")


def time_graph_ms(fn) -> float:
    """fn replayed from a CUDA graph (as the engine's decode steps run), median of the replays."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return triton.testing.do_bench(graph.replay, return_mode="median")


def patch_interpreter_loop_bounds() -> None:
    """numpy >= 2.4 refuses int() of a 1-element array, which Triton's interpreter hands to range()
    for a loop bound loaded from memory (as tests/helpers/interpret.py's prelude)."""
    from triton.runtime import interpreter

    patch = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--block-sizes", type=int, nargs="+", default=(16, 32, 64, 128))
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument(
        "--check-only", action="store_true", help="only check the kernel's XOR once a block size (any device)"
    )
    args = parser.parse_args()
    if args.context % 128:
        parser.error("--context must be a multiple of 128: the kernel reads whole tiles, unmasked")
    if args.check_only:
        global DEVICE
        if os.environ.get("TRITON_INTERPRET") == "1":
            patch_interpreter_loop_bounds()
        DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
        for block_size in args.block_sizes:
            x = inputs(args.batch, args.context, block_size)
            out = torch.empty(args.batch * NUM_KV_HEADS, dtype=torch.int32, device=DEVICE)
            read_kv(x, out, 64, 4, 2)
            check(x, out)
            print(f"block size {block_size}: the kernel's XOR of every byte is torch's")
            for block_n in (64, 128):
                if block_size % block_n == 0:
                    out.fill_(0)
                    read_kv_tma(x, out, block_n, 4, 2)
                    check(x, out)
                    print(
                        f"block size {block_size}, TMA boxes of {block_n} keys: the kernel's XOR of every byte is torch's"
                    )
        return
    for block_size in args.block_sizes:
        x = inputs(args.batch, args.context, block_size)
        out = torch.empty(args.batch * NUM_KV_HEADS, dtype=torch.int32, device=DEVICE)
        nbytes = 2 * args.batch * args.context * NUM_KV_HEADS * HEAD_DIM
        shape = f"b{args.batch}x{args.context} block size {block_size}"
        pointer_grid = itertools.product((64, 128, 256), (4, 8), (1,))
        tma_grid = [c for c in itertools.product((64, 128), (4,), (1, 2, 3, 5)) if block_size % c[0] == 0]
        for what, reader, grid in (("", read_kv, pointer_grid), (" through TMA", read_kv_tma, tma_grid)):
            rows = []
            for block_n, warps, stages in grid:
                try:
                    out.fill_(0)
                    reader(x, out, block_n, warps, stages)
                    check(x, out)
                    ms = time_graph_ms(lambda: reader(x, out, block_n, warps, stages))  # noqa: B023
                except Exception as e:  # out of shared memory, say
                    print(
                        f"bs{block_size}{what} {block_n}/{warps}/{stages}: {type(e).__name__}: {e}"[:200],
                        flush=True,
                    )
                    continue
                rows.append((nbytes / ms / 1e9, block_n, warps, stages))
            if rows:
                rows.sort(reverse=True)
                print(
                    f"fp8 K/V reads alone{what}, {shape}: "
                    + ", ".join(f"{tbs:.2f} TB/s ({bn}/{w}/{s})" for tbs, bn, w, s in rows[:4]),
                    flush=True,
                )


if __name__ == "__main__":
    main()
