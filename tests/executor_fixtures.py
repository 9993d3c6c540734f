"""Helpers for the executor tests: a minimal scheduler that builds step plans, and HF references."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from executor_service.config import ExecutorConfig
from executor_service.executor import LocalExecutor
from protos.plan import NewSequence, StepPlan, StepResult, StepSamplingParams


def make_executor(model: Path, **kwargs) -> LocalExecutor:
    kwargs.setdefault("num_kv_blocks", 128)
    kwargs.setdefault("max_model_len", 512)
    return LocalExecutor(ExecutorConfig(model=str(model), **kwargs))


@dataclass
class _Seq:
    token_ids: list[int]
    params: StepSamplingParams
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    sent: bool = False  # the executor holds it


class MiniScheduler:
    """Just enough of a scheduler to drive a LocalExecutor: block allocation, plans, updates."""

    def __init__(self, executor: LocalExecutor) -> None:
        self.executor = executor
        self.block_size = executor.describe().block_size
        self.free_blocks = list(range(executor.describe().num_kv_blocks))
        self.seqs: dict[int, _Seq] = {}
        self.step_id = 0

    def add(
        self,
        seq_id: int,
        prompt: list[int],
        params: StepSamplingParams | None = None,
        shared_blocks: list[int] | None = None,
        num_computed_tokens: int = 0,
    ) -> None:
        """A new sequence; `shared_blocks` / `num_computed_tokens` model a prefix-cache hit."""
        params = params or StepSamplingParams()
        params.num_prompt_tokens = len(prompt)
        seq = _Seq(list(prompt), params, list(shared_blocks or []), num_computed_tokens)
        self.seqs[seq_id] = seq

    def plan(
        self, schedule: dict[int, int], finished: tuple[int, ...] = (), preempted: tuple[int, ...] = ()
    ) -> StepPlan:
        plan = StepPlan(
            step_id=self.step_id, finished_seq_ids=list(finished), preempted_seq_ids=list(preempted)
        )
        self.step_id += 1
        for seq_id in (*finished, *preempted):
            seq = self.seqs[seq_id]
            self.free_blocks += seq.block_table
            seq.block_table, seq.num_computed_tokens, seq.sent = [], 0, False
        for seq_id, n in schedule.items():
            seq = self.seqs[seq_id]
            needed = -(-(seq.num_computed_tokens + n) // self.block_size) - len(seq.block_table)
            new_blocks = [self.free_blocks.pop(0) for _ in range(max(0, needed))]
            seq.block_table += new_blocks
            if not seq.sent:
                plan.new_seqs.append(
                    NewSequence(
                        seq_id,
                        list(seq.token_ids),
                        list(seq.block_table),
                        seq.num_computed_tokens,
                        seq.params,
                    )
                )
                new_blocks = []
                seq.sent = True
            plan.seq_ids.append(seq_id)
            plan.num_scheduled_tokens.append(n)
            plan.num_computed_tokens.append(seq.num_computed_tokens)
            plan.new_block_ids += new_blocks
            plan.num_new_blocks.append(len(new_blocks))
        return plan

    def update(self, plan: StepPlan, result: StepResult) -> None:
        for seq_id, n in zip(plan.seq_ids, plan.num_scheduled_tokens, strict=True):
            self.seqs[seq_id].num_computed_tokens += n
        for seq_id, token in zip(result.seq_ids, result.token_ids, strict=True):
            self.seqs[seq_id].token_ids.append(token)

    def step(self, schedule: dict[int, int], **kwargs) -> tuple[StepResult, torch.Tensor | None]:
        """Plan, run with logits for every scheduled token, update."""
        plan = self.plan(schedule, **kwargs)
        result, logits = self.executor.step_with_logits(plan)
        self.update(plan, result)
        return result, logits

    def decode_all(self) -> dict[int, int]:
        return {
            i: 1 for i, s in self.seqs.items() if s.sent and s.num_computed_tokens == len(s.token_ids) - 1
        }


def hf_logits(model: torch.nn.Module, token_ids: list[int]) -> torch.Tensor:
    """Hugging Face logits for every position of one sequence: [len, vocab]."""
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].float()


def prompt_ids(length: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, 512, (length,), generator=g).tolist()
