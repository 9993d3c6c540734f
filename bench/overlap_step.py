"""Two micro-batches on two CUDA streams: does overlapping one half's attention with the other
half's GEMMs shorten W1's decode step? (A lead for issue 17's W1 target, in the manner of NanoFlow's
intra-device parallelism and SGLang's two-batch overlap; nothing of it is in the engine.)

W1's decode step as its kernels run it, without the engine: 28 layers of Qwen3-0.6B's shape at batch
256 over a paged KV cache (e4m3 at block size 32, or bf16 at 16; contexts drawn like W1's mid-run),
each layer RMSNorm -> q/k/v GEMM -> the fused q/k norm, rotary and K/V store -> paged decode attention
-> o GEMM -> RMSNorm -> gate/up GEMM -> SiLU-and-mul -> down GEMM, each variant replayed from one CUDA
graph:

  whole      the 256 sequences as one batch (what the engine runs)
  halves     two halves of 128 (alternate sequences by context, so their KV bytes match), one after
             the other on one stream
  streams    the same two halves on two streams, forked and joined inside the graph, so that the GPU
             runs one half's kernels in the other's idle SMs (a GEMM of 128 tokens fills a fraction
             of the SMs; attention is bound by DRAM)
  staggered  streams, the second half starting once the first has done its first layer's attention

`halves` and `streams` run the same kernels on the same inputs, so their outputs must be the same
bytes (checked: a race between the streams would show); `whole` is checked against `halves` to
bf16's rounding (a GEMM of 128 rows may sum in another order than one of 256).

    python bench/overlap_step.py [--batch 256] [--layers 28] [--kv bf16|fp8] [--repeats 3]
"""

from __future__ import annotations

import argparse
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
EPS = 1e-6
FP8 = torch.float8_e4m3fn


