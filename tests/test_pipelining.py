"""Two plans in flight under random aborts, refused steps and preemption, and the scheduler's own
pipelined plans replayed on a real executor (see also test_scheduler.py, test_executor_plans.py)."""

from __future__ import annotations

import copy

import pytest
from executor_fixtures import make_executor, prompt_ids
from helpers.fake_executor import CountingPipe, FakeExecutor, greedy, make_engine, prompt
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from scheduler_service.config import SchedulerConfig
from scheduler_service.engine import LLMEngine
from scheduler_service.sampling_params import SamplingParams


def _shared_prompt(n: int, seed: int, shared: int) -> list[int]:
    return (prompt(12, 77)[:shared] + prompt(n, seed))[: max(n, 1) + shared]


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    requests=st.lists(
        st.tuples(
            st.integers(1, 12),  # prompt length
            st.integers(0, 3),  # seed
            st.integers(1, 10),  # max tokens
            st.integers(0, 5),  # arrival step
            st.sampled_from([0, 4, 8]),  # shared prefix length
            st.one_of(st.none(), st.integers(0, 12)),  # abort step
        ),
        min_size=1,
        max_size=6,
    ),
    num_kv_blocks=st.integers(8, 20),
    budget=st.integers(1, 24),
    caching=st.booleans(),
    fail_steps=st.sets(st.integers(1, 30), max_size=2),
    eos=st.booleans(),
    depth=st.sampled_from([1, 2, 3]),
)
# Three plans in flight: a sequence preempted by the third while the first samples it, then
# admitted again before that result was back, took the stale token as its own (found by this test;
# "executor sampled a token for sequence 3 in mid-prefill").
@example(
    requests=[(1, 0, 1, 0, 0, None), (1, 0, 1, 0, 0, None), (4, 0, 4, 1, 8, None), (12, 0, 6, 0, 0, None)],
    num_kv_blocks=8,
    budget=5,
    caching=False,
    fail_steps=set(),
    eos=False,
    depth=3,
)
def test_random_aborts_refusals_and_preemption(
    requests, num_kv_blocks, budget, caching, fail_steps, eos, depth
):
    def generate(engine: LLMEngine, aborts=True):
        finished, gone, ids, rids, step = {}, set(), {}, {}, 0
        while step < 3000 and (
            engine.has_unfinished_requests() or engine.scheduler.has_finished_to_send() or step <= 13
        ):
            for j, (n, seed, max_tokens, arrival, shared, abort_at) in enumerate(requests):
                if arrival == step:
                    sp = greedy(max_tokens)
                    sp.ignore_eos = not eos
                    rid = engine.add_request(_shared_prompt(n, seed, shared), sp)
                    ids[rid] = j
                    rids[j] = rid
                if (
                    aborts
                    and abort_at == step
                    and j in rids
                    and j not in finished
                    and engine.abort_request(rids[j])
                ):
                    gone.add(j)
            try:
                outs = engine.step()
            except ValueError:
                outs = engine.fail_requests(engine.last_plan.seq_ids, "rejected")
                gone |= {ids[o.request_id] for o in outs}
                ex = getattr(engine.executor, "executor", None)
                for seq in engine.scheduler.running if ex is not None else ():
                    if seq.sent and seq.seq_id in ex.seqs:
                        assert seq.block_table == ex.seqs[seq.seq_id].block_table, (seq, ex.seqs[seq.seq_id])
            for o in outs:
                if o.finished and o.error is None and ids[o.request_id] not in gone:
                    finished[ids[o.request_id]] = (o.finish_reason, o.token_ids)
            step += 1
        assert not engine.has_unfinished_requests()
        assert engine.scheduler.block_manager.num_used_blocks == 0
        return finished, gone

    ref, _ = generate(
        make_engine(SchedulerConfig(), eos_token_ids=(2, 3, 5, 7), max_model_len=32)[0], aborts=False
    )
    executor = FakeExecutor(num_kv_blocks=num_kv_blocks, eos_token_ids=(2, 3, 5, 7), max_model_len=32)
    config = SchedulerConfig(
        max_num_batched_tokens=budget, enable_prefix_caching=caching, max_plans_in_flight=depth
    )
    pipe = CountingPipe(executor, fail_steps=fail_steps)
    got, gone = generate(LLMEngine(pipe, config))
    assert pipe.most_in_flight <= depth
    for j in got:
        assert got[j] == ref[j], j
    assert set(got) | gone == set(range(len(requests)))
    assert not executor.seqs


