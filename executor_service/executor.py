"""LocalExecutor: applies step plans to per-sequence state and runs them through the model runner.

Two steps may be in flight (steps_in_flight.py tells their lifecycle): `send(plan)` launches a
step on the device without waiting for it, `receive(plan)` waits and returns its result, in plan
order. A step sent while the one before it still runs takes the tokens that one samples straight
from the device. So the host prepares step N+1 (and the scheduler's answer travels) while the
device runs step N.

With tensor_parallel_size N > 1 it is rank 0: it spawns ranks 1..N-1 (tp_worker.py) and
broadcasts every valid plan to them before launching it; only rank 0 samples and replies. Its
sampled ids reach the other ranks' devices by a broadcast in the step (ModelRunner.launch), so they
run two steps in flight as well; the host copies follow with a later message."""

from __future__ import annotations

import contextlib
import logging
from collections import deque
from collections.abc import Callable, Iterator

import torch

from executor_service import parallel
from executor_service.config import ExecutorConfig
from executor_service.model_runner import RunOutput
from executor_service.plan_validation import PlanError, PlanLimits, StepOrderError, validate_plan
from executor_service.runner_startup import start_model_runner
from executor_service.sampling_metadata import uses_penalties
from executor_service.sequence import SequenceState
from executor_service.steps_in_flight import (
    StepInFlight,
    apply_plan,
    drop_all,
    fill_placeholders,
    launch_batch,
    step_result,
)
from executor_service.tp_worker import WorkerProcesses
from protos.plan import ExecutorInfo, StepPlan, StepResult

logger = logging.getLogger(__name__)

__all__ = ["LocalExecutor", "PlanError"]


