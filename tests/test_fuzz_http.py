"""Bad input at the HTTP API (http_api.py): hypothesis throwing malformed bodies at /v1/completions,
/v1/chat/completions, /tokenize and /detokenize, malformed JSON text and headers at all of them, and
unknown paths and methods, against an in-process scheduler over the fake executor (fast: no model)
whose checkpoint has Qwen3's own chat template (tools, tool calls, reasoning).

Every answer must be the server's own: a status under 500; for a 4xx, an OpenAI error object
(`{"error": {"message", "type", "param", "code"}}`, a message that says something); for a stream, a
4xx before it starts or events that are each JSON and end in `data: [DONE]` (or an error event),
never a connection cut short; and a good request right after is served. The gRPC side's catalogue
is tests/test_fuzz_generate.py; the known bad bodies, each with its status and message, are in
tests/test_http_request_features.py and here (test_catalog)."""

from __future__ import annotations

import json
import math
import os
import shutil

import httpx
import pytest
from helpers.chat_templates import QWEN3
from helpers.fake_executor import FakeExecutor
from helpers.scheduler_server import serving_http
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler_service.http_api import MAX_BODY_BYTES

# The fake's context: long enough for Qwen3's tools preamble, short enough that a request without
# max_tokens ends soon.
MAX_MODEL_LEN = 512
VOCAB = 512
JSON_HEADERS = {"content-type": "application/json"}
# Hypothesis examples per test: each is a request and a good one after it (a few ms each).
EXAMPLES = int(os.environ.get("TANDEM_FUZZ_EXAMPLES", 60))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@pytest.fixture(scope="module")
def checkpoint(qwen3_tied, tmp_path_factory):
    path = tmp_path_factory.mktemp("fuzz_http") / "qwen3"
    shutil.copytree(qwen3_tied, path)
    (path / "chat_template.jinja").write_text(QWEN3)
    return path


@pytest.fixture(scope="module")
def url(checkpoint):
    executor = FakeExecutor(num_kv_blocks=2048, block_size=4, max_model_len=MAX_MODEL_LEN)
    with serving_http(checkpoint, executor=executor) as server:
        yield f"http://127.0.0.1:{server.http_port}"


@pytest.fixture(scope="module")
def client(url):
    with httpx.Client(base_url=url, timeout=60) as client:
        yield client


# -- what every answer must be --------------------------------------------------------------------


def _dumps(body) -> bytes:
    """JSON text as a client may write it: lone surrogates escaped (\\ud800), NaN and Infinity as
    Python's json writes them (the server's parser reads them)."""
    return json.dumps(body, allow_nan=True).encode()


def check_error(r: httpx.Response) -> None:
    """A 4xx in the server's own shape."""
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:500])
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"].strip(), error
    assert isinstance(error["type"], str) and isinstance(error["code"], str), error


def check_events(text: str) -> None:
    """A stream's events: each a JSON chunk, the last `[DONE]` (or an error event after which the
    stream ends); nothing cut short."""
    assert text.endswith("\n\n"), text[-300:]
    events = [e for e in text.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events), text[:300]
    payloads = [e[len("data: ") :] for e in events]
    if payloads[-1] == "[DONE]":
        payloads = payloads[:-1]
    else:  # an error event ends it
        assert "error" in json.loads(payloads[-1]), payloads[-1][:300]
    for payload in payloads:
        chunk = json.loads(payload)  # (JSON: no NaN, no Infinity)
        assert "error" in chunk or "choices" in chunk, payload[:300]
        assert "Infinity" not in payload and "NaN" not in payload, payload[:300]


def check_answer(r: httpx.Response) -> None:
    """Whatever the request, an answer of the server's own."""
    assert r.status_code < 500, (r.status_code, r.text[:500])
    if 300 <= r.status_code < 400:  # (FastAPI's, as vLLM's: a path with a trailing slash, redirected)
        assert r.status_code == 307 and r.headers["location"], r.headers
    elif r.status_code >= 400 and r.request.method != "HEAD":
        check_error(r)
    elif r.headers.get("content-type", "").startswith("text/event-stream"):
        check_events(r.text)
    elif r.request.method != "HEAD":  # (HEAD: no body)
        json.loads(r.text)


