"""The OpenAI-compatible HTTP API against the real services (issue 18, items 1, 2 and 4), through
the official `openai` client: models, completions (equal to gRPC's greedy text), chat (prompt tokens
equal to transformers' apply_chat_template), streaming equal to whole answers, n, logprobs, errors,
API keys, raw SSE framing, and many concurrent streams with cancels that leak no block."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest
from helpers.chat_checkpoint import chat_checkpoint
from helpers.metrics import scrape_samples
from helpers.services import Services

from client import TandemClient
from client.defaults import free_port

pytestmark = pytest.mark.slow

KEY = "sk-http-test"
PROMPT = "def fibonacci(n):"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return chat_checkpoint(tmp_path_factory.mktemp("chat_ckpt"))


@pytest.fixture(scope="module")
def services(checkpoint, tmp_path_factory):
    http_port = free_port()
    services = Services(
        checkpoint, tmp_path_factory.mktemp("http_logs"), ["--http-port", str(http_port), "--api-key", KEY]
    )
    services.http_url = f"http://127.0.0.1:{http_port}"
    try:
        services.start()
        yield services
    finally:
        services.stop()


@pytest.fixture(scope="module")
def api(services):
    return openai.OpenAI(base_url=f"{services.http_url}/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def model(api):
    return api.models.list().data[0].id


def test_models_lists_the_served_model(api, services):
    models = api.models.list().data
    assert len(models) == 1
    with TandemClient(services.address, api_key=KEY) as client:
        assert models[0].id == client.model_info().model


def test_models_retrieve_gives_the_served_model_else_a_404(api, model, services):
    """OpenAI's client.models.retrieve: the served model's card by its id; another id is a 404
    (model_not_found, naming it) and the server goes on serving."""
    card = api.models.retrieve(model)
    assert card.id == model and card.object == "model"
    with pytest.raises(openai.NotFoundError) as e:
        api.models.retrieve("Qwen/Qwen3-8B")
    assert e.value.status_code == 404 and "Qwen/Qwen3-8B" in str(e.value)
    assert e.value.body["code"] == "model_not_found"
    assert api.models.list().data[0].id == model


def test_a_chat_template_sent_with_the_request_is_refused(api, model):
    """A chat template in the request (or in chat_template_kwargs) is a 400 naming it, as vLLM's
    default: it was ignored with a warning, and the prompt rendered with another template."""
    messages = [{"role": "user", "content": "hi"}]
    for extra in (
        {"chat_template": "{{ messages[0].content }}"},
        {"chat_template_kwargs": {"chat_template": "x"}},
    ):
        with pytest.raises(openai.BadRequestError) as e:
            api.chat.completions.create(model=model, messages=messages, max_tokens=2, extra_body=extra)
        assert "chat_template" in str(e.value)
    ok = api.chat.completions.create(model=model, messages=messages, max_tokens=2)
    assert ok.choices[0].finish_reason in ("length", "stop")


def test_completions_equal_the_grpc_greedy_text(api, model, services):
    with TandemClient(services.address, api_key=KEY) as client:
        expected = client.complete(PROMPT, max_tokens=24, temperature=0.0)
    got = api.completions.create(model=model, prompt=PROMPT, max_tokens=24, temperature=0)
    assert got.choices[0].text == expected.text
    assert got.usage.prompt_tokens == expected.prompt_tokens
    assert got.usage.completion_tokens == expected.completion_tokens
    assert got.choices[0].finish_reason == expected.finish_reason


def test_streamed_completion_equals_the_whole_one(api, model):
    whole = api.completions.create(model=model, prompt=PROMPT, max_tokens=24, temperature=0)
    chunks = list(
        api.completions.create(
            model=model,
            prompt=PROMPT,
            max_tokens=24,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason


def test_n_and_logprobs(api, model):
    got = api.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0, n=2, logprobs=2)
    assert [c.index for c in got.choices] == [0, 1]
    assert got.choices[0].text == got.choices[1].text  # greedy
    logprobs = got.choices[0].logprobs
    assert len(logprobs.tokens) == got.usage.completion_tokens // 2
    assert all(len(top) == 2 for top in logprobs.top_logprobs)
    assert all(lp <= 0 for lp in logprobs.token_logprobs)


def test_chat_prompt_tokens_equal_transformers_apply_chat_template(api, model, checkpoint):
    transformers = pytest.importorskip("transformers")
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(checkpoint))
    messages = [
        {"role": "system", "content": "You write Python."},
        {"role": "user", "content": "Sort a list."},
    ]
    for kwargs in ({}, {"enable_thinking": False}):
        expected = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, **kwargs
        )
        if isinstance(expected, dict) or hasattr(expected, "input_ids"):
            expected = expected["input_ids"]
        got = api.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=8,
            temperature=0,
            extra_body={"chat_template_kwargs": kwargs},
        )
        assert got.usage.prompt_tokens == len(expected), kwargs


def test_continue_final_message_prompt_equals_transformers(api, model, checkpoint, services):
    """vLLM's continue_final_message: the prompt ends inside the final (assistant) message, as
    transformers' apply_chat_template(continue_final_message=True) cuts it, through /tokenize and a
    chat completion; with add_generation_prompt left on it is a 400 naming both (it was ignored)."""
    transformers = pytest.importorskip("transformers")
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(checkpoint))
    messages = [
        {"role": "user", "content": "Name a sorting algorithm."},
        {"role": "assistant", "content": "One fast sorting algorithm is"},
    ]
    expected = tokenizer.apply_chat_template(
        messages, add_generation_prompt=False, continue_final_message=True, tokenize=True
    )
    if isinstance(expected, dict) or hasattr(expected, "input_ids"):
        expected = expected["input_ids"]
    body = {
        "model": model,
        "messages": messages,
        "add_generation_prompt": False,
        "continue_final_message": True,
    }
    tokens = httpx.post(
        f"{services.http_url}/tokenize", json=body, headers={"Authorization": f"Bearer {KEY}"}
    )
    assert tokens.status_code == 200 and tokens.json()["tokens"] == expected
    extra = {"add_generation_prompt": False, "continue_final_message": True}
    got = api.chat.completions.create(
        model=model, messages=messages, max_tokens=4, temperature=0, extra_body=extra
    )
    assert got.usage.prompt_tokens == len(expected)
    with pytest.raises(openai.BadRequestError, match="add_generation_prompt"):
        api.chat.completions.create(
            model=model, messages=messages, max_tokens=4, extra_body={"continue_final_message": True}
        )


def test_streamed_chat_equals_the_whole_answer(api, model):
    messages = [{"role": "user", "content": "Write a function."}]
    whole = api.chat.completions.create(
        model=model, messages=messages, max_tokens=24, temperature=0, top_logprobs=2, logprobs=True
    )
    message = whole.choices[0].message
    assert message.role == "assistant"
    assert len(whole.choices[0].logprobs.content) == whole.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 for t in whole.choices[0].logprobs.content)
    chunks = list(
        api.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=24,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reasoning = "".join(
        getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices
    )
    assert content == (message.content or "")
    assert reasoning == (getattr(message, "reasoning_content", None) or "")
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_chat_n_2(api, model):
    got = api.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=8, temperature=0, n=2
    )
    assert len(got.choices) == 2
    assert got.choices[0].message.content == got.choices[1].message.content


def test_errors_are_openai_error_objects(api, model, services):
    with pytest.raises(openai.BadRequestError) as e:
        api.completions.create(model=model, prompt=PROMPT, max_tokens=-1)
    assert e.value.status_code == 400
    assert "max_tokens" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError):
        api.completions.create(model=model, prompt=PROMPT, temperature=-1)
    with pytest.raises(openai.NotFoundError):
        api.completions.create(model="no-such-model", prompt=PROMPT)
    with pytest.raises(openai.BadRequestError):  # the template's raise_exception
        api.chat.completions.create(model=model, messages=[{"role": "robot", "content": "x"}])
    refused = openai.OpenAI(base_url=f"{services.http_url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        refused.models.list()
    assert e.value.status_code == 401
    # health needs no key
    assert httpx.get(f"{services.http_url}/health").status_code == 200


def test_raw_sse_framing(services, model):
    body = {"model": model, "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "stream": True}
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.stream("POST", f"{services.http_url}/v1/completions", json=body, headers=headers) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == ""
    assert events[-2] == "data: [DONE]"
    for event in events[:-2]:
        assert event.startswith("data: ")
        json.loads(event[len("data: ") :])


def test_concurrent_streams_with_cancels_leak_no_block(services, model):
    async def main():
        api = openai.AsyncOpenAI(base_url=f"{services.http_url}/v1", api_key=KEY, max_retries=0, timeout=120)

        async def one(i):
            stream = await api.completions.create(
                model=model, prompt=f"{PROMPT} # {i}", max_tokens=32, temperature=0.8, seed=i, stream=True
            )
            n = 0
            async for _ in stream:
                n += 1
                if i % 3 == 0 and n == 2:  # a third go away mid-stream
                    await stream.close()
                    return "cancelled"
            return "done"

        results = await asyncio.gather(*(one(i) for i in range(200)))
        await api.close()
        return results

    results = asyncio.run(main())
    assert results.count("done") == 200 - len(range(0, 200, 3))
    deadline = time.monotonic() + 30
    with TandemClient(services.address, api_key=KEY) as client:
        client.complete(PROMPT, max_tokens=2)  # the engine is healthy after the storm
    while True:
        metrics = services.metrics("scheduler")
        used = metrics.get("tandem_scheduler_kv_cache_blocks_used")
        running = metrics.get("tandem_scheduler_requests_running")
        if (used == 0 and running == 0) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert (used, running) == (0, 0), services.logs()


def test_grpc_chat_equals_http_chat(api, model, services):
    messages = [{"role": "user", "content": "Write a function."}]
    http = api.chat.completions.create(model=model, messages=messages, max_tokens=16, temperature=0)
    with TandemClient(services.address, api_key=KEY) as client:
        stream = client.chat(messages, max_tokens=16, temperature=0.0)
        chunks = list(stream)
    # the same split as HTTP's: content as text, the <think> block as reasoning_content
    text = "".join(c.text for c in chunks[:-1])
    reasoning = "".join(c.reasoning_content for c in chunks[:-1])
    assert chunks[-1].prompt_tokens == http.usage.prompt_tokens
    message = http.choices[0].message
    assert text == (message.content or "")
    assert reasoning == (getattr(message, "reasoning_content", None) or "")


def test_tandem_chat_cli_streams_replies(api, model, services):
    import subprocess
    import sys

    from helpers.processes import CHILD_ENV, ROOT

    expected = api.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=12, temperature=0
    )
    done = subprocess.run(
        [sys.executable, "-m", "client.cli", "chat", "--server", services.address, "--api-key", KEY]
        + ["--max-tokens", "12"],
        input="Hi\nAgain\n\n",
        capture_output=True,
        text=True,
        env=CHILD_ENV,
        cwd=ROOT,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    replies = done.stdout.split("\n")
    assert replies[0] == expected.choices[0].message.content.split("\n")[0]


def test_request_features_across_the_split_services(api, model, services):
    """logit_bias, min_tokens and prompt_logprobs travel the executor's gRPC step protocol too."""
    with TandemClient(services.address, api_key=KEY) as client:
        eos = client.model_info().eos_token_ids[0]
        grpc_scored = client.complete(PROMPT, max_tokens=1, prompt_logprobs=1)
    forced = api.completions.create(
        model=model, prompt=PROMPT, max_tokens=4, logit_bias={"42": 100}, logprobs=0
    )
    assert len(set(forced.choices[0].logprobs.tokens)) == 1
    held = api.completions.create(
        model=model, prompt=PROMPT, max_tokens=9, logit_bias={str(eos): 100}, extra_body={"min_tokens": 3}
    )
    assert (held.usage.completion_tokens, held.choices[0].finish_reason) == (4, "stop")
    scored = api.completions.create(
        model=model, prompt=PROMPT, max_tokens=1, extra_body={"prompt_logprobs": 1}
    )
    prompt_logprobs = scored.choices[0].model_extra["prompt_logprobs"]
    assert len(prompt_logprobs) == scored.usage.prompt_tokens and prompt_logprobs[0] is None
    http_values = [next(iter(e.values()))["logprob"] for e in prompt_logprobs[1:]]
    assert http_values == pytest.approx([lp.logprob for lp in grpc_scored.prompt_logprobs], abs=1e-6)


