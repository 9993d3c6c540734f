"""Checks a StepPlan against the executor's state and limits before anything is applied.

The executor holds at most `max_held_seqs` sequences (HELD_SEQS_PER_BATCH_SEQ x max_num_seqs):
a scheduler drops what it does not run (finished_seq_ids, preempted_seq_ids), so more than that
is a client that registers sequences and never schedules them, whose memory would grow without
bound."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

from executor_service.sequence import SequenceState
from protos.plan import NewSequence, StepPlan, StepSamplingParams

# Headroom over max_num_seqs for the sequences the scheduler holds: the batch, and those whose
# end or preemption reaches the executor with the next plan (two in flight).
HELD_SEQS_PER_BATCH_SEQ = 2


class PlanError(ValueError):
    """A plan the executor cannot execute; no state was changed."""


class StepOrderError(RuntimeError):
    """A send or receive out of the executor's protocol order (no device work was involved)."""


@dataclass(frozen=True)
class PlanLimits:
    block_size: int
    num_kv_blocks: int
    vocab_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int

    @property
    def max_held_seqs(self) -> int:
        return HELD_SEQS_PER_BATCH_SEQ * self.max_num_seqs


def check_step_order(step_id: int, last_step_id: int | None) -> None:
    """Step ids on one stream must increase: PlanError for a repeated or an older one."""
    if last_step_id is not None and step_id <= last_step_id:
        raise PlanError(
            f"step {step_id} is out of order on this stream: the last step was {last_step_id}, so the "
            f"next step id must be {last_step_id + 1} or above"
        )


def check_num_new_seqs(step_id: int, num_new_seqs: int, max_held_seqs: int) -> None:
    """Before a plan is read: more new sequences than the executor may hold is PlanError at once.
    Each one read costs ~10 us and ~800 bytes (3M in a 64 MiB plan: 30 s and 2.5 GB)."""
    if num_new_seqs > max_held_seqs:
        raise PlanError(
            f"step {step_id}: {num_new_seqs} new seqs exceed {HELD_SEQS_PER_BATCH_SEQ} x max_num_seqs "
            f"({max_held_seqs}), the most sequences the executor holds"
        )


def _first(values: list, is_bad) -> tuple[int, object] | None:
    """(index, value) of the first entry for which is_bad holds."""
    return next(((i, v) for i, v in enumerate(values) if is_bad(v)), None)


def _duplicates(ids: list[int]) -> list[int]:
    return sorted(i for i, count in Counter(ids).items() if count > 1)


