"""The offline LLM as a user of vLLM's offline API (vllm.LLM, vllm.SamplingParams) writes against
it: the fields of its outputs, the prompt forms generate() takes, chat()."""

from __future__ import annotations

import pytest

from client.llm import LLM
from scheduler_service.sampling_params import SamplingParams

PROMPT = [5, 6, 7, 8, 9]


@pytest.fixture(scope="module")
def llm(qwen3_tied):
    return LLM(str(qwen3_tied), block_size=4, num_kv_blocks=256, max_num_seqs=8, max_num_batched_tokens=64)


def _generate(llm, prompt, **params):
    return llm.generate(prompt, SamplingParams(**params), use_tqdm=False)[0]


def test_stop_reason_is_the_stop_token_id_as_an_int(llm):
    """vLLM's stop_reason is the stop token id (an int) or the stop string (a str); it was the id as
    a string ("42"), so `stop_reason == token_id` never held."""
    token = _generate(llm, PROMPT, max_tokens=4, ignore_eos=True).token_ids[2]
    for stop in ([], ["no such text"]):  # (with stop strings, the text is matched as it goes)
        out = _generate(llm, PROMPT, max_tokens=8, ignore_eos=True, stop_token_ids=[token], stop=stop)
        assert out.outputs[0].finish_reason == "stop"
        assert out.outputs[0].stop_reason == token and isinstance(out.outputs[0].stop_reason, int)
    length = _generate(llm, PROMPT, max_tokens=2, ignore_eos=True)
    assert (length.outputs[0].finish_reason, length.outputs[0].stop_reason) == ("length", None)
