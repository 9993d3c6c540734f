"""W1's decode step as its kernels run it, without the engine: 28 layers of Qwen3-0.6B's shape at
batch 256 over an e4m3 KV cache (block size 32, contexts drawn like W1's), each layer RMSNorm ->
q/k/v GEMM -> the fused q/k norm, rotary and K/V store -> paged decode attention -> o GEMM ->
RMSNorm -> gate/up GEMM -> SiLU-and-mul -> down GEMM, replayed from one CUDA graph. Times the step
with Programmatic Dependent Launch for the Triton kernels (executor_service/pdl.py) and without
(TANDEM_PDL=0, captured apart), checks that both give the same bytes, and times the fused rotary
kernel alone (28 launches in a graph).

    python bench/decode_chain.py [--batch 256] [--layers 28] [--repeats 3]

Runs on any checkout that has the fused ops (one without PDL times the same graph twice).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn.functional as F
import triton

from executor_service.attention import triton_kernels as tk
from executor_service.fp8 import fp8_v_cache
from executor_service.layers.rotary import RotaryEmbedding
from executor_service.layers.triton_ops import qk_norm_rope, rms_norm, silu_and_mul

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER = 1024, 16, 8, 128, 3072
BLOCK_SIZE = 32
EPS = 1e-6
FP8 = torch.float8_e4m3fn


def build(batch: int, layers: int, seed: int = 0) -> dict:
    torch.manual_seed(seed)
    rng = random.Random(seed)
    dev, dt = "cuda", torch.bfloat16
    # W1's contexts mid-run: its prompt plus part of its output.
    contexts = [rng.randint(100, 1024) + rng.randint(1, 512) for _ in range(batch)]
    blocks = [triton.cdiv(c, BLOCK_SIZE) for c in contexts]
    width = max(blocks)
    perm = torch.randperm(sum(blocks)).tolist()
    tables = torch.zeros(batch, width, dtype=torch.int32)
    at = 0
    for i, n in enumerate(blocks):
        tables[i, :n] = torch.tensor(perm[at : at + n])
        at += n
    positions = torch.tensor([c - 1 for c in contexts])
    slots = torch.tensor(
        [
            int(tables[i, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE
            for i, p in enumerate(positions.tolist())
        ]
    )
    caches = []
    for _ in range(layers):
        k = (torch.randn(sum(blocks), BLOCK_SIZE, KV_HEADS, HEAD_DIM, device=dev) * 0.5).to(FP8)
        v = fp8_v_cache((torch.randn(sum(blocks), BLOCK_SIZE, KV_HEADS, HEAD_DIM, device=dev) * 0.5).to(FP8))
        caches.append((k, v))

    def w(*shape):
        return (torch.randn(*shape, device=dev) * shape[-1] ** -0.5).to(dt)

    weights = [
        {
            "in_norm": 1 + 0.1 * w(HIDDEN),
            "post_norm": 1 + 0.1 * w(HIDDEN),
            "q_norm": 1 + 0.1 * w(HEAD_DIM),
            "k_norm": 1 + 0.1 * w(HEAD_DIM),
            "qkv": w((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN),
            "o": w(HIDDEN, HEADS * HEAD_DIM),
            "gate_up": w(2 * INTER, HIDDEN),
            "down": w(HIDDEN, INTER),
        }
        for _ in range(layers)
    ]
    return {
        "x": torch.randn(batch, HIDDEN, device=dev).to(dt),
        "weights": weights,
        "caches": caches,
        "tables": tables.to(dev),
        "context_lens": torch.tensor(contexts, dtype=torch.int32, device=dev),
        "cu_seqlens_q": torch.arange(batch + 1, dtype=torch.int32, device=dev),
        "seq_order": torch.tensor(
            sorted(range(batch), key=lambda i: -contexts[i]), dtype=torch.int32, device=dev
        ),
        "positions": positions.to(dev),
        "slots": slots.to(dev),
        "cos_sin": RotaryEmbedding(HEAD_DIM, 4096, 1_000_000.0).to(dev).cos_sin_cache.to(dt),
    }


def step(s: dict) -> torch.Tensor:
    x, residual = s["x"], None
    for lw, (k_cache, v_cache) in zip(s["weights"], s["caches"]):
        if residual is None:
            h, residual = rms_norm(x, lw["in_norm"], EPS), x
        else:
            h, residual = rms_norm(x, lw["in_norm"], EPS, residual)
        qkv = F.linear(h, lw["qkv"])
        q, _ = qk_norm_rope(
            qkv, s["positions"], lw["q_norm"], lw["k_norm"], s["cos_sin"], EPS, HEADS, KV_HEADS, HEAD_DIM,
            kv_cache=(k_cache, v_cache, s["slots"], 1.0, 1.0),
        )  # fmt: skip
        out = torch.empty_like(q)
        tk.paged_decode(
            q, k_cache, v_cache, out, s["tables"], s["context_lens"], s["cu_seqlens_q"], HEAD_DIM**-0.5,
            seq_order=s["seq_order"],
        )  # fmt: skip
        x = F.linear(out.view(q.shape[0], -1), lw["o"])
        h, residual = rms_norm(x, lw["post_norm"], EPS, residual)
        x = F.linear(silu_and_mul(F.linear(h, lw["gate_up"])), lw["down"])
    return x + residual


def rope_only(s: dict) -> None:
    qkv = s.setdefault(
        "qkv",
        torch.randn(s["x"].shape[0], (HEADS + 2 * KV_HEADS) * HEAD_DIM, device="cuda").to(torch.bfloat16),
    )
    for lw, (k_cache, v_cache) in zip(s["weights"], s["caches"]):
        qk_norm_rope(
            qkv, s["positions"], lw["q_norm"], lw["k_norm"], s["cos_sin"], EPS, HEADS, KV_HEADS, HEAD_DIM,
            kv_cache=(k_cache, v_cache, s["slots"], 1.0, 1.0),
        )  # fmt: skip


def graph_us(fn, s: dict) -> tuple[float, object]:
    result = fn(s)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = fn(s)
    graph.replay()
    torch.cuda.synchronize()
    ms = triton.testing.do_bench(graph.replay, warmup=20, rep=300, return_mode="median")
    return ms * 1e3, (result.clone() if result is not None else None)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    s = build(args.batch, args.layers)
    rows = []
    outputs = {}
    for _ in range(args.repeats):
        for pdl in ("0", "1"):
            os.environ["TANDEM_PDL"] = pdl
            us, out = graph_us(step, s)
            outputs.setdefault(pdl, out)
            rope_us, _ = graph_us(rope_only, s)
            rows.append((pdl, us, rope_us / args.layers))
    os.environ.pop("TANDEM_PDL")
    same = torch.equal(outputs["0"], outputs["1"])
    print(
        f"batch {args.batch}, {args.layers} layers, e4m3 cache, block size {BLOCK_SIZE}; PDL and not give the same bytes: {same}"
    )
    print("| TANDEM_PDL | decode step (us) | fused rotary + K/V store (us a launch) |")
    print("|---|---|---|")
    for pdl, us, rope in rows:
        print(f"| {pdl} | {us:.1f} | {rope:.2f} |")
    if not same:
        raise SystemExit("PDL changed the step's output")


if __name__ == "__main__":
    main()
