"""Request features through the HTTP API (the scheduler in-process over a LocalExecutor, talked to
with the official `openai` client): the same answers as the offline LLM for logit_bias, min_tokens,
include_stop_str_in_output, n and prompt_logprobs (vLLM's extra fields), max_tokens against
max_completion_tokens, the user in the logs, and bad input as a 400 naming the limit."""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import threading
import time

import grpc
import httpx
import openai
import pytest
from helpers.scheduler_server import NUM_KV_BLOCKS, serving_http

from client.llm import LLM
from scheduler_service.errors import TandemRequestError
from scheduler_service.http_api import OpenAIServer
from scheduler_service.openai_protocol import MAX_SEQUENCES_PER_REQUEST
from scheduler_service.sampling_params import SamplingParams
from scheduler_service.tokenizer import Tokenizer

PROMPT = "The list type"


@pytest.fixture(scope="module")
def checkpoint(qwen3_tied, tmp_path_factory):
    """The conftest checkpoint with a plain chat template (an assistant's tool calls written as
    Llama 3.1's template writes them: arguments through `tojson`)."""
    path = tmp_path_factory.mktemp("with_template") / "qwen3"
    shutil.copytree(qwen3_tied, path)
    (path / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ m.role }}: {{ m.content }}"
        "{% if 'tool_calls' in m %} calls{% for c in m.tool_calls %} "
        "{{ c.function.name }}{{ c.function.arguments | tojson }}{% endfor %}{% endif %}{{ '\\n' }}"
        "{% endfor %}assistant:"
    )
    return path


@pytest.fixture(scope="module")
def server(checkpoint):
    with serving_http(checkpoint) as server:
        yield server


@pytest.fixture(scope="module")
def api(server):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.http_port}/v1", api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def model(api):
    return api.models.list().data[0].id


@pytest.fixture(scope="module")
def reference(checkpoint):
    return LLM(str(checkpoint), num_kv_blocks=NUM_KV_BLOCKS)


def _offline(reference, **params):
    return reference.generate(PROMPT, SamplingParams(**params), use_tqdm=False)[0]


def test_logit_bias_forces_a_token(api, model, reference):
    got = api.completions.create(model=model, prompt=PROMPT, max_tokens=5, logit_bias={"42": 100})
    assert got.choices[0].text == reference.tokenizer.token_text(42) * 5
    assert (
        got.choices[0].text == _offline(reference, max_tokens=5, temperature=1.0, logit_bias={42: 100}).text
    )


def test_min_tokens_holds_an_early_end_of_sequence_back(api, model, reference):
    eos = reference.executor.describe().eos_token_ids[0]
    kwargs = {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": 10,
        "temperature": 0,
        "logit_bias": {str(eos): 100},
    }
    eager = api.completions.create(**kwargs)
    assert (eager.usage.completion_tokens, eager.choices[0].finish_reason) == (1, "stop")
    held = api.completions.create(**kwargs, extra_body={"min_tokens": 4})
    expected = _offline(reference, max_tokens=10, logit_bias={eos: 100}, min_tokens=4)
    assert held.choices[0].text == expected.text and held.usage.completion_tokens == 5


def test_include_stop_str_in_output_keeps_the_stop_text(api, model, reference):
    full = _offline(reference, max_tokens=16, ignore_eos=True).text
    stop = full[4:7]
    kwargs = {"model": model, "prompt": PROMPT, "max_tokens": 16, "temperature": 0, "stop": [stop]}
    extra = {"ignore_eos": True}
    cut = api.completions.create(**kwargs, extra_body=extra)
    kept = api.completions.create(**kwargs, extra_body={**extra, "include_stop_str_in_output": True})
    assert cut.choices[0].text == full[: full.find(stop)]
    assert kept.choices[0].text == full[: full.find(stop) + len(stop)]


def test_n_samples_equal_the_offline_ones(api, model, reference):
    got = api.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=11, n=3)
    expected = _offline(reference, max_tokens=8, temperature=1.0, seed=11, n=3)
    assert [c.text for c in got.choices] == [o.text for o in expected.outputs]
    assert got.usage.prompt_tokens == len(expected.prompt_token_ids)  # counted once


def _expected_prompt_logprobs(reference, num_top: int) -> list:
    text = reference.tokenizer.token_text
    out = [None]
    for lp in _offline(reference, max_tokens=1, prompt_logprobs=num_top).prompt_logprobs[1:]:
        entry = {str(lp.token_id): (round(lp.logprob, 4), lp.rank, text(lp.token_id))}
        for rank, (t, v) in enumerate(lp.top_logprobs, 1):
            entry.setdefault(str(t), (round(v, 4), rank, text(t)))
        out.append(entry)
    return out


def _as_tuples(prompt_logprobs: list) -> list:
    return [
        None
        if e is None
        else {k: (round(v["logprob"], 4), v["rank"], v["decoded_token"]) for k, v in e.items()}
        for e in prompt_logprobs
    ]


def test_prompt_logprobs_whole_and_streamed(api, model, reference):
    expected = _expected_prompt_logprobs(reference, 2)
    extra = {"prompt_logprobs": 2}
    got = api.completions.create(model=model, prompt=PROMPT, max_tokens=1, extra_body=extra)
    assert _as_tuples(got.choices[0].model_extra["prompt_logprobs"]) == expected
    chunks = list(
        api.completions.create(model=model, prompt=PROMPT, max_tokens=3, stream=True, extra_body=extra)
    )
    first = chunks[0].choices[0].model_extra["prompt_logprobs"]
    assert _as_tuples(first) == expected
    assert all("prompt_logprobs" not in (c.choices[0].model_extra or {}) for c in chunks[1:] if c.choices)
    assert got.choices[0].model_extra["prompt_logprobs"][0] is None


def test_prompt_logprobs_of_a_streamed_chat_are_a_400(server):
    """A chat completion's prompt_logprobs are its response's (vLLM's place), which a stream of
    chunks does not have: a streamed chat with them is a 400, as vLLM's. It streamed the answer and
    left them out without a word."""
    url = f"http://127.0.0.1:{server.http_port}/v1/chat/completions"
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "prompt_logprobs": 1}
    r = httpx.post(url, json={**body, "stream": True})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"].startswith("prompt_logprobs are not available when stream=true")
    assert httpx.post(url, json=body).json()["prompt_logprobs"][0] is None
    # vLLM's rule refuses more than 0 alternatives only: 0 streams, without them.
    chunks = _events(url, {**body, "prompt_logprobs": 0, "stream": True})
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all("prompt_logprobs" not in c for c in chunks)


def test_max_tokens_and_max_completion_tokens(api, model):
    messages = [{"role": "user", "content": "Hi"}]
    with pytest.raises(openai.BadRequestError) as e:
        api.chat.completions.create(model=model, messages=messages, max_tokens=4, max_completion_tokens=5)
    assert "max_tokens (4) and max_completion_tokens (5) differ" in e.value.body["message"]
    same = api.chat.completions.create(
        model=model, messages=messages, max_tokens=3, max_completion_tokens=3, extra_body={"ignore_eos": True}
    )
    assert same.usage.completion_tokens == 3
    newer = api.chat.completions.create(
        model=model, messages=messages, max_completion_tokens=2, extra_body={"ignore_eos": True}
    )
    assert newer.usage.completion_tokens == 2


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"logit_bias": {"3": 150}}, "logit_bias[3] must be in [-100, 100], got 150"),
        ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias has 301 entries; at most 300"),
        ({"logit_bias": {"99999": 1}}, "logit_bias token id 99999 is outside the vocabulary"),
        (
            {"logit_bias": {"abc": 1}},
            "logit_bias keys must be token ids in decimal digits (as \"42\"), got 'abc'",
        ),
        # int() took these for 50, 7, 7 and 3: a key is decimal digits, nothing else.
        ({"logit_bias": {"5_0": 1}}, "token ids in decimal digits (as \"42\"), got '5_0'"),
        ({"logit_bias": {" 7 ": 1}}, "token ids in decimal digits (as \"42\"), got ' 7 '"),
        ({"logit_bias": {"+7": 1}}, "token ids in decimal digits (as \"42\"), got '+7'"),
        ({"logit_bias": {"\u0663": 1}}, "token ids in decimal digits (as \"42\"), got '\u0663'"),
        ({"logit_bias": {"-1": 1}}, "logit_bias keys must be token ids (integers >= 0), got -1"),
        ({"logit_bias": {"9" * 5000: 1}}, "... (5000 characters) is outside the vocabulary"),
        ({"min_tokens": 20, "max_tokens": 10}, "min_tokens (20) must be <= max_tokens (10)"),
        ({"prompt_logprobs": 50}, "prompt_logprobs (50) exceeds max_logprobs (20"),
        ({"logprobs": -1}, "logprobs must be >= 0, got -1"),
        ({"stop_token_ids": [5] * 4097}, "at most 4096 stop_token_ids, got 4097"),
    ],
)
def test_bad_features_are_400_naming_the_limit(server, extra, message):
    url = f"http://127.0.0.1:{server.http_port}/v1/completions"
    r = httpx.post(url, json={"prompt": PROMPT, "max_tokens": 10, **extra})
    assert r.status_code == 400
    assert message in r.json()["error"]["message"]
    assert httpx.post(url, json={"prompt": PROMPT, "max_tokens": 2}).status_code == 200


