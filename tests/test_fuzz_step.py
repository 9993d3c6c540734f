"""Hypothesis against the executor's Step stream: random and malformed StepPlans sent to the real
ExecutorServer (in-process, a LocalExecutor over the 4-layer test checkpoint) through its gRPC
stubs. Every plan gets a result or INVALID_ARGUMENT with a short message naming the step, never
INTERNAL or a crash; a rejected plan changes no state (the held sequences decode exactly the
reference tokens next), and the service serves a good plan afterwards.

Before every example the executor holds two sequences: seq 1 (5 prompt tokens, blocks 0-1) and
seq 2 (3 prompt tokens, block 2), both prefilled, one sampled token each. The base plan decodes
both and prefills a new seq 3 (6 tokens, blocks 3-4). Limits: vocabulary 512, 32 blocks of 4,
max_num_seqs 8, max_num_batched_tokens 64, max_model_len 128.

Catalog of bad plans (MUTATIONS: one mutation of the base plan each; all INVALID_ARGUMENT):

  =========================  ===================================================================
  kind                       what
  =========================  ===================================================================
  unknown-seq-id             a scheduled id the executor does not hold, not in new_seqs
  finished-then-scheduled    seq 1 in finished_seq_ids (or preempted) and scheduled
  duplicate-seq-id           an id twice in seq_ids
  duplicate-new-seq          seq 3 twice in new_seqs
  duplicate-dropped          an id twice in finished_seq_ids + preempted_seq_ids
  reregister-held            new_seqs re-registers held seq 1 (not dropped first)
  block-out-of-range         a block id >= num_kv_blocks or < 0, in a block table or new_block_ids
  negative-count             num_computed_tokens / num_new_blocks < 0, num_scheduled_tokens <= 0
  mismatched-columns         a column one entry longer or shorter than seq_ids
  new-blocks-mismatch        new_block_ids longer or shorter than sum(num_new_blocks)
  huge-list                  10^5..10^6 entries in a column, a block table or token_ids (the
                             message must still be short: it used to quote whole columns)
  token-outside-vocab        a new token id >= 512 or < 0
  bad-sampling               temperature / top_p / min_p / penalties NaN, inf or out of range;
                             top_k, logprobs, num_prompt_tokens out of range (NaN and infinite
                             penalties used to run); more stop_token_ids than the vocabulary
                             (they were unbounded: 5M of them, an 8 MiB plan, made every step
                             of the batch 0.8 s instead of 3 ms while the sequence was held)
  unknown-tokens             tokens scheduled beyond the known ones (decode of 2)
  computed-mismatch          num_computed_tokens differs from the executor's count
  too-few-blocks             a block table too short for the scheduled tokens
  block-table-too-long       more than max_model_len / block_size blocks for one sequence, in a
                             new seq's table or appended to a held one (was INTERNAL, and it
                             left the executor's block tables corrupt)
  over-max-num-seqs          9 scheduled sequences (limit 8)
  over-batched-tokens        65+ scheduled tokens (limit 64)
  over-max-model-len         a new seq longer than max_model_len
  empty-new-seq              a new seq without token ids
  new-seq-new-blocks         num_new_blocks > 0 for a new seq (its block table is complete)
  new-seq-computed-range     a new seq's num_computed_tokens < 0 or > len(token_ids)
  =========================  ===================================================================

Random plans (any structure, any values) and random bytes: a result (OK) or INVALID_ARGUMENT;
bytes that are no StepPlan: INVALID_ARGUMENT. A plan over the 64 MiB message limit is
RESOURCE_EXHAUSTED (tests/test_executor_security.py).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from executor_service.config import ExecutorConfig
from executor_service.executor import LocalExecutor
from executor_service.server import ExecutorServer
from protos.plan import NewSequence, StepPlan, StepSamplingParams, plan_to_proto
from protos.tandem.v1 import executor_pb2 as pb
from protos.tandem.v1 import executor_pb2_grpc as pb_grpc

VOCAB = 512
BLOCK_SIZE = 4
NUM_BLOCKS = 32
MAX_NUM_SEQS = 8
MAX_BATCHED = 64
MAX_MODEL_LEN = 128
MAX_BLOCKS_PER_SEQ = MAX_MODEL_LEN // BLOCK_SIZE
IA = grpc.StatusCode.INVALID_ARGUMENT
# A status message must stay readable (and fit gRPC's 8 KiB metadata limit) whatever the plan.
MAX_DETAILS_CHARS = 1024
STEP_METHOD = "/tandem.v1.ExecutorService/Step"

PROMPT_1, PROMPT_2, PROMPT_3 = [5, 6, 7, 8, 9], [10, 11, 12], [20, 21, 22, 23, 24, 25]
# ~40 ms an example (a reset, two prefills, the plan, a decode): the file runs in ~30 s.
FUZZ = settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
# kind -> examples tried / handled as expected; printed at the end of the module (pytest -s).
TRIED: Counter[str] = Counter()
HANDLED: Counter[str] = Counter()
ACCEPTED: Counter[str] = Counter()  # random input that happened to be a valid plan


@pytest.fixture(scope="module")
def executor(qwen3_tied):
    config = ExecutorConfig(
        model=str(qwen3_tied),
        block_size=BLOCK_SIZE,
        num_kv_blocks=NUM_BLOCKS,
        max_num_seqs=MAX_NUM_SEQS,
        max_num_batched_tokens=MAX_BATCHED,
        max_model_len=MAX_MODEL_LEN,
    )
    server = ExecutorServer("127.0.0.1", 0)
    server.start()
    server.set_executor(LocalExecutor(config))
    channel = grpc.insecure_channel(server.address)
    stub = pb_grpc.ExecutorServiceStub(channel)
    _setup(stub)
    reference = _decode(stub)
    yield stub, channel, reference
    channel.close()
    server.stop(1.0)
    print(f"\nStep fuzzing, examples tried / handled: {sum(TRIED.values())} / {sum(HANDLED.values())}")
    for kind in sorted(TRIED):
        accepted = f"  ({ACCEPTED[kind]} valid, ran)" if ACCEPTED[kind] else ""
        print(f"  {kind:26} {TRIED[kind]:4} / {HANDLED[kind]}{accepted}")


def _new(seq_id: int, tokens: list[int], blocks: list[int], **params) -> NewSequence:
    return NewSequence(seq_id, tokens, blocks, 0, StepSamplingParams(num_prompt_tokens=len(tokens), **params))


def _setup(stub) -> None:
    """Reset, then hold seqs 1 and 2, prefilled."""
    stub.Reset(pb.ResetRequest(), timeout=10)
    prefill = StepPlan(
        1,
        new_seqs=[_new(1, PROMPT_1, [0, 1]), _new(2, PROMPT_2, [2])],
        seq_ids=[1, 2],
        num_scheduled_tokens=[5, 3],
        num_computed_tokens=[0, 0],
        num_new_blocks=[0, 0],
    )
    (result,) = _run(stub, [prefill])
    assert list(result.seq_ids) == [1, 2]


def _decode(stub) -> list[int]:
    """Decode seqs 1 and 2 once from the setup state; returns their tokens."""
    plan = StepPlan(
        2, seq_ids=[1, 2], num_scheduled_tokens=[1, 1], num_computed_tokens=[5, 3], num_new_blocks=[0, 0]
    )
    (result,) = _run(stub, [plan])
    assert list(result.seq_ids) == [1, 2]
    return list(result.token_ids)


def _run(stub, plans: list[StepPlan]) -> list[pb.StepResult]:
    return list(stub.Step(iter([plan_to_proto(p) for p in plans]), timeout=30))


def base_plan(step_id: int = 100) -> StepPlan:
    """Valid from the setup state: decode seqs 1 and 2 (seq 2 gets a spare block 5), prefill new seq 3."""
    return StepPlan(
        step_id,
        new_seqs=[_new(3, list(PROMPT_3), [3, 4])],
        seq_ids=[1, 2, 3],
        num_scheduled_tokens=[1, 1, 6],
        num_computed_tokens=[5, 3, 0],
        new_block_ids=[5],
        num_new_blocks=[0, 1, 0],
    )


# -- the catalog of mutations ----------------------------------------------------------------------

COLUMNS = ("num_scheduled_tokens", "num_computed_tokens", "num_new_blocks")
big_int32 = st.integers(NUM_BLOCKS, 2**31 - 1)
neg_int32 = st.integers(-(2**31), -1)
seq_id = st.integers(4, 2**64 - 1)


def _schedule(plan: StepPlan, seq: int, tokens: int = 1, computed: int = 0, num_new: int = 0) -> None:
    plan.seq_ids.append(seq)
    plan.num_scheduled_tokens.append(tokens)
    plan.num_computed_tokens.append(computed)
    plan.num_new_blocks.append(num_new)


def unknown_seq_id(draw, plan: StepPlan) -> None:
    _schedule(plan, draw(seq_id), draw(st.integers(1, 4)))


def finished_then_scheduled(draw, plan: StepPlan) -> None:
    getattr(plan, draw(st.sampled_from(["finished_seq_ids", "preempted_seq_ids"]))).append(
        draw(st.sampled_from([1, 2]))
    )


def duplicate_seq_id(draw, plan: StepPlan) -> None:
    i = draw(st.integers(0, 2))
    _schedule(plan, plan.seq_ids[i], plan.num_scheduled_tokens[i], plan.num_computed_tokens[i])


def duplicate_new_seq(draw, plan: StepPlan) -> None:
    plan.new_seqs.append(_new(3, draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6)), [6, 7]))


def duplicate_dropped(draw, plan: StepPlan) -> None:
    dropped = draw(st.sampled_from([1, 2, 77]))
    plan.finished_seq_ids.append(dropped)
    getattr(plan, draw(st.sampled_from(["finished_seq_ids", "preempted_seq_ids"]))).append(dropped)
    plan.seq_ids, plan.num_scheduled_tokens = plan.seq_ids[2:], plan.num_scheduled_tokens[2:]
    plan.num_computed_tokens, plan.num_new_blocks, plan.new_block_ids = plan.num_computed_tokens[2:], [0], []


def reregister_held(draw, plan: StepPlan) -> None:
    held = draw(st.sampled_from([1, 2]))
    plan.new_seqs.append(
        _new(held, draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8)), [8, 9])
    )


def block_out_of_range(draw, plan: StepPlan) -> None:
    bad = draw(st.one_of(big_int32, neg_int32))
    where = draw(st.sampled_from(["new-seq", "new_block_ids"]))
    if where == "new-seq":
        plan.new_seqs[0].block_table[draw(st.integers(0, 1))] = bad
    else:
        plan.new_block_ids[0] = bad


def negative_count(draw, plan: StepPlan) -> None:
    column = draw(st.sampled_from(COLUMNS))
    low = 0 if column == "num_scheduled_tokens" else -1
    getattr(plan, column)[draw(st.integers(0, 2))] = draw(st.integers(-(2**31), low))


def mismatched_columns(draw, plan: StepPlan) -> None:
    column = draw(st.sampled_from(("seq_ids", *COLUMNS)))
    values = getattr(plan, column)
    if draw(st.booleans()):
        values.pop(draw(st.integers(0, len(values) - 1)))
    else:
        values.append(draw(st.integers(0, 3)))


def new_blocks_mismatch(draw, plan: StepPlan) -> None:
    if draw(st.booleans()):
        plan.new_block_ids.append(draw(st.integers(0, NUM_BLOCKS - 1)))
    else:
        plan.new_block_ids.clear()


def huge_list(draw, plan: StepPlan) -> None:
    n = draw(st.sampled_from([10**5, 3 * 10**5, 10**6]))
    where = draw(
        st.sampled_from(["seq_ids", "new_block_ids", "block_table", "token_ids", "finished", *COLUMNS])
    )
    value = draw(st.integers(0, 3))
    if where == "block_table":
        plan.new_seqs[0].block_table = [value] * n
    elif where == "token_ids":
        plan.new_seqs[0].token_ids = [value] * n
    elif where == "finished":  # every id unknown, then seq 1 scheduled twice
        plan.finished_seq_ids = list(range(10**6, 10**6 + n))
        plan.seq_ids[2] = 1
    else:
        getattr(plan, where).extend([value] * n)


def token_outside_vocab(draw, plan: StepPlan) -> None:
    tokens = plan.new_seqs[0].token_ids
    tokens[draw(st.integers(0, len(tokens) - 1))] = draw(st.one_of(st.integers(VOCAB, 2**31 - 1), neg_int32))


NAN, INF = math.nan, math.inf
BAD_SAMPLING = {
    "temperature": [NAN, -INF, INF, -1.0, -1e-30],
    "top_p": [NAN, 0.0, -0.5, 1.0001, INF],
    "min_p": [NAN, -0.1, 1.5, INF],
    "top_k": [-1, -(2**31)],
    "repetition_penalty": [NAN, 0.0, -1.0, INF, -INF],
    "presence_penalty": [NAN, INF, -INF],
    "frequency_penalty": [NAN, INF, -INF],
    "logprobs": [-1, VOCAB + 1, 2**31 - 1],
    "num_prompt_tokens": [-1, -(2**31)],
    "min_tokens": [-1],
    "prompt_logprobs": [-1, VOCAB + 1],
    "stop_token_ids": [[VOCAB], [-1], [7] * (VOCAB + 1)],
    "logit_bias_token_ids": [[VOCAB]],
    "logit_bias_values": [[NAN], [INF]],
}


def bad_sampling(draw, plan: StepPlan) -> None:
    name = draw(st.sampled_from(sorted(BAD_SAMPLING)))
    params = plan.new_seqs[0].sampling_params
    setattr(params, name, draw(st.sampled_from(BAD_SAMPLING[name])))
    if name == "logit_bias_values":  # a column of the right length, one bad value
        params.logit_bias_token_ids = [1]
    elif name == "logit_bias_token_ids":
        params.logit_bias_values = [1.0]


def unknown_tokens(draw, plan: StepPlan) -> None:
    i = draw(st.integers(0, 2))
    plan.num_scheduled_tokens[i] += draw(st.integers(1, 3))


def computed_mismatch(draw, plan: StepPlan) -> None:
    i = draw(st.integers(0, 2))
    plan.num_computed_tokens[i] += draw(st.sampled_from([-2, -1, 1, 2, 1000]))
    plan.num_computed_tokens[i] = max(0, plan.num_computed_tokens[i])
    if plan.num_computed_tokens == base_plan().num_computed_tokens:
        plan.num_computed_tokens[2] = 1


def block_table_too_long(draw, plan: StepPlan) -> None:
    # In-range block ids, but more than max_model_len / block_size (32) of them for one sequence.
    extra = draw(st.integers(1, 8))
    if draw(st.booleans()):
        plan.new_seqs[0].block_table = [3] * (MAX_BLOCKS_PER_SEQ + extra)
    else:  # seq 1 holds 2 blocks
        plan.new_block_ids = [5] + [6] * (MAX_BLOCKS_PER_SEQ - 2 + extra)
        plan.num_new_blocks[0] = MAX_BLOCKS_PER_SEQ - 2 + extra


def too_few_blocks(draw, plan: StepPlan) -> None:
    plan.new_seqs[0].block_table = plan.new_seqs[0].block_table[: draw(st.integers(0, 1))]


def over_max_num_seqs(draw, plan: StepPlan) -> None:
    for i in range(MAX_NUM_SEQS + 1 - len(plan.seq_ids)):
        plan.new_seqs.append(_new(10 + i, [5], [10 + i]))
        _schedule(plan, 10 + i)


def over_batched_tokens(draw, plan: StepPlan) -> None:
    n = draw(st.integers(MAX_BATCHED, MAX_MODEL_LEN - 1))
    plan.new_seqs[0].token_ids = [7] * n
    plan.new_seqs[0].block_table = list(range(6, 6 + -(-n // BLOCK_SIZE)))
    plan.num_scheduled_tokens[2] = n


def over_max_model_len(draw, plan: StepPlan) -> None:
    plan.new_seqs[0].token_ids = [7] * draw(st.integers(MAX_MODEL_LEN + 1, 4 * MAX_MODEL_LEN))


def empty_new_seq(draw, plan: StepPlan) -> None:
    plan.new_seqs[0].token_ids = []


def new_seq_new_blocks(draw, plan: StepPlan) -> None:
    plan.num_new_blocks[2] = 1
    plan.new_block_ids.append(draw(st.integers(6, NUM_BLOCKS - 1)))


def new_seq_computed_range(draw, plan: StepPlan) -> None:
    plan.new_seqs[0].num_computed_tokens = draw(
        st.one_of(neg_int32, st.integers(len(PROMPT_3) + 1, 2**31 - 1))
    )


MUTATIONS: dict[str, Callable] = {
    f.__name__.replace("_", "-"): f
    for f in (
        unknown_seq_id,
        finished_then_scheduled,
        duplicate_seq_id,
        duplicate_new_seq,
        duplicate_dropped,
        reregister_held,
        block_out_of_range,
        negative_count,
        mismatched_columns,
        new_blocks_mismatch,
        huge_list,
        token_outside_vocab,
        bad_sampling,
        unknown_tokens,
        computed_mismatch,
        too_few_blocks,
        block_table_too_long,
        over_max_num_seqs,
        over_batched_tokens,
        over_max_model_len,
        empty_new_seq,
        new_seq_new_blocks,
        new_seq_computed_range,
    )
}


def _expect_state_unchanged(stub, reference: list[int]) -> None:
    """The held sequences decode the reference tokens (greedy): nothing was applied."""
    assert _decode(stub) == reference


def _send(channel: grpc.Channel, plan: StepPlan | bytes) -> tuple[list[pb.StepResult], grpc.RpcError | None]:
    """One plan (or raw bytes) on a new Step stream: (its results, the error if any)."""
    results: list[pb.StepResult] = []
    message = plan if isinstance(plan, bytes) else plan_to_proto(plan).SerializeToString()
    # No request serializer: the bytes go out as they are.
    step = channel.stream_stream(STEP_METHOD, response_deserializer=pb.StepResult.FromString)
    try:
        results.extend(step(iter([message]), timeout=30))
    except grpc.RpcError as e:
        return results, e
    return results, None


def _check_rejection(error: grpc.RpcError, step_id: int | None) -> None:
    assert error.code() == IA, f"{error.code()}: {error.details()}"
    details = error.details()
    assert len(details) <= MAX_DETAILS_CHARS, f"{len(details)} chars: {details[:200]}..."
    if step_id is not None:
        assert details.startswith(f"step {step_id}: "), details


@pytest.mark.parametrize("kind", sorted(MUTATIONS))
@settings(FUZZ, max_examples=10)
@given(data=st.data())
def test_each_bad_plan_kind_is_invalid_argument_and_changes_nothing(executor, kind, data):
    stub, channel, reference = executor
    TRIED[kind] += 1
    _setup(stub)
    plan = base_plan(step_id=data.draw(st.integers(100, 2**64 - 1), label="step_id"))
    MUTATIONS[kind](data.draw, plan)
    results, error = _send(channel, plan)
    assert error is not None, f"{kind} accepted: {plan}"
    assert not results
    _check_rejection(error, plan.step_id)
    _expect_state_unchanged(stub, reference)
    HANDLED[kind] += 1


def test_the_base_plan_is_valid(executor):
    """The mutations start from a plan the executor runs (so each one is what makes it bad)."""
    stub, _, reference = executor
    _setup(stub)
    (result,) = _run(stub, [base_plan()])
    assert list(result.seq_ids) == [1, 2, 3]
    assert list(result.token_ids[:2]) == reference


# -- random plans ----------------------------------------------------------------------------------

int32 = st.integers(-(2**31), 2**31 - 1)
small = st.one_of(st.integers(-3, 40), int32)
ids = st.one_of(st.integers(0, 12), st.integers(0, 2**64 - 1))
floats = st.floats(width=32, allow_nan=True, allow_infinity=True)


@st.composite
def sampling_params(draw) -> StepSamplingParams:
    return StepSamplingParams(
        temperature=draw(st.one_of(st.just(0.0), floats)),
        top_k=draw(st.one_of(st.just(0), int32)),
        top_p=draw(st.one_of(st.just(1.0), floats)),
        min_p=draw(st.one_of(st.just(0.0), floats)),
        seed=draw(st.none() | st.integers(0, 2**64 - 1)),
        repetition_penalty=draw(st.one_of(st.just(1.0), floats)),
        presence_penalty=draw(st.one_of(st.just(0.0), floats)),
        frequency_penalty=draw(st.one_of(st.just(0.0), floats)),
        logprobs=draw(st.one_of(st.just(0), st.integers(0, 8), int32)),
        num_prompt_tokens=draw(small),
    )


@st.composite
def random_plans(draw) -> StepPlan:
    """Any shape: columns of independent lengths, ids and counts from tiny to extreme, new seqs
    with any tokens and blocks; mostly invalid, sometimes valid."""
    n = draw(st.integers(0, 10))
    column = lambda values: draw(st.lists(values, min_size=max(0, n - 1), max_size=n + 1))  # noqa: E731
    new_seqs = draw(
        st.lists(
            st.builds(
                NewSequence,
                seq_id=ids,
                token_ids=st.lists(st.one_of(st.integers(0, VOCAB - 1), int32), max_size=40),
                block_table=st.lists(st.one_of(st.integers(0, NUM_BLOCKS - 1), int32), max_size=12),
                num_computed_tokens=small,
                sampling_params=sampling_params(),
            ),
            max_size=4,
        )
    )
    return StepPlan(
        step_id=draw(st.integers(0, 2**64 - 1)),
        new_seqs=new_seqs,
        seq_ids=column(ids),
        num_scheduled_tokens=column(small),
        num_computed_tokens=column(small),
        new_block_ids=draw(st.lists(st.one_of(st.integers(0, NUM_BLOCKS - 1), int32), max_size=12)),
        num_new_blocks=column(st.integers(-2, 3)),
        finished_seq_ids=draw(st.lists(ids, max_size=4)),
        preempted_seq_ids=draw(st.lists(ids, max_size=4)),
    )


@st.composite
def valid_new_seq_plans(draw) -> StepPlan:
    """Plans that pass validation (new seqs, in range), with random sampling parameters that
    are in range but extreme: they must run, never fail inside the model or the sampler."""
    plan = StepPlan(draw(st.integers(0, 2**64 - 1)))
    free = list(range(6, NUM_BLOCKS))
    for seq in range(draw(st.integers(1, 3))):
        tokens = draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=16))
        blocks = [free.pop() for _ in range(-(-len(tokens) // BLOCK_SIZE))]
        params = StepSamplingParams(
            temperature=draw(st.sampled_from([0.0, 1e-30, 1e-7, 0.5, 1.0, 3e38])),
            top_k=draw(st.sampled_from([0, 1, 5, VOCAB, 2**31 - 1])),
            top_p=draw(st.sampled_from([1e-30, 0.5, 1.0])),
            min_p=draw(st.sampled_from([0.0, 1e-30, 0.5, 1.0])),
            seed=draw(st.none() | st.integers(0, 2**64 - 1)),
            repetition_penalty=draw(st.sampled_from([1e-30, 0.5, 1.0, 3e38])),
            presence_penalty=draw(st.sampled_from([-3e38, 0.0, 2.0, 3e38])),
            frequency_penalty=draw(st.sampled_from([-3e38, 0.0, 2.0, 3e38])),
            logprobs=draw(st.sampled_from([0, 1, VOCAB])),
            num_prompt_tokens=draw(st.sampled_from([0, 1, len(tokens), 2**31 - 1])),
        )
        plan.new_seqs.append(NewSequence(100 + seq, tokens, blocks, 0, params))
        _schedule(plan, 100 + seq, len(tokens))
    return plan


@FUZZ
@given(plan=random_plans())
def test_random_plans_get_a_result_or_invalid_argument(executor, plan):
    stub, channel, reference = executor
    TRIED["random-plan"] += 1
    _setup(stub)
    results, error = _send(channel, plan)
    if error is None:
        ACCEPTED["random-plan"] += 1
        assert [r.step_id for r in results] == [plan.step_id]
        _setup(stub)  # the plan may have written the held sequences' blocks
    else:
        _check_rejection(error, plan.step_id)
    _expect_state_unchanged(stub, reference)
    HANDLED["random-plan"] += 1


@FUZZ
@given(plan=valid_new_seq_plans())
def test_extreme_but_valid_sampling_runs(executor, plan):
    stub, channel, reference = executor
    TRIED["extreme-valid-sampling"] += 1
    _setup(stub)
    results, error = _send(channel, plan)
    assert error is None, f"{error.code()}: {error.details()}"
    (result,) = results
    assert list(result.seq_ids) == plan.seq_ids
    assert all(0 <= t < VOCAB for t in result.token_ids)
    for lp in result.logprobs:
        assert all(math.isfinite(x) or x == -math.inf for x in lp.sampled_logprobs)
    _expect_state_unchanged(stub, reference)  # seqs 1 and 2 untouched
    HANDLED["extreme-valid-sampling"] += 1


@FUZZ
@given(
    data=st.one_of(
        st.binary(max_size=256), st.binary(min_size=1, max_size=64).map(lambda b: b"\x12\xff\xff\x03" + b)
    )
)
def test_random_bytes_get_a_result_or_invalid_argument(executor, data):
    stub, channel, reference = executor
    TRIED["random-bytes"] += 1
    _setup(stub)
    _, error = _send(channel, data)
    if error is None:
        ACCEPTED["random-bytes"] += 1
        _setup(stub)
    else:
        _check_rejection(error, None)
    _expect_state_unchanged(stub, reference)
    HANDLED["random-bytes"] += 1


def test_bytes_that_are_no_step_plan_are_invalid_argument(executor):
    stub, channel, reference = executor
    _setup(stub)
    for data in (b"\xff\xff\xff\xff", b"\x12\x05\x08", b"\x1a\x80"):
        results, error = _send(channel, data)
        assert error is not None and not results
        _check_rejection(error, None)
        assert "not a valid tandem.v1.StepPlan" in error.details()
    reset = channel.unary_unary(
        "/tandem.v1.ExecutorService/Reset", response_deserializer=pb.ResetResponse.FromString
    )
    with pytest.raises(grpc.RpcError) as e:
        reset(b"\xff\xff", timeout=10)
    assert e.value.code() == IA and "not a valid tandem.v1.ResetRequest" in e.value.details()
    _expect_state_unchanged(stub, reference)
