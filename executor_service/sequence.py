"""The executor's per-sequence state, built from a plan's NewSequence and advanced by each step."""

from __future__ import annotations

from dataclasses import dataclass

from protos.plan import NewSequence, StepSamplingParams


@dataclass(slots=True)
class SequenceState:
    seq_id: int
    token_ids: list[int]
    block_table: list[int]
    num_computed_tokens: int
    sampling_params: StepSamplingParams
    # token_ids[:num_prompt_tokens] is the prompt; the rest was generated (penalties tell them apart).
    num_prompt_tokens: int
    # The model runner's row for this sequence's block table (set while the executor holds it).
    row: int = -1
    # While a step in flight samples this sequence's last token: token_ids ends with a -1
    # placeholder, and this is its row in that step's sampled ids (on the device).
    pending_row: int = -1

    @classmethod
    def from_new(cls, new: NewSequence) -> SequenceState:
        params = new.sampling_params
        # A NewSequence without num_prompt_tokens counts every token it brings as prompt.
        num_prompt = params.num_prompt_tokens or len(new.token_ids)
        return cls(
            seq_id=new.seq_id,
            token_ids=list(new.token_ids),
            block_table=list(new.block_table),
            num_computed_tokens=new.num_computed_tokens,
            sampling_params=params,
            num_prompt_tokens=min(num_prompt, len(new.token_ids)),
        )

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)
