"""The scheduler and engine against a fake executor that checks every plan (no model, no torch)."""

from __future__ import annotations

import pytest
from helpers.fake_executor import VOCAB, CountingPipe, FakeExecutor, greedy, make_engine, prompt
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from protos.plan import StepPlan
from scheduler_service.config import SchedulerConfig
from scheduler_service.engine import LLMEngine
from scheduler_service.sampling_params import InvalidRequestError, SamplingParams
from scheduler_service.sequence import Sequence


def run(engine: LLMEngine, max_steps: int = 10_000) -> dict[int, object]:
    finished = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert not engine.has_unfinished_requests(), "did not finish"
    bm = engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks, "blocks leaked"
    return finished


def test_chunked_prefill_respects_token_budget():
    engine, ex = make_engine(SchedulerConfig(max_num_batched_tokens=16))
    rid = engine.add_request(prompt(50), greedy(4))
    # No token comes out until the last chunk of the prompt is computed.
    assert [engine.step() for _ in range(3)] == [[], [], []]
    out = engine.step()
    assert [o.new_token_ids for o in out] == [out[0].token_ids] and len(out[0].token_ids) == 1
    finished = run(engine)
    assert [p.num_scheduled_tokens for p in ex.plans[:5]] == [[16], [16], [16], [2], [1]]
    assert [p.num_computed_tokens for p in ex.plans[:5]] == [[0], [16], [32], [48], [50]]
    assert len(ex.plans[0].new_seqs) == 1 and not any(p.new_seqs for p in ex.plans[1:])
    assert finished[rid].finish_reason == "length" and len(finished[rid].token_ids) == 4
    assert engine.scheduler.stats.num_chunked_prefills == 3


def test_mixed_prefill_and_decode_in_one_step():
    engine, ex = make_engine(SchedulerConfig(max_num_batched_tokens=16))
    a = engine.add_request(prompt(6), greedy(20))
    engine.step()
    b = engine.add_request(prompt(40, seed=1), greedy(4))
    for _ in range(4):
        engine.step()
    mixed = ex.plans[1:4]
    assert all(p.seq_ids == [a, b] for p in mixed)
    assert [p.num_scheduled_tokens for p in mixed] == [[1, 15], [1, 15], [1, 10]]
    assert ex.plans[4].num_scheduled_tokens == [1, 1]
    run(engine)


def test_max_num_seqs_bounds_the_batch():
    engine, ex = make_engine(SchedulerConfig(max_num_seqs=3))
    ids = [engine.add_request(prompt(5, seed=i), greedy(6)) for i in range(8)]
    finished = run(engine)
    assert max(len(p.seq_ids) for p in ex.plans) == 3
    assert sorted(finished) == ids
    assert all(len(finished[i].token_ids) == 6 for i in ids)
    # The executor's own limit applies when it is lower.
    engine, ex = make_engine(max_num_seqs=2)
    for i in range(5):
        engine.add_request(prompt(5, seed=i), greedy(3))
    run(engine)
    assert max(len(p.seq_ids) for p in ex.plans) == 2


def test_prefix_cache_hit_on_shared_prompt():
    engine, ex = make_engine()  # block_size 4
    shared = prompt(13)
    a = engine.add_request([*shared, 5, 6, 7], greedy(4))
    first = run(engine)[a]
    n = len(ex.plans)
    b = engine.add_request([*shared, 8, 9], greedy(4))
    second = run(engine)[b]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 12
    assert ex.plans[n].new_seqs[0].num_computed_tokens == 12
    assert ex.plans[n].num_scheduled_tokens == [3]
    stats = engine.scheduler.stats
    assert (stats.num_prefix_queried_tokens, stats.num_prefix_hit_tokens) == (16 + 15, 12)
    # An identical prompt still computes its last token.
    c = engine.add_request([*shared[:12]], greedy(4))
    assert run(engine)[c].num_cached_tokens == 8
    # Same tokens as without the cache.
    ref_engine, _ = make_engine(SchedulerConfig(enable_prefix_caching=False))
    r = ref_engine.add_request([*shared, 8, 9], greedy(4))
    ref = run(ref_engine)[r]
    assert ref.token_ids == second.token_ids and ref.num_cached_tokens == 0
    assert ref_engine.scheduler.stats.num_prefix_queried_tokens == 0


