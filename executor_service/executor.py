"""LocalExecutor: applies step plans to per-sequence state and runs them through the model runner.

With tensor_parallel_size N > 1 it is rank 0: it spawns ranks 1..N-1 (tp_worker.py) and
broadcasts every valid plan to them before running it; only rank 0 samples and replies."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import torch

from executor_service import parallel
from executor_service.config import ExecutorConfig
from executor_service.model_runner import ModelRunner
from executor_service.plan_validation import PlanError, PlanLimits, validate_plan
from executor_service.sequence import SequenceState
from executor_service.tp_worker import WorkerProcesses
from protos.plan import ExecutorInfo, StepPlan, StepResult

logger = logging.getLogger(__name__)

__all__ = ["LocalExecutor", "PlanError"]


class LocalExecutor:
    """The executor in-process: `describe()`, `step(plan)`, `reset()`; `close()` stops the
    tensor-parallel ranks."""

    def __init__(self, config: ExecutorConfig) -> None:
        self.config = config
        self.tp_size = config.tensor_parallel_size
        self.workers: WorkerProcesses | None = None
        # Tokens sampled by the last step, sent to ranks 1..N-1 with the next message.
        self._unsent_token_ids: list[int] = []
        if self.tp_size > 1:
            self.workers = WorkerProcesses(config)
            try:
                parallel.init_group(
                    config.device, config.tp_master_addr, config.tp_master_port, 0, self.tp_size
                )
                self.runner = ModelRunner(config, tp_rank=0)
            except BaseException:
                self.workers.kill()
                raise
        else:
            self.runner = ModelRunner(config)
        self.seqs: dict[int, SequenceState] = {}
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
            model=Path(self.config.model).resolve().name,
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
        )

    def step(self, plan: StepPlan) -> StepResult:
        return self._step(plan, all_logits=False)[0]

    def step_with_logits(self, plan: StepPlan) -> tuple[StepResult, torch.Tensor | None]:
        """Like step(), also returning logits for every scheduled token, [num_tokens, vocab_size]
        (None when nothing was scheduled). For tests and debugging: it costs a full-vocab matmul
        per token."""
        return self._step(plan, all_logits=True)

    def reset(self) -> int:
        """Drop every sequence; returns how many were held."""
        if self.workers is not None:
            self._broadcast(parallel.TPMessage("reset"))
        self._unsent_token_ids = []
        return drop_all(self.runner, self.seqs)

    def failed_ranks(self) -> list[tuple[int, int | None]]:
        """(rank, exit code) of the ranks 1..N-1 that are no longer running."""
        return self.workers.failed() if self.workers is not None else []

    def close(self) -> None:
        """Stop ranks 1..N-1 and leave the process group (nothing to do with one rank)."""
        if self.workers is None:
            return
        if not self.workers.failed():
            with contextlib.suppress(Exception):
                self._broadcast(parallel.TPMessage("close"))
        self.workers.join()
        parallel.destroy_group()
        self.workers = None

    def _broadcast(self, message: parallel.TPMessage) -> None:
        message.sampled_token_ids, self._unsent_token_ids = self._unsent_token_ids, []
        self.workers.send(message)

    def _step(self, plan: StepPlan, all_logits: bool) -> tuple[StepResult, torch.Tensor | None]:
        validate_plan(plan, self.seqs, self.limits)
        if self.workers is None:
            return self._run(plan, all_logits)
        try:
            self._broadcast(parallel.TPMessage("step", plan, all_logits))
            result, logits = self._run(plan, all_logits)
        except BaseException:
            # The ranks may now disagree on the state or wait in a collective: end the group.
            logger.error("step %d failed: stopping tensor-parallel ranks %s", plan.step_id, self.workers.pids)
            self.workers.kill()
            raise
        self._unsent_token_ids = result.token_ids
        return result, logits

    def _run(self, plan: StepPlan, all_logits: bool) -> tuple[StepResult, torch.Tensor | None]:
        batch = apply_plan(self.runner, self.seqs, plan)
        if not batch:
            return StepResult(step_id=plan.step_id), None
        prepared, out = self.runner.run(batch, plan.num_scheduled_tokens, all_logits)
        advance(batch, plan.num_scheduled_tokens, prepared.sampling_seqs, out.sampled_token_ids)
        result = StepResult(
            step_id=plan.step_id,
            seq_ids=[s.seq_id for s in prepared.sampling_seqs],
            token_ids=out.sampled_token_ids,
            num_tokens=[1] * len(out.sampled_token_ids),
            logprobs=out.logprobs,
            prepare_seconds=out.prepare_seconds,
            forward_seconds=out.forward_seconds,
            sample_seconds=out.sample_seconds,
        )
        return result, out.logits


def apply_plan(runner: ModelRunner, seqs: dict[int, SequenceState], plan: StepPlan) -> list[SequenceState]:
    """Steps 1-3 of StepPlan on a validated plan: drop, register, extend block tables; returns
    the scheduled sequences in batch order. Every tensor-parallel rank does this."""
    for seq_id in (*plan.finished_seq_ids, *plan.preempted_seq_ids):
        seq = seqs.pop(seq_id, None)
        if seq is not None:
            runner.remove_sequence(seq)
    for new in plan.new_seqs:
        seq = seqs[new.seq_id] = SequenceState.from_new(new)
        runner.add_sequence(seq)
    batch: list[SequenceState] = []
    offset = 0
    for seq_id, num_new in zip(plan.seq_ids, plan.num_new_blocks, strict=True):
        seq = seqs[seq_id]
        if num_new:
            runner.append_blocks(seq, plan.new_block_ids[offset : offset + num_new])
        offset += num_new
        batch.append(seq)
    return batch


def advance(
    batch: list[SequenceState],
    num_scheduled_tokens: list[int],
    sampling_seqs: list[SequenceState],
    sampled_token_ids: list[int],
) -> None:
    for seq, n in zip(batch, num_scheduled_tokens, strict=True):
        seq.num_computed_tokens += n
    append_tokens(sampling_seqs, sampled_token_ids)


def append_tokens(sampling_seqs: list[SequenceState], sampled_token_ids: list[int]) -> None:
    for seq, token_id in zip(sampling_seqs, sampled_token_ids, strict=True):
        seq.token_ids.append(token_id)


def drop_all(runner: ModelRunner, seqs: dict[int, SequenceState]) -> int:
    dropped = len(seqs)
    for seq in seqs.values():
        runner.remove_sequence(seq)
    seqs.clear()
    return dropped