def validate_plan(plan: StepPlan, seqs: dict[int, SequenceState], limits: PlanLimits) -> None:
    """Raise PlanError naming the first problem found. Ids in finished_seq_ids / preempted_seq_ids
    that the executor does not hold are ignored (a request aborted before it ever ran)."""

    def fail(message: str) -> None:
        raise PlanError(f"step {plan.step_id}: {message}")

    n = len(plan.seq_ids)
    for name in ("num_scheduled_tokens", "num_computed_tokens", "num_new_blocks"):
        if len(getattr(plan, name)) != n:
            fail(
                f"columns of mismatched lengths: {len(plan.seq_ids)} seq_ids but {len(getattr(plan, name))} {name}"
            )
    # Messages name the first bad entry, never a whole column (a status message must stay small).
    for name in ("num_computed_tokens", "num_new_blocks"):
        if bad := _first(getattr(plan, name), lambda v: v < 0):
            fail(f"negative count in {name}: {name}[{bad[0]}] = {bad[1]}")
    if bad := _first(plan.num_scheduled_tokens, lambda v: v <= 0):
        fail(f"num_scheduled_tokens must be positive: num_scheduled_tokens[{bad[0]}] = {bad[1]}")
    if sum(plan.num_new_blocks) != len(plan.new_block_ids):
        fail(
            f"columns of mismatched lengths: num_new_blocks sum to {sum(plan.num_new_blocks)} but "
            f"new_block_ids has {len(plan.new_block_ids)}"
        )
    for what, ids in (
        ("seq_ids", plan.seq_ids),
        ("new_seqs", [s.seq_id for s in plan.new_seqs]),
        ("finished_seq_ids + preempted_seq_ids", plan.finished_seq_ids + plan.preempted_seq_ids),
    ):
        if dup := _duplicates(ids):
            fail(f"duplicate seq id {dup[0]} in {what}")
    if n > limits.max_num_seqs:
        fail(f"{n} scheduled sequences exceed max_num_seqs ({limits.max_num_seqs})")
    if (total := sum(plan.num_scheduled_tokens)) > limits.max_num_batched_tokens:
        fail(f"{total} scheduled tokens exceed max_num_batched_tokens ({limits.max_num_batched_tokens})")
    _check_blocks("new_block_ids", plan.new_block_ids, limits, fail)

    dropped = set(plan.finished_seq_ids) | set(plan.preempted_seq_ids)
    new_seqs: dict[int, NewSequence] = {}
    for new in plan.new_seqs:
        if new.seq_id in seqs and new.seq_id not in dropped:
            fail(f"new seq {new.seq_id} is already held by the executor")
        _check_new_seq(new, limits, fail)
        new_seqs[new.seq_id] = new
    if new_seqs:
        held = len(seqs) - len(dropped.intersection(seqs)) + len(new_seqs)
        if held > limits.max_held_seqs:
            fail(
                f"{len(new_seqs)} new seqs would make the executor hold {held} sequences, more than "
                f"{HELD_SEQS_PER_BATCH_SEQ} x max_num_seqs ({limits.max_held_seqs}): finish or preempt "
                "the sequences that are not scheduled"
            )

    offset = 0
    for i, seq_id in enumerate(plan.seq_ids):
        num_new = plan.num_new_blocks[i]
        offset += num_new
        if seq_id in new_seqs:
            new = new_seqs[seq_id]
            if num_new:
                fail(f"new seq {seq_id} has num_new_blocks {num_new}; its block_table must be complete")
            num_tokens, num_blocks, computed = (
                len(new.token_ids),
                len(new.block_table),
                new.num_computed_tokens,
            )
        elif seq_id in seqs and seq_id not in dropped:
            seq = seqs[seq_id]
            num_tokens, num_blocks, computed = (
                seq.num_tokens,
                len(seq.block_table) + num_new,
                seq.num_computed_tokens,
            )
        else:
            fail(f"unknown seq id {seq_id} (not held and not in new_seqs)")
        c, k = plan.num_computed_tokens[i], plan.num_scheduled_tokens[i]
        if c != computed:
            fail(f"seq {seq_id}: num_computed_tokens mismatch: plan says {c}, executor has {computed}")
        if c + k > num_tokens:
            fail(f"seq {seq_id}: schedules tokens [{c}, {c + k}) but only {num_tokens} tokens are known")
        if c + k > limits.max_model_len:
            fail(f"seq {seq_id}: {c + k} tokens exceed max_model_len ({limits.max_model_len})")
        if num_blocks > (max_blocks := _max_blocks_per_seq(limits)):
            fail(f"seq {seq_id}: {num_blocks} blocks exceed max_model_len / block_size ({max_blocks})")
        if num_blocks * limits.block_size < c + k:
            fail(
                f"seq {seq_id}: too few blocks: {num_blocks} blocks of {limits.block_size} cannot hold "
                f"{c + k} tokens"
            )


