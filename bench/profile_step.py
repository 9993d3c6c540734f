"""Where a W1 step's GPU time goes: decode steps of the W1 model (Qwen3-0.6B shape) at a fixed batch
and context, timed end to end (CUDA graphs, as the engine runs them) and broken down by kernel with
torch.profiler, with the fused ops on and off.

    python bench/profile_step.py [--batch 256] [--context 512] [--steps 32] [--shape qwen3-8b] [-tp 2]

Prints, for each setting, the mean decode step in ms, rank 0's GPU kernel time per decode step
and its share by group (attention, GEMM, fused Triton ops, all-reduce under tensor parallelism,
sampling, other elementwise), then the top kernels. The prefill's kernels are left out: those of
a one-token run are subtracted from those of the longer run.
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.throughput import SHAPES, add_fp8_gemm_flags, apply_fp8_gemm_flags, build_w1_checkpoint

GROUPS = (
    ("all-reduce", ("nccl", "allreduce", "all_reduce")),
    ("attention", ("paged_attention", "store_kv", "split_kv_reduce", "flash", "varlen", "fmha")),
    ("moe", ("_moe_gemm", "_route", "_count", "_align", "_sum_topk")),
    ("fp8 quantize", ("quantize_per_token_group",)),  # the W8A8 GEMMs' activations
    ("gemm", ("gemm", "sm90", "cutlass", "nvjet", "cublas", "matmul", "splitk")),
    ("fused ops", ("_rms_norm", "_silu_and_mul", "_qk_norm_rope")),
    (
        "sampling",
        (
            "softmax",
            "sort",
            "topk",
            "multinomial",
            "argmax",
            "exponential",
            "gumbel",
            "cumsum",
            "_sample_kernel",
        ),
    ),
)


def group_of(name: str) -> str:
    lowered = name.lower()
    for group, keys in GROUPS:
        if any(k in lowered for k in keys):
            return group
    return "other"


def run(args: argparse.Namespace, model: str, fused_ops: str) -> None:
    from client.llm import LLM
    from scheduler_service.sampling_params import SamplingParams

    llm = LLM(
        model,
        device="cuda",
        fused_ops=fused_ops,
        max_num_seqs=args.batch,
        # The whole prefill in one step, so that every later step is a pure decode step of the batch
        # (in chunks, the first sequences would decode beside later prompts' chunks).
        max_num_batched_tokens=args.batch * args.context,
        enforce_eager=args.enforce_eager,
        tensor_parallel_size=args.tensor_parallel_size,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    rng = random.Random(0)
    prompts = [[rng.randint(0, 10000) for _ in range(args.context)] for _ in range(args.batch)]
    # Warm-up at the measured shapes: kernel compilation and autotuning stay out of the timings.
    llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)

    def generate(max_tokens: int) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        p = SamplingParams(max_tokens=max_tokens, temperature=0.6, ignore_eos=True)
        llm.generate(prompts, p, use_tqdm=False)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    # The prefill is the same in both runs: the difference is (steps - 1) decode steps.
    one, many = generate(1), generate(args.steps)
    step_ms = (many - one) / (args.steps - 1) * 1e3
    print(
        f"fused ops {fused_ops}: decode step at batch {args.batch}, context ~{args.context}: {step_ms:.2f} ms "
        f"({args.batch / step_ms * 1e3:.0f} tok/s)",
        flush=True,
    )

    def kernel_times(max_tokens: int) -> dict[str, list[float]]:
        p = SamplingParams(max_tokens=max_tokens, temperature=0.6, ignore_eos=True)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            llm.generate(prompts, p, use_tqdm=False)
            torch.cuda.synchronize()
        times = defaultdict(lambda: [0.0, 0])
        for event in prof.events():
            if event.device_type == torch.autograd.DeviceType.CUDA:
                times[event.name][0] += event.time_range.elapsed_us()
                times[event.name][1] += 1
        return times

    # Decode steps only: the kernels of a run with one token (the prefill) taken from a longer run.
    prefill, full = kernel_times(1), kernel_times(args.steps)
    kernels = {}
    for name, (t, n) in full.items():
        t0, n0 = prefill.get(name, (0.0, 0))
        if n > n0 and t > t0:
            kernels[name] = [t - t0, n - n0]
    total = sum(t for t, _ in kernels.values()) or 1.0
    print(f"  rank 0's GPU kernel time per decode step: {total / (args.steps - 1) / 1e3:.2f} ms")
    groups = defaultdict(float)
    for name, (t, _) in kernels.items():
        groups[group_of(name)] += t
    steps = args.steps - 1
    print(
        "  GPU time per decode step by group: "
        + ", ".join(
            f"{g} {t / steps / 1e3:.2f} ms ({t / total:.0%})"
            for g, t in sorted(groups.items(), key=lambda x: -x[1])
        )
    )
    for name, (t, n) in sorted(kernels.items(), key=lambda x: -x[1][0])[: args.top]:
        print(f"  {t / total:6.1%} {t / n:8.1f} us x {n:6d}  {name[:100]}")
    llm.executor.close()  # stops the TP ranks, if any


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint (default: the W1 checkpoint, built)")
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b")
    p.add_argument(
        "--w1-dir", default=None, help="where the checkpoint is built (default: a temp dir per shape)"
    )
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--fused-ops", choices=["on", "off", "both"], default="both")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--kv-cache-dtype", default="auto", help="auto (the model dtype) or fp8")
    p.add_argument(
        "--decode-stores-kv",
        choices=["on", "off"],
        default=None,
        help="fp8 KV: whether the decode kernel stores a decode step's K/V (and, with it, normalises and "
        "rotates q and K: DECODE_FUSES_ROPE) or the fused rotary kernel does (attention/triton_kernels.py)",
    )
    p.add_argument(
        "--decode-new-key-regs",
        choices=["on", "off"],
        default=None,
        help="with the decode kernel storing K/V: the step's key from registers, no barrier (DECODE_NEW_KEY_REGS)",
    )
    add_fp8_gemm_flags(p)
    args = p.parse_args(argv)
    if args.decode_new_key_regs is not None:
        from executor_service.attention import triton_kernels

        triton_kernels.DECODE_NEW_KEY_REGS = args.decode_new_key_regs == "on"
    if args.decode_stores_kv is not None:
        from executor_service.attention import triton_kernels

        triton_kernels.DECODE_STORES_KV = triton_kernels.DECODE_FUSES_ROPE = args.decode_stores_kv == "on"
    if not torch.cuda.is_available():
        raise SystemExit("bench/profile_step.py needs a CUDA device")
    if args.tensor_parallel_size > 1 and (args.fp8_gemm_table or args.fp8_gemm_swap_below):
        raise SystemExit("the --fp8-gemm flags set this process's GEMMs: rank 0's alone under -tp")
    apply_fp8_gemm_flags(args)
    w1_dir = Path(args.w1_dir or f"/tmp/tandem-w1-{args.shape}")
    model = args.model or str(build_w1_checkpoint(w1_dir, args.shape))
    for fused_ops in ("on", "off") if args.fused_ops == "both" else (args.fused_ops,):
        run(args, model, fused_ops)
        gc.collect()  # the next engine sizes its KV cache from free memory
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
