"""Bad input at both services' boundaries: a catalog of known-bad requests, each with the status
code it must get, and hypothesis throwing random and malformed GenerateRequests at the scheduler.

Every bad input gets a status code (never a crash, never INTERNAL or UNKNOWN for the client's own
mistake), and the service serves a good request right after.

The catalog (the id of each case is its name in the test report):

Scheduler, tandem.v1.GenerationService/Generate (in-process server over a LocalExecutor; the
test model has a vocabulary of 512 and max_model_len 1024):

  ===========================  ===================  ==============================================
  case                         expected code        what
  ===========================  ===================  ==============================================
  empty-text                   INVALID_ARGUMENT     text ""
  no-prompt                    INVALID_ARGUMENT     neither text nor token ids nor chat
  empty-token-ids              INVALID_ARGUMENT     token_ids {}
  token-id-vocab               INVALID_ARGUMENT     token id 512 (= vocabulary size)
  token-id-negative            INVALID_ARGUMENT     token id -1
  token-id-int32-max           INVALID_ARGUMENT     token id 2**31 - 1
  too-long                     INVALID_ARGUMENT     prompt + max_tokens > max_model_len
  no-room                      INVALID_ARGUMENT     prompt of max_model_len tokens, max_tokens unset
  max-tokens-int32-max         INVALID_ARGUMENT     max_tokens 2**31 - 1
  max-tokens-negative          INVALID_ARGUMENT     max_tokens -1
  max-tokens-zero              INVALID_ARGUMENT     max_tokens 0 (unset means up to max_model_len)
  temperature-negative         INVALID_ARGUMENT     temperature -1
  temperature-nan              INVALID_ARGUMENT     temperature NaN
  temperature-inf              INVALID_ARGUMENT     temperature +inf
  top-p-zero                   INVALID_ARGUMENT     top_p 0
  top-p-nan                    INVALID_ARGUMENT     top_p NaN
  top-k-negative               INVALID_ARGUMENT     top_k -5
  min-p-above-one              INVALID_ARGUMENT     min_p 1.5
  repetition-penalty-negative  INVALID_ARGUMENT     repetition_penalty -1
  presence-penalty-nan         INVALID_ARGUMENT     presence_penalty NaN
  frequency-penalty-inf        INVALID_ARGUMENT     frequency_penalty -inf
  logprobs-negative            INVALID_ARGUMENT     logprobs -1
  logprobs-above-vocab         INVALID_ARGUMENT     logprobs 1000000 (the executor would reject
                                                    the whole batch's plan)
  stop-token-id-vocab          INVALID_ARGUMENT     stop_token_ids [600]
  stop-token-id-negative       INVALID_ARGUMENT     stop_token_ids [-3]
  too-many-stop-strings        INVALID_ARGUMENT     65 stop strings
  stop-string-too-long         INVALID_ARGUMENT     a stop string of 2000 characters
  request-id-too-long          INVALID_ARGUMENT     request_id of 1000 characters (echoed in
                                                    every response)
  text-too-long                INVALID_ARGUMENT     200,000 characters of text (tokenized off the
                                                    event loop, then over max_model_len)
  invalid-utf8                 INVALID_ARGUMENT     raw bytes: text field holding \\xff\\xfe
  truncated-message            INVALID_ARGUMENT     raw bytes: a length prefix longer than the
                                                    message
  garbage-bytes                INVALID_ARGUMENT     raw bytes: \\xff\\xff\\xff\\xff
  over-message-limit           RESOURCE_EXHAUSTED   a 17 MiB request (limit 16 MiB)
  (no message: a request stream closed before its GenerateRequest is INVALID_ARGUMENT, while one
  refused for its size is RESOURCE_EXHAUSTED: test_a_call_without_its_request_is_invalid_argument)
  unknown-method               UNIMPLEMENTED        /tandem.v1.GenerationService/Nope
  unknown-service              UNIMPLEMENTED        /tandem.v9.Nothing/Generate
  ===========================  ===================  ==============================================

Executor, tandem.v1.ExecutorService/Step (the real executor server in-process, driven through its
stubs; 64 blocks of 16, vocabulary 512, max_model_len 1024, 512 batched tokens). Every case is INVALID_ARGUMENT, the
stream ends, and a good plan on a new stream then runs:

  unknown-seq-id, block-out-of-range, block-negative, duplicate-seq-ids, duplicate-new-seqs,
  zero-tokens, negative-tokens, mismatched-columns, new-blocks-mismatch, token-outside-vocab,
  computed-mismatch, beyond-known-tokens, over-batched-tokens, new-seq-already-held,
  empty-new-seq, too-few-blocks, nan-temperature, logprobs-above-vocab, negative-computed
"""