def good_request_works(client: httpx.Client) -> None:
    r = client.post("/v1/completions", json={"prompt": "The list type", "max_tokens": 2})
    assert r.status_code == 200, r.text[:500]
    assert r.json()["usage"]["completion_tokens"] == 2


def post(client: httpx.Client, path: str, content: bytes, headers: dict | None = None) -> httpx.Response:
    r = client.post(path, content=content, headers=JSON_HEADERS if headers is None else headers)
    check_answer(r)
    return r


# What a 400 says of a body that is no JSON object: never the answer to one that is.
_NO_OBJECT = (
    "the request body is not",
    "the request body must be",
    "the request body is empty",
    "the request body could not",
)


def post_object(client: httpx.Client, path: str, body: dict) -> httpx.Response:
    """post() of a JSON object: a refusal names what is wrong in it, not the body's shape (a field
    name with a lone surrogate was "the request body must be a JSON object, got a string")."""
    r = post(client, path, _dumps(body))
    if r.status_code == 400:
        assert not r.json()["error"]["message"].startswith(_NO_OBJECT), r.text[:500]
    return r


# -- strategies -----------------------------------------------------------------------------------

# Integers at every limit a field may have: 0, negative, int32, int64, uint64 and beyond.
BOUNDARY_INTS = st.sampled_from(
    [0, -1, 1, 2, -(2**31), 2**31 - 1, 2**31, 2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**30]
)
SMALL_INTS = st.integers(-3, 6)
FLOATS = st.sampled_from(
    [0.0, -0.0, 0.5, 1.0, 2.0, -1.0, 5e-324, 1e-320, 1e308, 3.5e38, -3.5e38, math.nan, math.inf, -math.inf]
) | st.floats(allow_nan=True, allow_infinity=True)
# Text at Unicode's edges: lone surrogates (JSON escapes them; no UTF-8 holds them), NUL, controls,
# other scripts' digits, astral characters, a long run.
EDGE_TEXT = st.sampled_from(
    ["", " ", "x", "\x00", "\ud800", "\udfff", "a\ud800b", "\n", "\u0661", "é", "🙂", "<think>", "</think>",
     "<tool_call>", "<|im_end|>", "<|endoftext|>", "x" * 3000, "\u202e", "\ufeff", "null"]
)  # fmt: skip
TEXT = EDGE_TEXT | st.text(max_size=12)
LEAF = st.none() | st.booleans() | BOUNDARY_INTS | SMALL_INTS | FLOATS | TEXT
JSON_VALUE = st.recursive(
    LEAF, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3), max_leaves=10
)
INTS = BOUNDARY_INTS | SMALL_INTS
TOKEN_IDS = st.lists(st.integers(0, VOCAB - 1) | BOUNDARY_INTS, max_size=6)


def _maybe(good: st.SearchStrategy) -> st.SearchStrategy:
    """A field's value: mostly one it may take, else anything JSON can say."""
    return st.one_of(good, good, JSON_VALUE)


LOGIT_BIAS_KEYS = st.sampled_from(["5", "-1", "512", "05", "abc", "", "1e3", "9" * 30])
_SAMPLING = {
    "model": st.sampled_from(["fake", "qwen3", "", "/x/fake"]) | TEXT,
    "n": st.integers(1, 3) | INTS,
    "stream": st.booleans(),
    "stream_options": st.none()
    | st.fixed_dictionaries(
        {}, optional={"include_usage": _maybe(st.booleans()), "continuous_usage_stats": _maybe(st.booleans())}
    ),
    "temperature": st.sampled_from([0, 0.7, 1]) | FLOATS,
    "top_p": st.sampled_from([0.9, 1]) | FLOATS,
    "top_k": st.sampled_from([-1, 0, 5]) | INTS,
    "min_p": FLOATS,
    "seed": INTS,
    "stop": TEXT | st.lists(TEXT, max_size=4) | st.just(["x"] * 100) | st.just([""]),
    "stop_token_ids": TOKEN_IDS,
    "presence_penalty": FLOATS,
    "frequency_penalty": FLOATS,
    "repetition_penalty": FLOATS,
    "logit_bias": st.dictionaries(LOGIT_BIAS_KEYS | TEXT, FLOATS | SMALL_INTS, max_size=3),
    "min_tokens": INTS,
    "prompt_logprobs": st.none() | INTS,
    "ignore_eos": st.booleans(),
    "include_stop_str_in_output": st.booleans(),
    "skip_special_tokens": st.booleans(),
    "spaces_between_special_tokens": st.booleans(),
    "truncate_prompt_tokens": st.sampled_from([-1, 1, 4]) | INTS,
    "response_format": st.none()
    | st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object", "json_schema"]) | JSON_VALUE}),
    "return_token_ids": st.booleans(),
    "user": TEXT,
    "max_tokens": st.integers(1, 4) | INTS,
    # vLLM's fields it refuses, and fields no API has
    "guided_json": JSON_VALUE,
    "priority": JSON_VALUE,
    "bad_words": JSON_VALUE,
    "x_unknown": JSON_VALUE,
}

