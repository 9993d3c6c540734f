"""Request features through gRPC (the scheduler service in-process over a LocalExecutor, talked to
with TandemClient): n samples in one stream, prompt logprobs and logprobs with token text,
logit_bias and min_tokens, include_stop_str_in_output, request ids and users in the logs, and
bad input refused with INVALID_ARGUMENT naming the limit while the service keeps serving."""

from __future__ import annotations

import asyncio
import json
import logging
import time

import grpc
import pytest
from helpers.scheduler_server import NUM_KV_BLOCKS, make_server, metrics, wait_idle

from client import AsyncTandemClient, Final, TandemClient, TandemError, cli
from client.llm import LLM
from scheduler_service.sampling_params import SamplingParams
from scheduler_service.server import ServerThread

PROMPT = "The list type"


@pytest.fixture(scope="module")
def server(qwen3_tied):
    thread = ServerThread(make_server(qwen3_tied))
    yield thread.start()
    thread.stop()


@pytest.fixture(scope="module")
def client(server):
    with TandemClient(f"127.0.0.1:{server.port}", retries=0) as client:
        client.wait_until_serving(20)
        yield client


@pytest.fixture(scope="module")
def reference(qwen3_tied):
    return LLM(str(qwen3_tied), num_kv_blocks=NUM_KV_BLOCKS)


def test_n_samples_come_in_one_stream_and_equal_the_offline_ones(client, reference):
    params = {"max_tokens": 12, "temperature": 1.0, "seed": 5}
    samples = client.complete_samples(PROMPT, 3, **params)
    expected = reference.generate(PROMPT, SamplingParams(**params, n=3), use_tqdm=False)[0]
    assert [s.index for s in samples] == [0, 1, 2]
    assert [s.token_ids for s in samples] == [o.token_ids for o in expected.outputs]
    assert [s.text for s in samples] == [o.text for o in expected.outputs]
    assert len({tuple(s.token_ids) for s in samples}) == 3
    with pytest.raises(ValueError, match="complete_samples"):
        client.complete(PROMPT, n=2)


def test_cancelling_a_request_of_n_samples_ends_them_all(client, server):
    stream = client.generate(PROMPT, n=4, max_tokens=500, ignore_eos=True)
    next(stream)
    stream.cancel()
    after = wait_idle(server)
    assert after[("tandem_scheduler_kv_cache_blocks_used",)] == 0


# Seeded samples 1 and 2 of this request: sample 0 draws token 5 (a stop token) first, sample 1
# goes on for all its 600 tokens.
EARLY_AND_LATE = dict(n=2, max_tokens=600, temperature=1.0, seed=1, stop_token_ids=[5])


def _cancelled(server) -> float:
    return metrics(server).get(("tandem_scheduler_requests_failed_total", ("code", "CANCELLED")), 0.0)


def _wait_cancelled(server, before: float) -> None:
    deadline = time.monotonic() + 10
    while _cancelled(server) == before:
        assert time.monotonic() < deadline, "the request was not cancelled"
        time.sleep(0.05)


def test_leaving_a_stream_after_one_samples_final_cancels_the_others(client, server):
    """A stream left (its `with` block) before its last sample ended is cancelled, every sample of
    it, as one left before any final: the first sample's final is not the end of the stream."""
    before = _cancelled(server)
    with client.generate(PROMPT, **EARLY_AND_LATE) as stream:
        for item in stream:
            if isinstance(item, Final):
                break
    assert (item.index, item.finish_reason, item.completion_tokens) == (0, "stop", 1)
    _wait_cancelled(server, before)  # the 600-token sample was aborted, not run to its end
    assert wait_idle(server)[("tandem_scheduler_kv_cache_blocks_used",)] == 0

    async def leave_async():
        async with AsyncTandemClient(f"127.0.0.1:{server.port}", retries=0) as aclient:
            async with aclient.generate(PROMPT, **EARLY_AND_LATE) as astream:
                async for item in astream:
                    if isinstance(item, Final):
                        break
            _wait_cancelled(server, before + 1)  # while the channel is still open

    asyncio.run(leave_async())


