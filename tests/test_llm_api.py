"""The offline LLM as a user of vLLM's offline API (vllm.LLM, vllm.SamplingParams) writes against
it: the fields of its outputs, the prompt forms generate() takes, chat()."""

from __future__ import annotations

import json
import shutil

import pytest
from helpers.chat_checkpoint import QWEN3_TEMPLATE

from client.llm import LLM
from scheduler_service.sampling_params import SamplingParams

PROMPT = [5, 6, 7, 8, 9]


@pytest.fixture(scope="module")
def llm(qwen3_tied):
    return LLM(str(qwen3_tied), block_size=4, num_kv_blocks=256, max_num_seqs=8, max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def chat_llm(qwen3_tied, tmp_path_factory):
    """The tied checkpoint with Qwen3's chat template."""
    directory = tmp_path_factory.mktemp("chat") / "ckpt"
    shutil.copytree(qwen3_tied, directory)
    config = {"eos_token": "<|endoftext|>", "chat_template": QWEN3_TEMPLATE}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return LLM(str(directory), block_size=4, num_kv_blocks=256, max_num_seqs=8, max_num_batched_tokens=64)


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


def test_prompts_as_vllms_dicts(llm):
    """vLLM's TextPrompt ({"prompt": text}) and TokensPrompt ({"prompt_token_ids": ids}), alone or
    in a list with plain prompts, were a TypeError."""
    params = SamplingParams(max_tokens=4)
    plain = llm.generate(["The list type", PROMPT], params, use_tqdm=False)
    as_dicts = llm.generate(
        [{"prompt": "The list type"}, {"prompt_token_ids": PROMPT}], params, use_tqdm=False
    )
    assert [o.token_ids for o in as_dicts] == [o.token_ids for o in plain]
    assert [(o.prompt, o.prompt_token_ids) for o in as_dicts] == [
        (o.prompt, o.prompt_token_ids) for o in plain
    ]
    one = llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)
    assert len(one) == 1 and one[0].token_ids == plain[1].token_ids


@pytest.mark.parametrize(
    "prompt, message",
    [
        ({"text": "x"}, "prompts[0] has keys this model does not take: 'text'"),
        ({}, "prompts[0] must be a string, a list of token ids (ints), or a dict with 'prompt' or"),
        ({"prompt": 5}, "prompts[0]['prompt'] must be a string, got 5"),
        ({"prompt_token_ids": [1.5]}, "prompts[0]['prompt_token_ids'] must be a list of token ids (ints)"),
        (
            {"prompt_token_ids": [5], "multi_modal_data": {}},
            "prompts[0] has keys this model does not take: 'multi_modal_data'",
        ),
    ],
)
def test_bad_prompt_dicts_are_refused_and_the_llm_keeps_serving(llm, prompt, message):
    with pytest.raises(TypeError) as e:
        llm.generate([prompt], use_tqdm=False)
    assert message in str(e.value)
    assert _generate(llm, PROMPT, max_tokens=1).token_ids


def test_outputs_carry_vllms_fields(llm):
    """RequestOutput's request_id and finished, CompletionOutput's cumulative_logprob (the sum of
    the sampled tokens' logprobs when logprobs are asked for, else None) and finished(), which
    code written for vLLM reads, were missing."""
    from client.llm import CompletionOutput, RequestOutput

    outs = llm.generate([PROMPT, "The list type"], SamplingParams(max_tokens=4, logprobs=1), use_tqdm=False)
    assert all(isinstance(o, RequestOutput) and o.finished for o in outs)
    assert len({o.request_id for o in outs}) == 2 and all(isinstance(o.request_id, str) for o in outs)
    sample = outs[0].outputs[0]
    assert isinstance(sample, CompletionOutput) and sample.finished()
    assert sample.cumulative_logprob == pytest.approx(sum(lp.logprob for lp in sample.logprobs))
    assert _generate(llm, PROMPT, max_tokens=2).outputs[0].cumulative_logprob is None


CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": [{"type": "text", "text": "The list type"}]},
]


def test_chat_renders_the_template_and_generates(chat_llm):
    """vLLM's LLM.chat (one conversation or a list of them, add_generation_prompt, tools,
    chat_template_kwargs, chat_template) was missing: code using it got an AttributeError."""
    llm = chat_llm
    params = SamplingParams(max_tokens=4)
    text = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nThe list type<|im_end|>\n"
    out = llm.chat(CONVERSATION, params, use_tqdm=False)
    assert len(out) == 1 and out[0].prompt == text + "<|im_start|>assistant\n"
    # Rendered text is tokenized without special tokens (the template writes its own).
    assert out[0].prompt_token_ids == llm.get_tokenizer().encode(out[0].prompt, add_special_tokens=False)
    assert (
        out[0].token_ids
        == llm.generate({"prompt_token_ids": out[0].prompt_token_ids}, params, use_tqdm=False)[0].token_ids
    )

    second = [{"role": "user", "content": "Exceptions"}]
    both = llm.chat([CONVERSATION, second], params, use_tqdm=False)
    assert [o.prompt for o in both] == [
        out[0].prompt,
        "<|im_start|>user\nExceptions<|im_end|>\n<|im_start|>assistant\n",
    ]

    no_prompt = llm.chat(CONVERSATION, params, use_tqdm=False, add_generation_prompt=False)
    assert no_prompt[0].prompt == text
    thinking_off = llm.chat(second, params, use_tqdm=False, chat_template_kwargs={"enable_thinking": False})
    assert thinking_off[0].prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    tool = {"type": "function", "function": {"name": "get_time", "parameters": {}}}
    with_tools = llm.chat(second, params, use_tqdm=False, tools=[tool])
    assert '"name": "get_time"' in with_tools[0].prompt
    own = llm.chat(second, params, use_tqdm=False, chat_template="{{ messages[0].content }}!")
    assert own[0].prompt == "Exceptions!"


def test_chat_continues_the_final_message(chat_llm):
    """vLLM's LLM.chat(continue_final_message=True): the prompt ends right after the final
    (assistant) message's text, no end of turn, and the model continues it; with
    add_generation_prompt left on it is an error naming both."""
    from scheduler_service.errors import InvalidRequestError

    started = [*CONVERSATION, {"role": "assistant", "content": "Lists are"}]
    params = SamplingParams(max_tokens=4)
    out = chat_llm.chat(
        started, params, use_tqdm=False, add_generation_prompt=False, continue_final_message=True
    )
    assert out[0].prompt.endswith("<|im_start|>assistant\nLists are")
    with pytest.raises(InvalidRequestError, match="add_generation_prompt"):
        chat_llm.chat(started, params, use_tqdm=False, continue_final_message=True)


def test_chat_errors_are_clear_and_the_llm_keeps_serving(chat_llm, llm):
    from scheduler_service.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="messages\\[0\\] has no role"):
        chat_llm.chat([{"content": "x"}], use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="unknown role: robot"):
        chat_llm.chat([{"role": "robot", "content": "x"}], use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="this model has no chat template"):
        llm.chat([{"role": "user", "content": "x"}], use_tqdm=False)
    assert chat_llm.chat([{"role": "user", "content": "x"}], SamplingParams(max_tokens=1), use_tqdm=False)[
        0
    ].token_ids


def test_logprobs_0_returns_the_sampled_tokens_own(llm):
    """vLLM's logprobs=0 returns each sampled token's logprob without alternatives (what a
    likelihood evaluation reads); it returned no logprobs at all, as None does."""
    # Both compared runs read the prompt from the prefix cache (a first, cold run computes it
    # whole: its logprobs may differ from a cached run's in the last bits).
    _generate(llm, PROMPT, max_tokens=4)
    out = _generate(llm, PROMPT, max_tokens=4, logprobs=0).outputs[0]
    with_one = _generate(llm, PROMPT, max_tokens=4, logprobs=1).outputs[0]
    assert [lp.token_id for lp in out.logprobs] == out.token_ids == with_one.token_ids
    assert [lp.logprob for lp in out.logprobs] == [lp.logprob for lp in with_one.logprobs]
    assert all(lp.top_logprobs == [] and lp.top_tokens == [] for lp in out.logprobs)
    assert out.cumulative_logprob == with_one.cumulative_logprob
    assert _generate(llm, PROMPT, max_tokens=4, logprobs=None).outputs[0].logprobs is None
    assert _generate(llm, PROMPT, max_tokens=4).outputs[0].logprobs is None