def build(batch: int, layers: int, kv: str, seed: int = 0) -> dict:
    torch.manual_seed(seed)
    rng = random.Random(seed)
    dev, dt = "cuda", torch.bfloat16
    block_size = 32 if kv == "fp8" else 16
    # W1's contexts mid-run: its prompt plus part of its output.
    contexts = [rng.randint(100, 1024) + rng.randint(1, 512) for _ in range(batch)]
    blocks = [triton.cdiv(c, block_size) for c in contexts]
    perm = torch.randperm(sum(blocks)).tolist()
    tables = torch.zeros(batch, max(blocks), dtype=torch.int32)
    at = 0
    for i, n in enumerate(blocks):
        tables[i, :n] = torch.tensor(perm[at : at + n])
        at += n
    positions = [c - 1 for c in contexts]
    slots = [int(tables[i, p // block_size]) * block_size + p % block_size for i, p in enumerate(positions)]
    shape = (sum(blocks), block_size, KV_HEADS, HEAD_DIM)
    caches = []
    for _ in range(layers):
        k = torch.randn(shape, device=dev) * 0.5
        v = torch.randn(shape, device=dev) * 0.5
        caches.append((k.to(FP8), fp8_v_cache(v.to(FP8))) if kv == "fp8" else (k.to(dt), v.to(dt)))

    def w(*dims):
        return (torch.randn(*dims, device=dev) * dims[-1] ** -0.5).to(dt)

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
        "weights": weights,
        "caches": caches,
        "cos_sin": RotaryEmbedding(HEAD_DIM, 4096, 1_000_000.0).to(dev).cos_sin_cache.to(dt),
        "x": torch.randn(batch, HIDDEN, device=dev).to(dt),
        "contexts": contexts,
        "tables": tables,
        "positions": positions,
        "slots": slots,
    }


def batch_inputs(s: dict, rows: list[int]) -> dict:
    """The step's per-sequence inputs for `rows` of the batch, as the engine would build them."""
    dev = "cuda"
    contexts = [s["contexts"][i] for i in rows]
    return {
        "rows": torch.tensor(rows, device=dev),
        "x": s["x"][rows].contiguous(),
        "tables": s["tables"][rows].to(dev),
        "context_lens": torch.tensor(contexts, dtype=torch.int32, device=dev),
        "cu_seqlens_q": torch.arange(len(rows) + 1, dtype=torch.int32, device=dev),
        "seq_order": torch.tensor(
            sorted(range(len(rows)), key=lambda i: -contexts[i]), dtype=torch.int32, device=dev
        ),
        "positions": torch.tensor([s["positions"][i] for i in rows], device=dev),
        "slots": torch.tensor([s["slots"][i] for i in rows], device=dev),
    }


def forward(s: dict, b: dict, after_first_attention=None) -> torch.Tensor:
    """The 28 layers over batch inputs b; after_first_attention(): called once layer 0's attention
    is launched (to record an event there)."""
    x, residual = b["x"], None
    for layer, (lw, (k_cache, v_cache)) in enumerate(zip(s["weights"], s["caches"])):
        if residual is None:
            h, residual = rms_norm(x, lw["in_norm"], EPS), x
        else:
            h, residual = rms_norm(x, lw["in_norm"], EPS, residual)
        qkv = F.linear(h, lw["qkv"])
        q, _ = qk_norm_rope(
            qkv, b["positions"], lw["q_norm"], lw["k_norm"], s["cos_sin"], EPS, HEADS, KV_HEADS, HEAD_DIM,
            kv_cache=(k_cache, v_cache, b["slots"], 1.0, 1.0),
        )  # fmt: skip
        out = torch.empty_like(q)
        tk.paged_decode(
            q, k_cache, v_cache, out, b["tables"], b["context_lens"], b["cu_seqlens_q"], HEAD_DIM**-0.5,
            seq_order=b["seq_order"],
        )  # fmt: skip
        if layer == 0 and after_first_attention is not None:
            after_first_attention()
        x = F.linear(out.view(q.shape[0], -1), lw["o"])
        h, residual = rms_norm(x, lw["post_norm"], EPS, residual)
        x = F.linear(silu_and_mul(F.linear(h, lw["gate_up"])), lw["down"])
    return x + residual


def variants(s: dict, batch: int) -> dict:
    order = sorted(range(batch), key=lambda i: -s["contexts"][i])
    whole = batch_inputs(s, list(range(batch)))
    halves = [batch_inputs(s, sorted(order[0::2])), batch_inputs(s, sorted(order[1::2]))]
    out = torch.empty(batch, HIDDEN, device="cuda", dtype=torch.bfloat16)

    def gather(parts):
        for b, y in zip(halves, parts):
            out[b["rows"]] = y
        return out

    def run_whole():
        return forward(s, whole)

    def run_halves():
        return gather([forward(s, b) for b in halves])

    streams = [torch.cuda.Stream(), torch.cuda.Stream()]

    def run_streams(stagger: bool):
        main = torch.cuda.current_stream()
        started = torch.cuda.Event()
        parts = [None, None]
        for i, (stream, b) in enumerate(zip(streams, halves)):
            stream.wait_stream(main)
            if stagger and i == 1:
                stream.wait_event(started)
            with torch.cuda.stream(stream):
                parts[i] = forward(s, b, started.record if (stagger and i == 0) else None)
        for stream in streams:
            main.wait_stream(stream)
        return gather(parts)

    return {
        "whole": run_whole,
        "halves": run_halves,
        "streams": lambda: run_streams(False),
        "staggered": lambda: run_streams(True),
    }


def graph_us(fn) -> tuple[float, torch.Tensor]:
    fn()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = fn()
    graph.replay()
    torch.cuda.synchronize()
    first = result.clone()
    ms = triton.testing.do_bench(graph.replay, warmup=20, rep=300, return_mode="median")
    return ms * 1e3, first


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--kv", choices=("bf16", "fp8"), default="fp8")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    s = build(args.batch, args.layers, args.kv)
    runs = variants(s, args.batch)
    times: dict[str, list[float]] = {name: [] for name in runs}
    outputs = {}
    for _ in range(args.repeats):
        for name, fn in runs.items():
            us, out = graph_us(fn)
            times[name].append(us)
            outputs.setdefault(name, out)
    ref = outputs["halves"]
    print(f"batch {args.batch}, {args.layers} layers, {args.kv} cache; us a decode step (CUDA graph replays)")
    print("| variant | us a step, each repeat | vs whole | output |")
    print("|---|---|---|---|")
    base = min(times["whole"])
    for name, ts in times.items():
        if name == "whole":
            check = f"max |diff| from halves {(outputs[name].float() - ref.float()).abs().max().item():.3g}"
        else:
            check = "same bytes as halves" if torch.equal(outputs[name], ref) else "DIFFERS from halves"
        print(f"| {name} | {' / '.join(f'{t:.1f}' for t in ts)} | {min(ts) / base:.3f} | {check} |")


if __name__ == "__main__":
    main()
