"""How often recompute changes greedy output, and where it does: the bound on what executor
recovery promises.

A request kept through an executor failure is recomputed: its prompt and the k tokens already
streamed go to the new executor as one prompt. That prefill rounds differently from the decode
steps of an undisturbed run, so in a low-precision dtype a greedy step whose top two logits are
nearly tied can flip. This measures, with no fault at all, every (stream, k) pair: the share whose
continuation differs from the undisturbed run, and the undisturbed run's top-1/top-2 logprob
margin at the first differing token (a flip needs a near-tie).

    python bench/recompute_divergence.py                      # the embedded model (bf16), CPU
    python bench/recompute_divergence.py --dtype float32
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from client.defaults import DEFAULT_MODEL
from client.llm import LLM
from scheduler_service.sampling_params import SamplingParams


@dataclass
class Divergence:
    stream: int
    k: int  # tokens streamed before the recompute
    position: int  # first generated token that differs
    margin: float  # the undisturbed run's top-1 minus top-2 logprob there


def measure(
    llm: LLM, prompts: list[list[int]], max_tokens: int, ks: list[int]
) -> tuple[int, list[Divergence]]:
    """(pairs compared, divergences): each prompt's greedy run against its recompute after k tokens."""
    undisturbed = llm.generate(
        prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True, logprobs=2), use_tqdm=False
    )
    pairs = [(i, k) for i in range(len(prompts)) for k in ks]
    recomputed = llm.generate(
        [prompts[i] + undisturbed[i].token_ids[:k] for i, k in pairs],
        SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        use_tqdm=False,
    )
    divergences = []
    for (i, k), out in zip(pairs, recomputed):
        want = undisturbed[i].token_ids[k:]
        got = out.token_ids[: len(want)]
        if got != want:
            j = next(j for j, (a, b) in enumerate(zip(got, want)) if a != b)
            top = undisturbed[i].logprobs[k + j].top_logprobs
            divergences.append(Divergence(i, k, k + j, top[0][1] - top[1][1]))
    return len(pairs), divergences


def token_prompts(n: int, seed: int, vocab: int, lo: int, hi: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument("--dtype", default=None, help="default: the checkpoint's")
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--ks", default="1,2,3,4,6,8,10,12,14,16,18,20,22,24,26,28,30,32,36,40")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    options = {"dtype": args.dtype} if args.dtype else {}
    llm = LLM(args.model, num_kv_blocks=4096, **options)
    vocab = llm.engine.info.vocab_size
    prompts = token_prompts(args.streams, args.seed, vocab, 4, 64)
    ks = [int(k) for k in args.ks.split(",")]
    t0 = time.perf_counter()
    pairs, divergences = measure(llm, prompts, args.max_tokens, ks)
    print(
        f"{args.model} ({llm.engine.info.dtype}): {len(divergences)} of {pairs} (stream, k) pairs differ "
        f"after recompute ({100 * len(divergences) / pairs:.2f}%), {time.perf_counter() - t0:.0f} s"
    )
    if divergences:
        margins = sorted(d.margin for d in divergences)
        print(
            f"top-1/top-2 logprob margin at the first differing token: max {margins[-1]:.4f}, "
            f"median {margins[len(margins) // 2]:.4f}"
        )
        for d in divergences[:10]:
            print(f"  stream {d.stream} k {d.k}: differs at token {d.position}, margin {d.margin:.4f}")


if __name__ == "__main__":
    main()
