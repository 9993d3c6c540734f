"""The fused q/k norm + rotary + K/V store kernel of a decode step on the GPU (layers/triton_ops.py
qk_norm_rope with the cache), timed as a CUDA graph of one launch per layer, each layer with its own
cache (as a decode step's 28 layers write 28 caches, so their partially written sectors do not stay
in L2). (It also timed a program per token and role against today's program per token, slower on the
H200, bench/RESULTS.md 2026-12-05; that kernel is gone.)

Also timed, to price the e4m3 V cache's transposed layout: the same launches with V stored slot-major
(a layout the decode kernel does not read; the cache bytes are not checked there). A decode token
writes one byte into each of its block's 1,024 V rows (8 KV heads x 128 dimensions) when V is
transposed, against 8 rows of 128 bytes slot-major.

    python bench/rope_store.py [--tokens 256] [--heads 16 8] [--layers 28] [--block-size 32]
    TRITON_INTERPRET=1 python bench/rope_store.py --device cpu --tokens 8   # the check alone

Checks first that the cache holds the attention backend's store of the k it returns, then prints us
a launch.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from executor_service.layers.rotary import RotaryEmbedding
from executor_service.layers.triton_ops import qk_norm_rope

HEAD_DIM, DTYPE, FP8 = 128, torch.bfloat16, torch.float8_e4m3fn


DEVICE = "cuda"


def decode_slots(num_tokens: int, block_size: int, num_blocks: int, gen: torch.Generator) -> torch.Tensor:
    """A decode step's slots: each token in a block of its own drawn at random, at a random offset
    (so about one in block_size starts its block and zeroes the rest of it)."""
    blocks = torch.randperm(num_blocks, generator=gen)[:num_tokens]
    offsets = torch.randint(0, block_size, (num_tokens,), generator=gen)
    return (blocks * block_size + offsets).to(DEVICE)


def caches(num_blocks: int, block_size: int, num_kv_heads: int, kv: str):
    """(k_cache, v_cache) of one layer: kv "fp8" (V transposed, the engine's), "fp8 V slot-major"
    (V's bytes laid out like K's, viewed with the transposed shape) or "bf16"."""
    shape = (num_blocks, block_size, num_kv_heads, HEAD_DIM)
    if kv == "bf16":
        return torch.zeros(shape, dtype=DTYPE, device=DEVICE), torch.zeros(shape, dtype=DTYPE, device=DEVICE)
    k_cache = torch.zeros(shape, dtype=torch.uint8, device=DEVICE).view(FP8)
    v = torch.zeros(shape, dtype=torch.uint8, device=DEVICE).view(FP8)
    if kv == "fp8":
        return k_cache, v.permute(0, 2, 3, 1).contiguous()
    return k_cache, v.permute(0, 2, 3, 1)  # slot-major bytes, the transposed cache's shape


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=256, help="decode tokens a step (one per sequence)")
    parser.add_argument("--heads", type=int, nargs=2, default=(16, 8), metavar=("QUERY", "KV"))
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--device", default="cuda", help="cpu: the check alone, under TRITON_INTERPRET=1")
    args = parser.parse_args()
    global DEVICE
    DEVICE = args.device
    num_heads, num_kv_heads = args.heads
    gen = torch.Generator().manual_seed(0)
    qkv_width = (num_heads + 2 * num_kv_heads) * HEAD_DIM
    qkv = (2 * torch.randn(args.tokens, qkv_width, generator=gen)).to(DTYPE).to(DEVICE)
    positions = torch.randint(0, 2048, (args.tokens,), generator=gen).to(DEVICE)
    weights = [(1 + 0.2 * torch.randn(HEAD_DIM, generator=gen)).to(DTYPE).to(DEVICE) for _ in range(2)]
    cos_sin = RotaryEmbedding(HEAD_DIM, 4096, 1_000_000.0).to(DEVICE).cos_sin_cache
    num_blocks = 4 * args.tokens
    slots = decode_slots(args.tokens, args.block_size, num_blocks, gen)
    rope_args = (qkv, positions, *weights, cos_sin, 1e-6, num_heads, num_kv_heads, HEAD_DIM)

    # The cache holds store_kv's bytes of the k it returns and of qkv's V, exactly.
    from executor_service.attention import torch_ref

    v = qkv[:, (num_heads + num_kv_heads) * HEAD_DIM :].view(args.tokens, num_kv_heads, HEAD_DIM)
    k_cache, v_cache = caches(num_blocks, args.block_size, num_kv_heads, "fp8")
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    _, k = qk_norm_rope(*rope_args, kv_cache=(k_cache, v_cache, slots, 0.5, 2.0))
    torch_ref.store_kv(k, v, k_ref, v_ref, slots, 0.5, 2.0)
    stored = torch.equal(k_cache.view(torch.uint8), k_ref.view(torch.uint8)) and torch.equal(
        v_cache.view(torch.uint8), v_ref.view(torch.uint8)
    )
    print(f"the cache holds store_kv's bytes of its k and V: {stored}")
    if not stored:
        sys.exit(1)
    if DEVICE == "cpu":
        return

    print(f"us a launch ({args.layers} launches in a CUDA graph, a cache each):")
    for kv in ("fp8", "fp8 V slot-major", "bf16"):
        layers = [caches(num_blocks, args.block_size, num_kv_heads, kv) for _ in range(args.layers)]

        def step(layers=layers):
            for k_cache, v_cache in layers:
                qk_norm_rope(*rope_args, kv_cache=(k_cache, v_cache, slots, 0.5, 2.0))

        step()  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        ms = triton.testing.do_bench(graph.replay, warmup=50, rep=300, return_mode="median")
        print(f"  {kv} cache: {ms * 1e3 / args.layers:.2f} us", flush=True)
        del layers


if __name__ == "__main__":
    main()
