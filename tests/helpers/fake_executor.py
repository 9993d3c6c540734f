"""Shared by the tests: from test_scheduler.py."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from protos.executor import StepOnlyExecutor
from protos.plan import ExecutorInfo, StepPlan, StepResult, TokenLogprobs
from scheduler_service.config import SchedulerConfig
from scheduler_service.engine import LLMEngine
from scheduler_service.sampling_params import SamplingParams

VOCAB = 512

EOS = 1


@dataclass
class _SeqState:
    token_ids: list[int]
    block_table: list[int]
    num_computed: int
    num_logprobs: int = 0
    # The "KV" the fake writes at each position: a hash chained over the prefix.
    values: list[int] = field(default_factory=list)


def _mix(prev: int, token: int) -> int:
    return (prev * 1_000_003 + token * 7919 + 1) % (2**61 - 1)


class FakeExecutor(StepOnlyExecutor):
    """Mirrors the StepPlan docstring. Its KV cache stores, per slot, a hash of the whole
    prefix up to that token; a sampled token is a function of that hash, so a wrong block
    table or a bad prefix-cache hit changes the output (and fails an explicit check first)."""

    def __init__(
        self,
        num_kv_blocks=64,
        block_size=4,
        max_model_len=128,
        max_num_seqs=64,
        max_tokens=512,
        eos_token_ids=(EOS,),
    ):
        self.info = ExecutorInfo(
            model="fake",
            architecture="Fake",
            block_size=block_size,
            num_kv_blocks=num_kv_blocks,
            max_model_len=max_model_len,
            vocab_size=VOCAB,
            eos_token_ids=list(eos_token_ids),
            tensor_parallel_size=1,
            dtype="float32",
            device="cpu",
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_tokens,
            attention_backend="fake",
            num_layers=1,
            block_bytes=1,
        )
        self.kv: list[int | None] = [None] * (num_kv_blocks * block_size)
        self.seqs: dict[int, _SeqState] = {}
        self.plans: list[StepPlan] = []
        self.last_step_id = 0

    def describe(self) -> ExecutorInfo:
        return self.info

    def reset(self) -> int:
        n = len(self.seqs)
        self.seqs.clear()
        return n

    def step(self, plan: StepPlan) -> StepResult:
        self._validate(plan)
        self.plans.append(plan)
        self.last_step_id = plan.step_id
        for sid in plan.finished_seq_ids + plan.preempted_seq_ids:
            del self.seqs[sid]
        for s in plan.new_seqs:
            self.seqs[s.seq_id] = _SeqState(
                list(s.token_ids), list(s.block_table), s.num_computed_tokens, s.sampling_params.logprobs
            )
        bs = self.info.block_size
        result = StepResult(step_id=plan.step_id)
        off = 0
        for sid, n, k in zip(plan.seq_ids, plan.num_scheduled_tokens, plan.num_new_blocks, strict=True):
            st_ = self.seqs[sid]
            st_.block_table += plan.new_block_ids[off : off + k]
            off += k
            for p in range(st_.num_computed, st_.num_computed + n):
                prev = 0
                if p > 0:
                    prev_slot = st_.block_table[(p - 1) // bs] * bs + (p - 1) % bs
                    prev = self.kv[prev_slot]
                    assert prev == _chain(st_, p - 1), f"seq {sid}: KV at position {p - 1} is wrong"
                self.kv[st_.block_table[p // bs] * bs + p % bs] = _mix(prev, st_.token_ids[p])
            st_.num_computed += n
            if st_.num_computed == len(st_.token_ids):
                tok = _chain(st_, st_.num_computed - 1) % VOCAB
                st_.token_ids.append(tok)
                result.seq_ids.append(sid)
                result.token_ids.append(tok)
                result.num_tokens.append(1)
                if st_.num_logprobs:
                    top = [(tok + j) % VOCAB for j in range(st_.num_logprobs)]
                    result.logprobs.append(TokenLogprobs(sid, [-tok / 1000], top, [-t / 1000 for t in top]))
        return result

    def _validate(self, plan: StepPlan) -> None:
        info = self.info
        bs = info.block_size
        assert plan.step_id > self.last_step_id, "step ids must increase"
        dropped = plan.finished_seq_ids + plan.preempted_seq_ids
        assert len(set(dropped)) == len(dropped), f"sequence dropped twice: {dropped}"
        for sid in dropped:
            assert sid in self.seqs, f"dropping unknown sequence {sid}"
        held = {sid: s for sid, s in self.seqs.items() if sid not in dropped}
        new_ids = {s.seq_id for s in plan.new_seqs}
        assert len(new_ids) == len(plan.new_seqs), "a new sequence is sent twice"
        for s in plan.new_seqs:
            assert s.seq_id not in held, f"new sequence {s.seq_id} is already held"
            assert s.token_ids and all(0 <= t < VOCAB for t in s.token_ids)
            assert 0 <= s.num_computed_tokens < len(s.token_ids), "the last token must be computed"
            held[s.seq_id] = _SeqState(s.token_ids, list(s.block_table), s.num_computed_tokens)
        cols = (plan.num_scheduled_tokens, plan.num_computed_tokens, plan.num_new_blocks)
        assert all(len(c) == len(plan.seq_ids) for c in cols), "ragged plan columns"
        assert len(set(plan.seq_ids)) == len(plan.seq_ids), "a sequence is scheduled twice"
        assert new_ids <= set(plan.seq_ids), "a new sequence is not scheduled"
        assert sum(plan.num_new_blocks) == len(plan.new_block_ids)
        assert sum(plan.num_scheduled_tokens) <= info.max_num_batched_tokens
        assert len(plan.seq_ids) <= info.max_num_seqs
        tables = {}
        off = 0
        for sid, n, c, k in zip(plan.seq_ids, *cols, strict=True):
            assert sid in held, f"scheduled unknown sequence {sid}"
            s = held[sid]
            assert k == 0 or sid not in new_ids, "a new sequence's block table must be complete"
            assert c == s.num_computed, f"seq {sid}: plan says {c} computed, executor has {s.num_computed}"
            assert n >= 1 and c + n <= len(s.token_ids), f"seq {sid}: tokens {c}..{c + n} not all known"
            table = s.block_table + plan.new_block_ids[off : off + k]
            off += k
            assert all(0 <= b < info.num_kv_blocks for b in table), f"block id out of range: {table}"
            assert len(table) * bs >= c + n, f"seq {sid}: {len(table)} blocks for {c + n} tokens"
            tables[sid] = table
        # A block written this step belongs to no other live sequence, except one that this step
        # fills (the prefix cache shares it as soon as it is scheduled) and that no other writes.
        owners: dict[int, set[int]] = {}
        for sid, s in held.items():
            for b in tables.get(sid, s.block_table):
                owners.setdefault(b, set()).add(sid)
        writers: dict[int, int] = {}
        for sid, n, c in zip(plan.seq_ids, plan.num_scheduled_tokens, plan.num_computed_tokens, strict=True):
            for i in {p // bs for p in range(c, c + n)}:
                b = tables[sid][i]
                assert writers.setdefault(b, sid) == sid, f"seqs {writers[b]} and {sid} write block {b}"
                shared = owners[b] - {sid}
                assert not shared or c + n >= (i + 1) * bs, f"seq {sid} writes block {b} shared with {shared}"


def _chain(s: _SeqState, p: int) -> int:
    while len(s.values) <= p:
        i = len(s.values)
        s.values.append(_mix(s.values[i - 1] if i else 0, s.token_ids[i]))
    return s.values[p]


def make_engine(config: SchedulerConfig | None = None, **executor_kwargs) -> tuple[LLMEngine, FakeExecutor]:
    executor = FakeExecutor(**executor_kwargs)
    return LLMEngine(executor, config or SchedulerConfig()), executor


def prompt(n: int, seed: int = 0) -> list[int]:
    return [2 + (seed * 97 + i * 31) % (VOCAB - 2) for i in range(n)]


def greedy(max_tokens: int | None = 8, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kw)


class CountingPipe:
    """The fake executor behind send / receive, counting how many plans were out at once."""

    takes_plans_ahead = True
    max_plans_in_flight = None

    def __init__(self, executor: FakeExecutor, fail_step: int | None = None, fail_steps=()) -> None:
        self.executor = executor
        self.fail_steps = {fail_step, *fail_steps} - {None}
        self.pending: list[StepPlan] = []
        self.most_in_flight = 0

    def describe(self) -> ExecutorInfo:
        return self.executor.describe()

    def reset(self) -> int:
        return self.executor.reset()

    def step(self, plan: StepPlan) -> StepResult:
        self.send(plan)
        return self.receive(plan)

    def send(self, plan: StepPlan) -> None:
        self.pending.append(plan)
        self.most_in_flight = max(self.most_in_flight, len(self.pending))

    def receive(self, plan: StepPlan) -> StepResult:
        # Runs the oldest plan now, as a remote executor that ran it while the next one traveled.
        oldest = self.pending.pop(0)
        assert oldest is plan, "results are read in plan order"
        if plan.step_id in self.fail_steps:
            self.pending.clear()  # a rejected plan closes the stream: the next one never runs
            raise ValueError(f"step {plan.step_id} rejected")
        return self.executor.step(plan)

    def discard(self) -> None:
        self.pending.clear()


class ScriptedExecutor(FakeExecutor):
    """Every sequence generates `script`'s tokens, then end-of-sequence (or, `slow` seconds a
    step, forever); `pause`: seconds a step otherwise; `architecture`: the one it reports."""

    def __init__(
        self,
        script: list[int],
        eos: int,
        vocab_size: int,
        slow: float = 0.0,
        pause: float = 0.0,
        architecture: str | None = None,
    ) -> None:
        super().__init__(num_kv_blocks=256, block_size=4, max_model_len=1024, eos_token_ids=(eos,))
        self.info.vocab_size = vocab_size
        if architecture is not None:
            self.info.architecture = architecture
        self.script, self.eos, self.slow, self.pause = script, eos, slow, pause
        self.num_prompt: dict[int, int] = {}

    def _validate(self, plan) -> None:
        """(The fake's own checks assume its small vocabulary; this one speaks the tokenizer's.)"""

    def step(self, plan):
        for s in plan.new_seqs:
            self.num_prompt[s.seq_id] = len(s.token_ids)
        result = super().step(plan)
        for i, sid in enumerate(result.seq_ids):
            state = self.seqs[sid]
            n = len(state.token_ids) - 1 - self.num_prompt[sid]
            tok = self.script[n] if n < len(self.script) else (self.script[0] if self.slow else self.eos)
            state.token_ids[-1] = result.token_ids[i] = tok
        if self.slow or self.pause:
            time.sleep(self.slow or self.pause)
        return result
