"""The host's side of each in-process step, by phase: the executor's send split into applying the
plan, the model runner's prepare, execute_model (and within it the model's decoder layers, their
self-attention and attention modules and MLPs), and the sampler. On CUDA these are launch times
(the device runs behind them), so a phase that takes as long as the device's own step is where an
eager step is host-bound. Prints the first 45 steps of the timed run and the sums over eager
(prefill / mixed) and decode steps.

    python bench/host_phases.py --workload w1 --device cuda --mode in-process --kv-cache-dtype fp8

Takes bench/throughput.py's flags (its in-process run); the timers wrap the classes' methods, so
they add a little time of their own to every call they time.
"""

from __future__ import annotations

import collections
import functools
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import throughput  # bench/throughput.py: the workload and the in-process run

from client.llm import LLM
from executor_service import executor as executor_module
from executor_service import model_runner, sampler
from executor_service.attention import triton_kernels, triton_paged
from executor_service.layers import (
    activation,
    attention,
    embed_head,
    linear,
    mlp,
    norm,
    self_attention,
    triton_ops,
)
from executor_service.models import base
from scheduler_service import scheduler

PHASES = (
    "apply_plan",
    "prepare",
    "execute_model",
    "model",
    "layers",
    "self_attn",
    "attention",
    "mlp",
    "sampler",
    # inside the layers: the GEMMs' launches, the norms, SiLU-and-mul, the fused rotary kernel,
    # the attention backend and its prefill kernel's launch, the LM head
    "linear",
    "norm",
    "act",
    "rope",
    "backend",
    "prefill",
    "lm_head",
)
# The host's work between two sends (the engine's receive, the scheduler's update and schedule).
BETWEEN = ("between", "schedule", "update")
# (what, its phase): the methods timed inside each send.
TIMED = (
    (model_runner.ModelRunner, "prepare", "prepare"),
    (model_runner.ModelRunner, "execute_model", "execute_model"),
    (base.DecoderModel, "forward", "model"),
    (base.DecoderLayer, "forward", "layers"),
    (self_attention.SelfAttention, "forward", "self_attn"),
    (attention.Attention, "forward", "attention"),
    (mlp.DenseMLP, "forward", "mlp"),
    (sampler.Sampler, "__call__", "sampler"),
    (linear.LinearBase, "matmul", "linear"),
    (norm.RMSNorm, "forward", "norm"),
    (activation.SiluAndMul, "forward", "act"),
    (triton_ops, "qk_norm_rope", "rope"),
    (triton_paged.TritonPagedBackend, "forward", "backend"),
    (triton_kernels, "paged_prefill", "prefill"),
    (embed_head.ParallelLMHead, "forward", "lm_head"),
    (scheduler.Scheduler, "schedule", "schedule"),
    (scheduler.Scheduler, "update", "update"),
)


class StepPhases:
    """Wraps the executor's send and the TIMED methods; one record per send."""

    def __init__(self) -> None:
        self.current: collections.defaultdict[str, float] = collections.defaultdict(float)
        # (tokens, new sequences, sequences, send seconds, seconds by phase); a send's phases also
        # hold the host's time since the send before ended ("between") and the scheduler's in it
        self.steps: list[tuple[int, int, int, float, dict[str, float]]] = []
        self.last_end: float | None = None
        self.runs: list[int] = []  # where each LLM.generate call's steps begin

    def timer(self, fn, phase: str):
        current = self.current

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                current[phase] += time.perf_counter() - start

        return timed

    def install(self) -> None:
        for cls, name, phase in TIMED:
            setattr(cls, name, self.timer(getattr(cls, name), phase))
        executor_module.apply_plan = self.timer(executor_module.apply_plan, "apply_plan")
        send = executor_module.LocalExecutor.send

        def timed_send(executor, plan):
            start = time.perf_counter()
            between = {p: self.current.pop(p, 0.0) for p in BETWEEN[1:]}
            self.current.clear()
            if self.last_end is not None:
                between["between"] = start - self.last_end
            send(executor, plan)
            self.last_end = time.perf_counter()
            seconds = self.last_end - start
            self.current.update(between)
            tokens = sum(plan.num_scheduled_tokens)
            phases = dict(self.current)
            self.current.clear()
            self.steps.append((tokens, len(plan.new_seqs), len(plan.seq_ids), seconds, phases))

        executor_module.LocalExecutor.send = timed_send
        generate = LLM.generate

        def marked_generate(llm, *args, **kwargs):
            self.runs.append(len(self.steps))
            return generate(llm, *args, **kwargs)

        LLM.generate = marked_generate


def main(argv: list[str] | None = None) -> int:
    args = throughput.parse_args(argv)
    model = args.model
    if model is None:  # as bench/throughput.py: W1's built checkpoint, else the embedded model
        w1 = args.workload in ("w1", "w3", "w4")
        model = str(
            throughput.build_w1_checkpoint(Path(args.w1_dir), args.shape, args.quantization)
            if w1
            else throughput.DEFAULT_MODEL
        )
    vocab_size = throughput.json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    workload = throughput.make_workload(args, vocab_size)
    phases = StepPhases()
    phases.install()
    tokens, elapsed, _ = throughput.run_in_process(args, model, workload)
    print(
        f"in-process: {tokens} tokens in {elapsed:.2f} s = {tokens / elapsed:.0f} output tok/s (timed by phase)"
    )
    timed = phases.steps[phases.runs[-1] :]  # the timed run's (after the warm-up's generate)
    columns = PHASES + BETWEEN
    print("ms: tokens  new  seqs     send | " + " ".join(f"{p[:8]:>8s}" for p in columns))
    for n, new, seqs, seconds, by_phase in timed[:45]:
        row = " ".join(f"{by_phase.get(p, 0.0) * 1e3:8.2f}" for p in columns)
        print(f"    {n:6d} {new:4d} {seqs:5d} {seconds * 1e3:8.2f} | {row}")
    for label, group in (
        ("eager (prefill / mixed)", [s for s in timed if s[0] > s[2]]),
        ("decode", [s for s in timed if 0 < s[0] == s[2]]),
    ):
        if group:
            sums = ", ".join(f"{p} {sum(s[4].get(p, 0.0) for s in group):.3f}" for p in columns)
            print(f"{label}: {len(group)} steps, send {sum(s[3] for s in group):.3f} s; {sums} (s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