def test_the_user_and_the_request_id_are_logged(api, model, caplog):
    with caplog.at_level(logging.INFO, logger="scheduler_service"):
        got = api.completions.create(model=model, prompt=PROMPT, max_tokens=2, user="bob-42")
    assert f"request {got.id} (user 'bob-42')" in caplog.text


def test_a_long_user_is_logged_in_part(api, model, caplog):
    """`user` has no limit (as OpenAI's): a 1 MB one was a 1 MB line in the log for each request.
    The log keeps its first 256 characters and says how long it was; the request is served."""
    user = "u" * 300 + "v" * 1_000_000
    with caplog.at_level(logging.INFO, logger="scheduler_service"):
        got = api.completions.create(model=model, prompt=PROMPT, max_tokens=2, user=user)
    assert got.usage.completion_tokens == 2
    line = next(r.getMessage() for r in caplog.records if got.id in r.getMessage())
    assert f"(user {'u' * 256!r}... (1000300 characters))" in line
    assert len(line) < 1000


def test_chat_prompt_logprobs_are_the_response_s(api, model):
    got = api.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=2,
        extra_body={"prompt_logprobs": 0},
    )
    prompt_logprobs = got.model_extra["prompt_logprobs"]
    assert len(prompt_logprobs) == got.usage.prompt_tokens and prompt_logprobs[0] is None
    assert all(len(entry) == 1 for entry in prompt_logprobs[1:])  # each token's own only


@pytest.mark.parametrize("kwargs", [{"add_generation_prompt": False}, {"tools": None}, {"messages": []}])
def test_chat_template_kwargs_that_name_the_template_s_own_variables(server, kwargs):
    """vLLM's chat_template_kwargs override tools, documents and add_generation_prompt; `messages`
    is the request's own: a 400 that names it (not a 500), and the service keeps serving."""
    url = f"http://127.0.0.1:{server.http_port}/v1/chat/completions"
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    r = httpx.post(url, json={**body, "chat_template_kwargs": kwargs})
    if "messages" in kwargs:
        assert r.status_code == 400
        assert "chat_template_kwargs may not set 'messages'" in r.json()["error"]["message"]
    else:
        assert r.status_code == 200, r.text
    assert httpx.post(url, json=body).status_code == 200


@pytest.mark.parametrize(
    "part", [{"type": "text", "text": 5}, {"type": "text", "text": ["a"]}, {"type": "text"}]
)
def test_a_text_part_whose_text_is_no_string_is_a_400(server, part):
    """A content part's text is joined into the message's content: one that is not a string is a
    400 naming it (it was a bare 500), and the service keeps serving."""
    url = f"http://127.0.0.1:{server.http_port}/v1/chat/completions"
    content = [{"type": "text", "text": "Hi"}, part]
    r = httpx.post(url, json={"messages": [{"role": "user", "content": content}], "max_tokens": 2})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"].startswith("messages[0].content[1].text must be a string, got ")
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}], "max_tokens": 2}
    assert httpx.post(url, json=body).status_code == 200


@pytest.mark.parametrize(
    "message, named",
    [
        (
            {"role": "user", "content": 5},
            "messages[1].content must be a string or a list of content parts, got int",
        ),
        ({"role": "user", "content": {"text": "Hi"}}, "messages[1].content must be a string or a list of"),
        ({"role": "user", "content": True}, "messages[1].content must be a string or a list of"),
        ({"role": 5, "content": "Hi"}, "messages[1].role must be a string, got int"),
        ({"role": None, "content": "Hi"}, "messages[1].role must be a string, got NoneType"),
    ],
)
def test_a_message_whose_content_or_role_is_of_another_type_is_a_400(server, message, named):
    """OpenAI's (and vLLM's) content is a string, a list of parts or null, a role a string: anything
    else was rendered as Python writes it (`user: {'text': 'Hi'}`), a prompt the client never
    sent. A 400 naming it, and the service keeps serving."""
    url = f"http://127.0.0.1:{server.http_port}/v1/chat/completions"
    messages = [{"role": "system", "content": "Be brief."}, message]
    r = httpx.post(url, json={"messages": messages, "max_tokens": 2})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"].startswith(named)
    body = {"messages": [{"role": "user", "content": None}, {"role": "user"}], "max_tokens": 2}
    assert httpx.post(url, json=body).status_code == 200


@pytest.mark.parametrize(
    "calls, named",
    [
        ("get_weather", "messages[1].tool_calls must be a list of tool calls, got str"),
        ({"function": {"name": "f"}}, "messages[1].tool_calls must be a list of tool calls, got dict"),
        ([1], "messages[1].tool_calls[0] must be a tool call: "),
        ([{"name": "f", "arguments": "{}"}], "messages[1].tool_calls[0] must be a tool call: "),
        (
            [{"function": {"arguments": "{}"}}],
            "messages[1].tool_calls[0].function.name must be a string, got",
        ),
        ([{"function": {"name": 5}}], "messages[1].tool_calls[0].function.name must be a string, got int"),
        (
            [{"function": {"name": "f", "arguments": [1]}}],
            "messages[1].tool_calls[0].function.arguments must be a string (JSON) or an object, got list",
        ),
    ],
)
def test_an_assistant_s_tool_calls_of_another_shape_are_a_400_naming_them(server, calls, named):
    """OpenAI's tool calls are a list of {"function": {"name", "arguments"}}: other shapes reached
    the template, which failed with a message naming neither the message nor the field ("'str
    object' has no attribute 'name'"), or wrote them as Python writes them."""
    url = f"http://127.0.0.1:{server.http_port}/v1/chat/completions"
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "", "tool_calls": calls}]
    r = httpx.post(url, json={"messages": messages, "max_tokens": 2})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"].startswith(named), r.text
    messages[1]["tool_calls"] = [{"function": {"name": "f", "arguments": '{"a": 1}'}}]
    assert httpx.post(url, json={"messages": messages, "max_tokens": 2}).status_code == 200


def test_an_assistant_s_null_tool_calls_are_none(api, model, checkpoint):
    """The openai SDK writes a reply's message back with `"tool_calls": null` when it made no calls
    (`messages.append(reply.choices[0].message)`): vLLM drops it, as it drops an empty list, and
    so does this server. A template asking `'tool_calls' in message` (Llama 3.1's) took it for
    calls and failed on it."""
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello", "tool_calls": None},
        {"role": "user", "content": "Again"},
    ]
    got = api.chat.completions.create(
        model=model, messages=messages, max_tokens=1, extra_body={"prompt_logprobs": 0}
    )
    expected = "user: Hi\nassistant: Hello\nuser: Again\nassistant:"
    ids = [int(next(iter(entry))) for entry in got.model_extra["prompt_logprobs"][1:]]
    assert ids == Tokenizer(checkpoint).encode(expected, add_special_tokens=False)[1:]


def test_a_grpc_chat_message_without_a_role_is_invalid_argument(server):
    """As HTTP's "messages[1] has no role": an unset (empty) role was rendered as one by a template
    that takes any role (`: and now?`), a prompt the client never meant."""
    from protos.tandem.v1 import generation_pb2 as pb
    from protos.tandem.v1 import generation_pb2_grpc as pb_grpc

    chat = pb.Chat(messages=[pb.ChatMessage(role="user", content="Hi"), pb.ChatMessage(content="and now?")])
    request = pb.GenerateRequest(chat=chat, sampling_params=pb.SamplingParams(max_tokens=2))
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(request, timeout=30))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert e.value.details() == "chat.messages[1] has no role"
        chat.messages[1].role = "user"
        request = pb.GenerateRequest(chat=chat, sampling_params=pb.SamplingParams(max_tokens=2))
        assert list(stub.Generate(request, timeout=30))[-1].WhichOneof("payload") == "final"


@pytest.mark.parametrize(
    "endpoint, fields, named",
    [
        ("completions", {"prompt": [1] * 20_000 + ["a"]}, "prompt.list[int].20000: "),
        ("completions", {"prompt": PROMPT, "stop_token_ids": ["a"] * 20_000}, "stop_token_ids.0: "),
        (
            "completions",
            {"prompt": PROMPT, "logit_bias": {str(i): "x" for i in range(20_000)}},
            "logit_bias.0: ",
        ),
        ("chat/completions", {"messages": [1] * 20_000}, "messages.0: "),
    ],
)
def test_a_long_list_of_wrong_items_is_a_short_400(server, endpoint, fields, named):
    """Pydantic reported each wrong item (and the prompt's against each of its shapes): seconds of
    the event loop and a message of megabytes (118 MB for a million ids and one string). Lists stop
    at their first wrong item, and the message lists a few errors."""
    url = f"http://127.0.0.1:{server.http_port}/v1/{endpoint}"
    r = httpx.post(url, json={"max_tokens": 2, **fields}, timeout=60)
    assert r.status_code == 400, r.text[:500]
    assert len(r.content) < 2000, r.text[:500]
    assert named in r.json()["error"]["message"]
    assert httpx.post(url.replace("chat/", ""), json={"prompt": PROMPT, "max_tokens": 2}).status_code == 200