def _max_blocks_per_seq(limits: PlanLimits) -> int:
    return -(-limits.max_model_len // limits.block_size)


def _check_blocks(what: str, block_ids: list[int], limits: PlanLimits, fail) -> None:
    bad = [b for b in block_ids if not 0 <= b < limits.num_kv_blocks]
    if bad:
        fail(f"block id {bad[0]} in {what} is outside [0, {limits.num_kv_blocks})")


def _check_new_seq(new: NewSequence, limits: PlanLimits, fail) -> None:
    if not new.token_ids:
        fail(f"new seq {new.seq_id} has no token ids")
    bad = [t for t in new.token_ids if not 0 <= t < limits.vocab_size]
    if bad:
        fail(f"new seq {new.seq_id}: token id {bad[0]} is outside the vocabulary [0, {limits.vocab_size})")
    if len(new.token_ids) > limits.max_model_len:
        fail(
            f"new seq {new.seq_id} has {len(new.token_ids)} tokens, more than max_model_len ({limits.max_model_len})"
        )
    if not 0 <= new.num_computed_tokens <= len(new.token_ids):
        fail(
            f"new seq {new.seq_id}: num_computed_tokens {new.num_computed_tokens} is outside "
            f"[0, {len(new.token_ids)}]"
        )
    if len(new.block_table) > (max_blocks := _max_blocks_per_seq(limits)):
        fail(
            f"new seq {new.seq_id}: block_table of {len(new.block_table)} blocks exceeds "
            f"max_model_len / block_size ({max_blocks})"
        )
    _check_blocks(f"the block_table of new seq {new.seq_id}", new.block_table, limits, fail)
    if problem := sampling_problem(new.sampling_params, limits.vocab_size):
        fail(f"new seq {new.seq_id}: {problem}")


def sampling_problem(p: StepSamplingParams, vocab_size: int) -> str | None:
    if not (math.isfinite(p.temperature) and p.temperature >= 0):
        return f"temperature {p.temperature} must be >= 0"
    if p.top_k < 0:
        return f"top_k {p.top_k} must be >= 0 (0 = off)"
    if not 0 < p.top_p <= 1:
        return f"top_p {p.top_p} must be in (0, 1]"
    if not 0 <= p.min_p <= 1:
        return f"min_p {p.min_p} must be in [0, 1]"
    if not (math.isfinite(p.repetition_penalty) and p.repetition_penalty > 0):
        return f"repetition_penalty {p.repetition_penalty} must be > 0 and finite"
    for name in ("presence_penalty", "frequency_penalty"):
        if not math.isfinite(getattr(p, name)):
            return f"{name} {getattr(p, name)} must be finite"
    if not 0 <= p.logprobs <= vocab_size:
        return f"logprobs {p.logprobs} must be in [0, {vocab_size}]"
    if p.num_prompt_tokens < 0:
        return f"num_prompt_tokens {p.num_prompt_tokens} must be >= 0"
    if p.min_tokens < 0:
        return f"min_tokens {p.min_tokens} must be >= 0"
    if p.prompt_logprobs is not None and not 0 <= p.prompt_logprobs <= vocab_size:
        return f"prompt_logprobs {p.prompt_logprobs} must be in [0, {vocab_size}]"
    if len(p.logit_bias_token_ids) != len(p.logit_bias_values):
        return (
            f"logit_bias columns of mismatched lengths: {len(p.logit_bias_token_ids)} token ids but "
            f"{len(p.logit_bias_values)} values"
        )
    if len(p.logit_bias_token_ids) > vocab_size:
        return (
            f"logit_bias has {len(p.logit_bias_token_ids)} entries, more than the vocabulary ({vocab_size})"
        )
    # (each step bans them while the sequence is short of min_tokens: their number is its cost)
    if len(p.stop_token_ids) > vocab_size:
        return f"stop_token_ids has {len(p.stop_token_ids)} entries, more than the vocabulary ({vocab_size})"
    if bad := _first(p.logit_bias_values, lambda v: not math.isfinite(v)):
        return f"logit_bias_values[{bad[0]}] = {bad[1]} must be finite"
    for name in ("stop_token_ids", "logit_bias_token_ids"):
        if bad := _first(getattr(p, name), lambda t: not 0 <= t < vocab_size):
            return f"{name}[{bad[0]}] = {bad[1]} is outside the vocabulary [0, {vocab_size})"
    return None
