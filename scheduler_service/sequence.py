"""One request's tokens and its place in the KV cache, as the scheduler sees it."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from protos.plan import NewSequence, PromptLogprobs, StepSamplingParams, TokenLogprobs
from scheduler_service.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True)
class TokenLogprob:
    """A token's logprob and the top alternatives (token id, logprob), best first; a prompt
    token's also its rank in the vocabulary (1: the most likely)."""

    token_id: int
    logprob: float
    top_logprobs: list[tuple[int, float]]
    rank: int | None = None
    # The tokens' text, filled in by a front end with a tokenizer (request_handling.name_tokens).
    token: str | None = None
    top_tokens: list[str] | None = None


class Sequence:
    __slots__ = (
        "arrival",
        "block_hashes",
        "block_table",
        "client",
        "error",
        "finish_reason",
        "logprobs",
        "max_num_tokens",
        "name",
        "num_cached_tokens",
        "num_computed_tokens",
        "num_kv_written",
        "num_new_tokens",
        "num_pending_tokens",
        "num_prompt_tokens",
        "num_registered_blocks",
        "prompt_logprobs",
        "readmit_after",
        "sampling_params",
        "sent",
        "seq_id",
        "status",
        "step_params",
        "stop_ids",
        "token_ids",
    )

    def __init__(
        self,
        seq_id: int,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        arrival: int = 0,
        name: str | None = None,
        client: object | None = None,
    ) -> None:
        self.seq_id = seq_id
        # Who takes its outputs straight from the engine thread (the engine core's stream of a
        # request from an API server, engine_core.py); None: outputs go as RequestOutputs.
        self.client = client
        # The id its client knows the request by, for the logs.
        self.name = name or str(seq_id)
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.sampling_params = sampling_params
        self.step_params: StepSamplingParams = sampling_params.to_step_params(self.num_prompt_tokens)
        self.arrival = arrival
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None  # "stop" | "length" | "abort"
        self.error: str | None = None
        # One entry per output token when the request asked for logprobs, else None.
        self.logprobs: list[TokenLogprob] | None = [] if sampling_params.logprobs is not None else None
        # When the request asked for prompt logprobs: one entry per prompt token from the second.
        self.prompt_logprobs: list[TokenLogprob] | None = (
            [] if sampling_params.prompt_logprobs is not None else None
        )
        # Tokens whose KV is in the cache (or will be once the steps in flight complete).
        self.num_computed_tokens = 0
        # Of those, the ones written by steps whose results are back: only these blocks may be
        # registered in the prefix cache (a step in flight may still fail).
        self.num_kv_written = 0
        # Prefix-cache hit at first schedule; -1 until then.
        self.num_cached_tokens = -1
        self.block_table: list[int] = []
        # Chained hashes of the full blocks of token_ids, filled lazily by the block manager.
        self.block_hashes: list[bytes] = []
        # How many leading blocks of block_table are registered in the prefix cache.
        self.num_registered_blocks = 0
        # Whether the executor currently holds this sequence's state.
        self.sent = False
        # Tokens appended by the last update().
        self.num_new_tokens = 0
        # Tokens that plans in flight will sample (two plans in flight: up to 2).
        self.num_pending_tokens = 0
        # Once preempted: the step id of the plan that preempted it. Plans before that one may
        # sample it still, and their tokens are dropped only while it is not running, so it is
        # admitted again only once they are all applied (0: no such plan).
        self.readmit_after = 0
        # Set by the scheduler from the model's limits: sampled tokens that stop the sequence,
        # and the total length at which it stops with "length".
        self.stop_ids: frozenset[int] = frozenset()
        self.max_num_tokens = 0

    def __len__(self) -> int:
        return len(self.token_ids)

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, {self.status.value}, tokens={len(self.token_ids)}, "
            f"computed={self.num_computed_tokens}, blocks={self.block_table})"
        )

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def scores_prompt(self) -> bool:
        """Whether prompt logprobs are still to come: its prompt is computed, not read from the
        prefix cache (the executor scores only the positions it computes)."""
        lps = self.prompt_logprobs
        return lps is not None and len(lps) < self.num_prompt_tokens - 1

    def set_stop_rules(self, eos_token_ids: tuple[int, ...], max_model_len: int) -> None:
        """Which sampled tokens stop this sequence ("stop"), and at what length ("length")."""
        params = self.sampling_params
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids.update(eos_token_ids)
        self.stop_ids = frozenset(stop_ids)
        if params.min_tokens:  # the executor bans them until then
            # The end-of-sequence tokens even with ignore_eos (vLLM's all_stop_token_ids): they
            # wait for min_tokens there whether or not they stop the sequence after it.
            self.step_params.stop_token_ids = sorted(stop_ids.union(eos_token_ids))
        self.max_num_tokens = max_model_len
        if params.max_tokens is not None:
            self.max_num_tokens = min(max_model_len, self.num_prompt_tokens + params.max_tokens)

    def reset_for_recompute(self) -> None:
        """Forget every trace of an executor's state (it was lost): the tokens, generated ones
        included, are kept and recomputed by the next executor from scratch."""
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.num_kv_written = 0
        self.block_table = []
        self.block_hashes = []
        self.num_registered_blocks = 0
        self.sent = False
        self.num_new_tokens = 0
        self.num_pending_tokens = 0
        self.readmit_after = 0

    def to_new_sequence(self) -> NewSequence:
        """The executor's copy: all tokens known so far, prompt and generated."""
        return NewSequence(
            seq_id=self.seq_id,
            token_ids=list(self.token_ids),
            block_table=list(self.block_table),
            num_computed_tokens=self.num_computed_tokens,
            sampling_params=self.step_params,
        )

    def append_prompt_logprobs(self, lp: PromptLogprobs) -> None:
        """Record the prompt tokens a step scored; tokens scored before (a recompute) are skipped."""
        lps = self.prompt_logprobs
        num_top = len(lp.top_token_ids) // max(len(lp.token_logprobs), 1)
        # prompt_logprobs[j] is token j + 1's
        for j in range(len(lps) + 1 - lp.first_token_index, len(lp.token_logprobs)):
            if j < 0:
                return  # a gap: never, since a scoring sequence skips the prefix cache
            top = slice(j * num_top, (j + 1) * num_top)
            lps.append(
                TokenLogprob(
                    self.token_ids[lp.first_token_index + j],
                    lp.token_logprobs[j],
                    list(zip(lp.top_token_ids[top], lp.top_logprobs[top], strict=True)),
                    lp.ranks[j],
                )
            )

    def append_logprobs(self, lp: TokenLogprobs, num_before: int) -> None:
        """Record the logprobs of the tokens appended after position num_before. With logprobs 0
        (each token's own), without the alternative the executor reports beside it."""
        num_top = len(lp.top_token_ids) // max(len(lp.sampled_logprobs), 1)
        own_only = self.sampling_params.logprobs == 0
        for j in range(len(self.token_ids) - num_before):
            top = slice(j * num_top, (j + 1) * num_top)
            self.logprobs.append(
                TokenLogprob(
                    self.token_ids[num_before + j],
                    lp.sampled_logprobs[j],
                    [] if own_only else list(zip(lp.top_token_ids[top], lp.top_logprobs[top], strict=True)),
                )
            )
