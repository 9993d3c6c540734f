"""The offline LLM against vLLM's offline API, where code written for vLLM noticed a difference:
its constructor's arguments, generate()'s and chat()'s keywords, logprobs as dicts of Logprob,
request ids, SamplingParams.detokenize, the pooling methods, and stop reasons that the whole
outputs and the streamed ones work out in one place."""

from __future__ import annotations

import dataclasses
import functools
import json
import pickle
import shutil

import pytest
from helpers.chat_checkpoint import QWEN3_TEMPLATE
from tqdm import tqdm

from client.llm import LLM
from scheduler_service.errors import InvalidRequestError
from scheduler_service.request_handling import OutputProcessor
from scheduler_service.sampling_params import SamplingParams

PROMPT = [5, 6, 7, 8, 9]
SMALL = {"block_size": 4, "num_kv_blocks": 256, "max_num_seqs": 8, "max_num_batched_tokens": 64}


@pytest.fixture(scope="module")
def llm(qwen3_tied):
    return LLM(str(qwen3_tied), **SMALL)


def _generate(llm, prompt, **params):
    return llm.generate(prompt, SamplingParams(**params), use_tqdm=False)[0]


def test_vllms_constructor_arguments_are_taken(qwen3_tied, llm):
    """dtype="auto" (vLLM's default) was refused as not a dtype; seed=None (vLLM's unseeded engine),
    trust_remote_code and tokenizer_mode were a TypeError from the executor's config."""
    vllm_style = LLM(
        str(qwen3_tied), dtype="auto", seed=None, trust_remote_code=True, tokenizer_mode="auto", **SMALL
    )
    assert vllm_style.executor.config.dtype == llm.executor.config.dtype  # the checkpoint's
    greedy = [_generate(m, "The list type", max_tokens=6).token_ids for m in (vllm_style, llm)]
    assert greedy[0] == greedy[1]


def test_arguments_it_does_not_take_are_refused_by_name_before_loading(qwen3_tied):
    """An engine argument of vLLM's with no counterpart here was reported as ExecutorConfig's
    (`ExecutorConfig.__init__() got an unexpected keyword argument`); a tokenizer mode other than
    the one tokenizer this LLM has was not taken at all."""
    with pytest.raises(TypeError, match=r"LLM\(\) got unexpected keyword arguments 'swap_space', 'hf_token'"):
        LLM(str(qwen3_tied), swap_space=4, hf_token="x", **SMALL)
    with pytest.raises(ValueError, match="tokenizer_mode 'slow' is not taken"):
        LLM(str(qwen3_tied), tokenizer_mode="slow", **SMALL)


def test_skip_tokenizer_init_takes_token_ids_only(qwen3_tied, llm):
    """vLLM's skip_tokenizer_init (no tokenizer: token ids in, no text out) was a TypeError."""
    bare = LLM(str(qwen3_tied), skip_tokenizer_init=True, **SMALL)
    assert bare.get_tokenizer() is None
    out = _generate(bare, PROMPT, max_tokens=4)
    assert out.token_ids == _generate(llm, PROMPT, max_tokens=4).token_ids and out.text is None
    with pytest.raises(ValueError, match="pass token ids instead of text"):
        _generate(bare, "The list type")


def test_skip_tokenizer_init_s_refusals_name_it(qwen3_tied):
    """A text prompt, a chat or a stop string on an LLM made with skip_tokenizer_init was refused as
    if the checkpoint had no tokenizer.json ("this model has no tokenizer.json"), which it has: the
    refusal names the argument that left it out."""
    bare = LLM(str(qwen3_tied), skip_tokenizer_init=True, **SMALL)
    for refused in (
        lambda: _generate(bare, "The list type"),
        lambda: bare.chat([{"role": "user", "content": "Hi"}], use_tqdm=False),
        lambda: _generate(bare, PROMPT, stop=["."]),
    ):
        with pytest.raises(ValueError, match=r"skip_tokenizer_init=True") as refusal:
            refused()
        assert "has no tokenizer.json" not in str(refusal.value)


def test_lora_request_none_is_taken_and_an_adapter_refused(llm):
    """generate() and chat() did not take vLLM's lora_request keyword at all (TypeError), not even
    None."""
    plain = _generate(llm, PROMPT, max_tokens=3).token_ids
    out = llm.generate(PROMPT, SamplingParams(max_tokens=3), use_tqdm=False, lora_request=None)
    assert out[0].token_ids == plain
    assert llm.generate([PROMPT], SamplingParams(max_tokens=3), use_tqdm=False, lora_request=[None])
    for call in (
        lambda: llm.generate(PROMPT, use_tqdm=False, lora_request=object()),
        lambda: llm.chat([{"role": "user", "content": "hi"}], use_tqdm=False, lora_request=object()),
    ):
        with pytest.raises(ValueError, match="LoRA adapters are not supported"):
            call()