def test_prompt_logprobs_and_logprobs_carry_token_text(client, reference):
    got = client.complete(PROMPT, max_tokens=4, logprobs=2, prompt_logprobs=2)
    expected = reference.generate(
        PROMPT, SamplingParams(max_tokens=4, logprobs=2, prompt_logprobs=2), use_tqdm=False
    )[0]
    assert len(got.prompt_logprobs) == len(expected.prompt_token_ids) - 1
    for mine, ref in zip(got.prompt_logprobs, expected.prompt_logprobs[1:], strict=True):
        assert (mine.token_id, mine.token, mine.rank) == (ref.token_id, ref.token, ref.rank)
        assert mine.logprob == pytest.approx(ref.logprob, abs=1e-5)
        assert mine.top_tokens == ref.top_tokens and len(mine.top_logprobs) == 2
    text = reference.tokenizer.token_text
    assert [lp.token for lp in got.logprobs] == [text(t) for t in got.token_ids]
    assert all(lp.top_tokens == [text(t) for t, _ in lp.top_logprobs] for lp in got.logprobs)


def test_logit_bias_and_min_tokens(client):
    forced = client.complete(PROMPT, max_tokens=5, logit_bias={42: 100})
    assert forced.token_ids == [42] * 5
    eos = client.model_info().eos_token_ids[0]
    eager = client.complete(PROMPT, max_tokens=10, logit_bias={eos: 100})
    assert (eager.token_ids, eager.finish_reason) == ([eos], "stop")
    held = client.complete(PROMPT, max_tokens=10, logit_bias={eos: 100}, min_tokens=4)
    assert len(held.token_ids) == 5 and held.token_ids[-1] == eos and eos not in held.token_ids[:4]


def test_include_stop_str_in_output(client):
    full = client.complete(PROMPT, max_tokens=16, ignore_eos=True)
    stop = full.text[4:7]
    kept = client.complete(
        PROMPT, max_tokens=16, ignore_eos=True, stop=[stop], include_stop_str_in_output=True
    )
    cut = client.complete(PROMPT, max_tokens=16, ignore_eos=True, stop=[stop])
    assert kept.text == full.text[: full.text.find(stop) + len(stop)]
    assert cut.text == full.text[: full.text.find(stop)]
    assert kept.stop_reason == stop


def test_a_stop_token_ids_stop_reason_is_an_int_as_offline(client, reference):
    """The offline LLM and the HTTP API give a stop token id as an int; the client gave "358", so
    `stop_reason == token_id` never held. A stop string that looks like an id stays a string."""
    token = client.complete(PROMPT, max_tokens=16, ignore_eos=True).token_ids[1]
    params = {"max_tokens": 16, "stop_token_ids": [token]}
    got = client.complete(PROMPT, **params)
    expected = reference.generate(PROMPT, SamplingParams(**params), use_tqdm=False)[0].outputs[0]
    assert (got.finish_reason, got.stop_reason) == ("stop", expected.stop_reason) == ("stop", token)
    assert isinstance(got.stop_reason, int)
    stream = list(client.generate(PROMPT, **params))
    assert stream[-1].stop_reason == token
    text = client.complete(PROMPT, max_tokens=16, ignore_eos=True).text
    as_str = client.complete(PROMPT, max_tokens=16, ignore_eos=True, stop=[text[2:4]])
    assert as_str.stop_reason == text[2:4] and isinstance(as_str.stop_reason, str)


@pytest.mark.parametrize(
    "params, message",
    [
        ({"logit_bias": {3: 100.5}}, "logit_bias[3] must be in [-100, 100], got 100.5"),
        ({"logit_bias": dict.fromkeys(range(301), 1.0)}, "logit_bias has 301 entries; at most 300"),
        ({"logit_bias": {512: 1.0}}, "logit_bias token id 512 is outside the vocabulary (size 512)"),
        ({"min_tokens": 9, "max_tokens": 8}, "min_tokens (9) must be <= max_tokens (8)"),
        ({"n": 129}, "n must be in [1, 128], got 129"),
        ({"prompt_logprobs": 21}, "prompt_logprobs (21) exceeds max_logprobs (20"),
        # (15M of them in one message held the event loop, health included, for 9 s)
        ({"stop_token_ids": [5] * 4097}, "at most 4096 stop_token_ids, got 4097"),
    ],
)
def test_bad_features_are_invalid_argument_and_the_service_keeps_serving(client, params, message):
    with pytest.raises(TandemError) as e:
        list(client.generate(PROMPT, **{"max_tokens": 8, **params}))
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert message in e.value.message
    assert client.complete(PROMPT, max_tokens=2).token_ids


