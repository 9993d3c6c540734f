"""Cost of the tensor-parallel plan broadcast per step, for a 256-sequence decode plan.

Rank 0 sends every step a TPMessage (the plan and the previous step's sampled tokens), pickled,
down a pipe to each rank (executor_service/parallel.py); the alternative measured beside it is
a torch.distributed broadcast on a gloo group. Measured on the CPU with N processes: the
message size, pickling, and the per-step time of {send plan; 1-element all-reduce} minus that
of the all-reduce alone: what the broadcast adds to a step's critical path, receive and
unpickle on the other ranks included.

Run: python bench/tp_broadcast.py [--tp 2] [--batch 256] [--steps 2000]
"""

from __future__ import annotations

import argparse
import os
import pickle
import random
import socket
import sys
import time
import timeit
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from executor_service import parallel
from protos.plan import StepPlan


def decode_message(batch: int) -> parallel.TPMessage:
    rng = random.Random(0)
    num_new_blocks = [1 if rng.random() < 1 / 16 else 0 for _ in range(batch)]
    plan = StepPlan(
        step_id=12345,
        seq_ids=list(range(1000, 1000 + batch)),
        num_scheduled_tokens=[1] * batch,
        num_computed_tokens=[rng.randint(100, 2000) for _ in range(batch)],
        new_block_ids=[rng.randint(0, 5000) for n in num_new_blocks if n],
        num_new_blocks=num_new_blocks,
    )
    tokens = [rng.randrange(150_000) for _ in range(batch)]
    return parallel.TPMessage("step", plan, sampled_token_ids=tokens)


def gloo_broadcast(message: parallel.TPMessage, group) -> None:
    """The alternative: the pickled message as a length then the bytes, two gloo broadcasts."""
    payload = torch.frombuffer(
        bytearray(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8
    )
    dist.broadcast(torch.tensor([payload.numel()], dtype=torch.int64), src=0, group=group)
    dist.broadcast(payload, src=0, group=group)


def gloo_receive(group) -> parallel.TPMessage:
    size = torch.empty(1, dtype=torch.int64)
    dist.broadcast(size, src=0, group=group)
    payload = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.broadcast(payload, src=0, group=group)
    return pickle.loads(payload.numpy().tobytes())


def _timed(fn, steps: int) -> float:
    for _ in range(steps // 10):  # warm-up
        fn()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    dist.barrier()
    return (time.perf_counter() - t0) / steps


def _rank(rank: int, tp: int, port: int, batch: int, steps: int, pipes: list[tuple[int, int]]) -> None:
    torch.set_num_threads(1)
    parallel.init_group("cpu", "127.0.0.1", port, rank, tp)
    group = dist.new_group(backend="gloo")
    message = decode_message(batch)
    flag = torch.zeros(1)
    if rank == 0:
        writers = [os.fdopen(w, "wb") for _, w in pipes]
    else:
        reader = os.fdopen(pipes[rank - 1][0], "rb")

    def through_pipe() -> None:
        if rank == 0:
            data = parallel.encode_message(message)
            for f in writers:
                f.write(data)
                f.flush()
        else:
            assert len(parallel.read_message(reader).plan.seq_ids) == batch
        dist.all_reduce(flag)

    def through_gloo() -> None:
        if rank == 0:
            gloo_broadcast(message, group)
        else:
            assert len(gloo_receive(group).plan.seq_ids) == batch
        dist.all_reduce(flag)

    def reduce_only() -> None:
        dist.all_reduce(flag)

    # Interleaved rounds: the machine's load drifts.
    times = {"pipe": [], "gloo": [], "alone": []}
    for _ in range(3):
        times["pipe"].append(_timed(through_pipe, steps))
        times["gloo"].append(_timed(through_gloo, steps))
        times["alone"].append(_timed(reduce_only, steps))
    if rank == 0:
        best = {k: min(v) for k, v in times.items()}
        payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        number = 2000
        dumps = timeit.timeit(lambda: pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL), number=number)
        loads = timeit.timeit(lambda: pickle.loads(payload), number=number)
        print(
            f"tp {tp}, {batch}-sequence decode plan: {len(payload)} bytes pickled (best of 3 x {steps} steps)"
        )
        print(f"  pickle.dumps                              {dumps / number * 1e6:8.1f} us")
        print(f"  pickle.loads                              {loads / number * 1e6:8.1f} us")
        print(f"  step: 1-element all-reduce alone          {best['alone'] * 1e6:8.1f} us")
        for name in ("pipe", "gloo"):
            print(
                f"  plan broadcast per step, {name} (+ unpickle) {(best[name] - best['alone']) * 1e6:8.1f} us"
            )
    parallel.destroy_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--steps", type=int, default=2000)
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    pipes = [os.pipe() for _ in range(args.tp - 1)]
    ctx = mp.get_context("fork")  # the pipes' descriptors are inherited
    procs = [
        ctx.Process(target=_rank, args=(r, args.tp, port, args.batch, args.steps, pipes))
        for r in range(args.tp)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join()


if __name__ == "__main__":
    main()
