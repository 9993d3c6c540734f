"""Continuous batching: which sequences run each step, and how many tokens each computes.

vLLM v1's policy: prefill and decode are not separate phases. Every running sequence has
num_computed_tokens catching up with len(token_ids); a step gives each scheduled sequence
a number of tokens under a token budget (decode = 1, chunked prefill = a slice), running
sequences first, then waiting ones in arrival order. When the cache runs out, the newest
running sequence is preempted by recompute.

Two plans may be in flight (their lifecycle: steps_in_flight.py): step N+1 is scheduled before
step N's result is back, counting on one more token for every sequence N samples
(`num_pending_tokens`); the executor feeds what it sampled into N+1 itself. Stop checks lag by one step: a sequence that stops at N
computes one token in N+1 whose result is dropped. A sequence whose pending tokens reach its
length limit is not scheduled again. Blocks enter the prefix cache once a plan that writes their
last position is scheduled, so that requests arriving together share a prefix computed once (the
executor runs plans in order and, within a step, stores every token's KV before attention reads
it). A plan that fails takes the plans behind it along, and `abandon` takes the blocks they
registered out of the cache again.
"""

from __future__ import annotations

import itertools
import logging
from collections import deque

from protos.plan import ExecutorInfo, StepPlan, StepResult
from scheduler_service.block_manager import BlockManager
from scheduler_service.config import SchedulerConfig, resolve_limits
from scheduler_service.sequence import Sequence, SequenceStatus
from scheduler_service.stats import SchedulerStats
from scheduler_service.steps_in_flight import PlansInFlight

logger = logging.getLogger(__name__)

_RUNNING = SequenceStatus.RUNNING


