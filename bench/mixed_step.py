"""What one prompt arriving costs the running decodes: the W1 model (Qwen3-0.6B shape) decoding a
batch, then one prompt of a given length admitted, each engine step timed (one plan in flight, so
that a step's time is its own).

    python bench/mixed_step.py [--batch 16 64] [--prompt-len 128 512 1024 2048] [--enforce-eager]

Prints, per batch and prompt length, the median pure-decode step, the step that carries the
prompt (its prefill beside the decodes) and the steps after it, in ms. An online server's
inter-token latency p99 is the mixed step: every running stream waits for it.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.throughput import build_w1_checkpoint


def print_kernels(prof, top: int) -> None:
    import torch

    kernels: dict[str, list[float]] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            entry = kernels.setdefault(event.name, [0.0, 0])
            entry[0] += event.time_range.elapsed_us()
            entry[1] += 1
    total = sum(t for t, _ in kernels.values())
    print(
        f"    GPU kernel time of the mixed step: {total / 1e3:.2f} ms in {sum(n for _, n in kernels.values())} kernels"
    )
    for name, (t, n) in sorted(kernels.items(), key=lambda x: -x[1][0])[:top]:
        print(f"    {t / 1e3:7.3f} ms x {n:4d}  {name[:90]}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint (default: the W1 checkpoint, built)")
    p.add_argument("--batch", type=int, nargs="+", default=[16, 64])
    p.add_argument("--prompt-len", type=int, nargs="+", default=[128, 512, 1024, 2048])
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--device", default="cuda")
    p.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="K",
        help="the top K kernels and host functions of a further, profiled mixed step",
    )
    args = p.parse_args(argv)

    import torch

    from client.llm import LLM
    from scheduler_service.sampling_params import SamplingParams

    model = args.model or str(build_w1_checkpoint(Path(tempfile.gettempdir()) / "tandem-w1-qwen3-0.6b"))
    llm = LLM(
        model, device=args.device, max_num_seqs=256, max_plans_in_flight=1, enforce_eager=args.enforce_eager
    )
    engine = llm.engine
    rng = random.Random(0)
    vocab = engine.limits.vocab_size
    decode = SamplingParams(max_tokens=engine.limits.max_model_len - 64, temperature=0.6, ignore_eos=True)

    def timed_step() -> float:
        t0 = time.perf_counter()
        engine.step()
        if args.device == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - t0) * 1e3

    print(f"model {model}, one plan in flight, enforce_eager {args.enforce_eager}", flush=True)
    print("| batch | prompt | decode step ms (median) | mixed step ms | next 3 steps ms |")
    print("| --- | --- | --- | --- | --- |")
    for batch in args.batch:
        running = [
            engine.add_request([rng.randrange(vocab) for _ in range(64)], decode) for _ in range(batch)
        ]
        for _ in range(8):  # prefilled and decoding
            timed_step()
        for length in args.prompt_len:
            mixed = after = None
            for phase in ("warm-up", "timed", "profiled"):
                if phase == "profiled" and not args.profile:
                    break
                base = statistics.median(timed_step() for _ in range(16))
                engine.add_request(
                    [rng.randrange(vocab) for _ in range(length)],
                    SamplingParams(max_tokens=4, temperature=0.6, ignore_eos=True),
                )
                if phase == "profiled":
                    with torch.profiler.profile() as prof, cProfile.Profile() as host:
                        timed_step()
                    for _ in range(3):
                        timed_step()
                    continue
                mixed = timed_step()
                after = [timed_step() for _ in range(3)]
            print(
                f"| {batch} | {length} | {base:.2f} | {mixed:.2f} | {' / '.join(f'{t:.2f}' for t in after)} |",
                flush=True,
            )
            if args.profile:
                print_kernels(prof, args.profile)
                pstats.Stats(host).sort_stats("tottime").print_stats(args.profile)
        for rid in running:
            engine.abort_request(rid)
        for _ in range(4):
            timed_step()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
