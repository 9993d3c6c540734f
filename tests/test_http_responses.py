"""The response side of the HTTP API against vLLM's OpenAI-compatible server (the scheduler
in-process over a LocalExecutor, talked to with httpx): the fields of whole answers (vLLM's extras
null unless asked for), vLLM's return_token_ids (whole and streamed, completions and chat), a chat
stream's first chunks (a role each), logprobs a model rules out (-inf: vLLM's -9999.0, which JSON
can carry), the model card's fields, and vLLM's /version and /ping."""

from __future__ import annotations

import json
import math
import shutil

import httpx
import pytest
from helpers.fake_executor import FakeExecutor
from helpers.scheduler_server import post_ok, serving_http, stream_chunks
from tokenizers import Tokenizer as HFTokenizer

from scheduler_service.tokenizer import Tokenizer

PROMPT = "The list type"
MESSAGES = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def checkpoint(qwen3_tied, tmp_path_factory):
    """The conftest checkpoint with a plain chat template."""
    path = tmp_path_factory.mktemp("with_template") / "qwen3"
    shutil.copytree(qwen3_tied, path)
    (path / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ m.role }}: {{ m.content }}{{ '\\n' }}{% endfor %}assistant:"
    )
    return path


@pytest.fixture(scope="module")
def url(checkpoint):
    with serving_http(checkpoint) as server:
        yield f"http://127.0.0.1:{server.http_port}"


@pytest.fixture(scope="module")
def tokenizer(checkpoint):
    return Tokenizer(checkpoint)


def test_whole_answers_carry_vllm_s_fields_null_unless_asked(url):
    """vLLM's whole answers always carry system_fingerprint and service_tier, a completion choice
    its prompt_logprobs, prompt_token_ids and token_ids, a chat answer its prompt_logprobs and
    prompt_token_ids and each choice its token_ids: null where not asked for. (They were missing: a
    client reading them as vLLM writes them failed on a missing key.)"""
    completion = post_ok(f"{url}/v1/completions", prompt=PROMPT, max_tokens=2)
    assert (completion["system_fingerprint"], completion["service_tier"]) == (None, None)
    choice = completion["choices"][0]
    assert (choice["prompt_logprobs"], choice["prompt_token_ids"], choice["token_ids"]) == (None, None, None)
    chat = post_ok(f"{url}/v1/chat/completions", messages=MESSAGES, max_tokens=2)
    assert (chat["system_fingerprint"], chat["prompt_logprobs"], chat["prompt_token_ids"]) == (
        None,
        None,
        None,
    )
    assert chat["choices"][0]["token_ids"] is None


def test_return_token_ids_in_a_whole_completion(url, tokenizer):
    """vLLM's return_token_ids: each choice's prompt_token_ids (the prompt as encoded) and token_ids
    (what it generated: as many as completion_tokens, whose text is the choice's); it was ignored."""
    got = post_ok(
        f"{url}/v1/completions",
        prompt=PROMPT,
        max_tokens=6,
        temperature=0,
        ignore_eos=True,
        n=2,
        return_token_ids=True,
    )
    for choice in got["choices"]:
        assert choice["prompt_token_ids"] == tokenizer.encode(PROMPT)
        assert len(choice["token_ids"]) == 6
        assert tokenizer.decode(choice["token_ids"]) == choice["text"]
    assert got["usage"]["completion_tokens"] == 12
    # a list of prompts: each choice has its own
    two = post_ok(f"{url}/v1/completions", prompt=[PROMPT, "A tuple"], max_tokens=2, return_token_ids=True)
    assert [c["prompt_token_ids"] for c in two["choices"]] == [
        tokenizer.encode(p) for p in (PROMPT, "A tuple")
    ]