_COMPLETION = {
    **_SAMPLING,
    "logprobs": st.none() | st.integers(0, 3) | INTS,
    "echo": st.booleans(),
    "suffix": st.none() | TEXT,
    "best_of": st.none() | INTS,
    "add_special_tokens": st.booleans(),
}

PROMPT = st.one_of(
    TEXT,
    st.just("The list type"),
    TOKEN_IDS,
    st.lists(TEXT, max_size=3),
    st.lists(TOKEN_IDS, max_size=3),
    st.lists(st.lists(TOKEN_IDS, max_size=2), max_size=2),  # a list of lists of lists
)

_PART = st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "image_url", "input_audio", "bogus"]) | JSON_VALUE},
    optional={"text": _maybe(TEXT), "image_url": _maybe(st.just({"url": "data:image/png;base64,AAAA"}))},
)
_CALL = st.fixed_dictionaries(
    {},
    optional={
        "id": _maybe(st.just("call_1")),
        "type": _maybe(st.just("function")),
        "function": _maybe(
            st.fixed_dictionaries(
                {},
                optional={"name": _maybe(st.just("get_weather")), "arguments": _maybe(st.just('{"a": 1}'))},
            )
        ),
    },
)
MESSAGE = st.fixed_dictionaries(
    {},
    optional={
        "role": _maybe(st.sampled_from(["user", "assistant", "system", "tool", "developer", "bogus"])),
        "content": st.one_of(TEXT, st.none(), st.lists(_PART, max_size=2), JSON_VALUE),
        "tool_calls": st.none() | st.lists(_CALL, max_size=2) | JSON_VALUE,
        "reasoning": _maybe(TEXT),
        "tool_call_id": _maybe(TEXT),
        "name": _maybe(TEXT),
    },
)
TOOL = st.fixed_dictionaries(
    {},
    optional={
        "type": _maybe(st.just("function")),
        "function": _maybe(
            st.fixed_dictionaries(
                {},
                optional={
                    "name": _maybe(st.sampled_from(["get_weather", "", "a b"])),
                    "description": _maybe(TEXT),
                    "parameters": _maybe(st.dictionaries(TEXT, JSON_VALUE, max_size=3)),
                },
            )
        ),
    },
)
TOOL_CHOICE = st.one_of(
    st.sampled_from(["none", "auto", "required", "bogus"]),
    st.fixed_dictionaries(
        {"type": _maybe(st.just("function"))},
        optional={"function": _maybe(st.fixed_dictionaries({"name": _maybe(st.just("get_weather"))}))},
    ),
    JSON_VALUE,
)

# Template variables a request's chat_template_kwargs may name: its own, and the server's.
KWARG_NAMES = st.sampled_from(
    ["enable_thinking", "tools", "messages", "chat_template", "add_generation_prompt"]
)
_CHAT = {
    **_SAMPLING,
    "max_completion_tokens": st.integers(1, 4) | INTS,
    "logprobs": st.booleans(),
    "top_logprobs": st.integers(0, 3) | INTS,
    "tools": st.none() | st.lists(TOOL, max_size=2),
    "tool_choice": TOOL_CHOICE,
    "chat_template_kwargs": st.none() | st.dictionaries(KWARG_NAMES | TEXT, JSON_VALUE, max_size=2),
    "add_generation_prompt": st.booleans(),
    "continue_final_message": st.booleans(),
    "documents": st.none() | st.lists(st.dictionaries(TEXT, JSON_VALUE, max_size=2), max_size=2),
    "add_special_tokens": st.booleans(),
    "echo": st.booleans(),
    "chat_template": st.none() | TEXT,
}