from __future__ import annotations

import time
from collections.abc import Callable

import grpc
import pytest
from helpers.scheduler_server import make_server, metrics, wait_serving
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from executor_service.config import ExecutorConfig
from executor_service.executor import LocalExecutor
from executor_service.server import ExecutorServer
from protos.plan import NewSequence, StepPlan, StepSamplingParams, plan_to_proto
from protos.tandem.v1 import executor_pb2 as epb
from protos.tandem.v1 import executor_pb2_grpc as epb_grpc
from protos.tandem.v1 import generation_pb2 as pb
from protos.tandem.v1 import generation_pb2_grpc as pb_grpc
from scheduler_service.server import ServerThread

IA = grpc.StatusCode.INVALID_ARGUMENT
GENERATE = "/tandem.v1.GenerationService/Generate"
# Codes a client's own bad input may get; anything else (INTERNAL, UNKNOWN) is a server bug.
CLIENT_ERRORS = {IA, grpc.StatusCode.RESOURCE_EXHAUSTED}


def req(prompt=None, **sampling) -> pb.GenerateRequest:
    sampling.setdefault("max_tokens", 4)
    if sampling["max_tokens"] is None:  # unset: up to max_model_len
        del sampling["max_tokens"]
    params = pb.SamplingParams(**sampling)
    if isinstance(prompt, str):
        return pb.GenerateRequest(text=prompt, sampling_params=params)
    if prompt is None:
        return pb.GenerateRequest(sampling_params=params)
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling_params=params)


def _raw_text(text: bytes) -> bytes:
    """A GenerateRequest whose text field (1, length-delimited) holds these bytes."""
    return bytes([0x0A, len(text)]) + text