@pytest.mark.parametrize("depth", [2, 3])
def test_a_stopped_sequence_is_dropped_by_the_plan_behind_those_in_flight(depth):
    """A sequence that stops on a token is still in the plans scheduled ahead of its result: with
    `depth` plans out, the executor holds it after the scheduler has finished it (its request done,
    its blocks free) until the depth - 1 plans behind have run, and the plan after them drops it.
    A client that sees the scheduler idle may see the executor hold it for those steps, never
    longer."""
    reference, _ = make_engine()
    reference.add_request(prompt(6, 3), greedy(8))
    tokens = []
    while reference.has_unfinished_requests():
        tokens += [t for o in reference.step() for t in o.new_token_ids]
    assert len(tokens) == 8
    stop = tokens[2]
    stops_after = tokens.index(stop) + 1
    executor = FakeExecutor()
    pipe = CountingPipe(executor)
    engine = LLMEngine(pipe, SchedulerConfig(max_plans_in_flight=depth))
    engine.add_request(prompt(6, 3), greedy(8, stop_token_ids=[stop]))
    outs = []
    while not (outs and outs[0].finished):
        outs = engine.step()
    assert outs[0].finish_reason == "stop" and outs[0].token_ids == tokens[:stops_after]
    assert not engine.scheduler.running and engine.scheduler.block_manager.num_used_blocks == 0
    assert len(pipe.pending) == depth - 1 and executor.seqs, "the plans in flight still hold it"
    steps = 0
    while engine.has_unfinished_requests() or engine.scheduler.has_finished_to_send():
        assert engine.step() == []  # its tokens past the stop are dropped
        steps += 1
    assert not executor.seqs
    assert steps == depth  # the depth - 1 plans in flight, then the one dropping it


# -- executor: the pipelined scheduler's own plans on a LocalExecutor -----------------------


class _PipelinedRecorder:
    """A LocalExecutor taking two plans in flight, keeping every plan and result in plan order; a
    plan sent behind two waits in a queue until the oldest is received, as the executor service
    queues a third plan (servicer.py)."""

    takes_plans_ahead = True
    max_plans_in_flight = None  # it queues what the LocalExecutor cannot take yet

    def __init__(self, executor) -> None:
        self.executor = executor
        self.plans = []
        self.results = {}
        self._queued = []
        self._launched = 0

    def describe(self):
        return self.executor.describe()

    def reset(self) -> int:
        return self.executor.reset()

    def step(self, plan):
        self.send(plan)
        return self.receive(plan)

    def send(self, plan) -> None:
        self.plans.append(copy.deepcopy(plan))
        self._queued.append(plan)
        self._launch()

    def _launch(self) -> None:
        while self._queued and self._launched < 2:
            self.executor.send(self._queued.pop(0))
            self._launched += 1

    def receive(self, plan):
        result = self.executor.receive(plan)
        self._launched -= 1
        self._launch()
        self.results[plan.step_id] = result
        return result

    def discard(self) -> None:
        self._queued.clear()
        self._launched = 0
        self.executor.discard()