@st.composite
def bodies(draw, fields: dict, required: dict) -> dict:
    """A body: the required fields (mostly of their own shape), a few others (mostly good values),
    and a short max_tokens unless the draw says otherwise (the fake generates up to max_model_len)."""
    body = {name: draw(_maybe(strategy)) for name, strategy in required.items()}
    for name in draw(st.lists(st.sampled_from(sorted(fields)), max_size=6, unique=True)):
        body[name] = draw(_maybe(fields[name]))
    if draw(st.integers(0, 4)) == 0:  # a field no API has, named anything
        body[draw(TEXT)] = draw(JSON_VALUE)
    body.setdefault("max_tokens", 3)
    if isinstance(body.get("n"), int) and body["n"] > 4 and draw(st.booleans()):
        body["n"] = 4  # (a valid n of 128 is a valid request, only slow)
    return body


COMPLETION_BODIES = bodies(_COMPLETION, {"prompt": PROMPT})
CHAT_BODIES = bodies(_CHAT, {"messages": st.lists(MESSAGE, max_size=3)})


# -- the fuzzers ----------------------------------------------------------------------------------


@FUZZ
@given(body=COMPLETION_BODIES)
def test_fuzz_completions(client, body):
    post_object(client, "/v1/completions", body)
    good_request_works(client)


@FUZZ
@given(body=CHAT_BODIES)
def test_fuzz_chat_completions(client, body):
    post_object(client, "/v1/chat/completions", body)
    good_request_works(client)


_TOKENIZE = {
    "model": _SAMPLING["model"],
    "prompt": TEXT,
    "messages": st.lists(MESSAGE, max_size=3),
    "add_special_tokens": st.booleans(),
    "return_token_strs": st.booleans(),
    "add_generation_prompt": st.booleans(),
    "continue_final_message": st.booleans(),
    "tools": _CHAT["tools"],
    "documents": _CHAT["documents"],
    "chat_template_kwargs": _CHAT["chat_template_kwargs"],
}


@FUZZ
@given(
    tokenize=st.fixed_dictionaries({}, optional={k: _maybe(v) for k, v in _TOKENIZE.items()}),
    detokenize=st.fixed_dictionaries(
        {}, optional={"tokens": _maybe(TOKEN_IDS | st.lists(TOKEN_IDS)), "model": _maybe(_SAMPLING["model"])}
    ),
)
def test_fuzz_tokenize_and_detokenize(client, tokenize, detokenize):
    post_object(client, "/tokenize", tokenize)
    post_object(client, "/detokenize", detokenize)
    good_request_works(client)


# Bytes JSON text does not allow where they land, or that mean something else there.
JUNK_BYTES = [b"\x00", b"\xff", b"\xc3", b"\xed\xa0\x80", b"NaN", b"-Infinity", b"1e999", b"\\ud800",
              b'\\"', b"\\", b"{", b"[", b"]", b"}", b",", b":", b'"', b"null", b"\n", b"\xef\xbb\xbf"]  # fmt: skip
GOOD_BODY = b'{"prompt": "The list type", "max_tokens": 2, "stop": ["x"], "logit_bias": {"5": 1}}'


@st.composite
def mangled(draw) -> bytes:
    """A good body's JSON text, cut, spliced or salted with bytes JSON does not allow there."""
    text = bytearray(GOOD_BODY)
    for _ in range(draw(st.integers(1, 3))):
        at = draw(st.integers(0, len(text)))
        action = draw(st.sampled_from(["cut", "insert", "delete", "replace"]))
        if action == "cut":
            del text[at:]
        elif action == "delete":
            del text[at : at + draw(st.integers(1, 5))]
        else:
            junk = draw(st.sampled_from(JUNK_BYTES) | st.binary(max_size=4))
            text[at : at + (1 if action == "replace" else 0)] = junk
    return bytes(text)