def test_logprobs_0_is_allowed_by_max_logprobs_0(qwen3_tied):
    """max_logprobs bounds the alternatives asked for, so 0 allows logprobs=0 (each token's own);
    the LLM refused it, naming logprobs (1) the user never asked for, and left the batch's earlier
    prompts running into the next call."""
    from scheduler_service.errors import InvalidRequestError

    llm = LLM(str(qwen3_tied), block_size=4, num_kv_blocks=256, max_num_seqs=8, max_logprobs=0)
    plain, own = llm.generate(
        [PROMPT, PROMPT],
        [SamplingParams(max_tokens=3), SamplingParams(max_tokens=3, logprobs=0)],
        use_tqdm=False,
    )
    assert [lp.token_id for lp in own.logprobs] == own.token_ids == plain.token_ids
    assert all(lp.top_logprobs == [] for lp in own.logprobs)
    with pytest.raises(InvalidRequestError, match="logprobs \\(1\\) exceeds max_logprobs \\(0"):
        llm.generate([PROMPT, PROMPT], [SamplingParams(), SamplingParams(logprobs=1)], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize(
    "gpu_bytes, name, budget",
    [
        (None, "", 8192),  # no GPU
        (24 * 2**30, "NVIDIA L4", 8192),
        (80 * 2**30, "NVIDIA H100 80GB HBM3", 16384),
        (141 * 2**30, "NVIDIA H200", 16384),
        (80 * 2**30, "NVIDIA A100-SXM4-80GB", 8192),  # where vLLM measured the larger budget slower
    ],
)
def test_offline_step_budget_follows_the_gpu(gpu_bytes, name, budget):
    """The LLM class's default step budget, as vLLM's LLM class: 16,384 tokens on a GPU of 70 GiB or
    more other than an A100 (a batch's prompts prefill in half the steps), else the servers' 8,192."""
    from protos.defaults import offline_max_num_batched_tokens

    assert offline_max_num_batched_tokens(gpu_bytes, name) == budget


def test_llm_on_the_cpu_keeps_the_servers_step_budget(qwen3_tied):
    """Without max_num_batched_tokens an LLM on the CPU schedules at most 8,192 tokens a step, and
    the executor was built for the same budget."""
    llm = LLM(str(qwen3_tied), block_size=4, num_kv_blocks=256, max_num_seqs=8)
    assert llm.engine.scheduler.config.max_num_batched_tokens == 8192
    assert llm.executor.config.max_num_batched_tokens == 8192


def test_an_interrupted_generate_leaves_nothing_running_into_the_next(llm, monkeypatch):
    """Ctrl-C during generate() (here: in the executor's third step) left the call's requests in
    the engine, and the next generate() stepped them to their end (max_model_len with ignore_eos)
    before it returned its own few tokens."""
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    expected = llm.generate(PROMPT, params, use_tqdm=False)[0].token_ids
    receive, calls = llm.executor.receive, []

    def interrupted(plan):
        calls.append(plan)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return receive(plan)

    monkeypatch.setattr(llm.executor, "receive", interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([PROMPT] * 3, SamplingParams(max_tokens=None, ignore_eos=True), use_tqdm=False)
    monkeypatch.undo()
    assert not llm.engine.has_unfinished_requests()
    stats = llm.engine.scheduler.stats
    before = stats.num_generation_tokens
    assert llm.generate(PROMPT, params, use_tqdm=False)[0].token_ids == expected
    assert stats.num_generation_tokens - before == len(expected)


def test_num_cached_tokens_of_n_samples_is_the_first_samples(qwen3_tied):
    """A prompt's num_cached_tokens is its first sample's, as the servers' usage counts it: it was
    the first finished sample's, so a new prompt of n samples (the first computes it, the others
    read its blocks) reported 0 or 12 by which sample happened to stop first."""
    llm = LLM(
        str(qwen3_tied),
        block_size=4,
        num_kv_blocks=64,
        max_model_len=48,
        max_num_seqs=8,
        max_num_batched_tokens=64,
    )
    later_first = 0
    for seed in range(6):
        prompt = [20 + 13 * seed + i for i in range(13)]  # new each time: nothing cached before it
        params = SamplingParams(
            n=2, max_tokens=8, temperature=1.0, seed=seed, stop_token_ids=list(range(0, 512, 5))
        )
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        first, second = (len(c.token_ids) for c in out.outputs)
        later_first += second < first
        assert out.num_cached_tokens == 0, (seed, first, second)
    assert later_first  # (some seed's second sample stops first: the case that went wrong)
    assert llm.generate([prompt], params, use_tqdm=False)[0].num_cached_tokens == 12


def test_text_continues_the_prompt_with_a_sentencepiece_style_tokenizer(qwen3_tied, tmp_path):
    """With a tokenizer that writes a word's space as a "▁" its token begins with (Llama 2's,
    Mistral's), the generated text lost its first space: decoded alone, a text's leading "▁" is
    dropped, so prompt + text ran two words together where vLLM's text continues the prompt."""
    from checkpoints import train_tokenizer

    directory = tmp_path / "ckpt"
    shutil.copytree(qwen3_tied, directory)
    train_tokenizer(directory, metaspace=True)
    llm = LLM(str(directory), block_size=4, num_kv_blocks=256, max_num_seqs=4)
    word = llm.get_tokenizer().token_to_id("▁object")
    prompt = "The list type is"
    for stop in ([], ["zzz"]):  # decoded at the end, and as it goes (for stop strings)
        pieces = []
        params = SamplingParams(max_tokens=2, logit_bias={word: 100}, stop=stop)
        out = llm.generate(prompt, params, use_tqdm=False, on_text=pieces.append)[0]
        assert out.token_ids == [word, word]
        assert out.text == "".join(pieces) == " object object"


def _hf_tokenizer(llm):
    """transformers' fast tokenizer of the model's tokenizer.json (what a user decodes with)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_file=str(llm.get_tokenizer().path / "tokenizer.json"))


# Ordinary tokens, then the end-of-sequence token (<|endoftext|>, a special token), whatever the
# model: min_tokens bans it for 6 tokens, then the bias forces it; its text is kept.
SPECIAL_LAST = {"max_tokens": 10, "min_tokens": 6, "logit_bias": {0: 100}, "include_stop_str_in_output": True}


@pytest.mark.parametrize("stop", [[], ["no such text"]])
def test_skip_special_tokens_off_writes_them_as_transformers_decode_does(llm, stop):
    """vLLM's skip_special_tokens=False: the text has the special tokens, written as transformers'
    tokenizer.decode(ids, skip_special_tokens=False) writes them, whether decoded at the end, matched
    for stop strings as it goes, or streamed to on_text (its pieces add up to the text). It was a
    TypeError; the default still leaves them out."""
    hf = _hf_tokenizer(llm)
    pieces = []
    params = SamplingParams(**SPECIAL_LAST, stop=stop, skip_special_tokens=False)
    out = llm.generate(PROMPT, params, use_tqdm=False, on_text=pieces.append)[0]
    assert len(out.token_ids) == 7 and out.token_ids[-1] == 0 and out.finish_reason == "stop"
    assert out.text == hf.decode(out.token_ids, skip_special_tokens=False)
    assert out.text.endswith("<|endoftext|>") and len(out.text) > len("<|endoftext|>")
    assert "".join(pieces) == out.text
    plain = _generate(llm, PROMPT, **SPECIAL_LAST, stop=stop)
    assert plain.token_ids == out.token_ids
    assert (
        plain.text
        == hf.decode(out.token_ids, skip_special_tokens=True)
        == out.text.removesuffix("<|endoftext|>")
    )
    # Without include_stop_str_in_output the stop token's text is left out (vLLM's rule); its id stays.
    dropped = _generate(
        llm, PROMPT, **{**SPECIAL_LAST, "include_stop_str_in_output": False}, skip_special_tokens=False
    )
    assert (dropped.token_ids, dropped.text) == (out.token_ids, plain.text)
    # vLLM's spaces_between_special_tokens (a slow tokenizer's option) is taken either way: the same text.
    spaced = _generate(
        llm, PROMPT, **SPECIAL_LAST, stop=stop, skip_special_tokens=False, spaces_between_special_tokens=False
    )
    assert spaced.text == out.text


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(llm):
    """vLLM's truncate_prompt_tokens: the prompt's last k tokens are the prompt (RequestOutput's
    prompt_token_ids are those, and the output is the one they give), for token ids and text alike;
    -1 keeps max_model_len of them. It was a TypeError."""
    ids = list(range(1, 21))
    out = _generate(llm, ids, max_tokens=4, ignore_eos=True, truncate_prompt_tokens=5)
    assert out.prompt_token_ids == ids[-5:]
    assert out.token_ids == _generate(llm, ids[-5:], max_tokens=4, ignore_eos=True).token_ids
    text = "The list type is a mutable sequence"
    encoded = llm.get_tokenizer().encode(text)
    assert len(encoded) > 3
    assert _generate(llm, text, max_tokens=2, truncate_prompt_tokens=3).prompt_token_ids == encoded[-3:]
    assert _generate(llm, ids, max_tokens=2, truncate_prompt_tokens=-1).prompt_token_ids == ids
    assert _generate(llm, ids, max_tokens=2, truncate_prompt_tokens=50).prompt_token_ids == ids


def test_a_prompt_still_too_long_after_truncation_or_a_bad_truncation_is_refused(llm):
    from scheduler_service.errors import InvalidRequestError

    max_model_len = llm.engine.limits.max_model_len
    long = [5] * (max_model_len + 10)
    with pytest.raises(
        InvalidRequestError, match=f"prompt \\({max_model_len} tokens\\) \\+ max_tokens \\(4\\)"
    ):
        _generate(llm, long, max_tokens=4, truncate_prompt_tokens=-1)
    for bad in (0, -2):
        with pytest.raises(ValueError, match=f"truncate_prompt_tokens must be >= 1 .* or -1 .*got {bad}"):
            _generate(llm, PROMPT, truncate_prompt_tokens=bad)
    assert _generate(llm, long, max_tokens=4, truncate_prompt_tokens=8).prompt_token_ids == [5] * 8


def test_two_llms_in_two_threads_generate_what_each_does_alone(qwen3_tied):
    """The forward context (attention metadata of the step running) is per thread: it was a module
    global, so two offline LLMs stepping at once in one process read each other's metadata and
    failed (IndexError, TypeError) or could attend with the other's block tables."""
    import threading

    prompts = [[(i * 7 + j) % 500 + 3 for j in range(5 + 3 * i)] for i in range(8)]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    llms = [LLM(str(qwen3_tied), block_size=4, num_kv_blocks=256, max_num_seqs=8) for _ in range(2)]
    alone = [o.token_ids for o in llms[0].generate(prompts, params, use_tqdm=False)]
    results: list = []

    def run(llm) -> None:
        try:
            for _ in range(2):
                results.append([o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        except Exception as e:  # (raised in the thread: kept for the assertion below)
            results.append(e)

    threads = [threading.Thread(target=run, args=(llm,)) for llm in llms]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(results) == 4 and all(r == alone for r in results), [type(r).__name__ for r in results]
