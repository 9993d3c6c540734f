"""Reasoning and tool calls through the HTTP API, whole and streamed: an in-process scheduler whose
fake executor writes a scripted answer (Qwen3's `<think>` block, then Hermes tool calls), talked to
with the official `openai` client; and a client that goes away mid-request frees its blocks."""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import ssl
import time

import grpc
import httpx
import openai
import pytest
from helpers.chat_checkpoint import chat_checkpoint
from helpers.fake_executor import ScriptedExecutor
from helpers.scheduler_server import wait_http_health

from client import AsyncTandemClient, Chunk, TandemClient
from client.messages import Completion, CompletionBuilder, chat_request
from protos.tandem.v1 import generation_pb2 as pb
from protos.tandem.v1 import generation_pb2_grpc as pb_grpc
from scheduler_service.async_engine import EngineOptions
from scheduler_service.config import SchedulerConfig
from scheduler_service.server import SchedulerServer, ServerThread
from scheduler_service.tokenizer import Tokenizer

ANSWER = (
    "<think>\nThe user wants the weather.\n</think>\n\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "°C"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'
)
TOOLS = [
    {"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": {}}}}
    for name in ("get_weather", "get_time")
]
MESSAGES = [{"role": "user", "content": "Weather and time in Paris?"}]


def _server(checkpoint, slow=0.0, pause=0.0, **kwargs):
    tokenizer = Tokenizer(checkpoint)
    script = tokenizer.encode(ANSWER, add_special_tokens=False)
    executor = ScriptedExecutor(script, eos=0, vocab_size=tokenizer.vocab_size, slow=slow, pause=pause)
    options = EngineOptions(SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=1024))
    server = SchedulerServer(
        executor, options, tokenizer_for=lambda info: tokenizer, port=0, http_port=0, **kwargs
    )
    return server, executor


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return chat_checkpoint(tmp_path_factory.mktemp("ckpt"))


@pytest.fixture(scope="module")
def server(checkpoint):
    server, _ = _server(checkpoint, pause=0.003)  # a token a step: streams come in pieces
    with ServerThread(server):
        wait_http_health(f"http://127.0.0.1:{server.http_port}")
        yield server


@pytest.fixture(scope="module")
def api(server):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.http_port}/v1", api_key="x", max_retries=0)


def test_reasoning_and_tool_calls_whole(api):
    got = api.chat.completions.create(
        model="fake", messages=MESSAGES, tools=TOOLS, max_tokens=200, temperature=0
    )
    choice = got.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.reasoning_content == "\nThe user wants the weather.\n"
    calls = choice.message.tool_calls
    assert [c.function.name for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0].function.arguments) == {"city": "Paris", "unit": "°C"}
    assert calls[0].id != calls[1].id


