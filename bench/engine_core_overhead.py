"""CPU cost of the engine core per output token, in one thread: what a decode step costs the core
of a split scheduler (`--api-server-count N`) from scheduling the plan to the messages for its API
servers, with the executor taken out.

Per step: LLMEngine.step_sequences (schedule, the plan and result through their protobuf wire
form, update) and CoreBridge.step_outputs (each API server's "out" message built from the
sequences, TTFT / ITL observed, msgpack, one ZeroMQ send each to a connected DEALER that never
reads, with no high-water mark: every send succeeds, as in service; to a peer not connected each
would raise, and the exceptions' reference cycles were ~97% of the objects that set off the
garbage collections this script counted before). 256 decoding sequences by default,
their requests spread over the API servers as SO_REUSEPORT would spread them. Also counts
Python's garbage collections over the timed steps (--freeze-heap: as the services, once started).

    python bench/engine_core_overhead.py [--num-seqs 256] [--steps 1000] [--api-servers 2] [--profile] [--freeze-heap]
    python bench/engine_core_overhead.py --workload w1    # W1's 256 requests, admitted and run to the end

With --workload w1 the timed part is BENCH.md's whole W1 run (its requests as bench/throughput.py
draws them): admission, the prefill steps, the batch shrinking as requests finish, the finishes;
what the H200's split measures per output token, less its threads' contention and the network.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import sys
import time
from pathlib import Path

import zmq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gc_times import GCTimes
from bench.scheduler_overhead import TrivialExecutor
from protos.plan import ExecutorInfo, StepPlan, StepResult, plan_to_proto, result_from_proto, result_to_proto
from protos.service_main import freeze_startup_heap, mark_service_process
from protos.tandem.v1 import executor_pb2 as pb
from scheduler_service import engine_ipc as ipc
from scheduler_service.config import SchedulerConfig
from scheduler_service.engine import LLMEngine
from scheduler_service.engine_core import CoreBridge
from scheduler_service.executor_client import RemoteExecutor
from scheduler_service.metrics import SchedulerMetrics
from scheduler_service.request_stream import RequestStream, StreamTable
from scheduler_service.sampling_params import SamplingParams


class WireExecutor(TrivialExecutor):
    """TrivialExecutor behind the protobuf conversions and (de)serialization RemoteExecutor does."""

    def step(self, plan: StepPlan) -> StepResult:
        plan_to_proto(plan).SerializeToString()
        result = super().step(plan)
        msg = pb.StepResult.FromString(result_to_proto(result).SerializeToString())
        return result_from_proto(msg)


class _Core:
    """What CoreBridge reads of AsyncEngine (its loop's callbacks run at once: one thread)."""

    def __init__(self, streams: StreamTable) -> None:
        self.streams = streams
        self.step_outputs = None

    def call_soon(self, callback, *args) -> None:
        callback(*args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--workload",
        choices=["decode", "w1"],
        default="decode",
        help="decode: --num-seqs sequences decoding (default); w1: W1's requests from admission to the end",
    )
    parser.add_argument("--num-seqs", type=int, default=256, help="running decode sequences")
    parser.add_argument("--steps", type=int, default=1000, help="decode steps measured")
    parser.add_argument("--api-servers", type=int, default=2, help="API servers the outputs go to")
    parser.add_argument("--profile", action="store_true", help="print cProfile's top functions too")
    parser.add_argument(
        "--freeze-heap", action="store_true", help="freeze the heap after the warm-up, as the services do"
    )
    parser.add_argument(
        "--executor",
        help="HOST:PORT of an executor service (bench/stub_executor.py) instead of the in-process one",
    )
    args = parser.parse_args()

    rng = random.Random(0)
    if args.workload == "w1":
        args.num_seqs, max_len = 256, 2 * 1024 + 16
    else:
        max_len = 400 + 2 * args.steps + 600
    info = ExecutorInfo(
        model="trivial", architecture="Trivial", block_size=16,
        num_kv_blocks=args.num_seqs * (max_len // 16 + 2), max_model_len=max_len, vocab_size=32000,
        eos_token_ids=[0], tensor_parallel_size=1, dtype="bfloat16", device="cpu",
        max_num_seqs=args.num_seqs, max_num_batched_tokens=8192, attention_backend="none",
        num_layers=1, block_bytes=1,
    )  # fmt: skip
    executor = WireExecutor(info) if args.executor is None else RemoteExecutor(args.executor)
    engine = LLMEngine(executor, SchedulerConfig(max_num_seqs=args.num_seqs))
    vocab_size = engine.info.vocab_size
    if args.workload == "w1":
        from types import SimpleNamespace

        from bench.throughput import make_workload

        w1 = SimpleNamespace(seed=0, num_requests=256, min_prompt_len=100, max_prompt_len=1024,
                             min_output_len=100, max_output_len=1024)  # fmt: skip
        requests = [(r.prompt_token_ids, r.max_tokens) for r in make_workload(w1, vocab_size)]
    else:
        requests = [
            ([rng.randrange(2, vocab_size) for _ in range(rng.randint(200, 400))], 2 * args.steps + 550)
            for _ in range(args.num_seqs)
        ]
    metrics = SchedulerMetrics()
    streams = StreamTable(metrics)
    bridge = CoreBridge(_Core(streams), metrics, ipc.ipc_address())
    peers = [f"api-{i}".encode() for i in range(args.api_servers)]
    # The API servers' ends: connected, never read (their own context, as another process's).
    bridge._socket.setsockopt(zmq.SNDHWM, 0)
    api_context = zmq.Context()
    api_sockets = []
    for peer in peers:
        api = api_context.socket(zmq.DEALER)
        api.setsockopt(zmq.IDENTITY, peer)
        api.setsockopt(zmq.RCVHWM, 0)
        api.setsockopt(zmq.LINGER, 0)
        api.connect(bridge.address)
        api.send(ipc.pack("hello"))
        api_sockets.append(api)
    for _ in peers:  # each connection is up once its hello is in
        bridge._socket.recv_multipart()

    def admit() -> None:
        now = time.perf_counter()
        for i, (prompt, max_tokens) in enumerate(requests):
            params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.6)
            peer = peers[rng.randrange(len(peers))]
            stream = RequestStream(str(i), i, len(prompt), params, now, peer=peer)
            engine.add_request(prompt, params, request_id=i, client=stream)
            streams.add(stream)
            bridge._remote[i] = (peer, stream)

    def step() -> int:
        seqs = engine.step_sequences()
        bridge.step_outputs(seqs)
        return sum(seq.num_new_tokens for seq in seqs)

    if args.workload == "decode":  # the prefills and a few decode steps before the timing
        admit()
        while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running) or (
            engine.scheduler.waiting
        ):
            step()
        for _ in range(10):
            step()
    if args.freeze_heap:  # as the services do once they serve
        mark_service_process()  # as the services, once started
        freeze_startup_heap()
    collections = GCTimes()

    profiler = cProfile.Profile(time.thread_time) if args.profile else None
    tokens = 0
    t0, cpu0, process0 = time.perf_counter(), time.thread_time(), time.process_time()
    if profiler is not None:
        profiler.enable()
    num_steps = 0
    if args.workload == "w1":
        admit()
        while engine.has_unfinished_requests() or engine.scheduler.has_finished_to_send():
            tokens += step()
            num_steps += 1
    else:
        for num_steps in range(1, args.steps + 1):  # noqa: B007 (the count is read after)
            tokens += step()
    if profiler is not None:
        profiler.disable()
    cpu, wall = time.thread_time() - cpu0, time.perf_counter() - t0
    process = time.process_time() - process0
    collections.stop()
    bridge.close()
    for api in api_sockets:
        api.close()
    api_context.term()
    if args.executor is not None:
        executor.close()

    print("command:", " ".join([Path(sys.executable).name, *sys.argv]))
    what = "W1's requests" if args.workload == "w1" else "decode sequences"
    print(
        f"{args.num_seqs} {what}, {num_steps} steps, {tokens} output tokens, {args.api_servers} API servers"
    )
    print(f"engine core CPU per output token (one thread): {cpu / tokens * 1e6:.2f} us")
    print(f"engine core CPU per output token (all threads): {process / tokens * 1e6:.2f} us")
    print(f"per step: {wall / num_steps * 1e3:.3f} ms wall, {cpu / num_steps * 1e3:.3f} ms CPU")
    print(f"garbage collections in the timed steps: {collections}")
    if profiler is not None:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