def test_values_past_the_step_plan_s_range_fail_only_their_own_request(services, model):
    """The executor's step plan carries sampling parameters as 32-bit numbers (and a 64-bit seed):
    a value outside them is a 400 naming the limit, or is carried as what it means (a top_k past
    the vocabulary is off; a negative seed is vLLM's int64 seed), and never fails the step of a
    request running beside it."""
    url, headers = f"{services.http_url}/v1", {"Authorization": f"Bearer {KEY}"}
    bystander = {"model": model, "prompt": PROMPT, "max_tokens": 256, "temperature": 0, "ignore_eos": True}
    bystander |= {"stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{url}/completions", json=bystander, headers=headers, timeout=60) as running:
        events = running.iter_lines()
        assert next(events).startswith("data: ")  # it is decoding
        refused = [
            ("completions", {"temperature": 1e300}, "temperature must be a finite number (a 32-bit float"),
            ("completions", {"repetition_penalty": 1e300}, "repetition_penalty must be a finite"),
            (
                "completions",
                {"repetition_penalty": 1e-300},
                "repetition_penalty must be > 0, got 1e-300 (0 as a 32-bit float)",
            ),
            # 1e-46 is 0 as the plan's 32-bit float: the executor refused the whole step (500 for
            # every request in it) where the scheduler took it for valid.
            ("completions", {"top_p": 1e-46}, "top_p must be in (0, 1], got 1e-46 (0 as a 32-bit float)"),
            ("completions", {"seed": 2**70}, "seed must be in [-2**63, 2**64)"),
            ("chat/completions", {"min_tokens": 2**40}, "+ min_tokens (1099511627776) exceeds max_model_len"),
        ]
        for endpoint, extra, message in refused:
            body = {"model": model, "prompt": "x", "messages": [{"role": "user", "content": "x"}], **extra}
            r = httpx.post(f"{url}/{endpoint}", json=body, headers=headers, timeout=60)
            assert r.status_code == 400, (extra, r.text)
            assert message in r.json()["error"]["message"]
        sampled = {}
        for extra in ({"seed": -2}, {"seed": 2**64 - 2}, {"seed": 7, "top_k": 10**12}, {"seed": 7}):
            body = {"model": model, "prompt": "x", "max_tokens": 8, "temperature": 1, **extra}
            r = httpx.post(f"{url}/completions", json=body, headers=headers, timeout=60)
            assert r.status_code == 200, r.text
            sampled[json.dumps(extra)] = r.json()["choices"][0]["text"]
        texts = list(sampled.values())
        assert texts[0] == texts[1] and texts[2] == texts[3]  # -2 is 2**64 - 2; top_k 10**12 is off
        chunks = [json.loads(e.removeprefix("data: ")) for e in events if e and e != "data: [DONE]"]
    assert "error" not in chunks[-1], chunks[-1]
    assert chunks[-1]["usage"]["completion_tokens"] == 256
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"