def test_reasoning_is_named_as_vllm_names_it_and_as_it_was(server):
    """Current vLLM names the reasoning `reasoning` (message and delta); earlier vLLM (and DeepSeek's
    API) `reasoning_content`, which clients of those read: both are sent, alike. (Only
    reasoning_content was.)"""
    url = f"http://127.0.0.1:{server.http_port}/v1/chat/completions"
    body = {"model": "fake", "messages": MESSAGES, "tools": TOOLS, "max_tokens": 200, "temperature": 0}
    message = httpx.post(url, json=body, timeout=60).json()["choices"][0]["message"]
    assert message["reasoning"] == message["reasoning_content"] == "\nThe user wants the weather.\n"
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: {")]
    deltas = [c["choices"][0]["delta"] for c in map(json.loads, events) if c["choices"]]
    assert all(d.get("reasoning") == d.get("reasoning_content") for d in deltas)
    assert "".join(d.get("reasoning") or "" for d in deltas) == message["reasoning"]


def test_reasoning_and_tool_calls_streamed_equal_the_whole_answer(api):
    chunks = list(
        api.chat.completions.create(
            model="fake", messages=MESSAGES, tools=TOOLS, max_tokens=200, temperature=0, stream=True
        )
    )
    deltas = [c.choices[0] for c in chunks if c.choices]
    assert deltas[0].delta.role == "assistant"
    reasoning = "".join(getattr(d.delta, "reasoning_content", None) or "" for d in deltas)
    assert reasoning == "\nThe user wants the weather.\n"
    # OpenAI's delta format: a call's index, id, type and name first, then fragments of its arguments.
    calls: dict[int, dict] = {}
    for d in deltas:
        for call in d.delta.tool_calls or ():
            if call.id is not None:
                assert call.index not in calls and call.type == "function" and call.function.name
                calls[call.index] = {
                    "id": call.id,
                    "name": call.function.name,
                    "arguments": call.function.arguments,
                }
            else:
                assert call.function.name is None
                calls[call.index]["arguments"] += call.function.arguments
    fragments = sum(1 for d in deltas for call in d.delta.tool_calls or () if call.id is None)
    assert fragments > 2  # the arguments came in pieces
    assert [(i, c["name"]) for i, c in calls.items()] == [(0, "get_weather"), (1, "get_time")]
    whole = api.chat.completions.create(
        model="fake", messages=MESSAGES, tools=TOOLS, max_tokens=200, temperature=0
    )
    assert [c["arguments"] for c in calls.values()] == [
        c.function.arguments for c in whole.choices[0].message.tool_calls
    ]
    assert json.loads(calls[1]["arguments"]) == {"zone": "CET"}
    assert deltas[-1].finish_reason == "tool_calls"


def test_grpc_chat_splits_reasoning_and_tool_calls_as_http_does(api, server):
    whole = api.chat.completions.create(
        model="fake", messages=MESSAGES, tools=TOOLS, max_tokens=200, temperature=0
    )
    with TandemClient(f"127.0.0.1:{server.port}", retries=0) as client:
        items = list(client.chat(MESSAGES, tools=TOOLS, max_tokens=200))
        plain = client.complete("Weather?", max_tokens=200)
    chunks = [i for i in items if isinstance(i, Chunk)]
    builder = CompletionBuilder()
    for item in items:
        builder.add(item)
    got = builder.build()
    message = whole.choices[0].message
    assert got.reasoning_content == message.reasoning_content
    assert got.text == (message.content or "")
    assert [(c.index, c.name, c.arguments) for c in got.tool_calls] == [
        (i, c.function.name, c.function.arguments) for i, c in enumerate(message.tool_calls)
    ]
    assert got.finish_reason == "tool_calls"
    pieces = [c for chunk in chunks for c in chunk.tool_calls]
    assert pieces[0].name == "get_weather" and pieces[0].id and pieces[0].arguments == ""
    assert len(pieces) > 3  # the arguments streamed
    # a text prompt's answer is not split
    assert plain.text.startswith("<think>") and plain.reasoning_content is None and not plain.tool_calls


# A conversation that goes on after the answer's tool calls: the calls, then their results.
TOOL_TURNS = [
    *MESSAGES,
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            },
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
]


def test_grpc_chat_renders_tool_turns_and_text_parts_as_http_does(api, server):
    """The assistant's tool calls reached the template over HTTP but were dropped over gRPC (the
    call's turn rendered empty, its result answering nothing), and OpenAI's list of text parts
    failed in the client with "bad argument type for built-in operation"."""
    parts = [{**m, "content": [{"type": "text", "text": m["content"]}]} for m in MESSAGES]
    with TandemClient(f"127.0.0.1:{server.port}", retries=0) as client:
        for messages in (TOOL_TURNS, parts):
            http = api.chat.completions.create(
                model="fake", messages=messages, tools=TOOLS, max_tokens=1, temperature=0
            )
            final = list(client.chat(messages, tools=TOOLS, max_tokens=1))[-1]
            assert final.prompt_tokens == http.usage.prompt_tokens
        # What a gRPC message cannot carry is refused, not dropped.
        with pytest.raises(ValueError, match="reasoning_content"):
            client.chat([{**MESSAGES[0], "reasoning_content": "x"}])
        with pytest.raises(TypeError, match=r"messages\[0\].content\[0\]"):
            client.chat([{"role": "user", "content": [{"type": "image_url"}]}])


