"""LocalExecutor's plan handling: bad plans are refused whole, state survives, describe/reset."""

from __future__ import annotations

import copy
import json
import re
import shutil
from pathlib import Path

import pytest
from executor_fixtures import MiniScheduler, make_executor, prompt_ids
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from executor_service.config import ExecutorConfig
from executor_service.executor import LocalExecutor, PlanError
from protos.executor import StepOnlyExecutor
from protos.plan import NewSequence, StepPlan, StepSamplingParams

NUM_KV_BLOCKS = 32


@pytest.fixture
def executor(qwen3_tied) -> LocalExecutor:
    return make_executor(
        qwen3_tied, num_kv_blocks=NUM_KV_BLOCKS, max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64
    )


@pytest.fixture
def sched(executor) -> MiniScheduler:
    """Seq 1 has a 16-token prompt in block 0, prefilled: 17 tokens, 16 computed, decoding next."""
    sched = MiniScheduler(executor)
    sched.add(1, prompt_ids(16, seed=1))
    sched.step({1: 16})
    return sched


def _new(seq_id: int, tokens: list[int], blocks: list[int], computed: int = 0, **params) -> NewSequence:
    return NewSequence(seq_id, tokens, blocks, computed, StepSamplingParams(**params))


def _decode(seq_id=1, computed=16, blocks=(5,), **changes) -> StepPlan:
    plan = StepPlan(
        step_id=99,
        seq_ids=[seq_id],
        num_scheduled_tokens=[1],
        num_computed_tokens=[computed],
        new_block_ids=list(blocks),
        num_new_blocks=[len(blocks)],
    )
    for name, value in changes.items():
        setattr(plan, name, value)
    return plan


def _new_plan(*news: NewSequence, n: int | None = None, **changes) -> StepPlan:
    plan = StepPlan(
        step_id=99,
        new_seqs=list(news),
        seq_ids=[s.seq_id for s in news],
        num_scheduled_tokens=[n or len(s.token_ids) for s in news],
        num_computed_tokens=[s.num_computed_tokens for s in news],
        num_new_blocks=[0] * len(news),
    )
    for name, value in changes.items():
        setattr(plan, name, value)
    return plan


BAD_PLANS = {
    "unknown seq id 7": _decode(seq_id=7),
    "duplicate seq id 1 in seq_ids": _decode(
        seq_ids=[1, 1], num_scheduled_tokens=[1, 1], num_computed_tokens=[16, 16], num_new_blocks=[1, 0]
    ),
    "duplicate seq id 2 in new_seqs": _new_plan(
        _new(2, [5, 6], [3]),
        _new(2, [5, 6], [4]),
        seq_ids=[2],
        num_scheduled_tokens=[2],
        num_computed_tokens=[0],
        num_new_blocks=[0],
    ),
    "new seq 1 is already held": _new_plan(_new(1, [5, 6], [3])),
    f"block id {NUM_KV_BLOCKS} in new_block_ids is outside [0, {NUM_KV_BLOCKS})": _decode(
        blocks=[NUM_KV_BLOCKS]
    ),
    "block id -1 in the block_table of new seq 2": _new_plan(_new(2, [5, 6], [-1])),
    "token id 512 is outside the vocabulary [0, 512)": _new_plan(_new(2, [5, 512], [3])),
    "token id -3 is outside the vocabulary": _new_plan(_new(2, [-3, 5], [3])),
    "num_computed_tokens mismatch: plan says 15, executor has 16": _decode(computed=15),
    "schedules tokens [16, 18) but only 17 tokens are known": _decode(num_scheduled_tokens=[2]),
    "too few blocks: 1 blocks of 16 cannot hold 17 tokens": _decode(blocks=[]),
    "5 scheduled sequences exceed max_num_seqs (4)": _new_plan(*[_new(i, [5], [i]) for i in range(2, 7)]),
    "65 scheduled tokens exceed max_num_batched_tokens (64)": _new_plan(_new(2, [5] * 65, [3, 4, 6, 7, 8])),
    "num_scheduled_tokens must be positive": _decode(num_scheduled_tokens=[-1]),
    "negative count in num_new_blocks": _decode(num_new_blocks=[-1]),
    "negative count in num_computed_tokens": _decode(computed=-2),
    "1 seq_ids but 0 num_scheduled_tokens": _decode(num_scheduled_tokens=[]),
    "num_new_blocks sum to 1 but new_block_ids has 2": _decode(blocks=[5, 6], num_new_blocks=[1]),
    "new seq 2 has num_new_blocks 1": _new_plan(_new(2, [5], [3]), new_block_ids=[4], num_new_blocks=[1]),
    "new seq 2 has 300 tokens, more than max_model_len (256)": _new_plan(
        _new(2, [5] * 300, list(range(19))), n=40
    ),
    "top_p 0.0 must be in (0, 1]": _new_plan(_new(2, [5], [3], top_p=0.0)),
    "temperature -1.0 must be >= 0": _new_plan(_new(2, [5], [3], temperature=-1.0)),
    # (each step bans them while the sequence is short of min_tokens: 5M made a step 0.8 s, not 3 ms)
    "stop_token_ids has 513 entries, more than the vocabulary (512)": _new_plan(
        _new(2, [5], [3], min_tokens=4, stop_token_ids=[7] * 513)
    ),
    # Seq 1 is finished by this plan, so scheduling it is scheduling an unknown sequence.
    "unknown seq id 1": _decode(finished_seq_ids=[1]),
}