def test_prefix_cache_covers_generated_tokens():
    engine, _ = make_engine()
    p = prompt(6)
    a = engine.add_request(p, greedy(10))
    out = run(engine)[a]
    # 15 tokens were computed (the last sampled one never is): 3 full blocks, 6 generated.
    b = engine.add_request([*p, *out.token_ids[:8], 3, 4], greedy(2))
    assert run(engine)[b].num_cached_tokens == 12


def test_preemption_recomputes_newest_and_matches_unconstrained_run():
    requests = [(prompt(10, seed=i), greedy(20)) for i in range(4)]
    ref_engine, _ = make_engine()
    ref_ids = [ref_engine.add_request(p, sp) for p, sp in requests]
    ref = run(ref_engine)
    assert ref_engine.scheduler.stats.num_preemptions == 0

    engine, ex = make_engine(num_kv_blocks=12)  # 48 slots for 4 x 30 tokens
    ids = [engine.add_request(p, sp) for p, sp in requests]
    preempted: set[int] = set()
    finished = {}
    while engine.has_unfinished_requests():
        running_before = [s.seq_id for s in engine.scheduler.running]
        n_plans = len(ex.plans)
        for o in engine.step():
            if o.finished:
                finished[o.request_id] = o
        if len(ex.plans) == n_plans:
            continue
        plan = ex.plans[-1]
        victims = plan.preempted_seq_ids
        assert victims == running_before[::-1][: len(victims)], "the newest running sequence goes first"
        preempted.update(victims)
        for s in plan.new_seqs:
            if s.seq_id in preempted:  # re-sent with prompt + generated tokens
                assert len(s.token_ids) > 10
    assert engine.scheduler.stats.num_preemptions > 0 and preempted
    assert not engine.scheduler.block_manager.num_used_blocks
    for i, r in zip(ids, ref_ids, strict=True):
        assert finished[i].token_ids == ref[r].token_ids
        assert finished[i].finish_reason == "length"


def test_stop_rules_and_finish_reasons():
    p = prompt(7)
    ref_engine, _ = make_engine()
    r = ref_engine.add_request(p, greedy(12))
    ref = run(ref_engine)[r].token_ids
    i = next(i for i in range(1, 12) if ref[i] not in ref[:i])
    eos = ref[i]

    def generate(params: SamplingParams, **kw):
        engine, _ = make_engine(**kw)
        rid = engine.add_request(p, params)
        out = run(engine)[rid]
        return out.finish_reason, out.token_ids

    # eos stops and is kept in the output, like HF generate.
    assert generate(SamplingParams(max_tokens=12), eos_token_ids=[eos]) == ("stop", ref[: i + 1])
    assert generate(greedy(12), eos_token_ids=[eos]) == ("length", ref)
    # Every eos id of the model stops generation, not only the first one listed.
    other = next(t for t in range(2, VOCAB) if t not in ref)
    assert generate(SamplingParams(max_tokens=12), eos_token_ids=[other, eos]) == ("stop", ref[: i + 1])
    stop_ids = SamplingParams(max_tokens=12, ignore_eos=True, stop_token_ids=[eos])
    assert generate(stop_ids) == ("stop", ref[: i + 1])
    assert generate(greedy(5)) == ("length", ref[:5])
    # max_tokens=None runs until max_model_len.
    reason, tokens = generate(greedy(None), max_model_len=19)
    assert reason == "length" and tokens == ref[:12]


def test_logprobs_follow_the_tokens_through_preemption():
    engine, _ = make_engine(num_kv_blocks=8)
    ids = [engine.add_request(prompt(8, seed=i), greedy(8, logprobs=2)) for i in range(3)]
    plain = engine.add_request(prompt(8, seed=9), greedy(8))
    seen: dict[int, list] = {i: [] for i in ids}
    finished = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.request_id == plain:
                assert o.new_logprobs is None and o.logprobs is None
                continue
            assert [lp.token_id for lp in o.new_logprobs] == o.new_token_ids
            seen[o.request_id] += o.new_logprobs
            if o.finished:
                finished[o.request_id] = o
    assert engine.scheduler.stats.num_preemptions > 0
    for i in ids:
        out = finished[i]
        assert out.logprobs == seen[i] and len(out.logprobs) == 8
        for tok, lp in zip(out.token_ids, out.logprobs, strict=True):
            assert lp.logprob == -tok / 1000
            assert lp.top_logprobs == [(tok, -tok / 1000), ((tok + 1) % VOCAB, -((tok + 1) % VOCAB) / 1000)]


