"""Stop strings end generation the same way in-process (`LLM.generate`, `tandem generate --model`)
as through the services (tests/test_e2e_services.py, test_scheduler_service.py): the text ends
before the stop string, the tokens at the one that completed it, the finish reason is "stop"."""

from __future__ import annotations

import json

import pytest

from client import cli
from client.llm import LLM
from scheduler_service.sampling_params import SamplingParams

MAX_TOKENS = 24
PROMPT = "The list type"


@pytest.fixture(scope="module")
def llm(qwen3_tied):
    return LLM(str(qwen3_tied), num_kv_blocks=256)


def spanning_stop(llm: LLM, full) -> str:
    """Three characters of the output that start inside its sixth token and end in a later one."""
    pieces = [llm.tokenizer.decode([t]) for t in full.token_ids]
    start = len("".join(pieces[:5])) + len(pieces[5]) - 1
    return full.text[start : start + 3]


def test_a_stop_string_ends_offline_generation_at_the_token_that_completed_it(llm):
    full = llm.generate(PROMPT, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False)[0]
    assert full.finish_reason == "length" and len(full.token_ids) == MAX_TOKENS
    stop = spanning_stop(llm, full)
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, stop=["never seen", stop])
    out = llm.generate(PROMPT, params, use_tqdm=False)[0]
    assert out.finish_reason == "stop"
    assert out.text == full.text[: full.text.find(stop)]
    assert out.token_ids == full.token_ids[: len(out.token_ids)] and len(out.token_ids) < MAX_TOKENS
    decode = llm.tokenizer.decode
    assert stop in decode(out.token_ids) and stop not in decode(out.token_ids[:-1])


def test_a_batch_stops_each_request_at_its_own_stop_string(llm):
    full = llm.generate(PROMPT, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False)[0]
    stop = spanning_stop(llm, full)
    params = [
        SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, stop=[stop]),
        SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True),
        SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, stop=["never seen"]),
    ]
    stopped, unstopped, unmatched = llm.generate([PROMPT] * 3, params, use_tqdm=False)
    assert stopped.finish_reason == "stop" and stopped.text == full.text[: full.text.find(stop)]
    assert (unstopped.text, unstopped.finish_reason) == (full.text, "length")
    assert (unmatched.token_ids, unmatched.text) == (full.token_ids, full.text)
    assert unmatched.finish_reason == "length"


def test_tandem_generate_model_stops_at_the_stop_string(llm, qwen3_tied, capsys):
    full = llm.generate(PROMPT, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False)[0]
    stop = spanning_stop(llm, full)
    argv = ["generate", PROMPT, "--model", str(qwen3_tied), "--max-tokens", str(MAX_TOKENS), "--ignore-eos"]
    assert cli.main([*argv, "--stop", stop, "--json"]) == 0
    line = json.loads(capsys.readouterr().out)
    assert line["finish_reason"] == "stop" and line["text"] == full.text[: full.text.find(stop)]
    assert line["token_ids"] == full.token_ids[: len(line["token_ids"])]


def test_stop_strings_need_a_tokenizer_and_are_bounded(llm):
    with pytest.raises(ValueError, match="at most 64 stop strings"):
        SamplingParams(stop=["x"] * 65)
    with pytest.raises(ValueError, match=r"stop\[0\] is 1025 characters long"):
        SamplingParams(stop=["x" * 1025])
    with pytest.raises(ValueError, match=r"stop\[1\] is an empty string"):  # vLLM refuses it too
        SamplingParams(stop=["x", ""])
    tokenizer, llm.tokenizer = llm.tokenizer, None
    try:
        with pytest.raises(ValueError, match="stop strings need a tokenizer"):
            llm.generate([[5, 6]], SamplingParams(stop=["x"]), use_tqdm=False)
    finally:
        llm.tokenizer = tokenizer
