"""CPU cost of the scheduler per decode step: schedule (plan building included) + update.

256 running sequences with prompts of a few hundred tokens, already prefilled, and a
trivial in-process executor. Prints mean / p50 / p99 per step in milliseconds.

    python bench/scheduler_overhead.py [--num-seqs 256] [--steps 2000]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

from protos.executor import StepOnlyExecutor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from protos.plan import ExecutorInfo, StepPlan, StepResult
from scheduler_service.config import SchedulerConfig
from scheduler_service.engine import LLMEngine
from scheduler_service.sampling_params import SamplingParams


class TrivialExecutor(StepOnlyExecutor):
    """Samples token 7 for every sequence that reaches the end of its known tokens."""

    def __init__(self, info: ExecutorInfo) -> None:
        self.info = info
        self.pending: dict[int, int] = {}  # seq id -> tokens not yet computed

    def describe(self) -> ExecutorInfo:
        return self.info

    def reset(self) -> int:
        self.pending.clear()
        return 0

    def step(self, plan: StepPlan) -> StepResult:
        pending = self.pending
        for sid in plan.finished_seq_ids + plan.preempted_seq_ids:
            del pending[sid]
        for s in plan.new_seqs:
            pending[s.seq_id] = len(s.token_ids) - s.num_computed_tokens
        sampled = []
        for sid, n in zip(plan.seq_ids, plan.num_scheduled_tokens, strict=True):
            left = pending[sid] - n
            if left == 0:
                sampled.append(sid)
                left = 1
            pending[sid] = left
        return StepResult(
            step_id=plan.step_id, seq_ids=sampled, token_ids=[7] * len(sampled), num_tokens=[1] * len(sampled)
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-seqs", type=int, default=256, help="running decode sequences")
    parser.add_argument("--steps", type=int, default=2000, help="decode steps measured")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    parser.add_argument("--no-prefix-caching", action="store_true", help="disable prefix caching")
    args = parser.parse_args()

    rng = random.Random(0)
    prompts = [[rng.randrange(2, 32000) for _ in range(rng.randint(200, 400))] for _ in range(args.num_seqs)]
    max_len = 400 + args.steps + 600
    info = ExecutorInfo(
        model="trivial",
        architecture="Trivial",
        block_size=args.block_size,
        num_kv_blocks=args.num_seqs * (max_len // args.block_size + 2),
        max_model_len=max_len,
        vocab_size=32000,
        eos_token_ids=[0],
        tensor_parallel_size=1,
        dtype="bfloat16",
        device="cpu",
        max_num_seqs=args.num_seqs,
        max_num_batched_tokens=8192,
        attention_backend="none",
        num_layers=1,
        block_bytes=1,
    )
    executor = TrivialExecutor(info)
    config = SchedulerConfig(max_num_seqs=args.num_seqs, enable_prefix_caching=not args.no_prefix_caching)
    engine = LLMEngine(executor, config)
    for p in prompts:
        engine.add_request(p, SamplingParams(max_tokens=args.steps + 550, ignore_eos=True))
    scheduler = engine.scheduler
    while scheduler.waiting or any(s.num_computed_tokens < s.num_prompt_tokens for s in scheduler.running):
        engine.step()
    assert scheduler.stats.num_running == args.num_seqs

    sched_ms, total_ms = [], []
    perf = time.perf_counter
    for _ in range(args.steps):
        t0 = perf()
        plan = scheduler.schedule()
        t1 = perf()
        result = executor.step(plan)
        t2 = perf()
        scheduler.update(plan, result)
        t3 = perf()
        assert len(plan.seq_ids) == args.num_seqs and sum(plan.num_scheduled_tokens) == args.num_seqs
        sched_ms.append((t1 - t0 + t3 - t2) * 1e3)
        total_ms.append((t3 - t0) * 1e3)
    # The engine loop adds RequestOutput creation.
    engine_ms = []
    for _ in range(min(args.steps, 500)):
        t0 = perf()
        outs = engine.step()
        engine_ms.append((perf() - t0) * 1e3)
        assert len(outs) == args.num_seqs

    print("command:", " ".join([Path(sys.executable).name, *sys.argv]))
    print(f"{args.num_seqs} decode sequences, {args.steps} steps, block_size {args.block_size}")
    for name, xs in [
        ("schedule + update", sched_ms),
        ("  + trivial executor", total_ms),
        ("engine.step (+ outputs)", engine_ms),
    ]:
        xs = sorted(xs)
        p50, p99 = xs[len(xs) // 2], xs[min(len(xs) - 1, int(len(xs) * 0.99))]
        print(f"{name:<24} mean {statistics.fmean(xs):.3f} ms  p50 {p50:.3f} ms  p99 {p99:.3f} ms")


if __name__ == "__main__":
    main()
