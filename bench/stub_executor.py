"""An executor service with no model: every step answers at once, one token for each sequence
whose prompt is computed. What the split's front end (the scheduler service: engine core, API
servers, gRPC streams) can carry, with the GPU taken out:

    python bench/throughput.py --workload w1 --model models/tandem-tiny-pydoc --mode split \\
        --executor-cmd "python bench/stub_executor.py" --stream-interval 1 --api-server-count 2

It takes the executor service's flags (--model for the vocabulary, --port, --metrics-port,
--max-num-seqs, --max-num-batched-tokens; the rest are ignored) and serves the real
ExecutorService (servicer, ownership, metrics) over a stub. The token it samples is 7: W1
ignores EOS.

`--step-ms T` paces it like a GPU: each plan is launched as it arrives (two in flight, as the
CUDA executor) and its result comes back T ms after the step before it ended, or after its launch
if the device had run dry, so the executor's gaps between steps (tandem_executor_idle_seconds:
the scheduler late with a plan) show on a machine without a GPU (W1 on the H200: 5.5 ms a step).
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
import time
from collections import deque
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from executor_service.metrics import start_metrics_server
from executor_service.server import ExecutorServer
from protos.executor import StepOnlyExecutor
from protos.plan import ExecutorInfo, StepPlan, StepResult
from protos.service_main import LOG_FORMAT

TOKEN = 7


class StubExecutor(StepOnlyExecutor):
    overlaps_steps = False
    tp_size = 1
    num_graph_steps = 0
    device_timeline = None

    def __init__(self, vocab_size: int, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.info = ExecutorInfo(
            model="stub", architecture="Stub", block_size=16, num_kv_blocks=1 << 20, max_model_len=32768,
            vocab_size=vocab_size, eos_token_ids=[0], tensor_parallel_size=1, dtype="bfloat16", device="cpu",
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, attention_backend="stub",
            num_layers=1, block_bytes=1,
        )  # fmt: skip
        # seq id -> [tokens so far, tokens computed]
        self.seqs: dict[int, list[int]] = {}

    def describe(self) -> ExecutorInfo:
        return self.info

    def reset(self) -> int:
        n = len(self.seqs)
        self.seqs.clear()
        return n

    def ready(self) -> bool:
        return True

    def failed_ranks(self) -> list:
        return []

    def step(self, plan: StepPlan) -> StepResult:
        seqs = self.seqs
        for sid in plan.finished_seq_ids + plan.preempted_seq_ids:
            seqs.pop(sid, None)
        for s in plan.new_seqs:
            seqs[s.seq_id] = [len(s.token_ids), s.num_computed_tokens]
        result = StepResult(step_id=plan.step_id)
        for sid, n in zip(plan.seq_ids, plan.num_scheduled_tokens, strict=True):
            state = seqs[sid]
            state[1] += n
            if state[1] >= state[0]:
                state[0] += 1
                result.seq_ids.append(sid)
                result.token_ids.append(TOKEN)
                result.num_tokens.append(1)
        return result


class PacedStubExecutor(StubExecutor):
    """StubExecutor whose steps take step_s each on an emulated device that runs them in order."""

    overlaps_steps = True
    takes_plans_ahead = True

    def __init__(
        self, vocab_size: int, max_num_seqs: int, max_num_batched_tokens: int, step_s: float
    ) -> None:
        super().__init__(vocab_size, max_num_seqs, max_num_batched_tokens)
        self.step_s = step_s
        self._device_free_at = 0.0
        self._launched: deque[tuple[StepResult, float]] = deque()

    def ready(self) -> bool:
        """Whether the oldest step launched is done (the servicer answers it then, not before)."""
        return not self._launched or self._launched[0][1] <= time.perf_counter()

    def send(self, plan: StepPlan) -> None:
        done = max(time.perf_counter(), self._device_free_at) + self.step_s
        self._device_free_at = done
        self._launched.append((self.step(plan), done))

    def receive(self, plan: StepPlan) -> StepResult:
        result, done = self._launched.popleft()
        wait = done - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        return result

    def discard(self) -> None:
        self._launched.clear()
        self._device_free_at = 0.0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--metrics-port", type=int, default=0)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--step-ms", type=float, default=0.0, help="emulated device time a step (0: none)")
    args, _ = p.parse_known_args()
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)  # as the executor service's
    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    server = ExecutorServer(args.host, args.port)
    metrics = (
        start_metrics_server(server.metrics, args.host, args.metrics_port) if args.metrics_port else None
    )
    server.start()
    sizes = (vocab, args.max_num_seqs, args.max_num_batched_tokens)
    server.set_executor(
        PacedStubExecutor(*sizes, args.step_ms / 1e3) if args.step_ms > 0 else StubExecutor(*sizes)
    )
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: threading.Thread(target=stop.set).start())
    stop.wait()
    server.stop(1.0)
    if metrics is not None:
        metrics.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