@pytest.mark.parametrize("num_prompts, n", [(MAX_SEQUENCES_PER_REQUEST + 1, 1), (513, 2)])
def test_more_sequences_than_a_request_may_have_are_a_400_before_any_work(
    server, monkeypatch, num_prompts, n
):
    """A completion's prompts x n are as many requests in the engine, tokenized and admitted one
    after another on the event loop: 200,000 prompts held it (every stream, every health check) for
    seconds, and had no limit. Past MAX_SEQUENCES_PER_REQUEST it is a 400 naming the limit, before a
    prompt is tokenized; a request of as many sequences is served."""
    url = f"http://127.0.0.1:{server.http_port}/v1/completions"
    tokenizer, encoded = server.engine.tokenizer, []
    encode = tokenizer.encode
    monkeypatch.setattr(tokenizer, "encode", lambda *args: encoded.append(1) or encode(*args))
    body = {"prompt": [PROMPT] * num_prompts, "n": n, "max_tokens": 1, "temperature": 0}
    r = httpx.post(url, json=body, timeout=60)
    assert r.status_code == 400, r.text[:300]
    assert r.json()["error"]["message"] == (
        f"prompt is a list of {num_prompts} prompts, x n ({n}) = {num_prompts * n} sequences; a request "
        f"generates at most {MAX_SEQUENCES_PER_REQUEST}: send fewer prompts per request"
    )
    assert not encoded and len(server.engine.streams) == 0
    body["prompt"] = body["prompt"][: MAX_SEQUENCES_PER_REQUEST // n]
    r = httpx.post(url, json=body, timeout=60)
    assert r.status_code == 200, r.text[:300]
    assert len(r.json()["choices"]) == MAX_SEQUENCES_PER_REQUEST


CHAT = {"messages": [{"role": "user", "content": "Hi"}]}


@pytest.mark.parametrize(
    "endpoint, fields, named",
    [
        ("completions", {"max_tokens": "12"}, "max_tokens: Input should be a valid integer"),
        ("completions", {"max_tokens": 12.0}, "max_tokens: Input should be a valid integer"),
        ("completions", {"max_tokens": True}, "max_tokens: Input should be a valid integer"),
        ("completions", {"n": "2"}, "n: Input should be a valid integer"),
        ("completions", {"seed": 1.5}, "seed: Input should be a valid integer"),
        ("completions", {"temperature": "0.5"}, "temperature: Input should be a valid number"),
        ("completions", {"top_p": True}, "top_p: Input should be a valid number"),
        ("completions", {"stream": "yes"}, "stream: Input should be a valid boolean"),
        ("completions", {"stream": 1}, "stream: Input should be a valid boolean"),
        ("completions", {"echo": "true"}, "echo: Input should be a valid boolean"),
        ("completions", {"logit_bias": {"5": "1"}}, "logit_bias.5: Input should be a valid number"),
        ("completions", {"stop_token_ids": [5.0]}, "stop_token_ids.0: Input should be a valid integer"),
        ("completions", {"prompt": [5, 6.0]}, "prompt.list[int].1: Input should be a valid integer"),
        (
            "completions",
            {"stream": True, "stream_options": {"include_usage": "yes"}},
            "stream_options.include_usage: Input should be a valid boolean",
        ),
        ("chat/completions", {"logprobs": 1}, "logprobs: Input should be a valid boolean"),
        (
            "chat/completions",
            {"max_completion_tokens": "5"},
            "max_completion_tokens: Input should be a valid",
        ),
        ("tokenize", {"prompt": PROMPT, "add_special_tokens": "no"}, "add_special_tokens: Input should be"),
        ("detokenize", {"tokens": [5, "6"]}, "tokens.1: Input should be a valid integer"),
    ],
)
def test_a_field_of_the_wrong_json_type_is_a_400_naming_it(server, endpoint, fields, named):
    """A string, a float or a boolean where an integer goes, a string where a number goes, anything
    but true or false where a boolean goes: a 400 naming the field, as OpenAI's API answers. They were
    taken (pydantic's lax mode): "max_tokens": "12", 12.0 or true was 12, 12 or 1 tokens, "stream":
    "yes" streamed."""
    base = f"http://127.0.0.1:{server.http_port}"
    url = f"{base}/{endpoint}" if endpoint.endswith("tokenize") else f"{base}/v1/{endpoint}"
    body = {"prompt": PROMPT} if endpoint == "completions" else CHAT if endpoint.startswith("chat") else {}
    r = httpx.post(url, json={"max_tokens": 2, **body, **fields} if body else fields)
    assert r.status_code == 400, r.text
    assert named in r.json()["error"]["message"], r.text
    assert httpx.post(f"{base}/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}).status_code == 200


@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
def test_an_integer_is_a_number_where_a_float_goes(server, endpoint):
    """JSON has one kind of number: 0 and 1 are numbers for temperature, top_p, the penalties and a
    logit_bias, as 0.0 and 1.0 are."""
    url = f"http://127.0.0.1:{server.http_port}/v1/{endpoint}"
    numbers = {"temperature": 0, "top_p": 1, "min_p": 0, "repetition_penalty": 1, "presence_penalty": 0}
    numbers |= {"frequency_penalty": 0, "logit_bias": {"5": 1}}
    body = {"prompt": PROMPT} if endpoint == "completions" else CHAT
    as_ints = httpx.post(url, json={**body, "max_tokens": 3, **numbers})
    as_floats = httpx.post(
        url,
        json={
            **body,
            "max_tokens": 3,
            **{k: float(v) if k != "logit_bias" else {"5": 1.0} for k, v in numbers.items()},
        },
    )
    assert as_ints.status_code == as_floats.status_code == 200, as_ints.text
    assert as_ints.json()["choices"] == as_floats.json()["choices"]


JSON = {"content-type": "application/json"}


@pytest.mark.parametrize(
    "content, headers, message",
    [
        (b"{not json", JSON, "the request body is not valid JSON: Expecting property name enclosed in "
         "double quotes at line 1 column 2"),
        (b'{"prompt": "x",\n "max_tokens": 2,, }', JSON, "the request body is not valid JSON: Expecting "
         "property name enclosed in double quotes at line 2 column 18"),
        (b"[1, 2]", JSON, "the request body must be a JSON object, got an array"),
        (b'"x"', JSON, "the request body must be a JSON object, got a string"),
        (b"null", JSON, "the request body must be a JSON object, got null"),
        (b"", JSON, "the request body is empty: send a JSON object (Content-Type: application/json)"),
        (b'{"prompt": "x"}', {"content-type": "text/plain"}, "the request body must be JSON, sent with "
         "Content-Type: application/json; got Content-Type 'text/plain'"),
        (b'{"prompt": "x"}', {}, "the request body must be JSON, sent with Content-Type: "
         "application/json; got no Content-Type"),
        (b'{"prompt": "\xff"}', JSON, "the request body is not UTF-8 JSON: invalid start byte at byte 12"),
        (b"[" * 100_000 + b"]" * 100_000, JSON, "the request body is not valid JSON: nested too deeply"),
        (b'{"max_tokens": ' + b"9" * 5000 + b"}", JSON, "the request body is not valid JSON: Exceeds the "
         "limit (4300 digits) for integer string conversion: value has 5000 digits"),
        (b'{"max_tokens": 2}', JSON, "prompt: Field required"),
        (b'{"prompt": "x", "max_tokens": "2"}', JSON, "max_tokens: Input should be a valid integer, got a "
         "string"),
        (b'{"prompt": [[5], [6, "7"]]}', JSON, "prompt.list[list[int]].1.1: Input should be a valid "
         "integer, got a string"),
    ],
)  # fmt: skip
def test_a_body_that_is_no_request_is_a_400_saying_what_is_wrong(server, content, headers, message):
    """Whatever is wrong with a body is named: where its JSON breaks, the Content-Type it was sent
    with, that it is empty or no JSON object, the path of a field of the wrong type and the type
    sent. They were "1: JSON decode error", ": Input should be a valid dictionary or object to
    extract fields from" (for a list, a string, a body sent as text/plain) and "There was an error
    parsing the body". Each is counted as a completion refused, and the server keeps serving."""
    url = f"http://127.0.0.1:{server.http_port}/v1/completions"
    registry = server.engine.metrics.registry

    def refused() -> float:
        labels = {"code": "INVALID_ARGUMENT"}
        return registry.get_sample_value("tandem_scheduler_requests_failed_total", labels) or 0.0

    before = refused()
    r = httpx.post(url, content=content, headers=headers)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"] == message
    assert refused() - before == 1
    assert httpx.post(url, json={"prompt": PROMPT, "max_tokens": 2}).status_code == 200


def test_negative_top_logprobs_are_a_400(server):
    url = f"http://127.0.0.1:{server.http_port}/v1/chat/completions"
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "logprobs": True}
    r = httpx.post(url, json={**body, "top_logprobs": -1})
    assert r.status_code == 400
    assert "top_logprobs must be >= 0, got -1" in r.json()["error"]["message"]


def test_top_logprobs_0_needs_no_logprobs(server):
    """vLLM's rule: top_logprobs over 0 need logprobs true; 0 (its default) asks for nothing, so
    it may come with logprobs false or left out, as clients that always send it do."""
    url = f"http://127.0.0.1:{server.http_port}/v1/chat/completions"
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "top_logprobs": 0}
    for logprobs in ({}, {"logprobs": False}):
        r = httpx.post(url, json={**body, **logprobs})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["logprobs"] is None
    r = httpx.post(url, json={**body, "top_logprobs": 1})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "top_logprobs needs logprobs: true"