@pytest.mark.parametrize("message", list(BAD_PLANS))
def test_bad_plan_raises_names_the_problem_and_changes_nothing(executor, sched, message):
    plan = copy.deepcopy(BAD_PLANS[message])
    # Bad plans that do not schedule seq 1 also finish it: that must not happen either.
    if 1 not in plan.seq_ids and not plan.finished_seq_ids:
        plan.finished_seq_ids.append(1)
    before = copy.deepcopy(executor.seqs)
    with pytest.raises(PlanError, match=re.escape(message)):
        executor.step(plan)
    assert executor.seqs == before
    # The executor keeps working: the next good plan decodes seq 1.
    result, _ = sched.step(sched.decode_all())
    assert result.seq_ids == [1]
    assert len(executor.seqs[1].token_ids) == 18


def test_plan_with_only_finished_ids_runs_no_forward(executor, sched):
    result = executor.step(StepPlan(step_id=5, finished_seq_ids=[1, 42]))
    assert result.step_id == 5 and result.seq_ids == [] and result.forward_seconds == 0.0
    assert executor.seqs == {}


def test_preempted_sequence_can_be_resent_in_the_same_plan(executor, sched):
    tokens = list(executor.seqs[1].token_ids)
    plan = _new_plan(_new(1, tokens, [7, 8]), preempted_seq_ids=[1])
    result = executor.step(plan)
    assert result.seq_ids == [1]
    assert executor.seqs[1].token_ids[:-1] == tokens
    assert executor.seqs[1].block_table == [7, 8]


def test_seeded_sampling_survives_preemption_and_batch_company(qwen3_tied):
    params = dict(temperature=1.0, seed=2024)
    prompt = prompt_ids(10, seed=3)

    alone = MiniScheduler(make_executor(qwen3_tied, seed=1))
    alone.add(1, prompt, StepSamplingParams(**params))
    alone.step({1: 10})
    for _ in range(9):
        alone.step({1: 1})

    crowd = MiniScheduler(make_executor(qwen3_tied, seed=2))
    crowd.add(1, prompt, StepSamplingParams(**params))
    crowd.add(2, prompt_ids(12, seed=4), StepSamplingParams(temperature=1.0))
    crowd.step({1: 10, 2: 12})
    for i in range(9):
        if i == 4:  # recompute preemption: dropped, then re-sent with everything it has
            crowd.step({2: 1}, preempted=(1,))
            crowd.step({1: len(crowd.seqs[1].token_ids), 2: 1})
        else:
            crowd.step({1: 1, 2: 1})
    assert crowd.seqs[1].token_ids == alone.seqs[1].token_ids
    assert len(set(alone.seqs[1].token_ids[10:])) > 3  # really sampled, not greedy repeats