NAN, INF = float("nan"), float("inf")
SCHEDULER_CATALOG: list[tuple[str, object, grpc.StatusCode, str]] = [
    ("empty-text", req(""), IA, "prompt is empty"),
    ("no-prompt", req(), IA, "prompt is empty: the GenerateRequest sets none of text, token_ids and chat"),
    ("empty-token-ids", req([]), IA, "prompt is empty"),
    ("token-id-vocab", req([5, 512]), IA, "outside the vocabulary (size 512)"),
    ("token-id-negative", req([-1]), IA, "outside the vocabulary"),
    ("token-id-int32-max", req([2**31 - 1]), IA, "outside the vocabulary"),
    ("too-long", req([5] * 1000, max_tokens=100), IA, "exceeds max_model_len (1024)"),
    ("no-room", req([5] * 1024, max_tokens=None), IA, "no room to generate"),
    ("max-tokens-int32-max", req([5], max_tokens=2**31 - 1), IA, "exceeds max_model_len"),
    ("max-tokens-negative", req([5], max_tokens=-1), IA, "max_tokens must be >= 1"),
    ("max-tokens-zero", req([5], max_tokens=0), IA, "max_tokens must be >= 1"),
    ("temperature-negative", req([5], temperature=-1), IA, "temperature must be >= 0"),
    ("temperature-nan", req([5], temperature=NAN), IA, "temperature must be a finite number"),
    ("temperature-inf", req([5], temperature=INF), IA, "temperature must be a finite number"),
    ("top-p-zero", req([5], top_p=0.0), IA, "top_p must be in (0, 1]"),
    ("top-p-nan", req([5], top_p=NAN), IA, "top_p must be a finite number"),
    ("top-k-negative", req([5], top_k=-5), IA, "top_k must be >= 0"),
    ("min-p-above-one", req([5], min_p=1.5), IA, "min_p must be in [0, 1]"),
    ("repetition-penalty-negative", req([5], repetition_penalty=-1), IA, "repetition_penalty must be > 0"),
    ("presence-penalty-nan", req([5], presence_penalty=NAN), IA, "presence_penalty must be a finite"),
    ("frequency-penalty-inf", req([5], frequency_penalty=-INF), IA, "frequency_penalty must be a finite"),
    ("logprobs-negative", req([5], logprobs=-1), IA, "logprobs must be >= 0"),
    ("logprobs-above-vocab", req([5], logprobs=1_000_000), IA, "exceeds the vocabulary size (512)"),
    (
        "logprobs-above-max",
        req([5], logprobs=21),
        IA,
        "exceeds max_logprobs (20; the scheduler's --max-logprobs)",
    ),
    ("stop-token-id-vocab", req([5], stop_token_ids=[600]), IA, "outside the vocabulary"),
    ("stop-token-id-negative", req([5], stop_token_ids=[-3]), IA, "stop_token_ids[0] must be >= 0"),
    ("too-many-stop-strings", req([5], stop=["x"] * 65), IA, "at most 64 stop strings"),
    ("stop-string-too-long", req([5], stop=["y" * 2000]), IA, "at most 1024"),
    ("request-id-too-long", pb.GenerateRequest(text="a", request_id="r" * 1000), IA, "at most 256"),
    (
        "request-id-newline",  # (logged as it is: it would forge a log line)
        pb.GenerateRequest(text="a", request_id="r1\nINFO forged"),
        IA,
        "not printable ('\\n') at position 2",
    ),
    ("text-too-long", req("word " * 40_000), IA, "exceeds max_model_len"),
    ("invalid-utf8", _raw_text(b"ab\xff\xfe"), IA, "not a valid tandem.v1.GenerateRequest"),
    ("truncated-message", bytes([0x0A, 0x50]) + b"abc", IA, "not a valid tandem.v1.GenerateRequest"),
    ("garbage-bytes", b"\xff\xff\xff\xff", IA, "not a valid tandem.v1.GenerateRequest"),
    (
        "over-message-limit",
        req([300] * (17 * 2**20 // 2)),
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "larger than max",
    ),
    ("unknown-method", ("/tandem.v1.GenerationService/Nope", b""), grpc.StatusCode.UNIMPLEMENTED, ""),
    ("unknown-service", ("/tandem.v9.Nothing/Generate", b""), grpc.StatusCode.UNIMPLEMENTED, ""),
]


@pytest.fixture(scope="module")
def scheduler(qwen3_tied):
    thread = ServerThread(make_server(qwen3_tied))
    server = thread.start()
    channel = grpc.insecure_channel(
        f"127.0.0.1:{server.port}", options=[("grpc.max_send_message_length", 64 * 2**20)]
    )
    wait_serving(channel)
    yield server, channel
    channel.close()
    thread.stop()


def _raw(channel: grpc.Channel, method: str = GENERATE):
    return channel.unary_stream(
        method, request_serializer=lambda b: b, response_deserializer=pb.GenerateResponse.FromString
    )


def good_request_works(channel: grpc.Channel) -> None:
    stub = pb_grpc.GenerationServiceStub(channel)
    responses = list(stub.Generate(req([7, 8, 9], max_tokens=3, ignore_eos=True), timeout=30))
    ids = [t for r in responses if r.WhichOneof("payload") == "chunk" for t in r.chunk.token_ids]
    assert len(ids) == 3 and responses[-1].final.finish_reason == pb.FINISH_REASON_LENGTH


@pytest.mark.parametrize(
    ("case", "bad", "code", "message"), SCHEDULER_CATALOG, ids=[c[0] for c in SCHEDULER_CATALOG]
)
def test_scheduler_catalog(scheduler, case, bad, code, message):
    _, channel = scheduler
    if isinstance(bad, tuple):
        call = _raw(channel, bad[0])(bad[1], timeout=30)
    elif isinstance(bad, bytes):
        call = _raw(channel)(bad, timeout=30)
    else:
        call = pb_grpc.GenerationServiceStub(channel).Generate(bad, timeout=30)
    with pytest.raises(grpc.RpcError) as e:
        list(call)
    assert e.value.code() == code, f"{case}: {e.value.code()} {e.value.details()}"
    assert message in (e.value.details() or ""), e.value.details()
    good_request_works(channel)


def test_a_call_without_its_request_is_invalid_argument(scheduler):
    """A client that closes its request stream before sending the GenerateRequest (a stream-request
    call, or a proxy that lost the message) got RESOURCE_EXHAUSTED, "requests are limited to 16777216
    bytes": the code of a request gRPC refused for its size, which also arrives as no message. Now it
    is INVALID_ARGUMENT saying the request is missing, counted as such; a request over the size limit
    is still RESOURCE_EXHAUSTED and counted so, and the service serves the next request."""
    server, channel = scheduler
    failed = "tandem_scheduler_requests_failed_total"
    before = metrics(server)
    without = channel.stream_stream(
        GENERATE, request_serializer=lambda b: b, response_deserializer=pb.GenerateResponse.FromString
    )
    with pytest.raises(grpc.RpcError) as e:
        list(without(iter([]), timeout=30))
    assert e.value.code() == IA, e.value.details()
    assert e.value.details() == (
        "no GenerateRequest arrived: the client closed the request stream before sending one (a "
        "Generate call sends exactly one GenerateRequest)"
    )
    with pytest.raises(grpc.RpcError) as e:
        list(pb_grpc.GenerationServiceStub(channel).Generate(req([300] * (17 * 2**20 // 2)), timeout=30))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.value.details()
    counted = {code: (failed, ("code", code)) for code in ("INVALID_ARGUMENT", "RESOURCE_EXHAUSTED")}
    deadline = time.monotonic() + 5  # (the refusal for size is counted once gRPC cancels its handler)
    while any(metrics(server).get(k, 0) - before.get(k, 0) != 1 for k in counted.values()):
        assert time.monotonic() < deadline, {
            c: metrics(server).get(k, 0) - before.get(k, 0) for c, k in counted.items()
        }
        time.sleep(0.05)
    good_request_works(channel)


def test_get_model_info_refuses_undecodable_bytes_as_invalid_argument(scheduler):
    _, channel = scheduler
    info = channel.unary_unary(
        "/tandem.v1.GenerationService/GetModelInfo",
        request_serializer=lambda b: b,
        response_deserializer=pb.GetModelInfoResponse.FromString,
    )
    with pytest.raises(grpc.RpcError) as e:
        info(b"\xff\xff\xff\xff", timeout=30)
    assert e.value.code() == IA, e.value.details()
    assert "not a valid tandem.v1.GetModelInfoRequest (4 bytes)" in e.value.details()
    assert info(b"", timeout=30).vocab_size == 512


# -- executor Step stream ------------------------------------------------------------------------

EXEC_BLOCKS = 64


@pytest.fixture(scope="module")
def executor_stub(qwen3_tied):
    server = ExecutorServer("127.0.0.1", 0)
    server.start()
    config = ExecutorConfig(
        model=str(qwen3_tied), num_kv_blocks=EXEC_BLOCKS, max_num_seqs=64, max_num_batched_tokens=512
    )
    server.set_executor(LocalExecutor(config))
    channel = grpc.insecure_channel(server.address)
    yield epb_grpc.ExecutorServiceStub(channel)
    channel.close()
    server.stop(1.0)


_step_ids = iter(range(1, 10**9))


def _new(seq_id: int, tokens: list[int], blocks: list[int], **params) -> NewSequence:
    return NewSequence(seq_id, tokens, blocks, 0, StepSamplingParams(num_prompt_tokens=len(tokens), **params))


def _plan(new_seqs=(), seq_ids=(), scheduled=(), computed=(), new_blocks=(), num_new=None, **kw) -> StepPlan:
    return StepPlan(
        step_id=next(_step_ids),
        new_seqs=list(new_seqs),
        seq_ids=list(seq_ids),
        num_scheduled_tokens=list(scheduled),
        num_computed_tokens=list(computed),
        new_block_ids=list(new_blocks),
        num_new_blocks=list(num_new if num_new is not None else [0] * len(seq_ids)),
        **kw,
    )


def _prefill(seq_id: int, tokens: list[int], blocks: list[int], **params) -> StepPlan:
    return _plan([_new(seq_id, tokens, blocks, **params)], [seq_id], [len(tokens)], [0])


def _run(stub, plans: list[StepPlan]) -> list[epb.StepResult]:
    return list(stub.Step(iter([plan_to_proto(p) for p in plans]), timeout=30))


def _drop(stub, *seq_ids: int) -> None:
    _run(stub, [_plan(finished_seq_ids=list(seq_ids))])


# (name, the plans sent on one stream: all but the last are good, the last is bad)
EXECUTOR_CATALOG: list[tuple[str, Callable[[], list[StepPlan]]]] = [
    ("unknown-seq-id", lambda: [_plan(seq_ids=[424242], scheduled=[1], computed=[0])]),
    ("block-out-of-range", lambda: [_prefill(1, [5, 6], [EXEC_BLOCKS])]),
    ("block-negative", lambda: [_prefill(1, [5, 6], [-1])]),
    ("duplicate-seq-ids", lambda: [_plan([_new(1, [5], [0])], [1, 1], [1, 1], [0, 0])]),
    ("duplicate-new-seqs", lambda: [_plan([_new(1, [5], [0]), _new(1, [6], [1])], [1], [1], [0])]),
    ("zero-tokens", lambda: [_plan([_new(1, [5], [0])], [1], [0], [0])]),
    ("negative-tokens", lambda: [_plan([_new(1, [5], [0])], [1], [-4], [0])]),
    ("mismatched-columns", lambda: [_plan([_new(1, [5], [0])], [1], [1, 1], [0])]),
    ("new-blocks-mismatch", lambda: [_plan([_new(1, [5], [0])], [1], [1], [0], new_blocks=[3], num_new=[0])]),
    ("token-outside-vocab", lambda: [_prefill(1, [5, 999], [0])]),
    ("computed-mismatch", lambda: [_plan([_new(1, [5, 6], [0])], [1], [1], [1])]),
    ("beyond-known-tokens", lambda: [_plan([_new(1, [5, 6], [0])], [1], [5], [0])]),
    ("over-batched-tokens", lambda: [_prefill(1, [5] * 1000, list(range(63)))]),
    ("new-seq-already-held", lambda: [_prefill(1, [5, 6], [0]), _prefill(1, [5, 6], [1])]),
    ("empty-new-seq", lambda: [_plan([_new(1, [], [0])], [1], [1], [0])]),
    ("too-few-blocks", lambda: [_prefill(1, [5] * 40, [0, 1])]),
    ("nan-temperature", lambda: [_prefill(1, [5, 6], [0], temperature=NAN)]),
    ("logprobs-above-vocab", lambda: [_prefill(1, [5, 6], [0], logprobs=10_000)]),
    ("negative-computed", lambda: [_plan([_new(1, [5, 6], [0])], [1], [1], [-1])]),
]


@pytest.mark.parametrize(("case", "plans"), EXECUTOR_CATALOG, ids=[c[0] for c in EXECUTOR_CATALOG])
def test_executor_step_catalog(executor_stub, case, plans):
    plans = plans()
    stub = executor_stub
    stub.Reset(epb.ResetRequest(), timeout=10)
    results = []
    with pytest.raises(grpc.RpcError) as e:
        for r in stub.Step(iter([plan_to_proto(p) for p in plans]), timeout=30):
            results.append(r)
    assert e.value.code() == IA, f"{case}: {e.value.code()} {e.value.details()}"
    assert len(results) == len(plans) - 1  # the good plans before the bad one ran
    assert f"step {plans[-1].step_id}" in e.value.details()
    # The executor stays up and serves the next good plan on a new stream.
    stub.Reset(epb.ResetRequest(), timeout=10)
    out = _run(stub, [_prefill(7, [5, 6, 7], [2])])
    assert list(out[0].seq_ids) == [7] and len(out[0].token_ids) == 1
    _drop(stub, 7)


def test_catalog_has_at_least_30_cases():
    assert len(SCHEDULER_CATALOG) + len(EXECUTOR_CATALOG) >= 30


# -- hypothesis ------------------------------------------------------------------------------------

floats = st.floats(allow_nan=True, allow_infinity=True, width=32)
int32 = st.integers(-(2**31), 2**31 - 1)
token_lists = st.one_of(
    st.lists(st.integers(-5, 600), max_size=40),
    st.lists(int32, max_size=10),
    # Huge lists: up to 200k ids (800 KB on the wire).
    st.tuples(st.integers(0, 200_000), st.integers(-1, 520)).map(lambda t: [t[1]] * t[0]),
)
sampling = st.builds(
    pb.SamplingParams,
    max_tokens=st.one_of(st.none(), int32, st.integers(-2, 8)),
    temperature=st.one_of(floats, st.just(0.0)),
    top_k=st.one_of(int32, st.integers(0, 600)),
    top_p=st.one_of(st.none(), floats, st.floats(0.01, 1.0)),
    min_p=st.one_of(floats, st.just(0.0)),
    seed=st.one_of(st.none(), st.integers(0, 2**64 - 1)),
    stop=st.lists(st.text(max_size=20), max_size=80),
    stop_token_ids=st.lists(st.one_of(int32, st.integers(0, 511)), max_size=20),
    ignore_eos=st.booleans(),
    repetition_penalty=st.one_of(st.none(), floats),
    presence_penalty=st.one_of(floats, st.just(0.0)),
    frequency_penalty=st.one_of(floats, st.just(0.0)),
    logprobs=st.one_of(st.integers(-3, 8), int32),
)
prompts = st.one_of(
    st.text(max_size=300).map(lambda t: {"text": t}),
    token_lists.map(lambda ids: {"token_ids": pb.TokenIds(ids=ids)}),
    st.just({}),
)
requests = st.builds(
    lambda prompt, params, rid: pb.GenerateRequest(**prompt, sampling_params=params, request_id=rid),
    prompts,
    sampling,
    st.text(max_size=300),
)


def _check_call(call) -> str:
    """Read at most a few responses (a valid request may generate for long), then cancel.
    Returns the outcome: a status code name, or "stream"."""
    try:
        for i, response in enumerate(call):
            assert response.WhichOneof("payload") in ("chunk", "final")
            if i == 2:
                call.cancel()
                return "stream"
        return "stream"
    except grpc.RpcError as e:
        if e.code() == grpc.StatusCode.CANCELLED and call.cancelled():
            return "stream"
        assert e.code() in CLIENT_ERRORS, f"{e.code()}: {e.details()}"
        return e.code().name


@settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
    ],
)
@given(request=requests)
def test_random_requests_get_a_status_code_or_a_stream(scheduler, request):
    _, channel = scheduler
    stub = pb_grpc.GenerationServiceStub(channel)
    _check_call(stub.Generate(request, timeout=30))
    good_request_works(channel)


@settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    data=st.one_of(
        st.binary(max_size=400),
        # A valid request with some of its bytes overwritten.
        st.tuples(
            st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), min_size=1, max_size=6),
            st.sampled_from([req("The list type"), req([5, 6, 7], stop=["ab"], logprobs=2)]),
        ).map(lambda t: _mutate(t[1].SerializeToString(), t[0])),
    )
)
def test_malformed_bytes_get_a_status_code_or_a_stream(scheduler, data):
    _, channel = scheduler
    _check_call(_raw(channel)(data, timeout=30))
    good_request_works(channel)


def _mutate(data: bytes, edits: list[tuple[int, int]]) -> bytes:
    out = bytearray(data)
    for pos, value in edits:
        out[pos % len(out)] = value
    return bytes(out)


def test_the_service_still_serves_after_the_fuzzing(scheduler):
    server, channel = scheduler
    good_request_works(channel)
    assert server.engine.engine is not None
