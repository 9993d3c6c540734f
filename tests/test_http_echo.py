"""A completion's `echo` through the HTTP API (the scheduler in-process over a LocalExecutor, talked
to with the official `openai` client and httpx), as vLLM's server answers it: each choice's text is
its prompt then its completion, and with `logprobs` the prompt's tokens come first in them (the
first with null), scored as `prompt_logprobs` scores them. Evaluation harnesses read a prompt's
likelihood this way (lm-evaluation-harness's `local-completions`); the server refused echo with a
400."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from helpers.scheduler_server import post_ok, serving_http, stream_chunks

from scheduler_service.tokenizer import Tokenizer

PROMPT = "The list type"
PROMPTS = ["The list type", "A tuple is"]


@pytest.fixture(scope="module")
def server(qwen3_tied):
    with serving_http(qwen3_tied) as server:
        yield server


@pytest.fixture(scope="module")
def url(server):
    return f"http://127.0.0.1:{server.http_port}/v1/completions"


@pytest.fixture(scope="module")
def api(server):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.http_port}/v1", api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def tokenizer(qwen3_tied):
    return Tokenizer(qwen3_tied)


def _joined(chunks: list[dict]) -> dict[int, dict]:
    """Each choice's streamed chunks put together: index -> text, logprobs, finish and stop reasons."""
    out: dict[int, dict] = {}
    for chunk in chunks:
        for c in chunk["choices"]:
            got = out.setdefault(c["index"], {"text": "", "logprobs": None, "chunks": 0})
            got["chunks"] += 1
            got["text"] += c["text"]
            if c["logprobs"] is not None:
                lp = got["logprobs"] or {k: [] for k in c["logprobs"]}
                got["logprobs"] = {k: lp[k] + c["logprobs"][k] for k in lp}
            if c["finish_reason"] is not None:
                got["finish_reason"], got["stop_reason"] = c["finish_reason"], c["stop_reason"]
    return out


def _prompt_part(prompt_logprobs: list, num_top: int) -> dict:
    """The completion logprobs an echoed prompt should have, from vLLM's prompt_logprobs of it."""
    tokens, values, tops = [], [], []
    for entry in prompt_logprobs[1:]:
        own = next(iter(entry.values()))  # (the token's own entry comes first)
        tokens.append(own["decoded_token"])
        values.append(own["logprob"])
        top = {e["decoded_token"]: e["logprob"] for e in list(entry.values())[1:] if e["rank"] <= num_top}
        tops.append({own["decoded_token"]: own["logprob"], **top})
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops}


def test_echo_returns_the_prompt_then_the_completion(url, api):
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    plain = post_ok(url, **body)
    echoed = post_ok(url, **body, echo=True)
    completion = plain["choices"][0]["text"]
    assert completion and echoed["choices"][0]["text"] == PROMPT + completion
    assert echoed["choices"][0]["logprobs"] is None
    assert echoed["usage"] == plain["usage"]  # (the prompt counted once, not as completion tokens)
    assert (echoed["choices"][0]["finish_reason"], echoed["choices"][0]["stop_reason"]) == ("length", None)
    # Streamed: the prompt comes first, then the completion; the same text in all.
    chunks = stream_chunks(url, **body, echo=True, stream_options={"include_usage": True})
    assert chunks[0]["choices"][0]["text"].startswith(PROMPT)
    assert _joined(chunks)[0]["text"] == PROMPT + completion
    assert chunks[-1]["usage"] == plain["usage"]
    # The openai client reads it as a vLLM server's.
    got = api.completions.create(model="", prompt=PROMPT, max_tokens=6, temperature=0, echo=True)
    assert got.choices[0].text.startswith(PROMPT)


def test_echoed_logprobs_are_the_prompt_s_then_the_completion_s(url, tokenizer):
    """The prompt's part of `logprobs` is what prompt_logprobs scores (the first token null), the
    completion's part what the completion's logprobs are without echo; text_offset follows the
    echoed text, whole and streamed."""
    body = {"prompt": PROMPT, "max_tokens": 5, "temperature": 0, "ignore_eos": True, "logprobs": 2}
    ids = tokenizer.encode(PROMPT)
    scored = post_ok(url, **body, prompt_logprobs=2)["choices"][0]["prompt_logprobs"]
    plain = post_ok(url, **body)["choices"][0]
    got = post_ok(url, **body, echo=True)["choices"][0]
    assert got["prompt_logprobs"] is None  # (not asked for)
    lp = got["logprobs"]
    n = len(ids)
    assert lp["tokens"][0] == tokenizer.token_text(ids[0])
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    expected = _prompt_part(scored, 2)
    for key in ("tokens", "token_logprobs", "top_logprobs"):
        assert lp[key][1:n] == expected[key], key
        assert lp[key][n:] == plain["logprobs"][key], key
    assert got["text"] == PROMPT + plain["text"]
    assert "".join(lp["tokens"]) == got["text"]
    offsets = [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(lp["tokens"]))]
    assert lp["text_offset"] == offsets and lp["text_offset"][n] == len(PROMPT)
    assert max(len(top) for top in lp["top_logprobs"][1:n]) == 3  # (the top 2 and the token itself)

    # With prompt_logprobs asked too (fewer than logprobs), that field keeps its own count.
    both = post_ok(url, **body, echo=True, prompt_logprobs=0)["choices"][0]
    assert both["logprobs"] == lp
    assert all(len(entry) == 1 for entry in both["prompt_logprobs"][1:])

    streamed = _joined(stream_chunks(url, **body, echo=True))[0]
    assert streamed["text"] == got["text"] and streamed["logprobs"] == lp