def test_return_token_ids_stop_where_the_text_stops(url, tokenizer):
    """A stop string ends the text early: the ids returned are those of the tokens kept (those the
    usage counts)."""
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    full = post_ok(f"{url}/v1/completions", **body)["choices"][0]["text"]
    stop = full[5:8]
    got = post_ok(f"{url}/v1/completions", **body, stop=[stop], return_token_ids=True)
    choice = got["choices"][0]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", stop)
    assert len(choice["token_ids"]) == got["usage"]["completion_tokens"] < 12
    assert tokenizer.decode(choice["token_ids"]).startswith(choice["text"])


def test_return_token_ids_in_a_streamed_completion(url, tokenizer):
    """Streamed, as vLLM's: a choice's first chunk carries the prompt's ids, each chunk its own
    generated ids, which put together are the whole answer's."""
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "n": 2}
    whole = post_ok(f"{url}/v1/completions", **body, return_token_ids=True)
    chunks = stream_chunks(f"{url}/v1/completions", **body, return_token_ids=True)
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == index]
        assert mine[0]["prompt_token_ids"] == tokenizer.encode(PROMPT)
        assert all("prompt_token_ids" not in c for c in mine[1:])
        assert [i for c in mine for i in c["token_ids"]] == whole["choices"][index]["token_ids"]
        assert "".join(c["text"] for c in mine) == whole["choices"][index]["text"]
    # not asked for: no ids in the chunks
    plain = stream_chunks(f"{url}/v1/completions", **body)
    assert all("token_ids" not in c and "prompt_token_ids" not in c for ch in plain for c in ch["choices"])