HEADERS = st.sampled_from(
    [
        JSON_HEADERS,
        {},
        {"content-type": "text/plain"},
        {"content-type": "application/json; charset=utf-16"},
        {"content-type": "application/json; charset=bogus"},
        {"content-type": "application/x-www-form-urlencoded"},
        {"content-type": "multipart/form-data; boundary=x"},
        {"content-type": "application/json", "content-encoding": "gzip"},
        {"content-type": "application/json", "x-request-timeout": "nan"},
        {"content-type": "application/json", "x-request-timeout": "-1"},
        {"content-type": "application/json", "x-request-timeout": "1e999"},
        {"content-type": "application/json", "x-request-timeout": "\u00bd".encode()},
    ]
)
PATHS = ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]
OTHER_PATHS = [*PATHS, "/v1/models", "/v1/models/fake", "/v1/models/", "/v1/models/%ff%00", "/v1/embeddings",
               "/health", "/ping", "/version", "/v1", "/", "/v1/completions/", "//v1/models", "/v1/models/a/b"]  # fmt: skip


@FUZZ
@given(content=mangled() | st.binary(max_size=40), headers=HEADERS, path=st.sampled_from(PATHS))
def test_fuzz_json_text_and_headers(client, content, headers, path):
    post(client, path, content, headers)
    good_request_works(client)


@FUZZ
@given(
    method=st.sampled_from(["GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "TRACE"]),
    path=st.sampled_from(OTHER_PATHS) | st.text(alphabet="/%azAZ09.-_~", max_size=20).map(lambda p: "/" + p),
    content=st.just(b"") | st.just(GOOD_BODY),
)
def test_fuzz_paths_and_methods(client, method, path, content):
    r = client.request(method, path, content=content, headers=JSON_HEADERS)
    check_answer(r)
    if r.status_code >= 400 and method != "HEAD":
        assert r.status_code in (400, 404, 405, 413, 422), r.status_code
    good_request_works(client)


# -- known inputs that broke the rule -------------------------------------------------------------

CHAT = '"messages": [{"role": "user", "content": "Hi"}]'
CATALOG: list[tuple[str, str, bytes, int, str]] = [
    # (name, path, body, status, the message's start)
    (  # (was "the request body must be a JSON object, got a string")
        "field-name-not-unicode",
        "/v1/completions",
        b'{"prompt": "hi", "max_tokens": 2, "\\ud800": 1}',
        400,
        "the request body's field name '\\ud800' is not valid Unicode (surrogates not allowed)",
    ),
    (
        "chat-field-name-not-unicode",
        "/v1/chat/completions",
        ("{" + CHAT + ', "max_tokens": 2, "x\\udc00": [1]}').encode(),
        400,
        "the request body's field name 'x\\udc00' is not valid Unicode (surrogates not allowed)",
    ),
    (  # (was ignored: the ids were the server's template's, a 200)
        "tokenize-chat-template",
        "/tokenize",
        ("{" + CHAT + ', "chat_template": "{{ messages }}"}').encode(),
        400,
        "chat_template in a request is not supported",
    ),
    (
        "tokenize-chat-template-kwarg",
        "/tokenize",
        ("{" + CHAT + ', "chat_template_kwargs": {"chat_template": "{{ messages }}"}}').encode(),
        400,
        "chat_template in a request is not supported",
    ),
    (
        "body-over-limit",
        "/v1/completions",
        b'{"prompt": "' + b"x" * MAX_BODY_BYTES + b'"}',
        413,
        f"the request body of {MAX_BODY_BYTES + 14} bytes exceeds the limit of {MAX_BODY_BYTES} bytes",
    ),
]


@pytest.mark.parametrize(
    ("case", "path", "content", "status", "message"), CATALOG, ids=[c[0] for c in CATALOG]
)
def test_catalog(client, case, path, content, status, message):
    r = post(client, path, content)
    assert r.status_code == status, r.text[:500]
    assert r.json()["error"]["message"].startswith(message), r.text[:500]
    good_request_works(client)
