"""The scheduler service in-process over a LocalExecutor, through the generated gRPC stubs."""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2
from helpers.scheduler_server import (
    MAX_NEW,
    NUM_KV_BLOCKS,
    FlakyExecutor,
    collect,
    make_server,
    metrics,
    request,
    wait_idle,
    wait_serving,
)

from client.llm import LLM
from protos.tandem.v1 import generation_pb2 as pb
from protos.tandem.v1 import generation_pb2_grpc as pb_grpc
from scheduler_service.async_engine import EngineOptions
from scheduler_service.config import SchedulerConfig
from scheduler_service.sampling_params import SamplingParams
from scheduler_service.server import ServerThread
from scheduler_service.tokenizer import tokenizer_resolver


@pytest.fixture(scope="module")
def service(qwen3_tied):
    thread = ServerThread(make_server(qwen3_tied))
    server = thread.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    wait_serving(channel)
    yield server, pb_grpc.GenerationServiceStub(channel)
    channel.close()
    thread.stop()


@pytest.fixture(scope="module")
def reference(qwen3_tied):
    return LLM(str(qwen3_tied), num_kv_blocks=NUM_KV_BLOCKS)


PROMPTS = [
    "The list type",
    "def f(x):",
    "Exceptions are",
    "import",
    *[[random.Random(i).randrange(2, 400) for _ in range(3 + 5 * i)] for i in range(6)],
    "class A:\n    pass\n",
    "for i in range(10):",
    "The with statement",
    "yield",
    "lambda",
    "async def",
]


def test_sixteen_concurrent_streams_match_the_offline_llm(service, reference):
    server, stub = service
    expected = reference.generate(PROMPTS, SamplingParams(max_tokens=MAX_NEW), use_tqdm=False)
    before = metrics(server)
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        results = list(pool.map(lambda p: collect(stub.Generate(request(p))), PROMPTS))
    received = 0
    for prompt, exp, (ids, texts, final, _) in zip(PROMPTS, expected, results, strict=True):
        assert ids == exp.token_ids, prompt
        assert "".join(texts) == exp.text == reference.tokenizer.decode(ids)
        reason = pb.FINISH_REASON_LENGTH if exp.finish_reason == "length" else pb.FINISH_REASON_STOP
        assert final.finish_reason == reason
        assert (final.prompt_tokens, final.completion_tokens) == (len(exp.prompt_token_ids), len(ids))
        received += len(ids)
    after = wait_idle(server)
    gen = ("tandem_scheduler_generation_tokens_total",)
    assert after[gen] - before[gen] == received
    stop = ("tandem_scheduler_requests_finished_total", ("reason", "stop"))
    length = ("tandem_scheduler_requests_finished_total", ("reason", "length"))
    assert after[stop] + after[length] - before.get(stop, 0) - before.get(length, 0) == len(PROMPTS)
    assert after[("tandem_scheduler_time_to_first_token_seconds_count",)] >= len(PROMPTS)
    assert after[("tandem_scheduler_executor_up",)] == 1
    prompt_sum = ("tandem_scheduler_request_prompt_tokens_sum",)
    assert after[prompt_sum] - before.get(prompt_sum, 0) == sum(len(e.prompt_token_ids) for e in expected)
    generated = ("tandem_scheduler_request_generation_tokens_sum",)
    assert after[generated] - before.get(generated, 0) == received
    [(labels, value)] = [(k[1:], v) for k, v in after.items() if k[0] == "tandem_scheduler_info"]
    assert value == 1 and ("model_name", reference.executor.describe().model) in labels