def test_return_token_ids_in_chat(url, tokenizer):
    """Chat, as vLLM's: the prompt's ids at the answer's top level (streamed: in the first chunk),
    each choice's generated ids in it (streamed: each chunk's own)."""
    body = {"messages": MESSAGES, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    prompt_ids = tokenizer.encode("user: Hi\nassistant:", add_special_tokens=False)
    whole = post_ok(f"{url}/v1/chat/completions", **body, return_token_ids=True)
    assert whole["prompt_token_ids"] == prompt_ids
    ids = whole["choices"][0]["token_ids"]
    assert len(ids) == whole["usage"]["completion_tokens"] == 6
    assert tokenizer.decode(ids) == whole["choices"][0]["message"]["content"]
    chunks = stream_chunks(f"{url}/v1/chat/completions", **body, return_token_ids=True)
    assert chunks[0]["prompt_token_ids"] == prompt_ids
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    assert [i for c in chunks[1:] if c["choices"] for i in c["choices"][0]["token_ids"]] == ids


def test_a_chat_stream_sends_each_choice_s_role_in_a_chunk_of_its_own(url):
    """OpenAI's and vLLM's streams carry one choice a chunk: with n > 1 the first chunks (the role)
    were one chunk of n choices, where a client reading choices[0] saw the first choice's only."""
    chunks = stream_chunks(f"{url}/v1/chat/completions", messages=MESSAGES, max_tokens=3, n=3)
    assert all(len(c["choices"]) == 1 for c in chunks if c["choices"])
    firsts = [c["choices"][0] for c in chunks[:3]]
    assert [c["index"] for c in firsts] == [0, 1, 2]
    assert all(c["delta"] == {"role": "assistant", "content": ""} for c in firsts)
    finished = [c["choices"][0]["index"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert sorted(finished) == [0, 1, 2]


def test_the_model_card_has_vllm_s_fields(url):
    """vLLM's model card: root, parent and permission beside OpenAI's fields and max_model_len."""
    card = httpx.get(f"{url}/v1/models").json()["data"][0]
    assert card["root"] == card["id"] and card["parent"] is None and card["max_model_len"] == 1024
    [permission] = card["permission"]
    assert permission["object"] == "model_permission" and permission["id"].startswith("modelperm-")
    assert (
        permission["allow_sampling"] and permission["allow_logprobs"] and not permission["allow_fine_tuning"]
    )
    assert httpx.get(f"{url}/v1/models/{card['id']}").json()["permission"][0]["object"] == "model_permission"


def test_version_and_ping(url):
    """vLLM's /version (the server's version) and /ping (SageMaker's health check, GET or POST):
    they were 404s."""
    r = httpx.get(f"{url}/version")
    assert r.status_code == 200 and isinstance(r.json()["version"], str)
    assert httpx.get(f"{url}/ping").status_code == 200
    assert httpx.post(f"{url}/ping").status_code == 200


class RulesOut(FakeExecutor):
    """Every token's alternatives after its first are ruled out by the model: logprob -inf."""

    def step(self, plan):
        result = super().step(plan)
        for lp in result.logprobs:
            lp.top_logprobs = [v if i == 0 else -math.inf for i, v in enumerate(lp.top_logprobs)]
        return result


@pytest.fixture(scope="module")
def ruling_out(checkpoint):
    with serving_http(checkpoint, executor=RulesOut(num_kv_blocks=64, max_model_len=128)) as server:
        yield f"http://127.0.0.1:{server.http_port}"


@pytest.mark.parametrize("stream", [False, True])
def test_a_logprob_of_minus_infinity_is_minus_9999(ruling_out, stream):
    """JSON has no infinity: a whole answer with a -inf logprob failed with a 500, and a stream
    sent `-Infinity`, which JSON parsers refuse. vLLM (and OpenAI) write -9999.0."""
    body = {"prompt": [5, 6, 7], "max_tokens": 3, "logprobs": 3}
    if stream:
        with httpx.stream("POST", f"{ruling_out}/v1/completions", json={**body, "stream": True}) as r:
            text = "".join(r.iter_text())
        assert "Infinity" not in text
        chunks = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
        tops = [
            t for c in chunks for ch in c["choices"] if ch["logprobs"] for t in ch["logprobs"]["top_logprobs"]
        ]
    else:
        tops = post_ok(f"{ruling_out}/v1/completions", **body)["choices"][0]["logprobs"]["top_logprobs"]
    assert tops and all(-9999.0 in top.values() for top in tops)
    assert all(v >= -9999.0 for top in tops for v in top.values())


def test_tokenize_s_token_strs_are_the_vocabulary_s(url, checkpoint):
    """vLLM's token_strs are convert_ids_to_tokens': the vocabulary's strings (byte-level BPE writes
    a leading space as "Ġ"), not each token's decoded text, which they were."""
    raw = HFTokenizer.from_file(str(checkpoint / "tokenizer.json"))
    got = httpx.post(
        f"{url}/tokenize", json={"prompt": "hello world again", "return_token_strs": True}
    ).json()
    assert got["token_strs"] == [raw.id_to_token(i) for i in got["tokens"]]
    assert any(s.startswith("Ġ") for s in got["token_strs"])


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "endpoint, body",
    [
        ("completions", {"prompt": "word " * 2000}),  # (refused from its size, before it is tokenized)
        ("completions", {"prompt": [5] * 1020, "max_tokens": 10}),
        ("chat/completions", {"messages": [{"role": "user", "content": "x " * 1020}], "max_tokens": 10}),
    ],
)
def test_a_prompt_too_long_is_openai_s_context_length_error(url, endpoint, body, stream):
    """A prompt too long for the model is a 400 whose message starts as OpenAI's and vLLM's ("This
    model's maximum context length is N tokens"), with OpenAI's code context_length_exceeded: what
    clients look for to tell it from other 400s (LiteLLM's ContextWindowExceededError); the
    server goes on serving."""
    r = httpx.post(f"{url}/v1/{endpoint}", json={**body, "stream": stream}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["message"].startswith("This model's maximum context length is 1024 tokens: prompt (")
    assert "max_model_len (1024)" in error["message"] and error["code"] == "context_length_exceeded"
    assert post_ok(f"{url}/v1/completions", prompt=PROMPT, max_tokens=1)["choices"][0]["finish_reason"]