def test_abort_frees_blocks_and_tells_the_executor():
    engine, ex = make_engine()
    bm = engine.scheduler.block_manager
    a = engine.add_request(prompt(10), greedy(50))
    b = engine.add_request(prompt(10, seed=1), greedy(5))
    engine.step()
    engine.step()
    assert bm.num_used_blocks == 6
    assert engine.abort_request(a)
    assert bm.num_used_blocks == 3
    c = engine.add_request(prompt(5, seed=2), greedy(5))
    assert engine.abort_request(c)  # still waiting: the executor never saw it
    assert not engine.abort_request(a) and not engine.abort_request(12345)
    engine.step()
    assert ex.plans[-1].finished_seq_ids == [a] and a not in ex.seqs
    assert sorted(run(engine)) == [b]
    assert engine.scheduler.stats.finished_by_reason == {"abort": 2, "length": 1}


def test_max_model_len_is_capped_by_kv_capacity():
    engine, _ = make_engine(num_kv_blocks=5, block_size=4, max_model_len=128)
    assert engine.limits.max_model_len == 20
    with pytest.raises(InvalidRequestError, match=r"exceeds max_model_len \(20\)"):
        engine.add_request(prompt(15), greedy(10))


@pytest.mark.parametrize("budget", [512, 8])
def test_a_sequence_larger_than_the_cache_fails_instead_of_looping(budget):
    engine, ex = make_engine(SchedulerConfig(max_num_batched_tokens=budget), num_kv_blocks=4)
    # Bypasses add_request, which would reject it against max_model_len (capped to 16).
    engine.scheduler.add(Sequence(99, prompt(20), greedy(4)))
    outs = []
    for _ in range(5):
        outs += engine.step()
    assert [(o.request_id, o.finished, o.finish_reason, o.new_token_ids) for o in outs] == [
        (99, True, "abort", [])
    ]
    assert "does not fit in the KV cache (4 blocks of 4 tokens)" in outs[0].error
    assert not engine.has_unfinished_requests() and 99 not in ex.seqs
    assert engine.scheduler.block_manager.num_used_blocks == 0


def _decode_plan() -> tuple[FakeExecutor, StepPlan]:
    engine, ex = make_engine()
    engine.add_request(prompt(10), greedy(5))
    engine.step()
    return ex, engine.scheduler.schedule()


@pytest.mark.parametrize(
    "corrupt",
    [
        lambda p: p.num_computed_tokens.__setitem__(0, 9),
        lambda p: p.num_scheduled_tokens.__setitem__(0, 3),
        lambda p: p.seq_ids.__setitem__(0, 999),
        lambda p: p.finished_seq_ids.append(999),
        lambda p: (p.new_block_ids.append(64), p.num_new_blocks.__setitem__(0, 1)),
    ],
)
def test_fake_executor_rejects_wrong_plans(corrupt):
    ex, plan = _decode_plan()
    corrupt(plan)
    with pytest.raises(AssertionError):
        ex.step(plan)


def test_fake_executor_detects_wrong_kv():
    ex, plan = _decode_plan()
    ex.kv = [0] * len(ex.kv)
    with pytest.raises(AssertionError, match="KV at position"):
        ex.step(plan)