def test_the_logs_name_the_request_and_its_user(client, caplog):
    with caplog.at_level(logging.INFO, logger="scheduler_service"):
        client.complete(PROMPT, max_tokens=2, request_id="req-logged-1", user="alice")
        stream = client.generate(PROMPT, max_tokens=500, ignore_eos=True, request_id="req-logged-2")
        next(stream)
        stream.cancel()
        deadline = time.monotonic() + 5
        while "req-logged-2 aborted" not in caplog.text:
            assert time.monotonic() < deadline, caplog.text
            time.sleep(0.02)
    assert "request req-logged-1 (user 'alice'): 6 prompt tokens, max_tokens=2" in caplog.text


def test_tandem_generate_json_with_samples_usage_and_logprobs(server, qwen3_tied, capsys):
    flags = ["--n", "2", "--temperature", "1", "--seed", "3", "--max-tokens", "3", "--json"]
    flags += ["--logit-bias", "42=100", "--prompt-logprobs", "1", "--logprobs", "1", "--prompt-ids", "5,6,7"]
    for where in (
        ["--server", f"127.0.0.1:{server.port}", "--user", "cli-user"],
        ["--model", str(qwen3_tied)],
    ):
        assert cli.main(["generate", *where, *flags]) == 0
        lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
        assert [line["index"] for line in lines] == [0, 1]
        for line in lines:
            assert line["token_ids"] == [42, 42, 42]
            usage = line["usage"]
            assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (3, 3, 6)
            assert [lp["token_id"] for lp in line["logprobs"]] == [42] * 3 and line["logprobs"][0]["token"]
            prompt_logprobs = line["prompt_logprobs"]
            assert prompt_logprobs[0] is None and [p["token_id"] for p in prompt_logprobs[1:]] == [6, 7]
    with pytest.raises(SystemExit) as e:
        cli.main(["generate", "--server", f"127.0.0.1:{server.port}", "--logit-bias", "x", "--prompt", "a"])
    assert e.value.code == 2
    assert "--logit-bias takes ID=BIAS (e.g. 42=100), got 'x'" in capsys.readouterr().err


def test_skip_special_tokens_false_writes_them_in_the_text(client, reference, qwen3_tied):
    """skip_special_tokens=False over gRPC: the chunks' text adds up to transformers'
    decode(ids, skip_special_tokens=False) of the generated ids, as the offline LLM's; unset, they
    are left out; spaces_between_special_tokens is taken either way (the same text)."""
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_file=str(qwen3_tied / "tokenizer.json"))
    # Ordinary tokens, then the end-of-sequence token forced after min_tokens, its text kept.
    params = {"max_tokens": 10, "min_tokens": 6, "logit_bias": {0: 100.0}, "include_stop_str_in_output": True}
    for stop in (None, ["no such text"]):
        got = client.complete(PROMPT, **params, stop=stop, skip_special_tokens=False)
        assert got.token_ids[-1] == 0 and got.text.endswith("<|endoftext|>")
        assert got.text == hf.decode(got.token_ids, skip_special_tokens=False)
        offline = reference.generate(
            PROMPT, SamplingParams(**params, skip_special_tokens=False), use_tqdm=False
        )[0]
        assert got.text == offline.text
        plain = client.complete(PROMPT, **params, stop=stop)
        assert (
            plain.text
            == hf.decode(got.token_ids, skip_special_tokens=True)
            == got.text.removesuffix("<|endoftext|>")
        )
        spaced = client.complete(
            PROMPT, **params, stop=stop, skip_special_tokens=False, spaces_between_special_tokens=False
        )
        assert spaced.text == got.text


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(client, reference):
    """truncate_prompt_tokens over gRPC: the final's prompt_tokens counts the tokens kept and the
    output is theirs, for text and token id prompts; 0 or -2 is INVALID_ARGUMENT naming it."""
    ids = reference.get_tokenizer().encode(PROMPT * 10)
    expected = reference.generate(ids[-6:], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
    for prompt in (PROMPT * 10, ids):
        got = client.complete(prompt, max_tokens=4, ignore_eos=True, truncate_prompt_tokens=6)
        assert (got.prompt_tokens, got.token_ids) == (6, expected.token_ids)
    whole = client.complete(ids, max_tokens=1, truncate_prompt_tokens=-1)
    assert whole.prompt_tokens == len(ids)
    for bad in (0, -2):
        with pytest.raises(TandemError) as e:
            client.complete(PROMPT, truncate_prompt_tokens=bad)
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert (
            f"truncate_prompt_tokens must be >= 1 (keep the prompt's last N tokens) or -1 (max_model_len), got {bad}"
            in e.value.message
        )