def test_reset_drops_every_sequence(executor, sched):
    sched.add(2, prompt_ids(5, seed=2))
    sched.step({1: 1, 2: 5})
    assert executor.reset() == 2
    assert executor.reset() == 0
    with pytest.raises(PlanError, match="unknown seq id 1"):
        executor.step(_decode(computed=17, blocks=[]))
    result = executor.step(_new_plan(_new(1, [5, 6, 7], [0])))
    assert result.seq_ids == [1]


def test_describe_reports_capacity_and_model_limits(qwen3_untied):
    executor = make_executor(qwen3_untied, block_size=32, num_kv_blocks=40, max_model_len=None)
    info = executor.describe()
    assert info.model == Path(qwen3_untied).name
    assert info.architecture == "Qwen3ForCausalLM"
    assert (info.block_size, info.num_kv_blocks, info.max_model_len) == (32, 40, 1024)
    assert info.eos_token_ids == [0, 1]
    assert (info.vocab_size, info.num_layers, info.dtype, info.device) == (512, 4, "float32", "cpu")
    assert info.block_bytes == 2 * 4 * 32 * 2 * 16 * 4  # K and V, 4 layers, 2 KV heads of 16, fp32
    assert info.attention_backend == "torch"
    assert executor.config.fused_ops == "off"  # auto: the Triton kernels need CUDA


def test_kv_cache_gb_sets_the_block_count(qwen3_tied):
    info = LocalExecutor(
        ExecutorConfig(model=str(qwen3_tied), kv_cache_gb=0.01, max_model_len=128)
    ).describe()
    assert info.num_kv_blocks == int(0.01 * 2**30) // info.block_bytes


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_model_len": 4096}, r"max_model_len \(4096\) must be in \[1, 1024\]"),
        ({"dtype": "float8"}, "dtype 'float8' is not one of"),
        ({"attention_backend": "nope"}, "attention_backend 'nope' is not one of auto, "),
        ({"attention_backend": "triton"}, "attention_backend 'triton' does not run on cpu"),
        ({"fused_ops": "yes"}, "fused_ops 'yes' is not one of auto, on, off"),
        (
            {"fused_ops": "on"},
            "fused_ops 'on' cannot be used: they are Triton kernels for CUDA, and the device is cpu",
        ),
        ({"block_size": 0}, r"block_size \(0\) must be positive"),
        ({"max_num_seqs": 9000}, r"max_num_batched_tokens \(8192\) must be >= max_num_seqs \(9000\)"),
        ({"device": "tpu"}, "device 'tpu' must be 'cpu' or 'cuda'"),
        # NaN and inf passed the `<= 0` check and failed at load, converting NaN to a block count.
        ({"kv_cache_gb": float("nan")}, r"kv_cache_gb \(nan\) must be a positive, finite number"),
        ({"kv_cache_gb": float("inf")}, r"kv_cache_gb \(inf\) must be a positive, finite number"),
    ],
)
def test_config_errors_say_what_to_change(qwen3_tied, kwargs, message):
    with pytest.raises(ValueError, match=message):
        ExecutorConfig(model=str(qwen3_tied), **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"model": None}, "model must be a checkpoint directory or a hub id (a string), got None"),
        ({"device": None}, "device must be a string, got None"),
        ({"max_num_seqs": "4"}, "max_num_seqs must be an integer, got '4'"),
        ({"block_size": 16.0}, "block_size must be an integer, got 16.0"),
        ({"max_model_len": True}, "max_model_len must be an integer, got True"),
        ({"kv_cache_gb": "1"}, "kv_cache_gb must be a number, got '1'"),
    ],
)
def test_config_arguments_of_another_type_are_a_type_error_naming_them(qwen3_tied, kwargs, message):
    """As LLM(...)'s engine arguments: they failed wherever they were first used, with Python's
    own words ("'<=' not supported between instances of 'str' and 'int'", an AttributeError)."""
    kwargs = {"model": str(qwen3_tied), **kwargs}
    with pytest.raises(TypeError) as e:
        ExecutorConfig(**kwargs)
    assert message in str(e.value)