BAD_REQUESTS = [
    (pb.GenerateRequest(text=""), "prompt is empty"),
    (pb.GenerateRequest(), "prompt is empty"),
    (request([5, 512]), "outside the vocabulary (size 512)"),
    (request([-1]), "outside the vocabulary (size 512)"),
    (request([5] * 1000, max_tokens=100), "exceeds max_model_len (1024)"),
    (request([5] * 1024, max_tokens=None), "no room to generate within max_model_len (1024)"),
    (request([5], max_tokens=0), "max_tokens must be >= 1"),
    (request([5], temperature=-0.5), "temperature must be >= 0"),
    (request([5], temperature=float("nan")), "temperature must be a finite number"),
    (request([5], top_p=0.0), "top_p must be in (0, 1]"),
    (request([5], top_p=1.5), "top_p must be in (0, 1]"),
    (request([5], top_k=-2), "top_k must be >= 0 (0 or -1 disables it)"),
    (request([5], max_tokens=-3), "max_tokens must be >= 1"),
    (request([5], min_p=2.0), "min_p must be in [0, 1]"),
    (request([5], repetition_penalty=0.0), "repetition_penalty must be > 0"),
    (request([5], stop_token_ids=[600]), "stop_token_ids[0] = 600 is outside the vocabulary"),
    (request([5], logprobs=-1), "logprobs must be >= 0"),
]


def test_bad_requests_are_invalid_argument_and_the_next_request_works(service):
    server, stub = service
    for bad, message in BAD_REQUESTS:
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(bad))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, message
        assert message in e.value.details()
        ids, _, final, _ = collect(stub.Generate(request([7, 8, 9], max_tokens=2)))
        assert len(ids) == 2 and final.finish_reason == pb.FINISH_REASON_LENGTH
    failed = metrics(server)[("tandem_scheduler_requests_failed_total", ("code", "INVALID_ARGUMENT"))]
    assert failed >= len(BAD_REQUESTS)


def test_unknown_fields_are_ignored_and_request_id_is_echoed(service, reference):
    server, stub = service
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    raw = channel.unary_stream(
        "/tandem.v1.GenerationService/Generate",
        request_serializer=lambda b: b,
        response_deserializer=pb.GenerateResponse.FromString,
    )
    msg = request([11, 12, 13], max_tokens=4)
    msg.request_id = "mine-1"
    # Field 99, varint 5, then field 100, length-delimited "hi": unknown to this server.
    data = msg.SerializeToString() + bytes([0x98, 0x06, 0x05, 0xA2, 0x06, 0x02]) + b"hi"
    responses = list(raw(data))
    assert {r.request_id for r in responses} == {"mine-1"}
    ids, _, _, _ = collect(responses)
    assert (
        ids == reference.generate([[11, 12, 13]], SamplingParams(max_tokens=4), use_tqdm=False)[0].token_ids
    )
    generated = {r.request_id for r in stub.Generate(request([11], max_tokens=1))}
    assert len(generated) == 1 and generated != {""}
    channel.close()


def test_cancelling_half_the_streams_leaves_the_others_correct(service, reference):
    server, stub = service
    prompts = [[random.Random(100 + i).randrange(2, 400) for _ in range(4 + 3 * i)] for i in range(8)]
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    expected = reference.generate(prompts, params, use_tqdm=False)
    before = metrics(server)[("tandem_scheduler_generation_tokens_total",)]
    # The cancelled ones would run for long (900 tokens) if they were not aborted.
    calls = [
        stub.Generate(request(p, max_tokens=900 if i % 2 == 0 else 64, ignore_eos=True))
        for i, p in enumerate(prompts)
    ]
    for call in calls[::2]:
        next(call)  # started and streaming
        call.cancel()
    for call, exp in zip(calls[1::2], expected[1::2]):
        ids, _, final, _ = collect(call)
        assert ids == exp.token_ids and final.completion_tokens == 64
    for call in calls[::2]:
        assert call.code() == grpc.StatusCode.CANCELLED
    after = wait_idle(server, timeout=2.0)
    assert after[("tandem_scheduler_generation_tokens_total",)] - before < 4 * 64 + 4 * 200
    assert after[("tandem_scheduler_kv_cache_blocks_used",)] == 0
    assert after[("tandem_scheduler_kv_cache_blocks_total",)] == NUM_KV_BLOCKS
    assert after[("tandem_scheduler_requests_failed_total", ("code", "CANCELLED"))] >= 4