def test_use_tqdm_may_be_a_callable_that_makes_the_bar(llm):
    """vLLM's use_tqdm takes a callable (functools.partial(tqdm, ...)) that makes the progress bar;
    it was taken as True and a default bar shown."""
    made = []

    def make_bar(**kwargs):
        made.append(kwargs)
        return functools.partial(tqdm, disable=True)(**kwargs)

    outs = llm.generate([PROMPT, "The list type"], SamplingParams(max_tokens=2, n=2), use_tqdm=make_bar)
    assert len(outs) == 2 and [m["total"] for m in made] == [4]


def test_pooling_methods_are_refused_clearly(llm):
    """encode/embed/classify/score/reward were AttributeErrors; vLLM's LLM raises ValueError for a
    model that only generates."""
    for method in ("encode", "embed", "classify", "reward"):
        with pytest.raises(ValueError, match=rf"LLM.{method}\(\) is vLLM's pooling API"):
            getattr(llm, method)(["The list type"])
    with pytest.raises(ValueError, match="generates text only"):
        llm.score("a", ["b"])


def test_logprobs_are_vllms_dicts_of_logprob(llm):
    """vLLM's logprobs are, per position, a dict token id -> Logprob(logprob, rank, decoded_token),
    the chosen token's first; code reading `logprobs[i][token_id].logprob` failed on the
    TokenLogprob entries, whose fields stay as attributes."""
    from client.llm import Logprob

    tokenizer = llm.get_tokenizer()
    out = _generate(llm, "The list type", max_tokens=4, logprobs=3, prompt_logprobs=2)
    sample = out.outputs[0]
    for token, position in zip(sample.token_ids, sample.logprobs, strict=True):
        assert isinstance(position, dict) and next(iter(position)) == token
        chosen = position[token]
        assert isinstance(chosen, Logprob) and chosen.logprob == position.logprob
        assert chosen.decoded_token == tokenizer.token_text(token)
        tops = [(t, position[t]) for t, _ in position.top_logprobs]
        assert [lp.rank for t, lp in tops if t != token] == [
            k for k, (t, _) in enumerate(position.top_logprobs, 1) if t != token
        ]
        assert all(lp.logprob == v for (_, lp), (_, v) in zip(tops, position.top_logprobs, strict=True))
        assert len(position) in (3, 4)  # (the chosen token once, where it is among the top 3)
        if token in dict(position.top_logprobs):  # its rank is its place among them
            assert chosen.rank == [t for t, _ in position.top_logprobs].index(token) + 1
    assert sample.cumulative_logprob == pytest.approx(
        sum(p[t].logprob for t, p in zip(sample.token_ids, sample.logprobs))
    )
    assert out.prompt_logprobs[0] is None
    for token, position in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:], strict=True):
        assert next(iter(position)) == token and position[token].rank == position.rank >= 1
        assert position[token].decoded_token == tokenizer.token_text(token)
    own = _generate(llm, PROMPT, max_tokens=2, logprobs=0).outputs[0]
    assert [list(p) for p in own.logprobs] == [[t] for t in own.token_ids]
    copied = pickle.loads(pickle.dumps(out))  # (and dataclasses.asdict takes the outputs)
    assert copied == out and copied.outputs[0].logprobs[0].top_logprobs == sample.logprobs[0].top_logprobs
    assert dataclasses.asdict(out)["outputs"][0]["logprobs"][0][sample.token_ids[0]]["rank"] is not None


def test_request_ids_count_prompts_over_the_llms_calls(qwen3_tied):
    """vLLM's offline request ids are "0", "1", ... one per prompt; they were the engine's, which
    counts each of n samples ("0", "2" for two prompts of n=2)."""
    fresh = LLM(str(qwen3_tied), **SMALL)
    first = fresh.generate(["a", "b"], SamplingParams(max_tokens=1, n=2), use_tqdm=False)
    second = fresh.generate(PROMPT, SamplingParams(max_tokens=1), use_tqdm=False)
    assert [o.request_id for o in first + second] == ["0", "1", "2"]


def test_detokenize_off_leaves_the_output_undecoded(llm):
    """vLLM's SamplingParams.detokenize was a TypeError."""
    decoded = _generate(llm, "The list type", max_tokens=4, logprobs=1)
    raw = _generate(llm, "The list type", max_tokens=4, logprobs=1, detokenize=False)
    assert raw.token_ids == decoded.token_ids and raw.text == "" and decoded.text
    assert all(p[t].decoded_token is None for t, p in zip(raw.token_ids, raw.outputs[0].logprobs))
    with pytest.raises(InvalidRequestError, match="need detokenize=True"):
        SamplingParams(stop=["x"], detokenize=False)
    with pytest.raises(InvalidRequestError, match="detokenize must be a boolean"):
        SamplingParams(detokenize="no")


def _finishes(llm, stream: bool, **params):
    """(finish_reason, stop_reason, token_ids, text): stop strings (one that never matches) make
    the LLM stream the request through OutputProcessor; without, it decodes the whole output."""
    stop = ["no such text"] if stream else []
    sample = _generate(llm, PROMPT, stop=stop, **params).outputs[0]
    return sample.finish_reason, sample.stop_reason, sample.token_ids, sample.text