GPT2_CONFIG = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": 64, "n_head": 2,
               "n_layer": 2, "n_positions": 128, "vocab_size": 512}  # fmt: skip


@pytest.mark.parametrize(
    ("file", "text", "message"),
    [
        ("config.json", "{not json", r"config.json is not valid JSON: Expecting property name"),
        ("config.json", "[1, 2]", r"config.json must hold a JSON object, not list"),
        ("config.json", None, r"config.json has no vocab_size"),
        (
            "config.json",
            json.dumps(GPT2_CONFIG),
            "architecture 'GPT2LMHeadModel' is not supported; supported: ",
        ),
        ("generation_config.json", "oops", r"generation_config.json is not valid JSON: Expecting value"),
    ],
)
def test_a_broken_config_json_is_refused_naming_the_file(qwen3_tied, tmp_path, file, text, message):
    """A JSON error did not say which file ("error: Expecting value: line 1 column 1 (char 0)"),
    and a config that is no object, lacks a key, or is another family's (GPT-2's n_embd) was an
    AttributeError or KeyError traceback of `tandem executor`."""
    model = tmp_path / "model"
    shutil.copytree(qwen3_tied, model)
    if text is None:
        config = json.loads((model / "config.json").read_text())
        del config["vocab_size"]
        text = json.dumps(config)
    (model / file).write_text(text)
    with pytest.raises(ValueError) as e:
        ExecutorConfig(model=str(model))
    assert re.search(message, str(e.value)), str(e.value)
    assert str(model) in str(e.value) or "GPT2" in str(e.value)


def test_kv_cache_smaller_than_max_model_len_is_refused(qwen3_tied):
    with pytest.raises(ValueError, match=r"fewer than max_model_len \(1024\)"):
        LocalExecutor(ExecutorConfig(model=str(qwen3_tied), num_kv_blocks=10))