def test_top_logprobs_over_max_logprobs_are_a_400_naming_them(server):
    """A chat's number of alternatives is its top_logprobs: the error names them (it named
    `logprobs`, which a chat request sends as true or false)."""
    url = f"http://127.0.0.1:{server.http_port}/v1/chat/completions"
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "logprobs": True}
    r = httpx.post(url, json={**body, "top_logprobs": 21, "prompt_logprobs": 2})
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    assert message.startswith("top_logprobs (21) exceeds max_logprobs (20; the scheduler's --max-logprobs)")
    r = httpx.post(url, json={**body, "top_logprobs": 2, "prompt_logprobs": 21})
    assert r.json()["error"]["message"].startswith("prompt_logprobs (21) exceeds max_logprobs (20")


def test_unknown_routes_and_methods_are_openai_error_objects(api, model, server):
    """The README's promise: every error is `{"error": {"message", "type", "param", "code"}}`."""
    with pytest.raises(openai.NotFoundError) as e:
        api.embeddings.create(model=model, input="x")  # an endpoint this server does not serve
    assert e.value.body["message"] == "Not Found" and e.value.body["type"] == "not_found_error"
    r = httpx.get(f"http://127.0.0.1:{server.http_port}/v1/completions")
    assert r.status_code == 405
    assert r.json()["error"]["message"] == "Method Not Allowed" and r.headers["allow"] == "POST"
    assert r.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
def test_a_prompt_that_is_not_unicode_is_a_400(server, endpoint):
    """JSON can escape a lone UTF-16 surrogate, which no tokenizer takes: a 400, not a bare 500."""
    url = f"http://127.0.0.1:{server.http_port}/v1/{endpoint}"
    text = '"The \\ud800 type"'  # as the JSON text carries it
    field = (
        f'"prompt": {text}'
        if endpoint == "completions"
        else f'"messages": [{{"role": "user", "content": {text}}}]'
    )
    r = httpx.post(url, content=f'{{{field}, "max_tokens": 2}}', headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert "is not valid Unicode (surrogates not allowed) at character" in r.json()["error"]["message"]


@pytest.mark.parametrize(
    "field, value, named",
    [
        ("stop", '"\\ud800"', "stop[0]"),
        ("stop", '["x", "a\\udfff"]', "stop[1]"),
        ("user", '"\\ud800"', "user"),
    ],
)
def test_other_strings_that_are_not_unicode_are_a_400(server, field, value, named):
    """A stop string or a user with a lone surrogate: a 400 naming it. It was accepted here, while
    API server processes (--api-server-count) could not pass it to their engine core (msgpack takes
    UTF-8): a 400 with the codec's words, and an admission left pending that held up their next
    graceful shutdown for all of --shutdown-timeout."""
    url = f"http://127.0.0.1:{server.http_port}/v1/completions"
    body = f'{{"prompt": "{PROMPT}", "max_tokens": 2, "{field}": {value}}}'
    r = httpx.post(url, content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"].startswith(f"{named} is not valid Unicode (surrogates not allowed)")
    assert httpx.post(url, json={"prompt": PROMPT, "max_tokens": 2, field: "x"}).status_code == 200


def test_a_request_refused_after_its_prompt_was_tokenized_leaves_nothing_running(server):
    """tool_choice "required" (not supported) is a 400, and the n samples it was refused with are not
    left generating for nobody."""
    url = f"http://127.0.0.1:{server.http_port}/v1/chat/completions"
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    body = {"messages": [{"role": "user", "content": "Hi"}], "tools": tools, "tool_choice": "required"}
    r = httpx.post(url, json={**body, "n": 2, "max_tokens": 900, "ignore_eos": True})
    assert r.status_code == 400 and "tool_choice" in r.json()["error"]["message"]
    assert len(server.engine.streams) == 0


def test_completion_top_logprobs_hold_the_sampled_token(api, model):
    """OpenAI's legacy completions (and vLLM's): top_logprobs are the `logprobs` most likely tokens
    and always the sampled one, so up to logprobs + 1 of them; logprobs=0 gives the sampled one."""
    kwargs = {"model": model, "prompt": PROMPT, "max_tokens": 12, "temperature": 2.0, "seed": 3}
    lp = api.completions.create(**kwargs, logprobs=0).choices[0].logprobs
    assert lp.top_logprobs == [{t: v} for t, v in zip(lp.tokens, lp.token_logprobs, strict=True)]
    lp = api.completions.create(**kwargs, logprobs=1).choices[0].logprobs
    for token, top in zip(lp.tokens, lp.top_logprobs, strict=True):
        assert token in top and len(top) <= 2  # (keyed by text: another token may share the sampled one's)
    assert any(len(top) == 2 for top in lp.top_logprobs)  # (at temperature 2, not always the likeliest)


@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
def test_stream_options_without_stream_are_a_400(server, endpoint):
    """OpenAI's and vLLM's rule: stream_options only with "stream": true (null is no options)."""
    url = f"http://127.0.0.1:{server.http_port}/v1/{endpoint}"
    body = {"max_tokens": 2}
    body |= (
        {"prompt": PROMPT} if endpoint == "completions" else {"messages": [{"role": "user", "content": "Hi"}]}
    )
    for stream in ({}, {"stream": False}):
        r = httpx.post(url, json={**body, **stream, "stream_options": {"include_usage": True}})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["message"] == "Stream options can only be defined when `stream=True`."
    assert httpx.post(url, json={**body, "stream_options": None}).status_code == 200
    assert httpx.post(url, json={**body, "stream_options": {}}).status_code == 200  # (vLLM's: no options)
    assert len(server.engine.streams) == 0


def _events(url: str, body: dict) -> list[dict]:
    with httpx.stream("POST", url, json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        lines = [line[len("data: ") :] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
def test_stream_options_take_vllm_s_defaults(server, endpoint):
    """vLLM's stream_options: include_usage defaults to true (`{}` ends the stream with the usage),
    and continuous_usage_stats puts the usage so far in every chunk; include_usage false or null
    sends none."""
    url = f"http://127.0.0.1:{server.http_port}/v1/{endpoint}"
    body = {"max_tokens": 4, "stream": True, "ignore_eos": True}
    body |= (
        {"prompt": PROMPT} if endpoint == "completions" else {"messages": [{"role": "user", "content": "Hi"}]}
    )
    chunks = _events(url, {**body, "stream_options": {}})
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4
    assert all("usage" not in c for c in chunks[:-1])
    for off in ({"include_usage": False}, {"include_usage": None}):
        assert all("usage" not in c for c in _events(url, {**body, "stream_options": off}))
    chunks = _events(url, {**body, "stream_options": {"continuous_usage_stats": True}})
    assert all("usage" in c for c in chunks)
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 4
    assert len({c["usage"]["prompt_tokens"] for c in chunks}) == 1


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_gone_before_the_first_read_of_its_stream_is_aborted(server, stream):
    """The client disconnects in the instant between its request's admission and the first read of
    its stream: called as an ASGI app whose receive() answers http.disconnect once the body is read,
    so that the disconnect is there before the response starts. The request is aborted (its blocks
    freed), not left generating up to max_tokens for nobody."""
    app = OpenAIServer(server.engine).app
    body = json.dumps({"prompt": PROMPT, "max_tokens": 900, "ignore_eos": True, "stream": stream}).encode()
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},  # uvicorn's
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/completions",
        "raw_path": b"/v1/completions",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
    }
    submitted = []

    async def call() -> int:
        messages = iter([{"type": "http.request", "body": body, "more_body": False}])

        async def receive():
            return next(messages, {"type": "http.disconnect"})

        async def send(message):
            pass

        real_submit = server.engine.submit

        async def submit(*args, **kwargs):
            streams = await real_submit(*args, **kwargs)
            submitted.extend(streams)
            return streams

        server.engine.submit = submit
        try:
            await app(scope, receive, send)
        finally:
            del server.engine.submit
        left = len(server.engine.streams)
        server.engine.abort_all(TandemRequestError("test cleanup"))  # (whatever the outcome)
        return left

    left = asyncio.run_coroutine_threadsafe(call(), server.engine._loop).result(10)
    assert len(submitted) == 1  # (it was admitted)
    assert left == 0


def test_a_request_without_its_key_is_a_401_whatever_its_body(server):
    """With API keys, a request without one is a 401 before its body is read: it was a 400 listing
    what was wrong with the body (the body read and validated for a caller without a key), and
    counted as INVALID_ARGUMENT. The same app with --api-key, as an ASGI app on the server's loop."""
    app = OpenAIServer(server.engine, api_keys=["sk-1"]).app
    bodies = [b"{not json", b"{}", json.dumps({"prompt": PROMPT, "max_tokens": "many"}).encode()]

    async def call() -> list[tuple[int, str]]:
        transport = httpx.ASGITransport(app)
        async with httpx.AsyncClient(transport=transport, base_url="http://tandem") as client:
            answers = []
            for path, body in [(p, b) for p in ("/v1/completions", "/v1/chat/completions") for b in bodies]:
                r = await client.post(path, content=body, headers={"content-type": "application/json"})
                answers.append((r.status_code, r.json()["error"]["code"]))
            r = await client.post(
                "/v1/completions",
                json={"prompt": PROMPT, "max_tokens": 2},
                headers={"authorization": "Bearer sk-1"},
            )
            answers.append((r.status_code, r.json()["object"]))
            return answers

    answers = asyncio.run_coroutine_threadsafe(call(), server.engine._loop).result(10)
    assert answers == [(401, "invalid_api_key")] * 6 + [(200, "text_completion")]


def test_a_long_grpc_chat_is_rendered_without_holding_up_the_event_loop(server):
    """A chat template is Jinja, some microseconds a message, and a 16 MiB request holds 3M of them:
    rendered on the event loop, such a chat held every health check and stream for 6 s. A long
    chat is rendered in a thread, and health checks are answered meanwhile."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from protos.tandem.v1 import generation_pb2 as pb
    from protos.tandem.v1 import generation_pb2_grpc as pb_grpc

    messages = [pb.ChatMessage(role="user", content="")] * 1_500_000  # (12 MB: under the 16 MiB limit)
    request = pb.GenerateRequest(chat=pb.Chat(messages=messages), sampling_params=pb.SamplingParams())
    latencies: list[float] = []
    done = threading.Event()
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        health = health_pb2_grpc.HealthStub(channel)

        def check() -> None:
            while not done.is_set():
                t0 = time.monotonic()
                health.Check(health_pb2.HealthCheckRequest(), timeout=30)
                latencies.append(time.monotonic() - t0)
                time.sleep(0.01)

        checker = threading.Thread(target=check)
        checker.start()
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as e:
            list(pb_grpc.GenerationServiceStub(channel).Generate(request, timeout=60))
        took = time.monotonic() - t0
        done.set()
        checker.join()
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "max_model_len (1024)" in e.value.details()
    assert took > 0.5, f"too short a chat to tell: {took:.2f} s"
    assert max(latencies) < took / 2, f"health took up to {max(latencies):.2f} s of the {took:.2f} s"


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "1e400", "-1", "0", "1_0"])
def test_a_request_timeout_that_cannot_expire_is_a_400(server, value):
    """X-Request-Timeout: a NaN or infinite deadline never passed (and a NaN broke the order of the
    others'), a negative or zero one had passed before the request began: a 400 naming the header."""
    url = f"http://127.0.0.1:{server.http_port}/v1/completions"
    body = {"prompt": PROMPT, "max_tokens": 2}
    r = httpx.post(url, json=body, headers={"X-Request-Timeout": value})
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert message == f"x-request-timeout must be a positive, finite number of seconds, got {value!r}"
    assert len(server.engine.streams) == 0
    assert httpx.post(url, json=body, headers={"X-Request-Timeout": "30"}).status_code == 200


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"max_completion_tokens": 0}, "max_completion_tokens must be >= 1, got 0"),
        ({"max_completion_tokens": 10**6}, r"\+ max_completion_tokens \(1000000\) exceeds max_model_len"),
        (
            {"max_completion_tokens": 2, "min_tokens": 5},
            r"min_tokens \(5\) must be <= max_completion_tokens \(2\)",
        ),
        ({"max_tokens": 0}, "max_tokens must be >= 1, got 0"),
        ({"max_tokens": 10**6}, r"\+ max_tokens \(1000000\) exceeds max_model_len"),
        ({"max_tokens": 2, "max_completion_tokens": 2, "min_tokens": 5}, r"must be <= max_tokens \(2\)"),
    ],
)
def test_errors_about_the_token_limit_name_the_field_sent(server, fields, message):
    """A chat request's limit is max_completion_tokens (OpenAI's newer name) or max_tokens: an error
    about it names the one the client sent."""
    import re

    url = f"http://127.0.0.1:{server.http_port}/v1/chat/completions"
    r = httpx.post(url, json={"messages": [{"role": "user", "content": "Hi"}], **fields})
    assert r.status_code == 400, r.text
    assert re.search(message, r.json()["error"]["message"]), r.json()["error"]["message"]