def test_whole_and_streamed_outputs_agree_on_why_they_stopped(llm):
    """The whole outputs' stop reason was worked out apart from OutputProcessor.finish's (the
    streams'); both are request_handling.finish_reasons' now: a stop token, an end-of-sequence
    token, the length, each with and without include_stop_str_in_output."""
    eos = llm.engine.limits.eos_token_ids[0]
    token = _generate(llm, PROMPT, max_tokens=4, ignore_eos=True).token_ids[2]
    cases = [
        ({"max_tokens": 8, "ignore_eos": True, "stop_token_ids": [token]}, ("stop", token)),
        ({"max_tokens": 4, "logit_bias": {eos: 100}}, ("stop", None)),  # the end-of-sequence token
        ({"max_tokens": 3, "ignore_eos": True}, ("length", None)),
    ]
    for params, reasons in cases:
        for include in (False, True):
            whole = _finishes(llm, False, include_stop_str_in_output=include, **params)
            assert whole[:2] == reasons
            assert _finishes(llm, True, include_stop_str_in_output=include, **params) == whole
    processor = OutputProcessor(None, SamplingParams(stop_token_ids=[token]))
    assert processor.finish("stop", token) == ("stop", token) and processor.finish(None, 3) == ("abort", None)


def test_a_tokens_prompts_text_is_its_outputs_prompt(llm):
    """vLLM's TokensPrompt may carry its text beside its ids ("prompt"), which its RequestOutput's
    prompt gives back; it was None (and a non-string there went unchecked)."""
    out = llm.generate(
        {"prompt_token_ids": PROMPT, "prompt": "five to nine"}, SamplingParams(max_tokens=2), use_tqdm=False
    )
    assert (out[0].prompt, out[0].prompt_token_ids) == ("five to nine", PROMPT)
    assert out[0].token_ids == _generate(llm, PROMPT, max_tokens=2).token_ids  # (the text is not tokenized)
    mixed = llm.generate([PROMPT, "The list type", {"prompt": "a"}], use_tqdm=False)
    assert [o.prompt for o in mixed] == [None, "The list type", "a"]
    with pytest.raises(TypeError, match=r"prompts\[0\]\['prompt'\] must be a string"):
        llm.generate({"prompt_token_ids": PROMPT, "prompt": 5}, use_tqdm=False)


def test_default_sampling_params_and_content_format_as_vllms(qwen3_tied, tmp_path, llm):
    """vLLM's LLM.get_default_sampling_params() (what generate() samples with when given none) and
    chat()'s chat_template_content_format were AttributeError and TypeError; "string" and "auto"
    are how chat() renders content, "openai" (the parts as a list) is refused."""
    assert llm.get_default_sampling_params() == SamplingParams()
    default = llm.generate(PROMPT, use_tqdm=False)[0].token_ids
    assert default == _generate(llm, PROMPT).token_ids
    directory = tmp_path / "ckpt"
    shutil.copytree(qwen3_tied, directory)
    config = {"eos_token": "<|endoftext|>", "chat_template": QWEN3_TEMPLATE}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    chat_llm = LLM(str(directory), **SMALL)
    conversation = [{"role": "user", "content": [{"type": "text", "text": "The list type"}]}]
    params = SamplingParams(max_tokens=2)
    outs = [
        chat_llm.chat(conversation, params, use_tqdm=False, chat_template_content_format=f)[0]
        for f in ("auto", "string")
    ]
    assert outs[0].prompt == outs[1].prompt and outs[0].token_ids == outs[1].token_ids
    with pytest.raises(ValueError, match="chat_template_content_format 'openai' is not taken"):
        chat_llm.chat(conversation, params, use_tqdm=False, chat_template_content_format="openai")


def test_a_chat_template_given_serves_a_checkpoint_without_one(qwen3_tied, llm, tmp_path):
    """chat(chat_template=...) is how vLLM chats with a base model, whose checkpoint has no chat
    template: it was refused ("this model has no chat template") before the one given was read. The
    template gets the checkpoint's special tokens (tokenizer_config.json's), as its own would."""
    template = "{{ bos_token }}{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:"
    messages = [{"role": "user", "content": "Hi"}]
    out = llm.chat(messages, SamplingParams(max_tokens=2), use_tqdm=False, chat_template=template)[0]
    assert out.prompt == "user: Hi\nassistant:" and len(out.outputs[0].token_ids) == 2
    with_config = tmp_path / "with_config"
    shutil.copytree(qwen3_tied, with_config)
    (with_config / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>"}))
    configured = LLM(str(with_config), **SMALL)
    out = configured.chat(messages, SamplingParams(max_tokens=2), use_tqdm=False, chat_template=template)[0]
    assert out.prompt == "<s>user: Hi\nassistant:"