def test_deadline_aborts_the_request(service):
    server, stub = service
    call = stub.Generate(request([21, 22], max_tokens=1000, ignore_eos=True), timeout=1.0)
    next(call)  # admitted and streaming when the deadline passes
    with pytest.raises(grpc.RpcError) as e:
        list(call)
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    after = wait_idle(server, timeout=2.0)
    assert after[("tandem_scheduler_requests_failed_total", ("code", "DEADLINE_EXCEEDED"))] == 1


def test_stop_strings_and_stop_token_ids(service, reference):
    _, stub = service
    prompt = "The list type"
    full = reference.generate([prompt], SamplingParams(max_tokens=MAX_NEW), use_tqdm=False)[0]
    # A stop string that spans a token boundary, starting in the middle of the output.
    pieces = [reference.tokenizer.decode([t]) for t in full.token_ids]
    start = len("".join(pieces[:5])) + len(pieces[5]) - 1
    stop = full.text[start : start + 3]
    ids, texts, final, _ = collect(stub.Generate(request(prompt, stop=[stop, "never seen"])))
    cut = full.text.find(stop)
    assert "".join(texts) == full.text[:cut]
    assert (final.finish_reason, final.stop_reason) == (pb.FINISH_REASON_STOP, stop)
    assert ids == full.token_ids[: len(ids)] and stop in reference.tokenizer.decode(ids)
    assert final.completion_tokens == len(ids)

    token = full.token_ids[6]
    ids, _, final, _ = collect(stub.Generate(request(prompt, stop_token_ids=[token])))
    assert ids == full.token_ids[: full.token_ids.index(token) + 1]
    assert (final.finish_reason, final.stop_reason) == (pb.FINISH_REASON_STOP, str(token))


def test_model_info_and_logprobs(service):
    _, stub = service
    info = stub.GetModelInfo(pb.GetModelInfoRequest())
    assert (info.vocab_size, info.max_model_len, info.num_kv_blocks, info.block_size) == (512, 1024, 256, 16)
    ids, _, _, _ = collect(stub.Generate(request([3, 4, 5], max_tokens=3, logprobs=2)))
    chunks = [
        r.chunk for r in stub.Generate(request([3, 4, 5], max_tokens=3, logprobs=2)) if r.chunk.token_ids
    ]
    logprobs = [lp for c in chunks for lp in c.logprobs]
    assert [lp.token_id for lp in logprobs] == ids
    assert all(len(lp.top_logprobs) == 2 and lp.logprob <= 0 for lp in logprobs)
    # logprobs=0, as offline and over HTTP: each token's own logprob, no alternatives; unset: none.
    own = [lp for r in stub.Generate(request([3, 4, 5], max_tokens=3, logprobs=0)) for lp in r.chunk.logprobs]
    assert [lp.token_id for lp in own] == ids and not any(lp.top_logprobs for lp in own)
    assert [lp.logprob for lp in own] == [lp.logprob for lp in logprobs]
    assert not [lp for r in stub.Generate(request([3, 4, 5], max_tokens=3)) for lp in r.chunk.logprobs]


def test_queue_limit_and_stream_interval(qwen3_tied):
    server = make_server(qwen3_tied, max_num_seqs=1, max_queue=1, stream_interval=4)
    with ServerThread(server):
        channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
        wait_serving(channel)
        stub = pb_grpc.GenerationServiceStub(channel)
        running = stub.Generate(request([5, 6], max_tokens=600, ignore_eos=True))
        next(running)
        waiting = stub.Generate(request([7, 8], max_tokens=9, ignore_eos=True))
        deadline = time.monotonic() + 5
        while len(server.engine.streams) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(request([9], max_tokens=2)))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-queue 1" in e.value.details()
        running.cancel()
        ids, _, _, sizes = collect(waiting)
        assert len(ids) == 9 and all(n >= 4 for n in sizes[:-1])
        channel.close()