@pytest.mark.parametrize(
    "extra, field",
    [
        ({"response_format": {"type": "json_object"}}, "response_format type 'json_object'"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "type 'json_schema'"),
        ({"guided_json": {"type": "object"}}, "guided_json"),
        ({"guided_choice": ["yes", "no"]}, "guided_choice"),
        ({"guided_regex": "[0-9]+"}, "guided_regex"),
        ({"structured_outputs": {"json": {"type": "object"}}}, "structured_outputs"),
    ],
)
@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
def test_output_constraints_it_cannot_honour_are_a_400(server, endpoint, extra, field):
    """A client asking for JSON (or another constrained output) is told it cannot have it, instead of
    silently getting free text."""
    url = f"http://127.0.0.1:{server.http_port}/v1/{endpoint}"
    body = {"max_tokens": 2}
    body |= (
        {"prompt": PROMPT} if endpoint == "completions" else {"messages": [{"role": "user", "content": "Hi"}]}
    )
    r = httpx.post(url, json={**body, **extra})
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert field in message and "not supported" in message, message
    assert len(server.engine.streams) == 0
    for harmless in ({"response_format": {"type": "text"}}, {"response_format": None, "guided_json": None}):
        assert httpx.post(url, json={**body, **harmless}).status_code == 200


def test_fields_it_ignores_are_logged_once_per_request(api, model, caplog):
    """vLLM's rule: fields it does not act on are accepted, and a warning names them; the openai
    client's own requests (and fields sent as null) draw none."""
    messages = [{"role": "user", "content": "Hi"}]
    with caplog.at_level(logging.WARNING, logger="scheduler_service"):
        api.chat.completions.create(model=model, messages=messages, max_tokens=2)
        api.completions.create(model=model, prompt=PROMPT, max_tokens=2, user="u", stream=False)
        list(api.chat.completions.create(model=model, messages=messages, max_tokens=2, stream=True))
        api.chat.completions.create(model=model, messages=messages, max_tokens=2, extra_body={"store": None})
    assert not [r for r in caplog.records if "ignored" in r.getMessage()]
    with caplog.at_level(logging.WARNING, logger="scheduler_service"):
        got = api.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=2,
            extra_body={"mm_processor_kwargs": {"x": 1}, "length_penalty": 1.0},
        )
    warnings = [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()]
    assert warnings == [
        f"request {got.id}: these fields were present in the request but ignored (not supported): "
        "'length_penalty', 'mm_processor_kwargs'"
    ]
    # A name with a newline cannot forge a log line, and thousands of names are cut short.
    forged = {"aa\n2026-12-05 09:00:00,000 ERROR scheduler_service.engine: FORGED": 1}
    many = {f"f{i:05d}": 1 for i in range(5000)}
    with caplog.at_level(logging.WARNING, logger="scheduler_service"):
        caplog.clear()
        api.completions.create(model=model, prompt=PROMPT, max_tokens=1, extra_body={**forged, **many})
    (warning,) = [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()]
    assert "\n" not in warning and "'aa\\n2026-12-05" in warning and warning.endswith(" and 4981 more")


def test_a_body_over_the_limit_is_a_413_and_the_server_keeps_serving(server, monkeypatch):
    """A request body over MAX_BODY_BYTES (the gRPC API's message limit) is a 413 naming the limit,
    refused from its Content-Length before it is read, or (a chunked body of no announced length) as
    its bytes pass the limit, and counted as gRPC counts an oversized message. Before, any body was
    read whole and parsed on the event loop that every stream and health check shares: a 200 MB
    prompt held them for seconds. Then a request under the limit is served."""
    from scheduler_service import http_api

    monkeypatch.setattr(http_api, "MAX_BODY_BYTES", 1000)  # (read when the app is built)
    app = OpenAIServer(server.engine).app
    registry = server.engine.metrics.registry

    def exhausted() -> float:
        labels = {"code": "RESOURCE_EXHAUSTED"}
        return registry.get_sample_value("tandem_scheduler_requests_failed_total", labels) or 0.0

    big = json.dumps({"prompt": PROMPT + " x" * 1000, "max_tokens": 2}).encode()

    async def chunks():
        for i in range(0, len(big), 100):
            yield big[i : i + 100]

    async def call() -> list:
        transport = httpx.ASGITransport(app)
        async with httpx.AsyncClient(transport=transport, base_url="http://tandem") as client:
            declared = await client.post(
                "/v1/completions", content=big, headers={"content-type": "application/json"}
            )
            chunked = await client.post(
                "/v1/chat/completions", content=chunks(), headers={"content-type": "application/json"}
            )
            small = await client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
            return [declared, chunked, small]

    before = exhausted()
    declared, chunked, small = asyncio.run_coroutine_threadsafe(call(), server.engine._loop).result(10)
    assert declared.status_code == 413
    assert declared.json()["error"]["message"] == (
        f"the request body of {len(big)} bytes exceeds the limit of 1000 bytes"
    )
    assert chunked.status_code == 413
    assert chunked.json()["error"]["message"] == "the request body exceeds the limit of 1000 bytes"
    assert exhausted() - before == 2
    assert small.status_code == 200 and small.json()["usage"]["completion_tokens"] == 2


