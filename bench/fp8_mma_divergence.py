"""Where FP8_MMA's greedy tokens part from the widening fp8 decode kernel's, and whether each parting
is a near-tie: the engine run twice on one GPU (the decode config's FP8_MMA off, then on), greedy,
with 2 logprobs a token; for each stream the first position whose tokens differ and the widening
run's top-1/top-2 logprob margin there (a rounding difference can only flip a near-tie: margins of
a few hundredths; a margin of 1 or more means the two runs computed different things).

On 2026-12-05's H100 the engine test on the tests' random bf16 model (head_dim 64) agreed at 142 of
192 positions, where a CPU model of FP8_MMA's rounding agreed at 185: this says which it was.

    python bench/fp8_mma_divergence.py                   # the tests' random model, its prompts
    python bench/fp8_mma_divergence.py --model <dir>     # any bf16 checkpoint, random prompts
    python bench/fp8_mma_divergence.py --cpu-baseline    # the yardstick: two exact CPU runs

--cpu-baseline runs the same comparison between two runs of the CPU torch backend with an fp8 cache
that differ only in summation order (the prompts prefilled whole, then in chunks of 8 tokens): how
often this model's greedy tokens part under a rounding difference that no one would call a bug.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(1, str(Path(__file__).resolve().parents[1] / "tests"))  # (checkpoints.build_qwen3)

from client.llm import LLM
from executor_service.attention import triton_kernels
from scheduler_service.sampling_params import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a checkpoint (default: the tests' random Qwen3, head_dim 64)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument(
        "--cpu-baseline", action="store_true",
        help="compare two CPU runs that differ only in prefill chunking (no GPU), as the yardstick",
    )  # fmt: skip
    args = parser.parse_args()
    if args.model is None:
        from checkpoints import build_qwen3

        args.model = str(build_qwen3(Path(tempfile.mkdtemp()), head_dim=64, seed=1))
    rng = random.Random(16)  # tests/helpers/hf_reference.make_prompts' draw for 30-37 tokens
    prompts = [[rng.randrange(2, 400) for _ in range(30 + i)] for i in range(args.prompts)]
    params = SamplingParams(max_tokens=args.max_tokens, logprobs=2)
    if args.cpu_baseline:
        # the whole prompts in one step, then 8 tokens a step: each prompt's attention summed in
        # another order, every kernel exact to its own rounding
        labels = ("whole prefill", "chunks of 8")
        setups = [
            (lambda: None, {"device": "cpu", "max_num_seqs": 8, "max_num_batched_tokens": b})
            for b in (4096, 8)
        ]
    else:
        labels = ("widening", "FP8_MMA")
        setups = [
            (lambda mma=mma: triton_kernels.DECODE_CONFIG_FP8.__setitem__("FP8_MMA", mma),
             {"device": "cuda", "enforce_eager": args.enforce_eager})
            for mma in (False, True)
        ]  # fmt: skip
    runs = []
    for setup, options in setups:
        setup()
        llm = LLM(
            args.model, num_kv_blocks=12, max_model_len=128, kv_cache_dtype="fp8", dtype="bfloat16", **options
        )
        runs.append(llm.generate(prompts, params, use_tqdm=False))
        llm.executor.close()
    same = total = 0
    for i, (first_run, second_run) in enumerate(zip(*runs, strict=True)):
        a, b = first_run.outputs[0], second_run.outputs[0]
        same += sum(x == y for x, y in zip(a.token_ids, b.token_ids, strict=False))
        total += len(a.token_ids)
        first = next(
            (k for k, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=False)) if x != y), None
        )
        if first is None:
            print(f"stream {i}: the same {len(a.token_ids)} tokens")
            continue
        top = sorted(a.logprobs[first].values(), key=lambda lp: -lp.logprob)
        margin = top[0].logprob - top[1].logprob if len(top) > 1 else float("nan")
        mma_top = sorted(b.logprobs[first].values(), key=lambda lp: -lp.logprob)
        print(
            f"stream {i}: first difference at token {first}: {labels[0]} {a.token_ids[first]} (margin over "
            f"the next {margin:.4f}), {labels[1]} {b.token_ids[first]} (its logprobs "
            f"{[round(lp.logprob, 4) for lp in mma_top]}, the first run's {[round(lp.logprob, 4) for lp in top]})"
        )
    print(f"positions with the same token: {same} of {total}")


if __name__ == "__main__":
    main()