class LocalExecutor:
    """The executor in-process: `describe()`, `step(plan)` (or `send(plan)` then
    `receive(plan)`, two steps in flight), `reset()`; `close()` stops the tensor-parallel ranks.
    It implements protos.executor.Executor and the servicer's ServedExecutor."""

    takes_plans_ahead = True
    max_plans_in_flight = 2  # its steps in flight; the service queues a third plan (servicer.py)

    def __init__(
        self, config: ExecutorConfig, on_workers: Callable[[WorkerProcesses], None] | None = None
    ) -> None:
        """`on_workers` receives ranks 1..N-1 as soon as they are started, so that a caller can watch
        them while the group forms and the model loads (both wait for every rank)."""
        self.config = config
        self.tp_size = config.tensor_parallel_size
        self.workers: WorkerProcesses | None = None
        # Tokens of the steps collected since the last message, one list per launched step in
        # order: ranks 1..N-1 fill their placeholders with them when the next message comes.
        self._unsent_token_ids: list[list[int]] = []
        if self.tp_size > 1:
            self.workers = WorkerProcesses(config)
            if on_workers is not None:
                on_workers(self.workers)
            try:
                parallel.init_group(
                    config.device, config.tp_master_addr, config.tp_master_port, 0, self.tp_size
                )
                self.runner = start_model_runner(config, tp_rank=0)
            except BaseException:
                self.workers.kill()
                raise
        else:
            self.runner = start_model_runner(config)
        self.seqs: dict[int, SequenceState] = {}
        self._in_flight: deque[StepInFlight] = deque()
        # Whether a step sent behind a running one overlaps it: on CUDA. On the CPU a step is
        # done when send() returns; the Step handler then runs one at a time.
        self.overlaps_steps = self.runner.device.type == "cuda"
        mc = config.model_config
        self.limits = PlanLimits(
            block_size=config.block_size,
            num_kv_blocks=self.runner.kv_cache.num_blocks,
            vocab_size=mc.vocab_size,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=config.max_model_len,
        )

    def describe(self) -> ExecutorInfo:
        mc = self.config.model_config
        return ExecutorInfo(
            model=self.config.model_name,
            architecture=mc.architecture,
            block_size=self.config.block_size,
            num_kv_blocks=self.runner.kv_cache.num_blocks,
            max_model_len=self.config.max_model_len,
            vocab_size=mc.vocab_size,
            eos_token_ids=list(mc.eos_token_ids),
            tensor_parallel_size=self.tp_size,
            dtype=self.config.dtype,
            device=self.config.device,
            max_num_seqs=self.config.max_num_seqs,
            max_num_batched_tokens=self.config.max_num_batched_tokens,
            attention_backend=self.config.attention_backend,
            num_layers=mc.num_hidden_layers,
            block_bytes=self.runner.kv_cache.block_bytes * self.tp_size,  # over all ranks
            kv_cache_dtype=self.config.kv_cache_dtype,
        )

    def step(self, plan: StepPlan) -> StepResult:
        self.send(plan)
        return self.receive(plan)

    def send(self, plan: StepPlan) -> None:
        """Validate, apply and launch a step. A plan the executor refuses (PlanError) changes
        nothing; its error, like any other, is raised by receive(), and plans sent after a
        failed one are not run."""
        if len(self._in_flight) >= self.max_plans_in_flight:
            raise StepOrderError(f"step {plan.step_id} sent with two steps in flight: receive one first")
        if self._in_flight and self._in_flight[-1].error is not None:
            error = RuntimeError(
                f"step {plan.step_id} not run: step {self._in_flight[-1].plan.step_id} failed"
            )
            self._in_flight.append(StepInFlight(plan, error=error))
            return
        try:
            self._in_flight.append(self._launch(plan))
        except Exception as e:
            self._in_flight.append(StepInFlight(plan, error=e))

    def ready(self) -> bool:
        """Whether receive() of the oldest step in flight would return without waiting."""
        try:  # read once: a Reset on the worker thread may empty the queue meanwhile
            step = self._in_flight[0]
        except IndexError:
            return True
        launch = step.launch
        return launch is None or step.result is not None or launch.ready()

    def receive(self, plan: StepPlan) -> StepResult:
        """The result of the oldest step in flight, which must be `plan`; raises its error."""
        if not self._in_flight or self._in_flight[0].plan.step_id != plan.step_id:
            raise StepOrderError(f"receive of step {plan.step_id}, which is not the oldest in flight")
        step = self._in_flight.popleft()
        if step.error is not None:
            raise step.error
        if step.result is None:
            self._collect(step)
        return step.result

    def discard(self) -> None:
        """Forget the steps in flight (their device work completes; their tokens are kept)."""
        try:
            for step in self._in_flight:
                if step.launch is not None and step.result is None:
                    self._collect(step)
        finally:
            self._in_flight.clear()

    def step_with_logits(self, plan: StepPlan) -> tuple[StepResult, torch.Tensor | None]:
        """Like step(), also returning logits for every scheduled token, [num_tokens, vocab_size]
        (None when nothing was scheduled). For tests and debugging: it costs a full-vocab matmul
        per token. Nothing may be in flight."""
        if self._in_flight:
            raise StepOrderError(f"step_with_logits of step {plan.step_id} with steps in flight")
        step = self._launch(plan, all_logits=True)
        if step.launch is None:  # nothing scheduled
            return step.result, None
        out = self._collect(step, all_logits=True)
        return step.result, out.logits

    def reset(self) -> int:
        """Drop every sequence; returns how many were held."""
        self.discard()
        if self.workers is not None:
            self._broadcast(parallel.TPMessage("reset"))
        self._unsent_token_ids = []
        return drop_all(self.runner, self.seqs)

    @property
    def device_timeline(self):
        """The device's time in steps and between them (device_timeline.py); None off CUDA."""
        return self.runner.timeline

    @property
    def num_graph_steps(self) -> int:
        """Steps the model runner replayed from a CUDA graph."""
        return self.runner.num_graph_steps

    def failed_ranks(self) -> list[tuple[int, int | None]]:
        """(rank, exit code) of the ranks 1..N-1 that are no longer running."""
        return self.workers.failed() if self.workers is not None else []

    def close(self) -> bool:
        """Stop ranks 1..N-1 and leave the process group (nothing to do with one rank); False when
        leaving did not finish (parallel.destroy_group). Every rank frees its CUDA graphs and then
        leaves the group, all at once: NCCL may finalize a communicator collectively, and waits for
        the graphs that captured its collectives."""
        if self.workers is None:
            return True
        if self.workers.failed():  # no rank to leave with: stop the others first
            self.workers.kill()
        else:
            with contextlib.suppress(Exception):
                self._broadcast(parallel.TPMessage("close"))
        self.runner.release_cuda_graphs()
        left = parallel.destroy_group()
        self.workers.join()
        self.workers = None
        return left

    def _broadcast(self, message: parallel.TPMessage) -> None:
        message.sampled_token_ids, self._unsent_token_ids = self._unsent_token_ids, []
        self.workers.send(message)

    @contextlib.contextmanager
    def _ranks_fail_together(self, step_id: int) -> Iterator[None]:
        """A failure here may leave the ranks disagreeing on the state or waiting in a collective:
        the group ends (the caller gets the error; the serve loop sees the ranks gone)."""
        try:
            yield
        except BaseException:
            if self.workers is not None:
                logger.error("step %d failed: stopping tensor-parallel ranks %s", step_id, self.workers.pids)
                self.workers.kill()
            raise

    def _launch(self, plan: StepPlan, all_logits: bool = False) -> StepInFlight:
        validate_plan(plan, self.seqs, self.limits)
        prev = self._in_flight[-1] if self._in_flight else None
        with self._ranks_fail_together(plan.step_id):  # from here on the state changes
            batch = apply_plan(self.runner, self.seqs, plan)
            pending = None
            in_flight = prev is not None and prev.launch is not None and prev.result is None
            if batch and in_flight and prev.placeholders:
                if any(uses_penalties(s.sampling_params) for s in batch):
                    self._collect(prev)  # penalties read the generated tokens on the host
                else:
                    pending = prev.launch.sampled.sampled_token_ids
            if self.workers is not None:
                self._broadcast(parallel.TPMessage("step", plan, all_logits, pending=pending is not None))
            if not batch:
                return StepInFlight(plan, result=StepResult(step_id=plan.step_id))
            launch, placeholders = launch_batch(self.runner, batch, plan, pending, all_logits)
        return StepInFlight(plan, launch=launch, placeholders=placeholders)

    def _collect(self, step: StepInFlight, all_logits: bool = False) -> RunOutput:
        """Wait for a launched step; its tokens replace their placeholders; its result is set."""
        with self._ranks_fail_together(step.plan.step_id):
            out = self.runner.collect(step.launch, all_logits)
        fill_placeholders(step.placeholders, out.sampled_token_ids)
        if self.workers is not None:
            self._unsent_token_ids.append(out.sampled_token_ids)
        step.result = step_result(step.plan, [seq for seq, _ in step.placeholders], out)
        step.launch = None
        return out