@pytest.mark.parametrize("tool_calls_json", ["[{", '[{"id": "x"}]', '{"function": {}}'])
def test_grpc_chat_bad_tool_calls_are_invalid_argument_naming_the_message(server, tool_calls_json):
    request = chat_request(TOOL_TURNS, max_tokens=1)
    request.chat.messages[1].tool_calls_json = tool_calls_json  # as grpcurl may send it
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel, pytest.raises(grpc.RpcError) as e:
        list(pb_grpc.GenerationServiceStub(channel).Generate(request, timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "chat.messages[1].tool_calls_json" in e.value.details()


def test_the_async_client_chats_as_the_sync_one(server):
    """AsyncTandemClient, "the asyncio twin", has chat() too (a Chat prompt with tools)."""
    address = f"127.0.0.1:{server.port}"
    with TandemClient(address, retries=0) as client:
        expected = list(client.chat(MESSAGES, tools=TOOLS, max_tokens=200, request_id="sync"))

    async def chat():
        async with AsyncTandemClient(address, retries=0) as client:
            return [
                item async for item in client.chat(MESSAGES, tools=TOOLS, max_tokens=200, request_id="sync")
            ]

    def reply(items) -> Completion:
        """The whole reply: how it splits into chunks follows the reader's pace (tokens that wait
        for a slower reader go out together), not the client."""
        builder = CompletionBuilder()
        for item in items:
            builder.add(item)
        whole = builder.build()
        for call in whole.tool_calls:  # (tool call ids are random)
            call.id = bool(call.id)
        return whole

    got, want = reply(asyncio.run(chat())), reply(expected)
    got.cached_tokens = want.cached_tokens  # (the second found the prompt cached)
    assert got == want and got.finish_reason == "tool_calls"


def test_without_tools_the_calls_stay_text(api):
    got = api.chat.completions.create(model="fake", messages=MESSAGES, max_tokens=200, temperature=0)
    assert got.choices[0].message.tool_calls in (None, [])
    assert got.choices[0].message.content.lstrip().startswith("<tool_call>")
    assert got.choices[0].finish_reason == "stop"


def _grpc_chat(server, tools_json: str) -> list[pb.GenerateResponse]:
    request = chat_request(MESSAGES, max_tokens=200)
    request.chat.tools_json = tools_json  # as grpcurl or another language's client may send it
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        return list(pb_grpc.GenerationServiceStub(channel).Generate(request, timeout=30))


@pytest.mark.parametrize("tools_json", ["[]", "null"])
def test_grpc_chat_with_an_empty_tools_array_keeps_the_calls_text(server, tools_json):
    """As HTTP's `tools: []`: no tools, so the answer's <tool_call> blocks are its text."""
    responses = _grpc_chat(server, tools_json)
    text = "".join(r.chunk.text for r in responses if r.WhichOneof("payload") == "chunk")
    assert not [c for r in responses for c in r.chunk.tool_calls]
    assert text.lstrip().startswith("<tool_call>")
    assert responses[-1].final.finish_reason == pb.FINISH_REASON_STOP


@pytest.mark.parametrize("tools_json", [json.dumps(TOOLS[0]), '"get_weather"', "[1, 2]"])
def test_grpc_chat_tools_not_an_array_of_objects_is_invalid_argument(server, tools_json):
    """HTTP's `tools` must be a list of objects (400); a tool object sent alone was rendered into the
    prompt key by key, the template iterating over it."""
    with pytest.raises(grpc.RpcError) as e:
        _grpc_chat(server, tools_json)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "chat.tools_json must be a JSON array of tool objects" in e.value.details()


@pytest.mark.parametrize(
    "tool, named",
    [
        ({}, "[1].function must be an object"),
        ({"type": "function"}, "[1].function must be an object"),
        # (the Responses API's flat shape, sent to chat completions)
        ({"type": "function", "name": "get_time", "parameters": {}}, "[1].function must be an object"),
        ({"type": "function", "function": {"parameters": {}}}, "[1].function.name must be a string"),
        ({"type": "function", "function": {"name": 5}}, "[1].function.name must be a string, got int"),
        (
            {"type": "web_search", "function": {"name": "f"}},
            "[1].type must be \"function\", got 'web_search'",
        ),
        (
            {"function": {"name": "f", "parameters": "{}"}},
            "[1].function.parameters must be an object, got str",
        ),
    ],
)
def test_a_tool_that_is_no_openai_function_tool_is_refused(api, server, tool, named):
    """vLLM refuses these with a 400; they reached the chat template as sent, and the model a
    definition of nothing. Over gRPC, tools_json is checked the same way."""
    with pytest.raises(openai.BadRequestError) as e:
        api.chat.completions.create(model="fake", messages=MESSAGES, tools=[TOOLS[0], tool], max_tokens=2)
    assert e.value.body["message"].startswith("tools" + named), e.value.body
    with pytest.raises(grpc.RpcError) as e:
        _grpc_chat(server, json.dumps([TOOLS[0], tool]))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith("chat.tools_json" + named), e.value.details()
    ok = {"function": {"name": "get_time"}}  # (type may be left out, as vLLM's default)
    got = api.chat.completions.create(model="fake", messages=MESSAGES, tools=[ok], max_tokens=2)
    assert got.choices[0].finish_reason == "length"


@pytest.mark.parametrize("field", ["tools_json", "chat_template_kwargs_json"])
def test_grpc_chat_json_with_an_integer_python_cannot_read_is_invalid_argument(server, field):
    """An integer of more than 4,300 digits is JSON Python refuses (a ValueError that is no
    JSONDecodeError): it was an UNKNOWN status."""
    request = chat_request(MESSAGES, max_tokens=2)
    setattr(request.chat, field, '{"a": ' + "7" * 5000 + "}")
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel, pytest.raises(grpc.RpcError) as e:
        list(pb_grpc.GenerationServiceStub(channel).Generate(request, timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith(f"chat.{field} is not JSON: Exceeds the limit (4300 digits)")


@pytest.mark.parametrize("field", ["tools_json", "chat_template_kwargs_json"])
def test_grpc_chat_json_nested_too_deeply_is_invalid_argument(server, field):
    """JSON nested past the parser's recursion limit was an UNKNOWN status (a RecursionError)."""
    request = chat_request(MESSAGES, max_tokens=2)
    setattr(request.chat, field, '{"a": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(request, timeout=30))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert e.value.details() == f"chat.{field} is nested too deeply"
        served = list(stub.Generate(chat_request(MESSAGES, max_tokens=2), timeout=30))
        assert served[-1].WhichOneof("payload") == "final"


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_goes_away_frees_its_blocks(checkpoint, stream, caplog):
    server, executor = _server(checkpoint, slow=0.01)
    with ServerThread(server) as running:
        url = f"http://127.0.0.1:{running.http_port}"
        wait_http_health(url)
        # 900 tokens at 10 ms a step take 9 s: the request must end well before.
        body = {"model": "fake", "prompt": "hello", "max_tokens": 900, "stream": stream}
        start = time.monotonic()
        if stream:  # a few events, then the connection is closed
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=10) as r:
                lines = r.iter_lines()
                assert next(lines).startswith("data: ")
                next(lines)
        else:  # the client gives up waiting for the whole answer
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(f"{url}/v1/completions", json=body, timeout=0.5)
        while executor.seqs or running.engine.streams:
            assert time.monotonic() < start + 5, "the request went on after its client left"
            time.sleep(0.05)
        assert running.engine.engine.scheduler.block_manager.num_free_blocks == 256
        gc.collect()  # (an asyncio future whose error was never retrieved logs it when collected)
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


def test_a_full_queue_is_429_and_no_executor_is_503(checkpoint):
    from scheduler_service.executor_client import ExecutorUnavailable

    server, _ = _server(checkpoint, slow=0.02)
    server.engine.options.max_queue = 1
    server.engine.options.config.max_num_seqs = 1
    with ServerThread(server) as running:
        url = f"http://127.0.0.1:{running.http_port}"
        wait_http_health(url)
        api = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        first = api.completions.create(model="fake", prompt="a", max_tokens=400, stream=True)
        next(iter(first))  # running: the one batch slot is taken
        second = api.completions.create(model="fake", prompt="b", max_tokens=400, stream=True)
        with pytest.raises(openai.RateLimitError) as e:
            for _ in range(3):
                api.completions.create(model="fake", prompt="c", max_tokens=4)
        assert e.value.status_code == 429
        assert "queue full" in e.value.body["message"]
        first.close()
        second.close()

    class Away(ScriptedExecutor):
        def describe(self):
            raise ExecutorUnavailable("no executor at 127.0.0.1:1")

    tokenizer = Tokenizer(checkpoint)
    away = Away([1], 0, tokenizer.vocab_size)
    options = EngineOptions(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=1024))
    server = SchedulerServer(away, options, tokenizer_for=lambda info: tokenizer, port=0, http_port=0)
    with ServerThread(server) as running:
        url = f"http://127.0.0.1:{running.http_port}"
        api = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.InternalServerError) as e:
            api.completions.create(model="fake", prompt="a", max_tokens=4)
        assert e.value.status_code == 503
        assert httpx.get(f"{url}/health").status_code == 503


@pytest.mark.parametrize("stream", [False, True])
def test_past_its_deadline_a_request_is_504_and_frees_its_blocks(checkpoint, stream):
    server, executor = _server(checkpoint, slow=0.01)
    with ServerThread(server) as running:
        url = f"http://127.0.0.1:{running.http_port}"
        wait_http_health(url)
        # 900 tokens at 10 ms a step take 9 s; the deadline is 0.5 s.
        body = {"model": "fake", "prompt": "hello", "max_tokens": 900, "stream": stream}
        start = time.monotonic()
        r = httpx.post(f"{url}/v1/completions", json=body, headers={"X-Request-Timeout": "0.5"}, timeout=10)
        assert time.monotonic() - start < 5
        if stream:  # the status is sent: the error comes as an event, then [DONE]
            events = [e for e in r.text.split("\n\n") if e]
            error = json.loads(events[-2].removeprefix("data: "))["error"]
            assert events[-1] == "data: [DONE]"
        else:
            assert r.status_code == 504
            error = r.json()["error"]
        assert "deadline passed" in error["message"] and error["type"] == "timeout"
        while executor.seqs or running.engine.streams:
            assert time.monotonic() < start + 5
            time.sleep(0.05)
        assert running.engine.engine.scheduler.block_manager.num_free_blocks == 256
        bad = httpx.post(f"{url}/v1/completions", json=body, headers={"X-Request-Timeout": "soon"})
        assert bad.status_code == 400 and "x-request-timeout" in bad.json()["error"]["message"]


def test_the_http_api_over_tls(checkpoint, tmp_path):
    from helpers.tls import CA

    ca, other = CA("tandem-test-ca"), CA("another-ca")
    cert, key = ca.issue("localhost", server=True)
    files = {}
    for name, pem in (("cert", cert), ("key", key), ("ca", ca.pem), ("other", other.pem)):
        files[name] = tmp_path / f"{name}.pem"
        files[name].write_bytes(pem)
    ours, theirs = (ssl.create_default_context(cafile=files[name]) for name in ("ca", "other"))
    server, _ = _server(checkpoint, http_tls=(str(files["cert"]), str(files["key"])))
    with ServerThread(server) as running:
        url = f"https://127.0.0.1:{running.http_port}"
        wait_http_health(url, verify=ours)
        trusted = httpx.Client(verify=ours)
        api = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, http_client=trusted)
        got = api.chat.completions.create(model="fake", messages=MESSAGES, max_tokens=200, temperature=0)
        assert got.choices[0].message.reasoning_content == "\nThe user wants the weather.\n"
        with pytest.raises(httpx.ConnectError):  # a certificate from a CA the client does not trust
            httpx.get(f"{url}/health", verify=theirs)
        with pytest.raises(httpx.HTTPError):  # plaintext to the TLS port
            httpx.get(f"http://127.0.0.1:{running.http_port}/health", timeout=5)
        trusted.close()


@pytest.mark.parametrize("final", ["", "|"])
def test_continue_final_message_over_http_cuts_as_transformers(server, checkpoint, final):
    """An empty final message (the assistant's turn opened for the model) was a 400, and "|" (a
    table begun) was cut inside the end-of-turn token that follows it: the prompt ended "|<|im_end|"."""
    transformers = pytest.importorskip("transformers")
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(checkpoint))
    messages = [*MESSAGES, {"role": "assistant", "content": final}]
    expected = tokenizer.apply_chat_template(
        messages, add_generation_prompt=False, continue_final_message=True, tokenize=True
    )
    if isinstance(expected, dict) or hasattr(expected, "input_ids"):
        expected = expected["input_ids"]
    body = {"messages": messages, "add_generation_prompt": False, "continue_final_message": True}
    got = httpx.post(f"http://127.0.0.1:{server.http_port}/tokenize", json=body)
    assert got.status_code == 200, got.text
    assert got.json()["tokens"] == expected
