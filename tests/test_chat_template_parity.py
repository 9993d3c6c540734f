"""Chat templating against transformers' apply_chat_template, to the character and the token id,
with the chat templates Qwen3 and Llama 3.1 checkpoints ship (their tokenizer_config.json's
`chat_template`) written beside a small tokenizer: system, user, assistant and tool turns, tools,
past tool calls and reasoning, `add_generation_prompt`, `continue_final_message`, template kwargs
(`enable_thinking`, `date_string`), and a BOS the template writes itself."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.chat_templates import LLAMA31, QWEN3
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.processors import TemplateProcessing

from protos.defaults import DEFAULT_MODEL
from scheduler_service.chat_template import ChatTemplate
from scheduler_service.errors import InvalidRequestError
from scheduler_service.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

BOS = "<|begin_of_text|>"
SPECIAL = ["<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>", BOS,
           "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]  # fmt: skip


def _checkpoint(directory: Path, template: str) -> Path:
    """The embedded model's tokenizer with the templates' special tokens added and a BOS put
    before every text it encodes with special tokens (as Llama's tokenizer does), and `template`."""
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = HFTokenizer.from_file(str(Path(DEFAULT_MODEL) / "tokenizer.json"))
    tokenizer.add_special_tokens(SPECIAL)
    bos = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos)]
    )
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": "<|endoftext|>",
        "chat_template": template,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture(scope="module", params=["qwen3", "llama31"])
def checkpoint(request, tmp_path_factory):
    """(the checkpoint, transformers' tokenizer of it)"""
    template = {"qwen3": QWEN3, "llama31": LLAMA31}[request.param]
    path = _checkpoint(tmp_path_factory.mktemp(request.param), template)
    return path, transformers.AutoTokenizer.from_pretrained(str(path))


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather <now> & later, in °C",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
}
CHATS = {
    "system-and-user": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi, ünïcode"},
    ],
    "turns": [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
    ],
    "tool-turns": [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
    ],
    "reasoning-in-history": [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b", "reasoning_content": "about b"},
        {"role": "user", "content": "c"},
        {"role": "assistant", "content": "<think>\nabout d\n</think>\n\nd"},
        {"role": "user", "content": "e"},
    ],
}


def _ids(encoded) -> list[int]:
    return encoded["input_ids"] if isinstance(encoded, dict) or hasattr(encoded, "input_ids") else encoded


@pytest.mark.parametrize("chat", list(CHATS))
@pytest.mark.parametrize("tools", [None, TOOLS], ids=["no-tools", "tools"])
@pytest.mark.parametrize(
    "kwargs",
    [{}, {"enable_thinking": False}, {"date_string": "1 Jan 2026"}],
    ids=["default", "no-thinking", "date"],
)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_renders_and_tokenizes_as_transformers(checkpoint, chat, tools, kwargs, add_generation_prompt):
    """The text, and its token ids encoded without the tokenizer's own special tokens (the
    template writes its BOS: one, not two), as apply_chat_template(tokenize=True) gives them."""
    checkpoint, hf = checkpoint
    messages = CHATS[chat]
    options = {"tools": tools, "add_generation_prompt": add_generation_prompt, **kwargs}
    expected = hf.apply_chat_template(messages, tokenize=False, **options)
    got = ChatTemplate.load(checkpoint).render(
        messages, tools=tools, add_generation_prompt=add_generation_prompt, chat_template_kwargs=kwargs
    )
    assert got == expected
    ids = Tokenizer(checkpoint).encode(got, add_special_tokens=False)
    assert ids == _ids(hf.apply_chat_template(messages, tokenize=True, **options))
    writes_bos = "bos_token" in ChatTemplate.load(checkpoint).source  # (Llama's does)
    assert ids.count(hf.convert_tokens_to_ids(BOS)) == (1 if writes_bos else 0)


@pytest.mark.parametrize(
    "final",
    [
        "The weather in Paris is",
        "  Sunny, with a chance of\n",
        # a markdown table begun for the model: "|" also ends the template's end-of-turn token,
        # where the prompt was cut ("...|<|im_end|" / "...|<|eot_id|")
        "|",
        # nothing yet, or only whitespace: the prompt opens the assistant's turn (a 400 before)
        "",
        " ",
    ],
)
def test_continue_final_message_cuts_as_transformers(checkpoint, final):
    checkpoint, hf = checkpoint
    messages = [*CHATS["system-and-user"], {"role": "assistant", "content": final}]
    expected = hf.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=False, continue_final_message=True
    )
    got = ChatTemplate.load(checkpoint).render(
        messages, add_generation_prompt=False, continue_final_message=True
    )
    assert got == expected
    assert not got.endswith(("<|im_end|>\n", "<|eot_id|>"))


def test_continue_final_message_without_text_is_refused():
    template = ChatTemplate(QWEN3)
    for final in ({"role": "assistant", "content": None}, {"role": "assistant"}):
        with pytest.raises(InvalidRequestError, match="needs a final message with text content"):
            template.render([{"role": "user", "content": "a"}, final], add_generation_prompt=False,
                            continue_final_message=True)  # fmt: skip


def test_reasoning_in_history_reaches_the_template_under_either_name():
    """vLLM now names an answer's reasoning `reasoning` (it was `reasoning_content`), and takes a
    past turn's `reasoning` back as the template's `reasoning_content`, which Qwen3's template
    reads. Sent as `reasoning`, it was dropped: the past turn rendered with an empty <think>."""
    template = ChatTemplate(QWEN3)
    turns = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [CALL]},
        {"role": "tool", "content": "sunny"},
    ]
    expected = template.render([turns[0], {**turns[1], "reasoning_content": "Ask the tool."}, turns[2]])
    assert "<think>\nAsk the tool.\n</think>" in expected
    assert template.render([turns[0], {**turns[1], "reasoning": "Ask the tool."}, turns[2]]) == expected
    # (a message's own reasoning_content wins, as the template reads it)
    both = {**turns[1], "reasoning": "other", "reasoning_content": "Ask the tool."}
    assert template.render([turns[0], both, turns[2]]) == expected


def test_named_templates_render_tool_use_for_tools_as_transformers(tmp_path):
    """A checkpoint whose chat_template is a list of named templates: transformers renders its
    "tool_use" one for a request with tools and "default" otherwise; so do we."""
    config = {
        "chat_template": [
            {"name": "default", "template": "D:{{ messages[0]['content'] }}"},
            {"name": "tool_use", "template": "T{{ tools | length }}:{{ messages[0]['content'] }}"},
        ]
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    template = ChatTemplate.load(tmp_path)
    messages = [{"role": "user", "content": "hi"}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert template.render(messages) == "D:hi"
    assert template.render(messages, tools=tools) == "T1:hi"
