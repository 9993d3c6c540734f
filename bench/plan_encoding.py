"""Cost of the step plan as dataclasses vs as a protobuf message, for a 256-sequence decode.

Decides the in-process currency between the scheduler and the executor (issue 2): the
dataclasses of protos/plan.py unless protobuf is as cheap. Run: python bench/plan_encoding.py
"""

from __future__ import annotations

import random
import sys
import timeit
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from protos import plan
from protos.tandem.v1 import executor_pb2


def main(batch: int = 256, number: int = 20000) -> None:
    rng = random.Random(0)
    seq_ids = list(range(1000, 1000 + batch))
    num_scheduled = [1] * batch
    num_computed = [rng.randint(100, 2000) for _ in range(batch)]
    num_new_blocks = [1 if rng.random() < 1 / 16 else 0 for _ in range(batch)]
    new_block_ids = [rng.randint(0, 5000) for n in num_new_blocks if n]

    def build_dataclass():
        return plan.StepPlan(5, [], seq_ids, num_scheduled, num_computed, new_block_ids, num_new_blocks)

    def read_dataclass(p):
        return p.seq_ids, p.num_scheduled_tokens, p.num_computed_tokens, p.new_block_ids, p.num_new_blocks

    def build_proto():
        return executor_pb2.StepPlan(
            step_id=5,
            seq_ids=seq_ids,
            num_scheduled_tokens=num_scheduled,
            num_computed_tokens=num_computed,
            new_block_ids=new_block_ids,
            num_new_blocks=num_new_blocks,
        )

    def read_proto(p):
        return (
            list(p.seq_ids),
            list(p.num_scheduled_tokens),
            list(p.num_computed_tokens),
            list(p.new_block_ids),
            list(p.num_new_blocks),
        )

    dc, msg = build_dataclass(), build_proto()
    rows = [
        ("dataclass build + read", lambda: read_dataclass(build_dataclass())),
        ("protobuf build + read", lambda: read_proto(build_proto())),
        ("dataclass -> protobuf -> bytes", lambda: plan.plan_to_proto(dc).SerializeToString()),
        (
            "bytes -> protobuf -> dataclass",
            lambda: plan.plan_from_proto(executor_pb2.StepPlan.FromString(msg.SerializeToString())),
        ),
    ]
    print(f"{batch}-sequence decode plan, {len(msg.SerializeToString())} bytes on the wire")
    for name, fn in rows:
        us = timeit.timeit(fn, number=number) / number * 1e6
        print(f"  {name:34s} {us:8.2f} us")


if __name__ == "__main__":
    main()