def test_a_token_id_prompt_is_echoed_as_its_text(url, tokenizer):
    ids = tokenizer.encode(PROMPT)
    body = {"max_tokens": 4, "temperature": 0, "ignore_eos": True, "echo": True, "logprobs": 1}
    as_text = post_ok(url, **body, prompt=PROMPT)["choices"][0]
    as_ids = post_ok(url, **body, prompt=ids)["choices"][0]
    assert tokenizer.decode(ids, skip_special_tokens=False) == PROMPT
    assert as_ids["text"] == as_text["text"] and as_ids["text"].startswith(PROMPT)
    assert as_ids["logprobs"] == as_text["logprobs"]
    # Special tokens included (as /detokenize writes them).
    eos = tokenizer.token_to_id("<|endoftext|>")
    got = post_ok(url, **{**body, "logprobs": None}, prompt=[*ids, eos])["choices"][0]
    assert got["text"].startswith(PROMPT + "<|endoftext|>")
    streamed = _joined(stream_chunks(url, **body, prompt=ids))[0]
    assert streamed["text"] == as_ids["text"] and streamed["logprobs"] == as_ids["logprobs"]


@pytest.mark.parametrize("stream", [False, True])
def test_each_choice_echoes_its_own_prompt(url, stream):
    """n samples of each of two prompts: choice i is sample i % n of prompt i // n, and echoes that
    prompt (with its logprobs, scored once by its first sample)."""
    body = {"prompt": PROMPTS, "n": 2, "max_tokens": 5, "temperature": 1.0, "seed": 7, "ignore_eos": True}
    plain = post_ok(url, **body, logprobs=1)
    scored = [post_ok(url, prompt=p, max_tokens=1, prompt_logprobs=1)["choices"][0] for p in PROMPTS]
    if stream:
        chunks = stream_chunks(url, **body, logprobs=1, echo=True, stream_options={"include_usage": True})
        got, usage = _joined(chunks), chunks[-1]["usage"]
        for i in range(4):  # (each choice's first chunk carries its prompt whole)
            first = next(c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == i)
            assert first["text"].startswith(PROMPTS[i // 2])
    else:
        echoed = post_ok(url, **body, logprobs=1, echo=True)
        got, usage = {c["index"]: c for c in echoed["choices"]}, echoed["usage"]
    assert usage == plain["usage"]
    assert sorted(got) == [0, 1, 2, 3]
    for i, c in enumerate(plain["choices"]):
        prompt = PROMPTS[i // 2]
        assert got[i]["text"] == prompt + c["text"]
        lp = got[i]["logprobs"]
        n = len(scored[i // 2]["prompt_logprobs"])
        assert lp["token_logprobs"][0] is None
        expected = _prompt_part(scored[i // 2]["prompt_logprobs"], 1)
        assert lp["tokens"][1:n] == expected["tokens"]
        assert lp["token_logprobs"][1:n] == pytest.approx(expected["token_logprobs"], abs=1e-4)
        assert lp["tokens"][n:] == c["logprobs"]["tokens"]
        assert lp["text_offset"][n] == len(prompt)


@pytest.mark.parametrize("stream", [False, True])
def test_max_tokens_0_returns_the_prompt_alone(url, stream):
    """vLLM's (and OpenAI's) echo with max_tokens 0: the prompt scored, nothing generated (the one
    token the engine samples is not returned, nor counted)."""
    body = {"prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 2}
    body["temperature"] = 0
    whole = post_ok(url, **{**body, "max_tokens": 3, "ignore_eos": True})["choices"][0]
    n = len(whole["logprobs"]["tokens"]) - 3
    if stream:
        chunks = stream_chunks(url, **body, stream_options={"include_usage": True})
        got, usage = _joined(chunks)[0], chunks[-1]["usage"]
    else:
        response = post_ok(url, **body)
        got, usage = response["choices"][0], response["usage"]
    assert got["text"] == PROMPT
    assert got["logprobs"] == {k: v[:n] for k, v in whole["logprobs"].items()}
    assert (got["finish_reason"], got["stop_reason"]) == ("length", None)
    assert usage["completion_tokens"] == 0 and usage["prompt_tokens"] == n
    # Without logprobs: the prompt's text alone.
    assert post_ok(url, **{**body, "logprobs": None})["choices"][0]["text"] == PROMPT


def test_stop_strings_apply_to_the_completion_alone(url):
    """Stop strings, include_stop_str_in_output, finish_reason and stop_reason are those of the
    completion without echo: a stop string in the prompt stops nothing."""
    body = {"prompt": PROMPT, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    full = post_ok(url, **body)["choices"][0]["text"]
    stop = full[4:7]
    in_prompt = PROMPT[4:]
    assert in_prompt not in full
    for extra in ({}, {"include_stop_str_in_output": True}):
        fields = {**body, **extra, "stop": [stop, in_prompt]}
        plain = post_ok(url, **fields)["choices"][0]
        echoed = post_ok(url, **fields, echo=True)["choices"][0]
        assert (echoed["finish_reason"], echoed["stop_reason"]) == ("stop", stop)
        assert echoed["text"] == PROMPT + plain["text"]
        assert plain["text"].endswith(stop) == bool(extra)
        streamed = _joined(stream_chunks(url, **fields, echo=True))[0]
        assert (streamed["text"], streamed["finish_reason"], streamed["stop_reason"]) == (
            echoed["text"],
            "stop",
            stop,
        )


@pytest.mark.parametrize(
    "endpoint, fields, message",
    [
        ("completions", {"suffix": "!"}, "suffix is not supported"),
        ("completions", {"max_tokens": 0, "min_tokens": 1}, "min_tokens (1) must be <= max_tokens (0)"),
        ("completions", {"max_tokens": -1}, "max_tokens must be >= 1, got -1"),
        ("completions", {"echo": False, "max_tokens": 0}, "max_tokens must be >= 1, got 0"),
        ("chat/completions", {}, "echo is not supported in chat completions"),
    ],
)
def test_what_echo_cannot_do_is_a_400_naming_the_field(server, url, endpoint, fields, message):
    body = {"max_tokens": 2, "echo": True}
    body |= (
        {"prompt": PROMPT} if endpoint == "completions" else {"messages": [{"role": "user", "content": "Hi"}]}
    )
    r = httpx.post(url.replace("completions", endpoint), json={**body, **fields})
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]["message"], r.json()["error"]["message"]
    assert len(server.engine.streams) == 0


def test_a_prompt_echoed_alone_needs_room_for_the_token_it_samples(url, api):
    """With max_tokens 0 the engine still samples one token: a prompt of max_model_len tokens does
    not fit, and the 400 says why rather than naming a max_tokens of 1 the client never sent."""
    max_model_len = api.models.list().data[0].model_extra["max_model_len"]
    body = {"prompt": [5] * max_model_len, "max_tokens": 0, "echo": True}
    r = httpx.post(url, json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"] == (
        f"This model's maximum context length is {max_model_len} tokens: "
        f"prompt ({max_model_len} tokens) + 1 token (echo with max_tokens 0 still samples one, not "
        f"returned) exceeds max_model_len ({max_model_len})"
    )
    assert post_ok(url, **{**body, "prompt": [5] * (max_model_len - 1)})["usage"]["completion_tokens"] == 0


@pytest.mark.parametrize("bad_id", [-1, 2**40, 4096])
def test_an_echoed_token_id_outside_the_vocabulary_is_a_400(server, url, bad_id):
    """The prompt's text is decoded for the echo: an id the tokenizer cannot take (negative, or past
    32 bits) was a 500 from the decoder, before the check that refuses it for every other prompt."""
    for max_tokens in (2, 0):
        r = httpx.post(url, json={"prompt": [5, bad_id], "max_tokens": max_tokens, "echo": True})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["message"].startswith(
            f"token id {bad_id} at position 1 is outside the vocabulary"
        )
    assert len(server.engine.streams) == 0


def test_servers_text_continues_the_prompt_with_a_sentencepiece_style_tokenizer(qwen3_tied, tmp_path):
    """With a tokenizer that writes a word's space as the "▁" its token begins with (Llama 2's,
    Mistral's), a completion's text decoded alone lost its first space, so prompt + text ran two
    words together; decoded as the prompt's continuation (as vLLM's) it keeps it: HTTP whole and
    streamed, and gRPC, as the offline LLM."""
    import shutil

    from checkpoints import train_tokenizer

    from client import TandemClient

    directory = tmp_path / "ckpt"
    shutil.copytree(qwen3_tied, directory)
    train_tokenizer(directory, metaspace=True)
    word = Tokenizer(directory).token_to_id("▁object")
    with serving_http(directory) as server:
        body = {"prompt": "The list type is", "max_tokens": 2, "logit_bias": {str(word): 100}}
        url = f"http://127.0.0.1:{server.http_port}/v1/completions"
        assert httpx.post(url, json=body).json()["choices"][0]["text"] == " object object"
        with httpx.stream("POST", url, json={**body, "stream": True}) as response:
            events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
        pieces = [json.loads(e)["choices"][0]["text"] for e in events if e != "[DONE]"]
        assert "".join(pieces) == " object object"
        with TandemClient(f"127.0.0.1:{server.port}") as client:
            got = client.complete("The list type is", max_tokens=2, logit_bias={word: 100})
        assert got.text == " object object"
