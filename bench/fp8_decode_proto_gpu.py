"""The fp8 decode prototypes on the GPU (not yet run): bench/fp8_decode_gluon.py's Gluon kernel and
bench/fp8_decode_tl_variants.py's plain-Triton variants 10 and 11, checked against the production
paged_decode over the same e4m3 caches, then timed like bench/attention.py (CUDA-graph replays,
TB/s of fp8 K and V bytes). Qwen3-0.6B shapes: 16 query heads, 8 KV heads, head_dim 128.

    python bench/fp8_decode_proto_gpu.py                # check, then b256x1024 at block size 32
    python bench/fp8_decode_proto_gpu.py --check-only
    python bench/fp8_decode_proto_gpu.py --batch 8 --context 8192   # (the prototypes have no splits)

The prototypes need a block size that is a multiple of 32 (the Gluon kernel: a warp's 32 keys in
one block) and launch one program per (KV head, sequence): no split-KV.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from attention import FP8, HEAD_DIM, NUM_KV_HEADS, SCALE, paged_decode_inputs, time_graph_ms
from fp8_decode_gluon import launch_gluon
from fp8_decode_tl_variants import launch_variant

from executor_service.attention import triton_kernels as tk

KV_SCALES = (0.5, 0.5)
_CU_SEQLENS: dict = {}


def _cu_seqlens(num_seqs: int, device) -> torch.Tensor:
    """arange(num_seqs + 1), made once (outside the CUDA-graph capture: not among the timed work)."""
    key = (num_seqs, str(device))
    if key not in _CU_SEQLENS:
        _CU_SEQLENS[key] = torch.arange(num_seqs + 1, dtype=torch.int32, device=device)
    return _CU_SEQLENS[key]


def candidates() -> dict:
    """name -> fn(q, k_cache, v_cache, out, block_tables, context_lens)."""
    out = {
        "production": lambda q, k, v, o, bt, cl: tk.paged_decode(
            q, k, v, o, bt, cl, _cu_seqlens(q.shape[0], q.device), SCALE,
            num_splits=1, kv_scales=KV_SCALES,
        ),
    }  # fmt: skip
    # the plain-Triton ones first: a Gluon kernel faulting would leave the CUDA context unusable
    for variant, stages in ((10, 2), (10, 3), (11, 2)):
        out[f"tl variant {variant} stages {stages}"] = lambda q, k, v, o, bt, cl, s=stages, n=variant: (
            launch_variant(q, k, v, o, bt, cl, SCALE, KV_SCALES, variant=n, stages=s)
        )
    for stages, sub, lazy in ((2, 1, False), (3, 1, False), (2, 2, False), (2, 1, True), (2, 2, True)):
        name = f"gluon stages {stages} tile {128 * sub}{' lazy' if lazy else ''}"
        out[name] = lambda q, k, v, o, bt, cl, s=stages, u=sub, z=lazy: launch_gluon(
            q, k, v, o, bt, cl, SCALE, KV_SCALES, stages=s, sub=u, lazy=z
        )
    return out


def check() -> bool:
    """Each candidate against production paged_decode (one split) at block sizes 32 and 64 and
    contexts around the tile and block edges; the V slots past each context zeroed, as the store
    leaves them."""
    ok = True
    contexts = [1, 2, 31, 32, 33, 64, 127, 128, 129, 255, 256, 257, 300, 511, 1000, 1024]
    for block_size in (32, 64):
        torch.manual_seed(block_size)
        x = paged_decode_inputs(len(contexts), max(contexts), block_size, FP8, contexts=contexts)
        v_slots = x["v_cache"].permute(0, 3, 1, 2)  # [num_blocks, block_size, heads, dim] view
        for table, c in zip(x["block_tables"].tolist(), contexts, strict=True):
            if c % block_size:
                v_slots[table[(c - 1) // block_size], c % block_size :] = 0
        args = (x["q"], x["k_cache"], x["v_cache"])
        meta = (x["block_tables"], x["context_lens"])
        ref = None
        for name, fn in candidates().items():
            out = torch.full_like(x["q"], float("nan"))
            try:
                fn(*args, out, *meta)
                torch.cuda.synchronize()
            except Exception as e:  # one prototype failing to compile or launch: report, go on
                print(f"check bs{block_size} {name}: FAIL ({type(e).__name__}: {e})")
                ok = False
                continue
            if ref is None:
                ref = out.float()
                continue
            err = (out.float() - ref).abs().max().item()
            good = bool(torch.isfinite(out).all()) and err < 2e-2
            ok &= good
            print(
                f"check bs{block_size} {name}: max abs diff from production {err:.2e} {'ok' if good else 'FAIL'}"
            )
    return ok


def bench(batch: int, context: int, block_size: int) -> None:
    x = paged_decode_inputs(batch, context, block_size, FP8)
    out = torch.empty_like(x["q"])
    kv_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM  # one byte a value
    for name, fn in candidates().items():
        try:
            ms = time_graph_ms(
                lambda fn=fn: fn(
                    x["q"], x["k_cache"], x["v_cache"], out, x["block_tables"], x["context_lens"]
                )
            )
        except Exception as e:
            print(f"decode fp8 b{batch}x{context} bs{block_size} {name}: FAIL ({type(e).__name__}: {e})")
            continue
        print(
            f"decode fp8 b{batch}x{context} bs{block_size} {name}: {ms * 1e3:.1f} us, {kv_bytes / ms / 1e9:.2f} TB/s"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check-only", action="store_true")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--block-size", type=int, nargs="*", default=[32, 64])
    args = parser.parse_args()
    ok = check()
    if args.check_only:
        sys.exit(0 if ok else 1)
    for block_size in args.block_size:
        bench(args.batch, args.context, block_size)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