def _params(max_tokens: int, stop: int | None) -> SamplingParams:
    """Greedy; with `stop`, an eighth of the vocabulary stops the sequence early."""
    if stop is None:
        return greedy(max_tokens)
    return greedy(max_tokens, stop_token_ids=list(range(stop, stop + VOCAB // 8)))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    requests=st.lists(
        st.tuples(
            st.integers(1, 30),
            st.integers(0, 2),
            st.integers(1, 12),
            st.integers(0, 6),
            st.one_of(st.none(), st.integers(2, VOCAB - VOCAB // 8)),
        ),
        min_size=2,
        max_size=8,
    ),
    num_kv_blocks=st.integers(11, 22),
    budget=st.integers(1, 40),
    max_num_seqs=st.integers(1, 6),
    caching=st.booleans(),
    plans_in_flight=st.sampled_from([1, 2]),
)
def test_random_workloads_match_unconstrained_run(
    requests, num_kv_blocks, budget, max_num_seqs, caching, plans_in_flight
):
    """Any cache size, budget, batch limit and number of plans in flight gives the tokens of an
    unconstrained run, stop tokens included."""

    def generate(engine: LLMEngine) -> dict[int, list[int]]:
        finished, step = {}, 0
        ids = {}
        while step < 2000 and (engine.has_unfinished_requests() or step <= 6):
            for j, (n, seed, max_tokens, arrival, stop) in enumerate(requests):
                if arrival == step:
                    ids[engine.add_request(prompt(n, seed), _params(max_tokens, stop))] = j
            for o in engine.step():
                if o.finished:
                    finished[ids[o.request_id]] = o.token_ids
            step += 1
        assert not engine.has_unfinished_requests()
        assert engine.scheduler.block_manager.num_used_blocks == 0
        return finished

    ref = generate(make_engine()[0])
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        enable_prefix_caching=caching,
        max_plans_in_flight=plans_in_flight,
    )
    engine, ex = make_engine(config, num_kv_blocks=num_kv_blocks)
    assert generate(engine) == ref
    assert all(sum(p.num_scheduled_tokens) <= budget for p in ex.plans)
    assert all(len(p.seq_ids) <= max_num_seqs for p in ex.plans)
    assert all(len(ref[j]) == r[2] for j, r in enumerate(requests) if r[4] is None)


# -- two plans in flight ------------------------------------------------------------------


def _run_all(engine: LLMEngine, requests) -> dict[int, object]:
    ids = [engine.add_request(p, sp) for p, sp in requests]
    finished = run(engine)
    while engine.scheduler.has_finished_to_send():  # as the async engine does: tell the executor
        assert engine.step() == []
    return {i: (finished[rid].finish_reason, finished[rid].token_ids) for i, rid in enumerate(ids)}


@pytest.mark.parametrize(
    ("requests", "config", "executor_kwargs"),
    [
        # stop tokens found one step late: the extra token computed for them is dropped
        ([(prompt(7, seed=i), _params(30, 100 + 37 * i)) for i in range(6)], {}, {}),
        # preemption while the victim's token is in flight
        ([(prompt(10, seed=i), greedy(20)) for i in range(4)], {}, {"num_kv_blocks": 12}),
        # chunked prefill next to decodes, and the length limit reached through pending tokens
        ([(prompt(40, seed=i), greedy(3 + i)) for i in range(4)], {"max_num_batched_tokens": 16}, {}),
        # max_model_len as the limit
        ([(prompt(9, seed=i), greedy(None)) for i in range(3)], {}, {"max_model_len": 21}),
    ],
    ids=["stop-tokens", "preemption", "chunked-prefill", "max-model-len"],
)
def test_two_plans_in_flight_give_the_tokens_of_one(requests, config, executor_kwargs):
    ref = _run_all(make_engine(SchedulerConfig(**config), **executor_kwargs)[0], requests)
    if requests[0][1].stop_token_ids:
        assert "stop" in {reason for reason, _ in ref.values()}
    executor = FakeExecutor(**executor_kwargs)
    pipe = CountingPipe(executor)
    engine = LLMEngine(pipe, SchedulerConfig(**config))
    assert engine.max_plans_in_flight == 2  # the default for an executor that takes plans ahead
    assert _run_all(engine, requests) == ref
    assert pipe.most_in_flight == 2
    assert not executor.seqs, "the executor still holds finished sequences"
    assert engine.scheduler.block_manager.num_used_blocks == 0


def test_abort_with_a_plan_in_flight_drops_its_token_and_frees_everything():
    executor = FakeExecutor()
    engine = LLMEngine(CountingPipe(executor))
    a = engine.add_request(prompt(10), greedy(50))
    b = engine.add_request(prompt(10, seed=1), greedy(6))
    engine.step()
    engine.step()  # a's next token is in flight
    assert engine.abort_request(a)
    got = {o.request_id: o for o in engine.step()}
    assert a not in got, "a token computed for an aborted request reached its stream"
    finished = run(engine)
    while engine.scheduler.has_finished_to_send():
        engine.step()
    assert finished[b].finish_reason == "length" and len(finished[b].token_ids) == 6
    ref_engine, _ = make_engine()
    rb = ref_engine.add_request(prompt(10, seed=1), greedy(6))
    assert run(ref_engine)[rb].token_ids == finished[b].token_ids
    assert not executor.seqs and engine.scheduler.block_manager.num_used_blocks == 0


def test_a_failed_plan_abandons_the_one_behind_it():
    """The executor refuses step 3 while step 4 is already out: both are undone, step 3's requests
    fail (as the async engine does), the others finish as in a run without the failure."""
    executor = FakeExecutor()
    pipe = CountingPipe(executor, fail_step=3)
    engine = LLMEngine(pipe)
    a = engine.add_request(prompt(6), greedy(8))
    engine.step()  # step 1 out, step 2 out, step 1's result
    with pytest.raises(ValueError, match="step 3 rejected"):
        for _ in range(3):
            engine.step()
    failed_plan = engine.last_plan
    assert failed_plan.step_id == 3 and failed_plan.seq_ids == [a]
    outs = engine.fail_requests(failed_plan.seq_ids, "rejected")
    assert [(o.request_id, o.finish_reason, o.error) for o in outs] == [(a, "abort", "rejected")]
    b = engine.add_request(prompt(9, seed=4), greedy(5))
    finished = run(engine)
    while engine.scheduler.has_finished_to_send():
        engine.step()
    ref_engine, _ = make_engine()
    rb = ref_engine.add_request(prompt(9, seed=4), greedy(5))
    assert run(ref_engine)[rb].token_ids == finished[b].token_ids
    assert not executor.seqs and engine.scheduler.block_manager.num_used_blocks == 0


def test_a_failed_plan_leaves_no_unwritten_block_in_the_prefix_cache():
    """With two plans in flight, step 1's result arrives while step 2 computes the KV of the token
    step 1 sampled. If step 2 then fails, the block holding that position must not be served from
    the prefix cache (the fake executor checks every KV it reads)."""
    ref_engine, _ = make_engine()
    r = ref_engine.add_request(prompt(7), greedy(4))
    generated = run(ref_engine)[r].token_ids

    executor = FakeExecutor()  # blocks of 4: prompt 0..6, the first sampled token at position 7
    engine = LLMEngine(CountingPipe(executor, fail_step=2))
    a = engine.add_request(prompt(7), greedy(4))
    engine.step()  # steps 1 and 2 out; step 1's result in
    with pytest.raises(ValueError, match="step 2 rejected"):
        engine.step()
    engine.fail_requests(engine.last_plan.seq_ids, "rejected")
    b = engine.add_request([*prompt(7), generated[0], 9, 10], greedy(3))
    finished = run(engine)
    assert finished[b].num_cached_tokens == 4, "only the block whose KV was written is a hit"
    ref_engine, _ = make_engine()
    rb = ref_engine.add_request([*prompt(7), generated[0], 9, 10], greedy(3))
    assert run(ref_engine)[rb].token_ids == finished[b].token_ids
    assert a not in finished


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# Found by this test: a plan abandoned behind a refused one had appended a block to a running
# sequence; the executor never got it, and a later plan scheduled into it.
@example(
    requests=[(1, 0, 2, 0), (22, 0, 7, 0), (16, 0, 7, 0), (2, 0, 4, 0), (9, 0, 5, 0)],
    num_kv_blocks=11,
    budget=15,
    caching=False,
    fail_steps={16},
)
@given(
    requests=st.lists(
        st.tuples(st.integers(1, 30), st.integers(0, 2), st.integers(1, 12), st.integers(0, 6)),
        min_size=2,
        max_size=6,
    ),
    num_kv_blocks=st.integers(11, 22),
    budget=st.integers(1, 40),
    caching=st.booleans(),
    fail_steps=st.sets(st.integers(1, 40), max_size=3),
)
def test_failed_plans_with_two_in_flight_fail_only_their_requests(
    requests, num_kv_blocks, budget, caching, fail_steps
):
    """Steps refused at random while another is in flight: the requests of each refused step fail
    (as the async engine fails them), every other request gets the tokens of an unconstrained run,
    the fake executor never reads a KV position that was not written, nothing leaks."""

    def generate(engine: LLMEngine) -> tuple[dict[int, list[int]], set[int]]:
        finished, failed, ids, step = {}, set(), {}, 0
        while step < 2000 and (
            engine.has_unfinished_requests() or engine.scheduler.has_finished_to_send() or step <= 6
        ):
            for j, (n, seed, max_tokens, arrival) in enumerate(requests):
                if arrival == step:
                    ids[engine.add_request(prompt(n, seed), greedy(max_tokens))] = j
            try:
                outs = engine.step()
            except ValueError:
                outs = engine.fail_requests(engine.last_plan.seq_ids, "rejected")
                failed |= {ids[o.request_id] for o in outs}
            for o in outs:
                if o.finished and o.error is None:
                    finished[ids[o.request_id]] = o.token_ids
            step += 1
        assert not engine.has_unfinished_requests()
        assert engine.scheduler.block_manager.num_used_blocks == 0
        return finished, failed

    ref, _ = generate(make_engine()[0])
    executor = FakeExecutor(num_kv_blocks=num_kv_blocks)
    config = SchedulerConfig(max_num_batched_tokens=budget, enable_prefix_caching=caching)
    got, failed = generate(LLMEngine(CountingPipe(executor, fail_steps=fail_steps), config))
    assert set(got) | failed == set(range(len(requests))) and not set(got) & failed
    assert all(got[j] == ref[j] for j in got)
    assert not executor.seqs


@pytest.mark.parametrize("in_flight", [1, 2])
def test_prefill_budget_while_decoding_bounds_each_step_and_still_progresses(in_flight):
    config = SchedulerConfig(max_num_batched_tokens=64, max_prefill_tokens_while_decoding=8)
    ex = FakeExecutor()
    engine = LLMEngine(CountingPipe(ex) if in_flight == 2 else ex, config)
    prompt_len = {}
    a = engine.add_request(prompt(6), greedy(40))
    prompt_len[a] = 6
    engine.step()
    for n, seed in ((50, 1), (30, 2)):
        prompt_len[engine.add_request(prompt(n, seed=seed), greedy(4))] = n
    finished = run(engine)
    decoding_plans = 0
    for plan in ex.plans:
        entries = list(zip(plan.seq_ids, plan.num_computed_tokens, plan.num_scheduled_tokens, strict=True))
        prefill = sum(n for seq_id, c, n in entries if c < prompt_len[seq_id])
        if any(c >= prompt_len[seq_id] for seq_id, c, _ in entries):  # a sequence decodes
            decoding_plans += 1
            assert prefill <= 8, plan
    assert decoding_plans > 10
    # Nobody starves: the two prompts (80 tokens) are through in about 80 / 8 steps while a decodes.
    assert all(len(finished[i].token_ids) == (40 if i == a else 4) for i in prompt_len)
    # The same tokens as without a budget (the fake's tokens are a function of the prefix).
    reference, _ = make_engine(SchedulerConfig(max_num_batched_tokens=64))
    for i, seed in zip(prompt_len, (0, 1, 2), strict=True):
        reference.add_request(prompt(prompt_len[i], seed=seed), greedy(40 if i == a else 4))
    expected = run(reference)
    assert [finished[i].token_ids for i in prompt_len] == [expected[i].token_ids for i in prompt_len]


def test_prefill_budget_leaves_a_step_without_decodes_alone():
    # W1-like offline use: every prompt arrives at once, nothing decodes yet.
    plans = []
    for budget in (0, 8):
        engine, ex = make_engine(
            SchedulerConfig(max_num_batched_tokens=64, max_prefill_tokens_while_decoding=budget)
        )
        for i in range(4):
            engine.add_request(prompt(20, seed=i), greedy(3))
        engine.step()
        engine.step()
        plans.append([(p.seq_ids, p.num_scheduled_tokens) for p in ex.plans])
    assert plans[0][0] == plans[1][0] and sum(plans[1][0][1]) == 64  # the whole step prefills
    # Once three of them decode, the fourth's last 16 tokens go 8 at a time.
    assert plans[0][1] == ([0, 1, 2, 3], [1, 1, 1, 16]) and plans[1][1] == ([0, 1, 2, 3], [1, 1, 1, 8])


def test_prefill_budget_is_validated():
    with pytest.raises(ValueError, match="max_prefill_tokens_while_decoding must be >= 0"):
        SchedulerConfig(max_prefill_tokens_while_decoding=-1)


# -- a shared prefix computed once -------------------------------------------------------------


def test_prompts_arriving_together_compute_their_shared_prefix_once():
    shared = prompt(64, seed=3)
    prompts = [[*shared, *prompt(3 + i, seed=10 + i)] for i in range(8)]
    engine, ex = make_engine()  # blocks of 4
    ids = [engine.add_request(p, greedy(5)) for p in prompts]
    finished = run(engine)
    # All eight in the first step: the first computes the 64 tokens, the others start after them.
    assert ex.plans[0].num_computed_tokens == [0] + [64] * 7
    assert [finished[i].num_cached_tokens for i in ids] == [0] + [64] * 7
    reference, _ = make_engine(SchedulerConfig(enable_prefix_caching=False))
    ref_ids = [reference.add_request(p, greedy(5)) for p in prompts]
    expected = run(reference)
    assert [finished[i].token_ids for i in ids] == [expected[i].token_ids for i in ref_ids]


def test_a_failed_plan_takes_the_prefix_it_shared_out_of_the_cache():
    """Step 1 computes a prefix that the requests beside it share; it is refused, and so is step 2
    behind it: the blocks step 1 registered must not serve a later request (the fake executor
    checks every KV it reads)."""
    shared = prompt(16, seed=3)
    executor = FakeExecutor()
    engine = LLMEngine(CountingPipe(executor, fail_step=1))
    first = [engine.add_request([*shared, 7 + i], greedy(3)) for i in range(3)]
    with pytest.raises(ValueError, match="step 1 rejected"):
        engine.step()
    engine.fail_requests(engine.last_plan.seq_ids, "rejected")
    assert not engine.scheduler.block_manager.cached_block_ids
    late = engine.add_request([*shared, 20], greedy(3))
    finished = run(engine)
    assert finished[late].num_cached_tokens == 0 and not set(first) & set(finished)
    ref_engine, _ = make_engine()
    r = ref_engine.add_request([*shared, 20], greedy(3))
    assert run(ref_engine)[r].token_ids == finished[late].token_ids


def test_a_result_in_another_order_than_the_plan_is_applied_by_sequence_id():
    # The executor samples in batch order and update() counts on it, looking sequences up by id
    # only where the order differs.
    engine, ex = make_engine()
    ids = [engine.add_request(prompt(5, seed=i), greedy(3)) for i in range(3)]
    engine.step()
    plan = engine.scheduler.schedule()
    result = ex.step(plan)
    expected = dict(zip(result.seq_ids, result.token_ids, strict=True))
    result.seq_ids.reverse()
    result.token_ids.reverse()
    engine.scheduler.update(plan, result)
    seqs = engine.scheduler.seqs
    assert [seqs[i].token_ids[-1] for i in ids] == [expected[i] for i in ids]

    plan = engine.scheduler.schedule()
    result = ex.step(plan)
    result.seq_ids[1] = 999
    with pytest.raises(RuntimeError, match="sampled sequence 999, not in the plan"):
        engine.scheduler.update(plan, result)


def test_min_tokens_bans_the_eos_tokens_even_with_ignore_eos_as_vllm():
    """vLLM's min_tokens masks all_stop_token_ids (stop_token_ids and the end-of-sequence tokens,
    which update_from_generation_config adds whatever ignore_eos): with ignore_eos an EOS token
    does not stop the sequence, but it still waits for min_tokens."""
    for ignore_eos, stops in ((True, {9}), (False, {2, 3, 9})):
        params = SamplingParams(max_tokens=8, min_tokens=3, ignore_eos=ignore_eos, stop_token_ids=[9])
        seq = Sequence(0, [1, 5], params)
        seq.set_stop_rules((2, 3), max_model_len=64)
        assert seq.stop_ids == stops
        assert seq.step_params.stop_token_ids == [2, 3, 9]
