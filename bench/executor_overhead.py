"""CPU cost of the executor per decode step, the model left out: plan validation, applying the
plan, batch preparation (numpy, host-to-device copies), greedy sampling of zero logits and the
result. On the GPU all of it runs on the host between the device's steps.

256 sequences with 300-token prompts are admitted and prefilled (the model call is replaced by
zero logits), then every step decodes one token for each. Prints mean / p50 / p99 per step in
milliseconds, split into prepare, the (stubbed) model call with the greedy sampler, the wait for
the sampled ids, and the rest: validation, applying the plan, the result.

With --grpc the same plans also go through the executor service (an in-process ExecutorServer on
a loopback port, driven by the scheduler's RemoteExecutor), one at a time and then with two in
flight: what the split adds per step (protobuf both ways, gRPC threads, the hop to the executor's
own thread) on top of the executor's own work.

    python bench/executor_overhead.py [--num-seqs 256] [--steps 1000] [--profile] [--grpc]

(--steps defaults to 1,000, or 500 with --grpc: the embedded model holds 2,048 positions, and
--grpc runs three times --steps decode steps after the 300-token prompts.)
"""

from __future__ import annotations

import argparse
import cProfile
import itertools
import pstats
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench.gc_times import GCTimes
from client.defaults import DEFAULT_MODEL
from executor_service.config import ExecutorConfig
from executor_service.executor import LocalExecutor
from protos.plan import NewSequence, StepPlan, StepSamplingParams
from protos.service_main import freeze_startup_heap, mark_service_process


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=300)
    parser.add_argument("--steps", type=int, help="decode steps timed (default 1000, 500 with --grpc)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--profile", action="store_true", help="print the top functions by own time")
    parser.add_argument("--grpc", action="store_true", help="also through the executor service (see above)")
    parser.add_argument(
        "--freeze-heap",
        action="store_true",
        help="freeze the heap before the timed steps, as the service does",
    )
    args = parser.parse_args()
    if args.steps is None:
        args.steps = 500 if args.grpc else 1000
    torch.set_num_threads(1)

    n, bs = args.num_seqs, args.block_size
    total_steps = args.steps * (3 if args.grpc else 1)  # direct, then one at a time and two in flight
    max_len = args.prompt_len + total_steps + 1
    blocks_per_seq = -(-max_len // bs)
    executor = LocalExecutor(
        ExecutorConfig(
            model=str(DEFAULT_MODEL),
            block_size=bs,
            num_kv_blocks=n * blocks_per_seq,
            max_num_seqs=n,
            max_num_batched_tokens=max(8192, n * args.prompt_len),
            max_model_len=blocks_per_seq * bs,
        )
    )
    runner = executor.runner
    vocab = runner.vocab_size
    zeros = torch.zeros(n, vocab)
    runner.execute_model = lambda batch, all_logits=False: (zeros[: len(batch.logits_indices)], None)

    rng = random.Random(0)
    params = StepSamplingParams(temperature=0.0)
    new = [
        NewSequence(
            seq_id=i,
            token_ids=[rng.randrange(2, vocab) for _ in range(args.prompt_len)],
            block_table=list(range(i * blocks_per_seq, i * blocks_per_seq + -(-args.prompt_len // bs))),
            num_computed_tokens=0,
            sampling_params=params,
        )
        for i in range(n)
    ]
    step_id = 1
    executor.step(
        StepPlan(
            step_id=step_id,
            new_seqs=new,
            seq_ids=list(range(n)),
            num_scheduled_tokens=[args.prompt_len] * n,
            num_computed_tokens=[0] * n,
            num_new_blocks=[0] * n,
        )
    )
    lengths = [args.prompt_len + 1] * n  # tokens known to the executor
    tables = [len(s.block_table) for s in new]

    def decode_plan() -> StepPlan:
        nonlocal step_id
        step_id += 1
        plan = StepPlan(step_id=step_id, seq_ids=list(range(n)), num_scheduled_tokens=[1] * n)
        for i in range(n):
            computed = lengths[i] - 1
            plan.num_computed_tokens.append(computed)
            if computed + 1 > tables[i] * bs:  # the new token starts a block
                plan.new_block_ids.append(i * blocks_per_seq + tables[i])
                plan.num_new_blocks.append(1)
                tables[i] += 1
            else:
                plan.num_new_blocks.append(0)
            lengths[i] += 1
        return plan

    plans = [decode_plan() for _ in range(total_steps)]
    grpc_plans, plans = plans[args.steps :], plans[: args.steps]
    if args.freeze_heap:
        mark_service_process()  # as the services, once started
        freeze_startup_heap()
    collections = GCTimes()
    totals, prepares, launches, samples = [], [], [], []
    profiler = cProfile.Profile() if args.profile else None
    if profiler:
        profiler.enable()
    for plan in plans:
        t0 = time.perf_counter()
        result = executor.step(plan)
        totals.append(time.perf_counter() - t0)
        prepares.append(result.prepare_seconds)
        launches.append(result.forward_seconds)
        samples.append(result.sample_seconds)
    if profiler:
        profiler.disable()
    collections.stop()

    def ms(values: list[float]) -> str:
        values = sorted(values)
        p99 = values[min(len(values) - 1, int(0.99 * len(values)))]
        return f"mean {statistics.mean(values) * 1e3:.3f}, p50 {values[len(values) // 2] * 1e3:.3f}, p99 {p99 * 1e3:.3f}"

    rest = [t - p - f - s for t, p, f, s in zip(totals, prepares, launches, samples, strict=True)]
    print(f"executor step, {n} decode sequences, no model ({args.steps} steps), ms:")
    print(f"  total                   {ms(totals)}")
    print(f"  prepare                 {ms(prepares)}")
    print(f"  model stub + sampler    {ms(launches)}")
    print(f"  wait + sampled ids out  {ms(samples)}")
    print(f"  validate, apply, result {ms(rest)}")
    print(f"garbage collections in these steps: {collections}")
    if profiler:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(20)
    if args.grpc:
        one, two = through_grpc(executor, grpc_plans[: args.steps], grpc_plans[args.steps :])
        direct = statistics.mean(totals)
        print(f"through the executor service, {args.steps} steps each, ms per step:")
        print(
            f"  one at a time           {ms(one)} (+{(statistics.mean(one) - direct) * 1e3:.3f} over direct)"
        )
        print(
            f"  two in flight           mean {statistics.mean(two) * 1e3:.3f} (+{(statistics.mean(two) - direct) * 1e3:.3f})"
        )


def through_grpc(executor: LocalExecutor, one_plans: list[StepPlan], two_plans: list[StepPlan]):
    """Per-step wall times through ExecutorServer + RemoteExecutor: one plan at a time, then with
    the next plan sent before the previous result is read (the scheduler's default)."""
    from executor_service.server import ExecutorServer
    from scheduler_service.executor_client import RemoteExecutor

    server = ExecutorServer("127.0.0.1", 0)
    server.start()
    server.set_executor(executor)
    try:
        with RemoteExecutor(server.address) as remote:
            one = []
            for plan in one_plans:
                t0 = time.perf_counter()
                remote.step(plan)
                one.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            remote.send(two_plans[0])
            for prev, plan in itertools.pairwise(two_plans):
                remote.send(plan)
                remote.receive(prev)
            remote.receive(two_plans[-1])
            two = [(time.perf_counter() - t0) / len(two_plans)]
    finally:
        server.stop(1)
    return one, two


if __name__ == "__main__":
    main()