def test_http_requests_land_in_the_request_histograms(api, model, services):
    """An HTTP request that finished is in e2e latency and the request token histograms, as a gRPC
    one is: their counts agree with tandem_scheduler_requests_finished_total."""
    names = [
        "tandem_scheduler_requests_finished_total",
        "tandem_scheduler_e2e_request_latency_seconds_count",
        "tandem_scheduler_request_prompt_tokens_count",
        "tandem_scheduler_request_generation_tokens_count",
        "tandem_scheduler_request_prompt_tokens_sum",
        "tandem_scheduler_request_generation_tokens_sum",
    ]
    services.wait_idle()
    time.sleep(0.3)  # the earlier tests' series relayed by API server processes (every 0.1 s)
    before = services.metrics("scheduler")
    whole = api.completions.create(model=model, prompt=PROMPT, max_tokens=5, temperature=0, n=2)
    chunks = list(
        api.completions.create(
            model=model,
            prompt=PROMPT,
            max_tokens=3,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    streamed = chunks[-1].usage
    prompt = whole.usage.prompt_tokens
    want = {
        "tandem_scheduler_requests_finished_total": 3,
        "tandem_scheduler_e2e_request_latency_seconds_count": 3,
        "tandem_scheduler_request_prompt_tokens_count": 3,
        "tandem_scheduler_request_generation_tokens_count": 3,
        "tandem_scheduler_request_prompt_tokens_sum": 2 * prompt + streamed.prompt_tokens,
        "tandem_scheduler_request_generation_tokens_sum": whole.usage.completion_tokens
        + streamed.completion_tokens,
    }
    # API server processes (--api-server-count) relay their series to the core every 0.1 s.
    deadline = time.monotonic() + 5
    while True:
        after = services.metrics("scheduler")
        delta = {name: after.get(name, 0) - before.get(name, 0) for name in names}
        if delta == want or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert delta == want


def test_http_requests_the_client_abandons_are_counted_as_cancelled(services, model):
    """A client that goes away (a stream closed mid-answer, a whole answer it stopped waiting for)
    is in tandem_scheduler_requests_failed_total{code="CANCELLED"}, as a cancelled gRPC call is."""
    url = f"http://127.0.0.1:{services.metrics_port}/metrics"

    def cancelled() -> float:
        return (
            scrape_samples(url)
            .get("tandem_scheduler_requests_failed_total", {})
            .get((("code", "CANCELLED"),), 0)
        )

    services.wait_idle()
    before = cancelled()
    body = {"model": model, "prompt": PROMPT, "max_tokens": 1000, "ignore_eos": True, "temperature": 0}
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=services.http_url, headers=headers) as http:
        with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
            lines = response.iter_lines()
            while not next(lines).startswith("data:"):
                pass
        with pytest.raises(httpx.ReadTimeout):
            http.post("/v1/completions", json=body, timeout=httpx.Timeout(10, read=0.3))
    services.wait_idle()
    deadline = time.monotonic() + 5
    while cancelled() - before < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert cancelled() - before == 2


def test_http_requests_refused_before_admission_are_counted(services, model):
    """A completion refused for its body (not JSON, a bad field), its timeout header or its model is
    in tandem_scheduler_requests_failed_total, as a gRPC request refused for its message is."""
    url = f"http://127.0.0.1:{services.metrics_port}/metrics"

    def failed() -> dict:
        return scrape_samples(url).get("tandem_scheduler_requests_failed_total", {})

    services.wait_idle()
    time.sleep(0.3)  # the earlier tests' series relayed by API server processes (every 0.1 s)
    before = failed()
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=services.http_url, headers=headers) as http:
        for response in (
            http.post("/v1/completions", content=b"{not json", headers={"Content-Type": "application/json"}),
            http.post("/v1/chat/completions", json={"model": model, "messages": "hi"}),
            http.post(
                "/v1/completions",
                json={"model": model, "prompt": PROMPT},
                headers={"X-Request-Timeout": "nan"},
            ),
            http.post("/v1/completions", json={"model": "not-this-one", "prompt": PROMPT}),
        ):
            assert response.status_code in (400, 404), response.text

    def delta(code: str) -> float:
        return after.get((("code", code),), 0) - before.get((("code", code),), 0)

    # API server processes (--api-server-count) relay their series to the core every 0.1 s.
    deadline = time.monotonic() + 5
    while True:
        after = failed()
        if (delta("INVALID_ARGUMENT"), delta("NOT_FOUND")) == (3, 1) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert delta("INVALID_ARGUMENT") == 3
    assert delta("NOT_FOUND") == 1