def test_health_follows_the_executor_and_a_rejected_plan_fails_only_its_requests(qwen3_tied):
    executor = FlakyExecutor(qwen3_tied)
    options = EngineOptions(
        SchedulerConfig(), executor_address="flaky:1", heartbeat_s=0.1, backoff_min_s=0.02, backoff_max_s=0.05
    )
    server = make_server(qwen3_tied, executor, options=options)
    with ServerThread(server):
        channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
        stub = pb_grpc.GenerationServiceStub(channel)
        wait_serving(channel, want=health_pb2.HealthCheckResponse.NOT_SERVING)
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(request([5])))
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "flaky:1" in e.value.details()
        assert metrics(server)[("tandem_scheduler_executor_up",)] == 0

        executor.up.set()
        wait_serving(channel)
        # The rejected plan holds the poisoned request and the running one: both fail, and the
        # executor (which validates every plan against its own state) keeps accepting the next.
        running = stub.Generate(request([5, 6, 7], max_tokens=500, ignore_eos=True))
        next(running)
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(request([FlakyExecutor.POISON, 5])))
        assert e.value.code() == grpc.StatusCode.INTERNAL and "rejected step" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            list(running)
        assert e.value.code() == grpc.StatusCode.INTERNAL
        ids, _, final, _ = collect(stub.Generate(request([5, 6], max_tokens=5, ignore_eos=True)))
        assert len(ids) == 5 and final.finish_reason == pb.FINISH_REASON_LENGTH
        assert len(executor.inner.seqs) <= 1  # the running one was dropped by a later plan
        assert metrics(server)[("tandem_scheduler_requests_failed_total", ("code", "INTERNAL"))] == 2

        # The executor dies mid-stream: NOT_SERVING and new requests refused (UNAVAILABLE naming
        # it) until it is back; the accepted request is kept and finishes (tests/test_reliability.py).
        running = stub.Generate(request([5, 6, 7], max_tokens=40, ignore_eos=True))
        first = next(running).chunk.token_ids  # one token, or more if the stream fell behind
        executor.up.clear()
        wait_serving(channel, want=health_pb2.HealthCheckResponse.NOT_SERVING)
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(request([5])))
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "flaky:1" in e.value.details()
        executor.up.set()
        ids, _, final, _ = collect(running)
        assert len(first) + len(ids) == 40 and final.finish_reason == pb.FINISH_REASON_LENGTH
        wait_serving(channel)
        # It goes away while idle: the heartbeat notices.
        executor.up.clear()
        wait_serving(channel, want=health_pb2.HealthCheckResponse.NOT_SERVING)
        executor.up.set()
        wait_serving(channel)
        assert len(collect(stub.Generate(request([5, 6], max_tokens=3)))[0]) == 3
        channel.close()


def test_without_a_tokenizer_text_prompts_are_refused_and_ids_stream(qwen3_tied):
    server = make_server(qwen3_tied)
    server.engine.tokenizer_for = lambda info: None
    with ServerThread(server):
        channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
        wait_serving(channel)
        stub = pb_grpc.GenerationServiceStub(channel)
        for bad in (pb.GenerateRequest(text="hello"), request([5], stop=["x"])):
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Generate(bad))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "no tokenizer: send token ids or start it with --tokenizer" in e.value.details()
        ids, texts, _, _ = collect(stub.Generate(request([5, 6], max_tokens=4, ignore_eos=True)))
        assert len(ids) == 4 and set(texts) == {""}
        channel.close()


def test_cli_flags_have_environment_twins(monkeypatch):
    import argparse

    from scheduler_service import cli

    monkeypatch.setenv("TANDEM_EXECUTOR_ADDRESS", "10.0.0.2:7000")
    monkeypatch.setenv("TANDEM_MAX_QUEUE", "12")
    parser = argparse.ArgumentParser()
    cli.add_parser(parser.add_subparsers())
    args = parser.parse_args(["scheduler", "--stream-interval", "3"])
    assert (args.executor, args.max_queue, args.stream_interval, args.port) == ("10.0.0.2:7000", 12, 3, 50051)
    assert (args.host, args.metrics_port, args.tokenizer) == ("127.0.0.1", 9101, None)
    assert args.func is cli.run
    args.stream_interval = 0
    assert cli.run(args) == 2  # refused before anything starts
    embedded = tokenizer_resolver(None)
    assert embedded(_info("tandem-tiny-pydoc")) is not None
    assert embedded(_info("some-other-model")) is None


