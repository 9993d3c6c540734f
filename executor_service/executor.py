"""LocalExecutor: applies step plans to per-sequence state and runs them through the model runner."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from executor_service.config import ExecutorConfig
from executor_service.model_runner import ModelRunner
from executor_service.plan_validation import PlanError, PlanLimits, validate_plan
from executor_service.sequence import SequenceState
from protos.plan import ExecutorInfo, StepPlan, StepResult

logger = logging.getLogger(__name__)

__all__ = ["LocalExecutor", "PlanError"]


class LocalExecutor:
    """The executor in-process: `describe()`, `step(plan)`, `reset()`."""

    def __init__(self, config: ExecutorConfig) -> None:
        self.config = config
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
            tensor_parallel_size=1,
            dtype=self.config.dtype,
            device=self.config.device,
            max_num_seqs=self.config.max_num_seqs,
            max_num_batched_tokens=self.config.max_num_batched_tokens,
            attention_backend=self.config.attention_backend,
            num_layers=mc.num_hidden_layers,
            block_bytes=self.runner.kv_cache.block_bytes,
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
        dropped = len(self.seqs)
        for seq in self.seqs.values():
            self.runner.remove_sequence(seq)
        self.seqs.clear()
        return dropped

    def _step(self, plan: StepPlan, all_logits: bool) -> tuple[StepResult, torch.Tensor | None]:
        validate_plan(plan, self.seqs, self.limits)
        for seq_id in (*plan.finished_seq_ids, *plan.preempted_seq_ids):
            seq = self.seqs.pop(seq_id, None)
            if seq is not None:
                self.runner.remove_sequence(seq)
        for new in plan.new_seqs:
            seq = self.seqs[new.seq_id] = SequenceState.from_new(new)
            self.runner.add_sequence(seq)
        if not plan.seq_ids:
            return StepResult(step_id=plan.step_id), None
        batch: list[SequenceState] = []
        offset = 0
        for seq_id, num_new in zip(plan.seq_ids, plan.num_new_blocks, strict=True):
            seq = self.seqs[seq_id]
            if num_new:
                self.runner.append_blocks(seq, plan.new_block_ids[offset : offset + num_new])
            offset += num_new
            batch.append(seq)

        prepared, out = self.runner.run(batch, plan.num_scheduled_tokens, all_logits)
        for seq, n in zip(batch, plan.num_scheduled_tokens, strict=True):
            seq.num_computed_tokens += n
        for seq, token_id in zip(prepared.sampling_seqs, out.sampled_token_ids, strict=True):
            seq.token_ids.append(token_id)
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