_KINDS = {
    "greedy": {},
    "temperature": {"temperature": 0.9, "top_p": 0.9},
    "seeded": {"temperature": 0.7, "seed": 11},
    "penalties": {"repetition_penalty": 1.2, "presence_penalty": 0.5},
    "logprobs": {"logprobs": 2},
    "stop": {"stop_token_ids": list(range(2, 200))},
}


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    requests=st.lists(
        st.tuples(
            st.integers(1, 30),
            st.integers(1, 10),
            st.sampled_from(sorted(_KINDS)),
            st.integers(0, 3),  # arrival step
            st.one_of(st.none(), st.integers(0, 8)),  # abort step
        ),
        min_size=1,
        max_size=6,
    ),
    budget=st.sampled_from([4, 8, 24, 64]),
    num_kv_blocks=st.sampled_from([16, 24, 64]),
    depth=st.sampled_from([2, 3]),
)
def test_pipelined_plans_replayed_one_at_a_time(qwen3_untied, requests, budget, num_kv_blocks, depth):
    """The pipelined scheduler's plans (extra steps for stopped sequences, preemption and aborts
    while a token is in flight) run with two or three in flight, then replayed one at a time on a
    fresh executor: the same results step by step, and the same final state."""
    options = dict(
        num_kv_blocks=num_kv_blocks, block_size=4, max_model_len=64, max_num_seqs=8, max_num_batched_tokens=64
    )
    rec = _PipelinedRecorder(make_executor(qwen3_untied, **options))
    engine = LLMEngine(rec, SchedulerConfig(max_num_batched_tokens=budget, max_plans_in_flight=depth))
    shared = prompt_ids(8, seed=99)
    ids = {}
    step = 0
    while step < 500 and (
        engine.has_unfinished_requests() or engine.scheduler.has_finished_to_send() or step <= 8
    ):
        for i, (n, max_tokens, kind, arrival, abort_at) in enumerate(requests):
            if arrival == step:
                tokens = (shared + prompt_ids(n, seed=i)) if i % 2 else prompt_ids(n, seed=i)
                ids[i] = engine.add_request(
                    tokens[:40], SamplingParams(max_tokens=max_tokens, **_KINDS[kind])
                )
            if abort_at == step and i in ids:
                engine.abort_request(ids[i])
        engine.step()
        step += 1
    assert not engine.has_unfinished_requests()

    replay = make_executor(qwen3_untied, **options)
    for plan in rec.plans:
        expected = replay.step(plan)
        got = rec.results[plan.step_id]
        assert (got.seq_ids, got.token_ids) == (expected.seq_ids, expected.token_ids), plan.step_id
        assert got.logprobs == expected.logprobs
    assert {i: s.token_ids for i, s in replay.seqs.items()} == {
        i: s.token_ids for i, s in rec.executor.seqs.items()
    }
    assert not rec.executor.seqs


def test_the_discarded_extra_token_of_a_stopped_sequence_preempts_no_live_request():
    """A stops at its first sampled token (the cache is full); with two plans in flight the plan
    behind computes one more token for A, whose result is dropped. Allocating a block for that
    token must not preempt B (a live request, recomputed from scratch); one plan at a time, B is
    never preempted."""

    def run_two(plans_in_flight: int):
        executor = FakeExecutor(num_kv_blocks=4, max_model_len=16)
        pipe = CountingPipe(executor) if plans_in_flight > 1 else executor
        engine = LLMEngine(pipe, SchedulerConfig(max_plans_in_flight=plans_in_flight))
        a = engine.add_request(prompt(8, seed=1), greedy(4, stop_token_ids=list(range(2, 512))))
        b = engine.add_request(prompt(7, seed=2), greedy(8))
        finished = {}
        while engine.has_unfinished_requests() or engine.scheduler.has_finished_to_send():
            for o in engine.step():
                if o.finished:
                    finished[o.request_id] = (o.finish_reason, o.token_ids)
        return finished[a], finished[b], engine.scheduler.stats.num_preemptions

    a1, b1, preemptions1 = run_two(1)
    a2, b2, preemptions2 = run_two(2)
    a3, b3, preemptions3 = run_two(3)
    assert (a1, b1) == (a2, b2) == (a3, b3) and a1[0] == "stop" and len(a1[1]) == 1
    assert preemptions1 == 0
    assert preemptions2 == preemptions3 == 0, "B was preempted to make room for a token that is thrown away"


def test_three_plans_in_flight_need_an_executor_that_queues_them(qwen3_untied):
    """LocalExecutor runs two steps in flight and has no queue: three is refused up front, saying
    what takes them."""
    with pytest.raises(ValueError, match=r"this executor takes at most 2 plans in flight \(3 needs a remote"):
        LLMEngine(make_executor(qwen3_untied), SchedulerConfig(max_plans_in_flight=3))
