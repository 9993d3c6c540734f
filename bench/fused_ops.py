"""RMSNorm and SiLU-and-mul (layers/triton_ops.py) over launch shapes, at a model's widths and a
range of step sizes: the warps of RMSNorm's program a row, SiLU-and-mul's columns and warps a
program, each with and without the fused fp8 quantization (W4's path and W1's).

At W4's decode step of 256 tokens (Qwen3-8B: hidden 4,096, intermediate 12,288) the two take 0.75
ms of a 9.85 ms step on the H200 (bench/RESULTS.md, 2026-12-06): RMSNorm 5.7 us a launch for ~7 MB
(1.2 TB/s), SiLU-and-mul 9.3 us for ~16 MB (1.7 TB/s), where the copy rate is ~4 TB/s.

    python bench/fused_ops.py                      # Qwen3-8B's widths, 16-16,384 tokens
    python bench/fused_ops.py --shape qwen3-0.6b   # W1's (hidden 1,024, intermediate 3,072)
    python bench/fused_ops.py --check-only         # correctness of every shape, no timing (CPU: TRITON_INTERPRET=1)

Each launch is timed as the median of CUDA-graph replays of 20 launches (the graph's own launch
spread over them). Every shape is checked first: SiLU-and-mul's output and quantized bytes equal
the default launch's bit for bit; RMSNorm's output within one rounding step of it (the warps set
the order of its sum of squares) and its residual sum equal. The last lines are the entries of
triton_ops.RMS_NORM_WARPS and SILU_AND_MUL_TILES where a shape beats the default by 3% or more at
the largest decode batch timed (the table is keyed by width only).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from executor_service.layers import triton_ops

WIDTHS = {"qwen3-8b": (4096, 12288), "qwen3-0.6b": (1024, 3072)}
RMS_WARPS = (1, 2, 4, 8, 16)
SILU_TILES = tuple((block, warps) for block in (512, 1024, 2048, 4096) for warps in (2, 4, 8, 16))
REPLAYS_PER_GRAPH = 20


def time_us(fn) -> float:
    """Median microseconds a launch of fn, from CUDA-graph replays of REPLAYS_PER_GRAPH launches."""
    import triton

    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(REPLAYS_PER_GRAPH):
            fn()
    ms = triton.testing.do_bench(graph.replay, warmup=10, rep=100, return_mode="median")
    return ms * 1e3 / REPLAYS_PER_GRAPH


def rms_case(m: int, hidden: int, quant: bool, device: str, warps: int | None):
    """rms_norm with a residual (the decoder layer's) at `warps` (None: the default launch)."""
    gen = torch.Generator(device="cpu").manual_seed(m)
    x = torch.randn(m, hidden, generator=gen).to(torch.bfloat16).to(device)
    residual = torch.randn(m, hidden, generator=gen).to(torch.bfloat16).to(device)
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(torch.bfloat16).to(device)

    def run():
        saved = dict(triton_ops.RMS_NORM_WARPS)
        if warps is not None:
            triton_ops.RMS_NORM_WARPS[hidden] = warps
        try:
            return triton_ops.rms_norm(x, weight, 1e-6, residual, quantize_rows_multiple=1 if quant else 0)
        finally:
            triton_ops.RMS_NORM_WARPS.clear()
            triton_ops.RMS_NORM_WARPS.update(saved)

    # bytes: x, residual read; the sum written; the output (bf16, or e4m3 and a scale a group)
    out_bytes = m * hidden * (1 if quant else 2) + (m * hidden // 128 * 4 if quant else 0)
    return run, 3 * m * hidden * 2 + out_bytes


def silu_case(m: int, size: int, quant: bool, device: str, tile: tuple[int, int] | None):
    gen = torch.Generator(device="cpu").manual_seed(m + 1)
    gate_up = (4 * torch.randn(m, 2 * size, generator=gen)).to(torch.bfloat16).to(device)

    def run():
        saved = dict(triton_ops.SILU_AND_MUL_TILES)
        if tile is not None:
            triton_ops.SILU_AND_MUL_TILES[size] = tile
        try:
            return triton_ops.silu_and_mul(gate_up, quantize_rows_multiple=1 if quant else 0)
        finally:
            triton_ops.SILU_AND_MUL_TILES.clear()
            triton_ops.SILU_AND_MUL_TILES.update(saved)

    out_bytes = m * size * (1 if quant else 2) + (m * size // 128 * 4 if quant else 0)
    return run, m * 2 * size * 2 + out_bytes


def _parts(result) -> list[torch.Tensor]:
    """The tensors a fused op returns: (out, sum) or an Fp8Input's bytes and scales."""
    from executor_service.layers.fp8_gemm_triton import Fp8Input

    items = (result,) if isinstance(result, (torch.Tensor, Fp8Input)) else result
    out = []
    for item in items:
        if isinstance(item, torch.Tensor):
            out.append(item)
        else:  # Fp8Input
            out += [item.q.view(torch.uint8), item.scales]
    return out


def check(op: str, got, want, what: str) -> None:
    """SiLU-and-mul: every tensor equal; RMSNorm: the residual sum equal, the output within two
    bf16 rounding steps (the row's scale a bit apart, then the weight's product) or one e4m3 code
    (quantized; its group scales likewise within 2^-6)."""
    got_parts, want_parts = _parts(got), _parts(want)
    assert len(got_parts) == len(want_parts), what
    for i, (g, w) in enumerate(zip(got_parts, want_parts, strict=True)):
        if op == "silu_and_mul" or torch.equal(g, w):
            assert torch.equal(g, w), f"{what}: output {i} differs from the default launch's"
            continue
        if g.dtype == torch.uint8:  # e4m3 codes: a rounding step is one code (same sign)
            diff = (g.to(torch.int16) - w.to(torch.int16)).abs()
            assert int(diff.max()) <= 1, f"{what}: e4m3 codes {int(diff.max())} apart"
        else:
            rel = ((g.float() - w.float()).abs() / w.float().abs().clamp_min(1e-30)).max()
            assert float(rel) <= 2**-6, f"{what}: output {i} {float(rel):.3g} from the default launch's"
    if op == "rms_norm":
        assert torch.equal(got[1], want[1]), f"{what}: the residual sum"


def sweep(widths: tuple[int, int], tokens: list[int], device: str, check_only: bool) -> dict:
    """Checks, then (unless check_only) times every launch shape; returns the winners as
    bench/throughput.py's --fused-op-launch JSON object (empty where the defaults hold)."""
    hidden, intermediate = widths
    table: dict[str, list[str]] = {"RMS_NORM_WARPS": [], "SILU_AND_MUL_TILES": []}
    launch: dict[str, dict] = {}
    decode_m = max((m for m in tokens if m <= 256), default=tokens[-1])
    for op, width, variants in (
        ("rms_norm", hidden, [(w,) for w in RMS_WARPS]),
        ("silu_and_mul", intermediate, SILU_TILES),
    ):
        for quant in (True, False):
            name = f"{op} {'quantized' if quant else 'bf16'} width {width}"
            rows: dict[str, dict[int, float]] = {}
            for m in tokens:
                make = rms_case if op == "rms_norm" else silu_case
                default_run, nbytes = make(m, width, quant, device, None)
                want = default_run()
                for variant in variants:
                    arg = variant[0] if op == "rms_norm" else variant
                    run, _ = make(m, width, quant, device, arg)
                    label = (
                        f"{variant[0]} warps"
                        if op == "rms_norm"
                        else f"{variant[0]} cols, {variant[1]} warps"
                    )
                    check(op, run(), want, f"{name} m={m} {label}")
                    if not check_only:
                        rows.setdefault(label, {})[m] = time_us(run)
                if not check_only:
                    rows.setdefault("default", {})[m] = time_us(default_run)
                    rows.setdefault("(bytes moved, MB)", {})[m] = nbytes / 1e6
            print(f"{name}: {'checked' if check_only else 'us a launch'} at {tokens} tokens", flush=True)
            if check_only:
                continue
            print(f"  {'':24s}" + "".join(f"{f'm={m}':>10s}" for m in tokens))
            for label, times in rows.items():
                print(f"  {label:24s}" + "".join(f"{times[m]:10.2f}" for m in tokens))
            default = rows["default"][decode_m]
            timed = {k: v for k, v in rows.items() if k not in ("default", "(bytes moved, MB)")}
            best = min(timed, key=lambda k: timed[k][decode_m])
            tbs = rows["(bytes moved, MB)"][decode_m] / timed[best][decode_m]
            print(
                f"  best at m={decode_m}: {best} {timed[best][decode_m]:.2f} us ({tbs:.2f} TB/s) against the default's {default:.2f}"
            )
            if quant and timed[best][decode_m] <= 0.97 * default:
                # keyed by width alone: the quantized (W4) path decides; the bf16 row is printed to compare
                if op == "rms_norm":
                    table["RMS_NORM_WARPS"].append(f"{width}: {best.split()[0]}")
                    launch.setdefault("rms_norm_warps", {})[str(width)] = int(best.split()[0])
                else:
                    cols, warps = best.replace(",", "").split()[0::2][:2]
                    table["SILU_AND_MUL_TILES"].append(f"{width}: ({cols}, {warps})")
                    launch.setdefault("silu_and_mul_tiles", {})[str(width)] = [int(cols), int(warps)]
    if not check_only:
        for knob, entries in table.items():
            print(
                f"table {knob} = {{{', '.join(entries)}}}" if entries else f"table {knob}: the default holds"
            )
    print(
        f"widths {hidden} / {intermediate}: every launch shape checked against the default launch", flush=True
    )
    return launch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(WIDTHS), default="qwen3-8b")
    p.add_argument("--tokens", default="16,64,128,256,2048,16384", help="step sizes (comma-separated)")
    p.add_argument("--check-only", action="store_true", help="check every launch shape; time nothing")
    p.add_argument("--widths", default=None, help="hidden,intermediate instead of --shape's (the CPU test's)")
    p.add_argument("--launch-out", default=None, help="write the winners as --fused-op-launch JSON here")
    args = p.parse_args()
    widths = tuple(int(w) for w in args.widths.split(",")) if args.widths else WIDTHS[args.shape]
    tokens = sorted(int(t) for t in args.tokens.split(","))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.check_only:
        raise SystemExit("timing needs a CUDA device (on the CPU: --check-only under TRITON_INTERPRET=1)")
    launch = sweep(widths, tokens, device, args.check_only)
    if args.launch_out:
        Path(args.launch_out).write_text(json.dumps(launch) + "\n")
        print(f"--fused-op-launch {json.dumps(launch)} written to {args.launch_out}")


if __name__ == "__main__":
    main()