def test_a_tokenizer_json_that_does_not_load_is_a_one_line_error(tmp_path, monkeypatch, capsys):
    """tokenizers' own bare Exception ("Model missing. at line 1 column 2") was a traceback of
    `tandem scheduler --tokenizer DIR`, and of LLM(..., tokenizer=DIR) and tandem generate --model."""
    import argparse

    from scheduler_service import cli
    from scheduler_service.tokenizer import Tokenizer

    for text in ("{}", "not json"):
        (tmp_path / "tokenizer.json").write_text(text)
        with pytest.raises(ValueError, match=f"cannot load the tokenizer {tmp_path / 'tokenizer.json'}: "):
            Tokenizer(tmp_path)
    monkeypatch.delenv("TANDEM_API_SERVER_COUNT", raising=False)
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(["--executor", "127.0.0.1:1", "--tokenizer", str(tmp_path)])
    assert cli.run(args) == 2
    assert "error: cannot load the tokenizer" in capsys.readouterr().err


def _info(model: str):
    from protos.plan import ExecutorInfo

    return ExecutorInfo(model, "Qwen3", 16, 64, 1024, 512, [0], 1, "float32", "cpu", 8, 64, "torch", 1, 1)


def test_http_requests_refused_while_the_executor_is_away_are_counted(qwen3_tied):
    """An HTTP request refused (503) while no executor is connected counts in
    tandem_scheduler_requests_failed_total{code="UNAVAILABLE"}, as the same gRPC refusal does."""
    import httpx

    options = EngineOptions(
        SchedulerConfig(), executor_address="flaky:1", backoff_min_s=0.02, backoff_max_s=0.05
    )
    server = make_server(qwen3_tied, FlakyExecutor(qwen3_tied), options=options, http_port=0)
    with ServerThread(server):
        channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
        wait_serving(channel, want=health_pb2.HealthCheckResponse.NOT_SERVING)
        with pytest.raises(grpc.RpcError):
            list(pb_grpc.GenerationServiceStub(channel).Generate(request([5])))
        response = httpx.post(
            f"http://127.0.0.1:{server.http_port}/v1/completions",
            json={"prompt": "The list type"},
            timeout=10,
        )
        assert response.status_code == 503
        assert metrics(server)[("tandem_scheduler_requests_failed_total", ("code", "UNAVAILABLE"))] == 2
        channel.close()


def test_shutdown_drains_a_request_whose_admission_is_still_on_its_way():
    """An API server (--api-server-count N) has a request's streams only once the engine core's
    admission comes back; SIGTERM in between must drain that request too, not cut it off."""
    import asyncio

    from scheduler_service.server import SchedulerServer

    class Engine:  # an API server's engine: one request admitted by the core, its answer in transit
        def __init__(self, metrics, on_health) -> None:
            self.metrics = metrics
            self.streams: list[str] = []
            self.num_pending_admissions = 1
            self.aborted = 0

        def stop_admitting(self) -> None:
            pass

        def abort_all(self, failure) -> int:
            self.aborted += len(self.streams)
            return len(self.streams)

        async def aclose(self) -> None:
            pass

        async def run(self) -> None:
            await asyncio.sleep(0.2)  # the core's "added" arrives
            self.num_pending_admissions, self.streams = 0, ["its stream"]
            await asyncio.sleep(0.2)  # it finishes
            self.streams = []

    async def main() -> tuple[bool, int]:
        server = SchedulerServer(engine_factory=Engine)
        request = asyncio.create_task(server.engine.run())
        await server.stop(grace=10.0)
        return request.done(), server.engine.aborted

    finished_before_stop, aborted = asyncio.run(main())
    assert finished_before_stop, "the server stopped before the request it had sent for admission ran"
    assert aborted == 0