def test_what_the_load_would_refuse_is_refused_by_the_configuration(qwen3_tied, tmp_path, capsys):
    """A fixed --num-kv-blocks too small for max_model_len, or a checkpoint without weights, was
    found only while loading, after the executor served: a traceback in its log and exit 1."""
    from client.cli import main

    with pytest.raises(
        ValueError,
        match=r"the KV cache holds 40 tokens \(10 blocks of 4\), fewer than max_model_len \(1024\)",
    ):
        ExecutorConfig(model=str(qwen3_tied), num_kv_blocks=10, block_size=4)
    assert ExecutorConfig(model=str(qwen3_tied), num_kv_blocks=256, block_size=4).num_kv_blocks == 256
    model = tmp_path / "model"
    shutil.copytree(qwen3_tied, model, ignore=shutil.ignore_patterns("*.safetensors"))
    with pytest.raises(ValueError, match=f"no \\*.safetensors files in {model}"):
        ExecutorConfig(model=str(model))
    assert main(["executor", "--model", str(model), "--port", "0", "--metrics-port", "0"]) == 2
    assert main(["executor", "--num-kv-blocks", "1", "--port", "0", "--metrics-port", "0"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "error: the KV cache holds 16 tokens (1 blocks of 16)" in err


def _two_seqs_then_decodes(**params) -> list[StepPlan]:
    """Prefill of two sequences (one with a prefill chunk left), then decodes that read the
    tokens the step before samples; step ids 1..4."""
    a, b = prompt_ids(9, seed=3), prompt_ids(20, seed=4)
    plans = [
        _new_plan(_new(1, a, [0], **params), _new(2, b, [1, 2], **params), n=None, step_id=1),
        StepPlan(step_id=2, seq_ids=[1, 2], num_scheduled_tokens=[1, 4], num_computed_tokens=[9, 16],
                 num_new_blocks=[0, 0]),
        StepPlan(step_id=3, seq_ids=[1, 2], num_scheduled_tokens=[1, 1], num_computed_tokens=[10, 20],
                 num_new_blocks=[0, 0]),
        StepPlan(step_id=4, seq_ids=[1, 2], num_scheduled_tokens=[1, 1], num_computed_tokens=[11, 21],
                 num_new_blocks=[0, 0]),
    ]  # fmt: skip
    plans[0].num_scheduled_tokens = [9, 16]  # seq 2: a 16-token chunk, its last 4 in step 2
    return plans


@pytest.mark.parametrize("params", [{}, {"repetition_penalty": 1.3}, {"temperature": 0.8, "seed": 5}])
def test_two_steps_in_flight_give_the_tokens_of_one_at_a_time(qwen3_tied, params):
    """send(N+1) before receive(N): N+1's decode rows take N's sampled tokens on the device (with
    penalties, N is waited for first); results and state equal those of step() one at a time."""
    options = dict(num_kv_blocks=NUM_KV_BLOCKS, max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64)
    one = make_executor(qwen3_tied, **options)
    expected = [one.step(plan) for plan in _two_seqs_then_decodes(**params)]
    two = make_executor(qwen3_tied, **options)
    plans = _two_seqs_then_decodes(**params)
    two.send(plans[0])
    got = []
    for i in range(1, len(plans)):
        two.send(plans[i])
        assert -1 in two.seqs[1].token_ids, "the token in flight is a placeholder on the host"
        got.append(two.receive(plans[i - 1]))
    got.append(two.receive(plans[-1]))
    assert [(r.seq_ids, r.token_ids) for r in got] == [(r.seq_ids, r.token_ids) for r in expected]
    assert {i: s.token_ids for i, s in two.seqs.items()} == {i: s.token_ids for i, s in one.seqs.items()}


def test_a_refused_step_in_flight_fails_in_order_and_stops_the_next(executor):
    good = _new_plan(_new(2, [5, 6, 7], [3]), step_id=1)
    bad = _decode(seq_id=9, step_id=2)
    executor.send(good)
    executor.send(bad)
    with pytest.raises(RuntimeError, match="two steps in flight"):
        executor.send(_decode(step_id=3))
    assert len(executor.receive(good).token_ids) == 1
    with pytest.raises(PlanError, match="unknown seq id 9"):
        executor.receive(bad)
    # A plan sent behind a refused one is not run; the refusal changed nothing.
    executor.send(_decode(seq_id=9, step_id=4))
    decode = StepPlan(
        step_id=5, seq_ids=[2], num_scheduled_tokens=[1], num_computed_tokens=[3], num_new_blocks=[0]
    )
    executor.send(decode)
    with pytest.raises(PlanError):
        executor.receive(_decode(seq_id=9, step_id=4))
    with pytest.raises(RuntimeError, match="step 5 not run: step 4 failed"):
        executor.receive(decode)
    executor.step(
        StepPlan(
            step_id=6, seq_ids=[2], num_scheduled_tokens=[1], num_computed_tokens=[3], num_new_blocks=[0]
        )
    )
    assert len(executor.seqs[2].token_ids) == 5 and -1 not in executor.seqs[2].token_ids


class _Recorder(StepOnlyExecutor):
    """A LocalExecutor run one step at a time, keeping every plan and result."""

    def __init__(self, executor: LocalExecutor) -> None:
        self.executor = executor
        self.plans: list[StepPlan] = []
        self.results = []

    def describe(self):
        return self.executor.describe()

    def reset(self) -> int:
        return self.executor.reset()

    def step(self, plan: StepPlan):
        result = self.executor.step(plan)
        self.plans.append(copy.deepcopy(plan))
        self.results.append(result)
        return result


@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    requests=st.lists(
        st.tuples(
            st.integers(1, 40),  # prompt length
            st.integers(1, 12),  # max tokens
            st.sampled_from(["greedy", "temperature", "seeded", "penalties", "logprobs"]),
        ),
        min_size=1,
        max_size=6,
    ),
    budget=st.sampled_from([8, 24, 64]),
    num_kv_blocks=st.sampled_from([16, 64]),
)
def test_replayed_plans_with_two_steps_in_flight_give_the_same_results(
    qwen3_untied, requests, budget, num_kv_blocks
):
    """The real scheduler's plans (chunked prefill, prefix hits, preemption, stops, every kind of
    sampling) recorded one step at a time, then replayed on a fresh executor with each plan sent
    before the previous result is read: the same results, step by step."""
    from scheduler_service.config import SchedulerConfig
    from scheduler_service.engine import LLMEngine
    from scheduler_service.sampling_params import SamplingParams

    kinds = {
        "greedy": {},
        "temperature": {"temperature": 0.9, "top_p": 0.9},
        "seeded": {"temperature": 0.7, "seed": 11},
        "penalties": {"repetition_penalty": 1.2, "presence_penalty": 0.5},
        "logprobs": {"logprobs": 2},
    }
    options = dict(
        num_kv_blocks=num_kv_blocks, block_size=4, max_model_len=64, max_num_seqs=8, max_num_batched_tokens=64
    )
    recorder = _Recorder(make_executor(qwen3_untied, **options))
    engine = LLMEngine(recorder, SchedulerConfig(max_num_batched_tokens=budget, max_plans_in_flight=1))
    shared = prompt_ids(8, seed=99)
    for i, (n, max_tokens, kind) in enumerate(requests):
        tokens = (shared + prompt_ids(n, seed=i))[: max(n, 1) + 8] if i % 2 else prompt_ids(n, seed=i)
        engine.add_request(tokens[:40], SamplingParams(max_tokens=max_tokens, **kinds[kind]))
    while engine.has_unfinished_requests() or engine.scheduler.has_finished_to_send():
        engine.step()

    replay = make_executor(qwen3_untied, **options)
    plans = recorder.plans
    got = []
    replay.send(plans[0])
    for i in range(1, len(plans)):
        replay.send(plans[i])
        got.append(replay.receive(plans[i - 1]))
    got.append(replay.receive(plans[-1]))
    for expected, result in zip(recorder.results, got, strict=True):
        assert (result.step_id, result.seq_ids, result.token_ids) == (
            expected.step_id,
            expected.seq_ids,
            expected.token_ids,
        )
        assert result.logprobs == expected.logprobs
    assert {i: s.token_ids for i, s in replay.seqs.items()} == {
        i: s.token_ids for i, s in recorder.executor.seqs.items()
    }


@pytest.mark.parametrize("extra", [{}, {"top_p": 0.9}, {"seed": 7}])
def test_a_tiny_positive_temperature_samples_the_greedy_tokens(qwen3_tied, extra):
    """temperature 1e-38 is valid (>= 0, finite in 32 bits) and next to greedy; dividing the logits
    by it overflowed them to inf, the softmax to NaN, and every step sampled token 0."""
    prompt = prompt_ids(10, seed=5)
    runs = {}
    for temperature in (0.0, 1e-38):
        sched = MiniScheduler(make_executor(qwen3_tied))
        sched.add(1, prompt, StepSamplingParams(temperature=temperature, **extra))
        sched.step({1: 10})
        for _ in range(7):
            sched.step({1: 1})
        runs[temperature] = sched.seqs[1].token_ids[10:]
    assert runs[1e-38] == runs[0.0]
    assert len(set(runs[0.0])) > 1  # (not a model that only ever says one token)