def test_the_served_body_limit_is_the_grpc_message_limit(server):
    """Over the real socket at the default limit: a body one byte over the gRPC API's message limit
    is a 413 naming it, and the connection's server answers health checks after."""
    from protos.defaults import GENERATION_MAX_MESSAGE_BYTES

    body = b" " * (GENERATION_MAX_MESSAGE_BYTES + 1)
    url = f"http://127.0.0.1:{server.http_port}"
    r = httpx.post(
        url + "/v1/completions", content=body, headers={"content-type": "application/json"}, timeout=30
    )
    assert r.status_code == 413, r.text
    assert f"exceeds the limit of {GENERATION_MAX_MESSAGE_BYTES} bytes" in r.json()["error"]["message"]
    assert httpx.get(url + "/health").status_code == 200


def test_health_and_models_answer_head(server):
    """A load balancer's HEAD probe gets GET's status and headers without a body (FastAPI's get()
    routes answered it 405), and a method neither takes is still a 405."""
    url = f"http://127.0.0.1:{server.http_port}"
    for path in ("/health", "/v1/models"):
        got, head = httpx.get(url + path), httpx.head(url + path)
        assert head.status_code == got.status_code == 200, (path, head.text)
        assert head.content == b"" and head.headers["content-type"] == got.headers["content-type"]
    assert httpx.delete(url + "/health").status_code == 405


@pytest.mark.parametrize(
    "endpoint, field",
    [
        (endpoint, field)
        for endpoint in ("completions", "chat/completions")
        for field in (
            "n",
            "stream",
            "presence_penalty",
            "frequency_penalty",
            "min_p",
            "repetition_penalty",
            "stop_token_ids",
        )
    ]
    + [("completions", "echo"), ("chat/completions", "logprobs")],
)
def test_a_field_sent_as_null_is_its_default(server, endpoint, field):
    """OpenAI's n, stream, presence_penalty, frequency_penalty, echo and chat's logprobs may be null
    (and vLLM's min_p, repetition_penalty and stop_token_ids): null is the default. A client that
    wrote `"n": null` (a wrapper passing on what its caller left unset) got a 400, "n: Input should
    be a valid integer"."""
    url = f"http://127.0.0.1:{server.http_port}/v1/{endpoint}"
    body = {"max_tokens": 2, "temperature": 0, "ignore_eos": True}
    body |= (
        {"prompt": PROMPT} if endpoint == "completions" else {"messages": [{"role": "user", "content": "Hi"}]}
    )
    r = httpx.post(url, json={**body, field: None})
    assert r.status_code == 200, r.text
    got = r.json()
    assert got == {**httpx.post(url, json=body).json(), "id": got["id"], "created": got["created"]}
    assert len(got["choices"]) == 1 and got["choices"][0]["logprobs"] is None


def test_an_assistant_s_tool_call_arguments_reach_the_template_as_an_object(api, model, checkpoint):
    """OpenAI's clients send a past call's arguments as a JSON string; chat templates (Llama 3.1's,
    transformers' convention) take them as an object and write them with `tojson`. vLLM parses
    them; here the string was passed on and written as a JSON string of JSON
    (`"{\\"city\\": ...}"`), a prompt the model was never trained on. An empty list of calls is
    dropped (a template that asks `'tool_calls' in message` took it for calls), and arguments that
    are no JSON object stay as the model wrote them."""
    calls = [
        {
            "id": "c1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
        },
        {"id": "c2", "type": "function", "function": {"name": "now", "arguments": ""}},
        {"id": "c3", "type": "function", "function": {"name": "bad", "arguments": "{oops"}},
    ]
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Sure", "tool_calls": []},
        {"role": "assistant", "content": None, "tool_calls": calls},
        {"role": "tool", "tool_call_id": "c1", "content": "18C"},
    ]
    got = api.chat.completions.create(
        model=model, messages=messages, max_tokens=1, extra_body={"prompt_logprobs": 0}
    )
    expected = (
        # (content null reaches the template as "", as vLLM gives it: it wrote "None")
        "user: Weather?\nassistant: Sure\nassistant:  calls "
        'get_weather{"city": "Paris"} now{} bad"{oops"\ntool: 18C\nassistant:'
    )
    # (the prompt's token ids, as the prompt logprobs name them: the first token has none)
    ids = [int(next(iter(entry))) for entry in got.model_extra["prompt_logprobs"][1:]]
    assert ids == Tokenizer(checkpoint).encode(expected, add_special_tokens=False)[1:]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
def test_stop_reason_names_what_stopped_the_choice(server, reference, endpoint, stream):
    """vLLM's stop_reason beside finish_reason: the stop string that ended the choice, the id of the
    stop token (of stop_token_ids) that did, and null for the end-of-sequence token or the length.
    The server knew it (gRPC's final message carries it) and left it out: a vLLM client reading
    which of its stop strings matched read nothing."""
    url = f"http://127.0.0.1:{server.http_port}/v1/{endpoint}"
    body = {"max_tokens": 12, "temperature": 0, "ignore_eos": True, "stream": stream}
    body |= (
        {"prompt": PROMPT} if endpoint == "completions" else {"messages": [{"role": "user", "content": "Hi"}]}
    )
    eos = reference.executor.describe().eos_token_ids[0]

    def final(**fields) -> tuple[str, object]:
        if not stream:
            choice = httpx.post(url, json={**body, **fields}).json()["choices"][0]
            return choice["finish_reason"], choice["stop_reason"]
        with httpx.stream("POST", url, json={**body, **fields}) as r:
            events = [line[len("data: ") :] for line in r.iter_lines() if line.startswith("data: ")]
        chunks = [json.loads(e)["choices"] for e in events[:-1]]
        assert all(c[0].get("stop_reason") is None for c in chunks[:-1])
        return chunks[-1][0]["finish_reason"], chunks[-1][0]["stop_reason"]

    text = httpx.post(url, json={**body, "stream": False}).json()["choices"][0]
    text = text["text"] if endpoint == "completions" else text["message"]["content"]
    assert final() == ("length", None)
    assert final(stop=["zzz", text[3:6]]) == ("stop", text[3:6])
    assert final(logit_bias={"42": 100}, stop_token_ids=[42]) == ("stop", 42)
    assert final(logit_bias={str(eos): 100}, ignore_eos=False) == ("stop", None)