class Scheduler:
    def __init__(self, config: SchedulerConfig, info: ExecutorInfo, first_step_id: int = 1) -> None:
        self.config = config
        self.limits = limits = resolve_limits(config, info)
        self.block_manager = BlockManager(
            limits.num_kv_blocks, limits.block_size, limits.enable_prefix_caching
        )
        self.waiting: deque[Sequence] = deque()
        # In admission order: the newest running sequence is last (the preemption victim).
        self.running: list[Sequence] = []
        self.seqs: dict[int, Sequence] = {}
        self._arrivals = itertools.count()
        # Continues across executor reconnects, so that a late result of an old step is told apart.
        self._next_step_id = first_step_id
        # Sequences the executor holds that finished since the last plan.
        self._finished_ids: list[int] = []
        # Plans scheduled and not yet applied, oldest first.
        self.in_flight = PlansInFlight()
        # Sequences failed inside schedule(), returned by the next update().
        self._failed: list[Sequence] = []
        self.stats = SchedulerStats(num_total_blocks=limits.num_kv_blocks)
        self._prefill_budget = config.max_prefill_tokens_while_decoding

    # -- requests -------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        if seq.seq_id in self.seqs:
            raise ValueError(f"sequence id {seq.seq_id} is already in use")
        seq.set_stop_rules(self.limits.eos_token_ids, self.limits.max_model_len)
        seq.arrival = next(self._arrivals)
        seq.status = SequenceStatus.WAITING
        self.seqs[seq.seq_id] = seq
        self.waiting.append(seq)

    def abort(self, seq_id: int) -> bool:
        """Finish a sequence with "abort" and free its blocks. Plans in flight may still compute
        for it: the executor runs plans in order, so a later plan's new owner of a freed block
        writes after them, and their results for it are dropped."""
        seq = self.seqs.get(seq_id)
        if seq is None:
            return False
        if seq.status is _RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self._finish(seq, "abort")
        self._refresh_gauges()
        return True

    def abandon(self) -> None:
        """Undo the bookkeeping of every plan in flight (steps_in_flight.py): the executor ran
        none of them."""
        self._finished_ids = self.in_flight.abandon(
            self.seqs, self.running, self.waiting, self.block_manager, self._finished_ids
        )
        self._refresh_gauges()

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _readmissible(self, seq: Sequence) -> bool:
        """Whether a preempted sequence may run again: no plan scheduled before its preemption is
        still in flight. (Such a plan may sample it, and update() drops that token only while the
        sequence is not running: admitted again first, it would take the token as its own.)"""
        in_flight = self.in_flight
        return not in_flight or in_flight.oldest().plan.step_id >= seq.readmit_after

    def can_schedule_ahead(self) -> bool:
        """Whether a plan scheduled now, before the results in flight, would compute anything."""
        if self._finished_ids or (self.waiting and self._readmissible(self.waiting[0])):
            return True
        return any(
            not s.num_pending_tokens or len(s.token_ids) + s.num_pending_tokens < s.max_num_tokens
            for s in self.running
        )

    def has_finished_to_send(self) -> bool:
        """Finished sequences whose executor state the next plan still has to drop."""
        return bool(self._finished_ids)

    @property
    def next_step_id(self) -> int:
        return self._next_step_id

    def unfinished(self) -> list[Sequence]:
        """Every running and waiting sequence, in arrival order."""
        return sorted(self.seqs.values(), key=lambda s: s.arrival)

    def _refresh_gauges(self) -> None:
        stats = self.stats
        stats.num_running = len(self.running)
        stats.num_waiting = len(self.waiting)
        stats.num_used_blocks = self.block_manager.num_used_blocks

    # -- schedule -------------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        bm = self.block_manager
        bs = self.limits.block_size
        budget = self.limits.max_num_batched_tokens
        plan = StepPlan(step_id=self._next_step_id, finished_seq_ids=self._finished_ids)
        self._next_step_id += 1
        self._finished_ids = []
        seq_ids = plan.seq_ids
        num_scheduled = plan.num_scheduled_tokens
        num_computed = plan.num_computed_tokens
        num_new_blocks = plan.num_new_blocks
        running = self.running
        # Scheduled sequences that sample this step, and those that do not (a prefill chunk).
        sampling: list[Sequence] = []
        partial: list[tuple[Sequence, int]] = []
        caching = bm.enable_prefix_caching
        registered: list[int] = []  # blocks this plan puts in the prefix cache
        preempted = False
        # Prefill tokens this step may still carry: all of the budget, or less while sequences decode.
        prefill_left = budget
        if self._prefill_budget and any(
            len(s.token_ids) + s.num_pending_tokens - s.num_computed_tokens == 1 for s in running
        ):
            prefill_left = self._prefill_budget

        # (a preemption pops from the end of running, behind seq: the loop sees it shorter)
        for seq in running:
            if budget <= 0:
                break
            c = seq.num_computed_tokens
            pending = seq.num_pending_tokens
            # Tokens known, or sampled by a plan in flight (its token is fed on the executor).
            known = len(seq.token_ids) + pending
            remaining = known - c
            if pending and known >= seq.max_num_tokens:
                continue  # it stops with "length" once the results in flight are in
            n = remaining if remaining <= budget else budget
            if remaining > 1 and n > prefill_left:  # a prefill chunk
                if not prefill_left:
                    continue
                n = prefill_left
            # Inline, not bm.can_append: most decode steps fit in the last block, and two method
            # calls per sequence were 10-25% of the step's scheduling cost.
            if c + n > len(seq.block_table) * bs:
                if not bm.can_append(seq, n):
                    if pending:
                        # Its token in flight may stop it: wait for that result rather than
                        # preempt a live request for a token that could be thrown away.
                        continue
                    while running[-1] is not seq and not bm.can_append(seq, n):
                        self._preempt(running.pop(), plan)
                        preempted = True
                    if not bm.can_append(seq, n):
                        self._preempt(running.pop(), plan)
                        preempted = True
                        if not running:
                            self._fail_unfittable(seq)
                        break
                new = bm.append_slots(seq, n)
                plan.new_block_ids.extend(new)
                num_new_blocks.append(len(new))
            else:
                num_new_blocks.append(0)
            if n < remaining:
                partial.append((seq, c + n))
            else:
                sampling.append(seq)
                seq.num_pending_tokens = pending + 1
            seq_ids.append(seq.seq_id)
            num_scheduled.append(n)
            num_computed.append(c)
            seq.num_computed_tokens = c + n
            budget -= n
            if remaining > 1:  # a prefill: its blocks may serve sequences admitted behind it
                prefill_left -= n
                if caching and (c + n) // bs > seq.num_registered_blocks:
                    registered += bm.cache_full_blocks(seq, c + n)

        # After a preemption, admitting new work would only thrash the cache.
        if not preempted:
            self._schedule_waiting(plan, min(budget, prefill_left), sampling, partial, registered)
        self.in_flight.scheduled(plan, sampling, partial, registered)
        self.stats.num_chunked_prefills += len(partial)
        self.stats.num_steps += 1
        self._refresh_gauges()
        return plan

    def _schedule_waiting(
        self,
        plan: StepPlan,
        budget: int,
        sampling: list[Sequence],
        partial: list[tuple[Sequence, int]],
        registered: list[int],
    ) -> None:
        """Admit waiting sequences in arrival order into plan, sampling or partial."""
        bm = self.block_manager
        bs = self.limits.block_size
        waiting = self.waiting
        running = self.running
        while waiting and budget > 0 and len(running) < self.limits.max_num_seqs:
            seq = waiting[0]
            if seq.readmit_after and not self._readmissible(seq):
                break  # (arrival order: none behind it goes first)
            cached = bm.find_cached_blocks(seq) if not seq.scores_prompt else []
            num_cached = len(cached) * bs
            n = min(len(seq.token_ids) - num_cached, budget)
            if not bm.can_allocate(seq, n, cached):
                if running:
                    break
                waiting.popleft()
                self._fail_unfittable(seq)
                continue
            bm.allocate(seq, n, cached)
            waiting.popleft()
            running.append(seq)
            seq.status = _RUNNING
            if seq.num_cached_tokens < 0:
                seq.num_cached_tokens = num_cached
                # Its prompt's lookup, once: a recompute (after a preemption, on a new executor)
                # reads back its own blocks, which is no prefix hit (as vLLM's hit rate).
                if bm.enable_prefix_caching:
                    self.stats.num_prefix_queried_tokens += len(seq.token_ids)
                    self.stats.num_prefix_hit_tokens += num_cached
            seq.num_computed_tokens = seq.num_kv_written = num_cached
            plan.new_seqs.append(seq.to_new_sequence())
            seq.sent = True
            plan.seq_ids.append(seq.seq_id)
            plan.num_scheduled_tokens.append(n)
            plan.num_computed_tokens.append(num_cached)
            plan.num_new_blocks.append(0)
            seq.num_computed_tokens = num_cached + n
            if bm.enable_prefix_caching:  # the next admission may hit these blocks
                registered += bm.cache_full_blocks(seq, num_cached + n)
            if seq.num_computed_tokens < len(seq.token_ids):
                partial.append((seq, seq.num_computed_tokens))
            else:
                sampling.append(seq)
                seq.num_pending_tokens += 1
            budget -= n

    def _preempt(self, seq: Sequence, plan: StepPlan) -> None:
        """Preempt by recompute: drop the KV, keep the tokens, requeue at the front."""
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = seq.num_kv_written = 0
        seq.num_pending_tokens = 0  # a token a plan in flight samples for it is dropped
        seq.readmit_after = plan.step_id
        self.waiting.appendleft(seq)
        if seq.sent:
            plan.preempted_seq_ids.append(seq.seq_id)
            seq.sent = False
        self.stats.num_preemptions += 1
        logger.debug("preempted request %s (%d tokens)", seq.name, len(seq.token_ids))

    def _fail_unfittable(self, seq: Sequence) -> None:
        if seq.status is SequenceStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        seq.error = (
            f"request {seq.name} ({len(seq.token_ids)} tokens) does not fit in the KV cache "
            f"({self.limits.num_kv_blocks} blocks of {self.limits.block_size} tokens)"
        )
        logger.error(seq.error)
        seq.num_new_tokens = 0
        self._finish(seq, "abort")
        self._failed.append(seq)

    # -- update ---------------------------------------------------------------------------

    def update(self, plan: StepPlan, result: StepResult) -> list[Sequence]:
        """Apply the executor's sampled tokens: append, stop checks, free finished blocks.
        Returns the sequences that got a token or finished, each with num_new_tokens set."""
        if result.step_id != plan.step_id:
            raise RuntimeError(f"result for step {result.step_id} does not match plan {plan.step_id}")
        applied = self.in_flight.applied(plan)
        sampling, partial = applied.sampling, applied.partial
        if len(result.seq_ids) != len(sampling):
            raise RuntimeError(
                f"step {plan.step_id}: executor sampled {len(result.seq_ids)} sequences, expected {len(sampling)}"
            )
        # The executor samples in batch order, so result i is sampling[i]; a lookup by id only
        # where it is not (one comparison of the columns, not one per sequence in the loop).
        if [s.seq_id for s in sampling] != result.seq_ids:
            by_id = {s.seq_id: s for s in sampling}
            missing = next((i for i in result.seq_ids if i not in by_id), None)
            if missing is not None:
                raise RuntimeError(
                    f"step {plan.step_id}: executor sampled sequence {missing}, not in the plan"
                )
            sampling = [by_id[i] for i in result.seq_ids]
        out = self._failed
        self._failed = []
        seqs = self.seqs
        stats = self.stats
        bm = self.block_manager
        caching = bm.enable_prefix_caching
        bs = self.limits.block_size
        token_ids = result.token_ids
        logprobs = {lp.seq_id: lp for lp in result.logprobs} if result.logprobs else None
        for lp in result.prompt_logprobs:
            seq = seqs.get(lp.seq_id)
            if seq is not None and seq.prompt_logprobs is not None:
                seq.append_prompt_logprobs(lp)
        any_finished = False
        num_generated = 0
        offset = 0
        for seq, k in zip(sampling, result.num_tokens, strict=True):
            if seq.status is not _RUNNING or seqs.get(seq.seq_id) is not seq:
                offset += k
                continue  # finished, aborted or preempted while the step ran: drop its token
            seq.num_pending_tokens -= 1
            tokens = seq.token_ids
            num_before = len(tokens)
            if seq.num_computed_tokens != num_before + seq.num_pending_tokens:
                raise RuntimeError(f"executor sampled a token for sequence {seq.seq_id} in mid-prefill")
            # This step wrote the KV of every token known before its result: those blocks may
            # now enter the prefix cache.
            seq.num_kv_written = num_before
            if num_before == seq.num_prompt_tokens:
                stats.num_prompt_tokens += num_before
            reason = None
            if k == 1:  # a decode step's one token (the loop below, without its overhead)
                tok = token_ids[offset]
                tokens.append(tok)
                if (
                    tok in seq.stop_ids
                    and num_before + 1 - seq.num_prompt_tokens > seq.step_params.min_tokens
                ):
                    reason = "stop"
                elif num_before + 1 >= seq.max_num_tokens:
                    reason = "length"
                num_new = 1
            else:
                for tok in token_ids[offset : offset + k]:
                    tokens.append(tok)
                    # (the executor bans stop tokens short of min_tokens: this only checks it)
                    if (
                        tok in seq.stop_ids
                        and len(tokens) - seq.num_prompt_tokens > seq.step_params.min_tokens
                    ):
                        reason = "stop"
                        break
                    if len(tokens) >= seq.max_num_tokens:
                        reason = "length"
                        break
                num_new = len(tokens) - num_before
            offset += k
            seq.num_new_tokens = num_new
            num_generated += num_new
            if logprobs is not None and seq.logprobs is not None and seq.seq_id in logprobs:
                seq.append_logprobs(logprobs[seq.seq_id], num_before)
            if reason is not None:
                self._finish(seq, reason)
                any_finished = True
            elif caching and num_before // bs > seq.num_registered_blocks:  # (num_kv_written)
                bm.cache_full_blocks(seq)
            out.append(seq)
        stats.num_generation_tokens += num_generated
        if any_finished:
            self.running = [s for s in self.running if s.status is _RUNNING]
        for seq, written in partial:
            if seq.status is _RUNNING and seqs.get(seq.seq_id) is seq:
                seq.num_kv_written = written
                if caching:
                    bm.cache_full_blocks(seq)
        self._refresh_gauges()
        return out

    def _finish(self, seq: Sequence, reason: str) -> None:
        """Mark finished and free the blocks. The caller removes seq from running/waiting."""
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        logger.debug("request %s finished (%s) after %d tokens", seq.name, reason, seq.num_output_tokens)
        by_reason = self.stats.finished_by_reason
        by_reason[reason] = by_reason.get(reason, 0) + 1
        # Keep the prompt + output blocks in the prefix cache for later requests.
        self.block_manager.cache_full_blocks(seq)
        self.block_manager.free(seq)
        del self.seqs[seq.seq_id]
        if seq.sent:
            self._finished_ids.append(seq.seq_id)
            seq.sent = False