def test_tokenize_and_detokenize_as_vllm_s(server, checkpoint):
    """vLLM's /tokenize (a prompt, or chat messages rendered as a chat completion renders them) and
    /detokenize: a client counts a prompt's tokens against max_model_len before it sends it, or
    reads ids back as text. They were a 404."""
    url = f"http://127.0.0.1:{server.http_port}"
    tokenizer = Tokenizer(checkpoint)
    ids = tokenizer.encode(PROMPT)
    r = httpx.post(f"{url}/tokenize", json={"prompt": PROMPT})
    assert r.status_code == 200, r.text
    assert r.json() == {"count": len(ids), "max_model_len": 1024, "tokens": ids, "token_strs": None}
    strs = httpx.post(f"{url}/tokenize", json={"prompt": PROMPT, "return_token_strs": True}).json()
    assert strs["token_strs"] == [tokenizer.id_to_token(i) for i in ids]  # (vLLM's: the vocabulary's)
    messages = [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    chat = httpx.post(f"{url}/tokenize", json={"messages": messages}).json()
    assert chat["tokens"] == tokenizer.encode("user: Hi\nassistant:", add_special_tokens=False)
    completion = httpx.post(f"{url}/v1/chat/completions", json={"messages": messages, "max_tokens": 1})
    assert chat["count"] == completion.json()["usage"]["prompt_tokens"]
    assert httpx.post(f"{url}/detokenize", json={"tokens": ids}).json() == {"prompt": PROMPT}
    for path, body, status, message in [
        ("tokenize", {"prompt": PROMPT, "model": "nope"}, 404, "the model 'nope' does not exist"),
        ("tokenize", {}, 400, "send a prompt or messages"),
        ("tokenize", {"messages": [{"content": "Hi"}]}, 400, "messages[0] has no role"),
        (
            "detokenize",
            {"tokens": [5, 10**6]},
            400,
            "token id 1000000 at position 1 is outside the vocabulary",
        ),
        ("detokenize", {"tokens": "abc"}, 400, "tokens: "),
    ]:
        r = httpx.post(f"{url}/{path}", json=body)
        assert r.status_code == status, r.text
        assert r.json()["error"]["message"].startswith(message), r.text
    special = tokenizer.encode("<|endoftext|>", add_special_tokens=False)
    assert httpx.post(f"{url}/detokenize", json={"tokens": special}).json() == {"prompt": "<|endoftext|>"}

    async def without_key() -> list[int]:  # (with --api-key they need it, as /v1 does)
        app = OpenAIServer(server.engine, api_keys=["sk-1"]).app
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as client:
            return [
                (await client.post("/tokenize", json={"prompt": PROMPT})).status_code,
                (await client.post("/detokenize", json={"tokens": ids})).status_code,
            ]

    assert asyncio.run_coroutine_threadsafe(without_key(), server.engine._loop).result(10) == [401, 401]


def test_an_unknown_model_s_404_quotes_its_name_cut_short(server):
    """The 404 quoted the name whole: a model name of 100,000 characters came back in a message of
    100 KB."""
    url = f"http://127.0.0.1:{server.http_port}"
    for endpoint, body in (("/v1/completions", {"prompt": PROMPT}), ("/tokenize", {"prompt": PROMPT})):
        r = httpx.post(url + endpoint, json={**body, "model": "m" * 100_000})
        assert r.status_code == 404, r.text
        message = r.json()["error"]["message"]
        assert message.startswith(
            f"the model {'m' * 64!r}... (100000 characters) does not exist: this server"
        )
        assert len(message) < 200


def test_detokenize_takes_the_ids_generation_takes(server, checkpoint):
    """/detokenize checked ids against the tokenizer's vocabulary (400 here) while a prompt's ids,
    a logit_bias and the model's samples go by the model's (512: its embedding is padded past the
    tokenizer). Now both go by the model's: an id the model has and the tokenizer does not is text
    "" (as in an answer that generated it), and one past the model's vocabulary is a 400 naming the
    id and the size, as a prompt of it is."""
    url = f"http://127.0.0.1:{server.http_port}"
    vocab_size = server.engine.engine.limits.vocab_size
    padded = Tokenizer(checkpoint).vocab_size  # the first id the tokenizer has no text for
    assert padded < vocab_size
    r = httpx.post(f"{url}/detokenize", json={"tokens": [5, padded, vocab_size - 1]})
    assert r.status_code == 200, r.text
    assert r.json() == {"prompt": httpx.post(f"{url}/detokenize", json={"tokens": [5]}).json()["prompt"]}
    forced = {"prompt": PROMPT, "max_tokens": 2, "logit_bias": {str(padded): 100}}
    assert httpx.post(f"{url}/v1/completions", json=forced).json()["choices"][0]["text"] == ""
    for tokens in ([5, vocab_size], [-1]):
        message = f"token id {tokens[-1]} at position {len(tokens) - 1} is outside the vocabulary (size {vocab_size})"
        r = httpx.post(f"{url}/detokenize", json={"tokens": tokens})
        assert r.status_code == 400 and r.json()["error"]["message"] == message, r.text
        r = httpx.post(f"{url}/v1/completions", json={"prompt": tokens, "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["message"] == message, r.text


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_stream_interval_sets_the_tokens_of_an_http_chunk(checkpoint, reference, endpoint):
    """--stream-interval 4 reaches the HTTP API as it does gRPC: each streamed chunk of a choice
    carries at least 4 tokens but its last, and the chunks add up to the whole answer."""
    with serving_http(checkpoint, stream_interval=4) as server:
        api = openai.OpenAI(base_url=f"http://127.0.0.1:{server.http_port}/v1", api_key="x", max_retries=0)
        model = api.models.list().data[0].id
        params = {
            "model": model,
            "max_tokens": 14,
            "temperature": 0,
            "stream": True,
            "extra_body": {"ignore_eos": True},
        }
        if endpoint == "completions":
            chunks = list(api.completions.create(prompt=PROMPT, logprobs=0, **params))
            sizes = [len(c.choices[0].logprobs.tokens) for c in chunks if c.choices and c.choices[0].logprobs]
            text = "".join(c.choices[0].text for c in chunks if c.choices)
        else:
            messages = [{"role": "user", "content": PROMPT}]
            chunks = list(api.chat.completions.create(messages=messages, logprobs=True, **params))
            sizes = [
                len(c.choices[0].logprobs.content) for c in chunks if c.choices and c.choices[0].logprobs
            ]
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert sum(sizes) == 14 and all(n >= 4 for n in sizes[:-1]), sizes
    if endpoint == "completions":
        assert text == _offline(reference, max_tokens=14, temperature=0, ignore_eos=True).text


def test_a_lone_surrogate_quoted_in_an_error_is_a_400_not_a_500(checkpoint, tmp_path):
    """JSON may carry a lone surrogate ("\\ud800"), which UTF-8 cannot encode: a chat template's
    error quoting such a role (as Qwen3's raise_exception does) was a 500 and a traceback; it is a
    400 with the character escaped, and the server keeps serving."""
    path = tmp_path / "raising"
    shutil.copytree(checkpoint, path)
    (path / "chat_template.jinja").write_text(
        "{% for m in messages %}{% if m.role not in ['user', 'assistant'] %}"
        "{{ raise_exception('unknown role: ' + m.role) }}{% endif %}{{ m.content }}{% endfor %}"
    )
    with serving_http(path) as server:
        url = f"http://127.0.0.1:{server.http_port}"
        body = json.dumps({"messages": [{"role": "\ud800", "content": "hi"}], "max_tokens": 3})
        for endpoint in ("/v1/chat/completions", "/tokenize"):
            r = httpx.post(url + endpoint, content=body, headers={"content-type": "application/json"})
            assert r.status_code == 400, (endpoint, r.status_code, r.text)
            assert "unknown role: \\ud800" in r.json()["error"]["message"]
        ok = httpx.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
        assert ok.status_code == 200


# Ordinary tokens, then the end-of-sequence token (<|endoftext|>, a special token) whatever the
# model: min_tokens bans it for 6 tokens, then the bias forces it; its text is kept.
SPECIAL_LAST = {
    "max_tokens": 10,
    "temperature": 0,
    "min_tokens": 6,
    "logit_bias": {"0": 100},
    "include_stop_str_in_output": True,
}


@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
def test_skip_special_tokens_false_writes_them_whole_and_streamed(server, reference, checkpoint, endpoint):
    """vLLM's skip_special_tokens: false puts the special tokens in the text as transformers'
    decode(ids, skip_special_tokens=False) writes them, the streamed pieces adding up to the same
    text (it was ignored with a warning); true, the default, leaves them out."""
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_file=str(checkpoint / "tokenizer.json"))
    url = f"http://127.0.0.1:{server.http_port}/v1/{endpoint}"
    chat = endpoint != "completions"
    body = {"messages": [{"role": "user", "content": "Hi"}]} if chat else {"prompt": PROMPT}

    def text_of(choice):
        return choice["message"]["content"] if chat else choice["text"]

    def streamed(**extra):
        pieces = []
        with httpx.stream("POST", url, json={**body, **SPECIAL_LAST, **extra, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    for choice in json.loads(line[6:])["choices"]:
                        pieces.append(choice["delta"].get("content") or "" if chat else choice["text"])
        return "".join(pieces)

    written = httpx.post(url, json={**body, **SPECIAL_LAST, "skip_special_tokens": False}).json()
    skipped = httpx.post(url, json={**body, **SPECIAL_LAST}).json()
    text = text_of(written["choices"][0])
    assert text.endswith("<|endoftext|>") and text_of(skipped["choices"][0]) == text.removesuffix(
        "<|endoftext|>"
    )
    assert streamed(skip_special_tokens=False, spaces_between_special_tokens=True) == text
    assert streamed() == text_of(skipped["choices"][0])
    if not chat:  # the same ids as offline: their text as transformers writes it
        params = {**SPECIAL_LAST, "logit_bias": {0: 100}, "skip_special_tokens": False}
        offline = reference.generate(PROMPT, SamplingParams(**params), use_tqdm=False)[0]
        assert text == offline.text == hf.decode(offline.token_ids, skip_special_tokens=False)
    # A slow tokenizer's spaces_between_special_tokens is taken either way (the same text).
    same = httpx.post(
        url,
        json={**body, **SPECIAL_LAST, "skip_special_tokens": False, "spaces_between_special_tokens": False},
    )
    assert text_of(same.json()["choices"][0]) == text


@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(server, reference, endpoint):
    """vLLM's truncate_prompt_tokens on both endpoints: the prompt's last k tokens are the prompt
    (usage.prompt_tokens counts them; the answer is the one they give); 0 or below -1 is a 400
    naming the field, and a prompt still too long after it the usual one."""
    url = f"http://127.0.0.1:{server.http_port}/v1/{endpoint}"
    chat = endpoint != "completions"
    body = {"messages": [{"role": "user", "content": PROMPT * 10}]} if chat else {"prompt": PROMPT * 10}
    body |= {"max_tokens": 4, "temperature": 0, "ignore_eos": True}
    whole = httpx.post(url, json=body).json()
    assert whole["usage"]["prompt_tokens"] > 6
    got = httpx.post(url, json={**body, "truncate_prompt_tokens": 6}).json()
    assert got["usage"]["prompt_tokens"] == 6
    chunks = []
    stream = {**body, "truncate_prompt_tokens": 6, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", url, json=stream) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert chunks[-1]["usage"]["prompt_tokens"] == 6
    if not chat:
        ids = reference.get_tokenizer().encode(PROMPT * 10)
        offline = reference.generate(ids[-6:], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)[
            0
        ]
        assert got["choices"][0]["text"] == offline.text
        # Echoed, the prompt is the text of the tokens kept (which echoed logprobs are for).
        echoed = httpx.post(url, json={**body, "truncate_prompt_tokens": 6, "echo": True}).json()
        kept = reference.get_tokenizer().decode(ids[-6:], skip_special_tokens=False)
        assert echoed["choices"][0]["text"] == kept + offline.text
    for bad in (0, -2):
        r = httpx.post(url, json={**body, "truncate_prompt_tokens": bad})
        assert r.status_code == 400
        assert r.json()["error"]["message"] == (
            f"truncate_prompt_tokens must be >= 1 (keep the prompt's last N tokens) or -1 (max_model_len), got {bad}"
        )
    if not chat:
        max_model_len = server.engine.engine.limits.max_model_len
        r = httpx.post(url, json={**body, "prompt": [5] * (max_model_len + 5), "truncate_prompt_tokens": -1})
        assert r.status_code == 400
        assert (
            f"prompt ({max_model_len} tokens) + max_tokens (4) exceeds max_model_len"
            in r.json()["error"]["message"]
        )
    assert len(server.engine.streams) == 0


def test_allowed_origins_answer_browsers_cross_origin_and_others_get_no_cors(checkpoint):
    """--allowed-origins (vLLM's flag; CORS): a browser page of an allowed origin gets its preflight
    answered (without the API key it cannot send there) and can read answers, a refusal for a
    missing key included; another origin gets no CORS header (the browser keeps the answer from
    it). Without the flag no response carries one."""
    key, allowed = "sk-cors", "https://app.example.com"
    preflight = {"Origin": allowed, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}  # fmt: skip
    body = {"prompt": "The list type", "max_tokens": 2}
    with serving_http(checkpoint, api_keys=[key], allowed_origins=[allowed]) as server:
        url = f"http://127.0.0.1:{server.http_port}/v1/completions"
        answer = httpx.options(url, headers=preflight)
        assert answer.status_code == 200
        assert answer.headers["access-control-allow-origin"] == allowed
        assert "authorization" in answer.headers["access-control-allow-headers"].lower()
        ok = httpx.post(url, json=body, headers={"Origin": allowed, "Authorization": f"Bearer {key}"})
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == allowed
        refused = httpx.post(url, json=body, headers={"Origin": allowed})
        assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == allowed
        other = httpx.post(
            url, json=body, headers={"Origin": "https://evil.example", "Authorization": f"Bearer {key}"}
        )
        assert "access-control-allow-origin" not in other.headers
    with serving_http(checkpoint) as server:
        url = f"http://127.0.0.1:{server.http_port}/v1/completions"
        plain = httpx.post(url, json=body, headers={"Origin": allowed})
        assert plain.status_code == 200 and "access-control-allow-origin" not in plain.headers
        assert httpx.options(url, headers=preflight).status_code == 405


def test_allowed_origins_flag_takes_a_list_and_refuses_what_is_no_origin():
    from scheduler_service.cli import parse_origins

    assert parse_origins("") == []
    assert parse_origins("https://a.example, http://localhost:3000") == [
        "https://a.example",
        "http://localhost:3000",
    ]
    assert parse_origins('["*"]') == ["*"]
    for bad in ("https://a.example/app", "a.example", '["x", 1]', "[nope"):
        with pytest.raises(ValueError, match="--allowed-origins"):
            parse_origins(bad)


def test_logprobs_0_is_served_under_max_logprobs_0(checkpoint, reference):
    """--max-logprobs 0 bounds the alternatives asked for, so it allows each token's own logprob
    (logprobs 0; a chat's logprobs true with top_logprobs 0) over HTTP and gRPC, as vLLM does and
    as the offline LLM already did; the servers refused it, naming logprobs (1) the client never
    asked for. One alternative is still a 400 naming the limit."""
    from client import TandemClient
    from client.messages import TandemError
    from scheduler_service.async_engine import EngineOptions
    from scheduler_service.config import SchedulerConfig

    want = reference.generate(
        [PROMPT], SamplingParams(max_tokens=3, logprobs=0, temperature=0), use_tqdm=False
    )[0]
    options = EngineOptions(SchedulerConfig(max_num_seqs=8, max_logprobs=0))
    with serving_http(checkpoint, options=options) as server:
        url = f"http://127.0.0.1:{server.http_port}/v1"
        greedy = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0}
        r = httpx.post(f"{url}/completions", json={**greedy, "logprobs": 0})
        assert r.status_code == 200, r.text
        logprobs = r.json()["choices"][0]["logprobs"]
        assert logprobs["token_logprobs"] == pytest.approx([lp.logprob for lp in want.logprobs], abs=1e-5)
        assert [len(top) for top in logprobs["top_logprobs"]] == [1, 1, 1]  # the token's own, as vLLM
        chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "logprobs": True}
        r = httpx.post(f"{url}/chat/completions", json={**chat, "top_logprobs": 0})
        assert r.status_code == 200, r.text
        assert all(entry["top_logprobs"] == [] for entry in r.json()["choices"][0]["logprobs"]["content"])
        r = httpx.post(f"{url}/completions", json={**greedy, "logprobs": 1})
        assert r.status_code == 400
        assert "logprobs (1) exceeds max_logprobs (0" in r.json()["error"]["message"]
        with TandemClient(f"127.0.0.1:{server.port}", retries=0) as client:
            got = client.complete(PROMPT, max_tokens=3, temperature=0, logprobs=0)
            assert got.token_ids == want.token_ids
            assert [lp.logprob for lp in got.logprobs] == pytest.approx(
                [lp.logprob for lp in want.logprobs], abs=1e-5
            )
            assert all(not lp.top_logprobs for lp in got.logprobs)
            with pytest.raises(
                TandemError, match="INVALID_ARGUMENT: logprobs \\(1\\) exceeds max_logprobs \\(0"
            ):
                client.complete(PROMPT, max_tokens=3, logprobs=1)


@pytest.fixture(scope="module")
def bos_server(checkpoint, tmp_path_factory):
    """The checkpoint with a tokenizer that starts each text with a BOS (<|endoftext|>, id 0), as
    Llama's does."""
    path = tmp_path_factory.mktemp("with_bos") / "qwen3"
    shutil.copytree(checkpoint, path)
    tokenizer = json.loads((path / "tokenizer.json").read_text())
    tokenizer["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [
            {"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}},
            {"Sequence": {"id": "A", "type_id": 0}},
        ],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<|endoftext|>": {"id": "<|endoftext|>", "ids": [0], "tokens": ["<|endoftext|>"]}},
    }
    (path / "tokenizer.json").write_text(json.dumps(tokenizer))
    with serving_http(path) as server:
        yield server


@pytest.mark.parametrize(("endpoint", "default"), [("completions", True), ("chat/completions", False)])
def test_add_special_tokens_is_vllm_s(bos_server, endpoint, default):
    """vLLM's add_special_tokens: a completion's text prompt gets the tokenizer's BOS unless it is
    off; a chat's rendered prompt gets it only when it is on (the template writes its own). It was
    ignored (a completion always had it, a chat never)."""
    url = f"http://127.0.0.1:{bos_server.http_port}/v1/{endpoint}"
    body = {"max_tokens": 1, "prompt_logprobs": 0}
    body |= (
        {"prompt": PROMPT} if endpoint == "completions" else {"messages": [{"role": "user", "content": "Hi"}]}
    )

    def prompt_ids(**fields) -> tuple[int, list[int]]:
        r = httpx.post(url, json={**body, **fields})
        assert r.status_code == 200, r.text
        answer = r.json()
        lps = (
            answer["prompt_logprobs"]
            if endpoint != "completions"
            else answer["choices"][0]["prompt_logprobs"]
        )
        assert len(lps) == answer["usage"]["prompt_tokens"]
        return answer["usage"]["prompt_tokens"], [int(next(iter(lp))) for lp in lps[1:]]

    with_bos, without = prompt_ids(add_special_tokens=True), prompt_ids(add_special_tokens=False)
    assert with_bos[0] == without[0] + 1
    assert with_bos[1][1:] == without[1]  # (the BOS is the first token, which has no logprob)
    assert prompt_ids() == (with_bos if default else without)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("allowed_token_ids", [5]),
        ("bad_words", ["list"]),
        ("use_beam_search", True),
        ("logits_processors", ["my.Processor"]),
        ("priority", 1),
    ],
)
@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
def test_vllm_s_sampling_features_not_served_are_a_400(server, endpoint, field, value):
    """vLLM's sampling fields this server cannot honour are a 400 naming them, not ignored (the
    output would have the tokens the client banned); their values that ask for nothing are taken."""
    url = f"http://127.0.0.1:{server.http_port}/v1/{endpoint}"
    body = {"max_tokens": 2}
    body |= (
        {"prompt": PROMPT} if endpoint == "completions" else {"messages": [{"role": "user", "content": "Hi"}]}
    )
    r = httpx.post(url, json={**body, field: value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"] == f"{field} is not supported by this server"
    default = {"allowed_token_ids": None, "bad_words": [], "use_beam_search": False, "priority": 0}
    assert httpx.post(url, json={**body, field: default.get(field)}).status_code == 200
    assert len(server.engine.streams) == 0


def test_tool_choice_without_tools_is_a_400_as_vllm_s(server):
    """vLLM's check_tool_usage: a tool_choice other than "none" needs tools; "required" with an
    empty list of them is "none"."""
    url = f"http://127.0.0.1:{server.http_port}/v1/chat/completions"
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    r = httpx.post(url, json={**body, "tool_choice": "auto"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"] == "When using `tool_choice`, `tools` must be set."
    for ok in (
        {"tool_choice": "none"},
        {"tool_choice": "auto", "tools": []},
        {"tool_choice": "required", "tools": []},
    ):
        assert httpx.post(url, json={**body, **ok}).status_code == 200, ok
